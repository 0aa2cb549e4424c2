/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The hold: attached by the CNI plugin on both tc hooks (tcx ingress and
 * egress) of a new pod's host veth before either end is up, removed by the
 * agent once it has classified the pod. Every IP packet to or from the pod
 * is dropped; ARP and IPv6 neighbour discovery pass (no policy covers them,
 * and the node's neighbour entry for the pod is then ready when the hold
 * goes).
 */
#include "lib/common.h"
#include "lib/parse.h"
#include "lib/count.h"

SEC("classifier")
int xdpcni_hold(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) <= data_end) {
		if (eth->h_proto == bpf_htons(ETH_P_ARP))
			return TC_ACT_OK;
		if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
			struct ipv6hdr *ip6h = (void *)(eth + 1);
			__u8 *type = (void *)(ip6h + 1);

			if ((void *)(type + 1) <= data_end && ip6h->nexthdr == IPPROTO_ICMPV6_ &&
			    *type >= ICMPV6_ND_FIRST && *type <= ICMPV6_ND_LAST)
				return TC_ACT_OK;
		}
	}
	count(slot_of(skb->ifindex), XDPCNI_V_DROP_HELD, skb->len);
	return TC_ACT_SHOT;
}

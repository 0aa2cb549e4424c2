// SPDX-License-Identifier: GPL-2.0-only
/*
 * Benchmark helpers, not part of the datapath. xdp_drop_count drops every
 * frame at the host veth and counts it: attached where the datapath would
 * run, it gives the ceiling any forwarding path on the machine can reach
 * for a given sender. tc_redirect_peer is the reference row of Cilium's
 * same-node technique (below). tc_pass does nothing: on a device's tcx
 * ingress it costs what the hook alone costs (the control of a program's
 * own cost there).
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>
#include "xdpcni.h"

char LICENSE[] SEC("license") = "GPL";

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} drop_count SEC(".maps");

SEC("xdp")
int xdp_drop_count(struct xdp_md *ctx)
{
	__u32 key = 0;
	__u64 *n = bpf_map_lookup_elem(&drop_count, &key);

	if (n)
		*n += 1;
	return XDP_DROP;
}

/*
 * Cilium's same-node technique, as a reference row of the benchmark (not
 * xdpcni's datapath): a tc ingress program on each pod's host veth that
 * looks the IPv4 destination up, rewrites the MACs, decrements the TTL and
 * hands the packet to the destination pod's eth0 with bpf_redirect_peer
 * (its receive path at once, GSO super-packets kept). No source check, no
 * NAT or policy awareness: the minimal program, so the cost of xdpcni's
 * checks is visible beside it. Keys and values as endpoints4's.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct endpoint_info);
} peer_endpoints SEC(".maps");

SEC("classifier")
int tc_redirect_peer(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	struct endpoint_info *ep;
	__u16 old_word, new_word;
	__u32 daddr;

	if ((void *)(ip + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;
	if (ip->ttl <= 1)
		return TC_ACT_OK;
	daddr = ip->daddr;
	ep = bpf_map_lookup_elem(&peer_endpoints, &daddr);
	if (!ep)
		return TC_ACT_OK;
	__builtin_memcpy(eth->h_dest, ep->pod_mac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, ep->host_mac, ETH_ALEN);
	old_word = *(__u16 *)&ip->ttl;
	ip->ttl -= 1;
	new_word = *(__u16 *)&ip->ttl;
	bpf_l3_csum_replace(skb, ETH_HLEN + __builtin_offsetof(struct iphdr, check), old_word,
			    new_word, sizeof(__u16));
	return bpf_redirect_peer(ep->ifindex, 0);
}

SEC("classifier")
int tc_pass(struct __sk_buff *skb)
{
	return TC_ACT_OK;
}

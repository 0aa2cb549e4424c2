/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The second stage of a cpumap redirect (pod.bpf.c's XDP program picked the
 * CPU): runs on that CPU with the frame already rewritten.
 */
#include "lib/common.h"
#include "lib/maps.h"
#include "lib/parse.h"
#include "lib/count.h"
#include "lib/endpoint.h"

/*
 * Second stage, on the CPU the first stage picked: the frame is already
 * rewritten; look its destination up again and hand it to the devmap.
 */
SEC("xdp/cpumap")
int xdpcni_cpumap(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct addr dst = {};
	struct endpoint_info *dst_ep;
	__u64 bytes = data_end - data;

	if ((void *)(eth + 1) > data_end)
		return verdict(ctx, XDPCNI_V_DROP_CPUMAP_LOST);
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *iph = (void *)(eth + 1);

		if ((void *)(iph + 1) > data_end)
			return verdict(ctx, XDPCNI_V_DROP_CPUMAP_LOST);
		dst.family = XDPCNI_FAMILY_IPV4;
		__builtin_memcpy(dst.addr, &iph->daddr, 4);
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6h = (void *)(eth + 1);

		if ((void *)(ip6h + 1) > data_end)
			return verdict(ctx, XDPCNI_V_DROP_CPUMAP_LOST);
		dst.family = XDPCNI_FAMILY_IPV6;
		__builtin_memcpy(dst.addr, &ip6h->daddr, 16);
	} else {
		return verdict(ctx, XDPCNI_V_DROP_CPUMAP_LOST);
	}

	dst_ep = lookup_endpoint(&dst);
	/*
	 * The MACs are rewritten already, so the kernel would discard it as
	 * PACKET_OTHERHOST: drop and count instead of passing.
	 */
	if (!dst_ep || bpf_redirect_map(&tx_ports, dst_ep->ifindex, XDP_DROP) != XDP_REDIRECT)
		return verdict(ctx, XDPCNI_V_DROP_CPUMAP_LOST);
	count(dst_ep->stats_slot, XDPCNI_V_RX_FASTPATH, bytes);
	return verdict(ctx, XDPCNI_V_CPUMAP_DELIVERED);
}

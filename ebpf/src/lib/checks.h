/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Stage 3's checks, one helper for every hop the fast path takes (a pod to a
 * pod of this node, a pod to another node's pod, another node's pod to a pod
 * of this node), and the rewrite every delivery makes: what the kernel's
 * forwarding would check and change, so that what the fast path carries is
 * what kernel routing would have.
 */
#pragma once

#include "maps.h"
#include "parse.h"

static __always_inline void decrement_ttl(struct packet *p)
{
	if (p->csum) {
		/* RFC 1624 incremental update, as the kernel's ip_decrease_ttl(). */
		__u32 check = *p->csum;

		check += bpf_htons(0x0100);
		*p->csum = (__u16)(check + (check >= 0xFFFF));
	}
	*p->ttl -= 1;
}

/*
 * The length of each segment of a GSO super-packet, from the L3 header on:
 * headers plus the segment size. TCP's header length is read from the
 * packet; UDP's is 8. 0 when it cannot be known here (the caller passes).
 */
static __always_inline __u32 gso_segment_len(const struct packet *p, const struct frame *f)
{
	__u8 *doff;

	if (p->proto == IPPROTO_UDP)
		return p->l4_off + 8 + f->gso_size;
	if (p->proto != IPPROTO_TCP)
		return 0;
	doff = (__u8 *)p->l4 + 12;
	if ((void *)(doff + 1) > f->data_end)
		return 0;
	return p->l4_off + (*doff >> 4) * 4 + f->gso_size;
}

/*
 * The MTU checks: a real frame must fit the destination's MTU (else the
 * kernel fragments or sends PTB); a GSO super-packet (longer than the
 * sender's MTU) only an skb hook can hand on whole, when each of its
 * segments fits both MTUs, which is what the kernel's forwarding checks
 * (skb_gso_validate_network_len).
 */
static __always_inline int check_mtu(const struct packet *p, const struct frame *f, __u32 src_mtu,
				     __u32 dst_mtu)
{
	__u32 seg;

	if (p->l3_len <= src_mtu)
		return p->l3_len > dst_mtu ? XDPCNI_V_PASS_MTU : STAGE_OK;
	if (!f->gso_size)
		return XDPCNI_V_PASS_GSO;
	seg = gso_segment_len(p, f);
	if (!seg || seg > src_mtu)
		return XDPCNI_V_PASS_GSO;
	if (seg > dst_mtu)
		return XDPCNI_V_PASS_MTU;
	return STAGE_OK;
}

/*
 * The NAT stage of a decision: a flow from or to a port where the kernel
 * NATs (a Service backend's, a hostPort) may be one conntrack NAT'd, and
 * the hook asks conntrack (STAGE_CT, STAGE_CT_TO); every other flow is
 * decided here. `src_ports`, `dst_ports`: whether that end may have such a
 * port (a local endpoint flagged NO_NAT_PORTS has none: its lookup is
 * skipped).
 */
static __always_inline int nat_stage(const struct packet *p, int src_ports, int dst_ports)
{
	struct nat_port_key nk = {
	    .family = p->src.family,
	    .proto = p->proto,
	    .port = p->sport,
	};

	if (!p->sport)
		return STAGE_OK;
	if (src_ports) {
		__builtin_memcpy(nk.addr, p->src.addr, 16);
		if (bpf_map_lookup_elem(&nat_ports, &nk))
			return STAGE_CT;
	}
	if (dst_ports) {
		nk.port = p->dport;
		__builtin_memcpy(nk.addr, p->dst.addr, 16);
		if (bpf_map_lookup_elem(&nat_ports, &nk))
			return STAGE_CT_TO;
	}
	return STAGE_OK;
}

/*
 * The checks of stage 3 once each entry has found the two ends of a hop, in
 * the order the kernel's forwarding makes them: an end that must take the
 * kernel path (`to_kernel`), the TTL, the MTUs (`in_mtu` of the device the
 * packet came in by, `out_mtu` of the one it would leave by), then the NAT
 * stage (`src_ports`, `dst_ports` as nat_stage's). STAGE_OK, STAGE_CT or
 * STAGE_CT_TO when the fast path may carry it; else the kernel's verdict.
 */
static __always_inline int forward_checks(const struct packet *p, const struct frame *f,
					  int to_kernel, __u32 in_mtu, __u32 out_mtu, int src_ports,
					  int dst_ports)
{
	int r;

	if (to_kernel)
		return XDPCNI_V_PASS_KERNEL_ONLY;
	if (*p->ttl <= 1)
		return XDPCNI_V_PASS_TTL;
	/*
	 * Longer than the sender's own MTU: no wire frame, a GSO super-packet
	 * (generic and tc modes keep the pod's TSO). XDP redirecting it would
	 * drop it (xdp_ok_fwd_dev): the kernel path segments it.
	 */
	r = check_mtu(p, f, in_mtu, out_mtu);
	if (r != STAGE_OK)
		return r;
	return nat_stage(p, src_ports, dst_ports);
}

/* TTL and MACs as the kernel's forwarding would set them. */
static __always_inline void rewrite(struct packet *p, const struct endpoint_info *dst)
{
	decrement_ttl(p);
	__builtin_memcpy(p->eth->h_dest, dst->pod_mac, ETH_ALEN);
	__builtin_memcpy(p->eth->h_source, dst->host_mac, ETH_ALEN);
}

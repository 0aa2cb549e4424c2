/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * From a pod: the programs on the host side of every pod veth (the packets
 * the pod sent), which deliver pod-to-pod traffic straight to the
 * destination pod. Two hooks, one set of decisions: the XDP program
 * redirects through a devmap or a cpumap to the destination's host veth; the
 * tc program (tcx ingress) hands the skb to the destination pod's eth0 with
 * bpf_redirect_peer, or to another node's pod CIDR's route with
 * bpf_redirect_neigh, and sends a north-south flow's replies back out of
 * their uplink (lib/north_south.h). Both run classify() (lib/classify.h) on a struct
 * frame and count into the same rows; everything they are not sure about
 * goes to the kernel (XDP_PASS, TC_ACT_UNSPEC): kernel routing is always
 * the fallback.
 */
#include "lib/common.h"
#include "lib/maps.h"
#include "lib/parse.h"
#include "lib/count.h"
#include "lib/cpu.h"
#include "lib/ct.h"
#include "lib/policy.h"
#include "lib/checks.h"
#include "lib/remote.h"
#include "lib/classify.h"
#include "lib/north_south.h"

/*
 * Stage 4 on XDP, rewrite and redirect: pick the target first
 * (bpf_redirect_map() only records it, and gives XDP_PASS when the entry is
 * missing, before the packet is touched), then rewrite.
 */
static __always_inline int rewrite_redirect(struct packet *p, const struct endpoint_info *dst,
					    __u64 bytes)
{
	long target;
	int r;

	if (dst->redirect == XDPCNI_REDIRECT_CPUMAP && dst->cpu_mask) {
		target =
		    bpf_redirect_map(&cpu_map, pick_cpu(dst->cpu_mask, flow_hash(p)), XDP_PASS);
		r = XDPCNI_V_REDIRECT_CPUMAP;
	} else {
		target = bpf_redirect_map(&tx_ports, dst->ifindex, XDP_PASS);
		r = XDPCNI_V_REDIRECT_DEVMAP;
	}
	STAGE_END(4, target, STAGE_STOPPED);
	if (target != XDP_REDIRECT)
		return XDPCNI_V_PASS_NO_TARGET;

	rewrite(p, dst);
	STAGE_END(5, p->eth, STAGE_STOPPED);
	if (r == XDPCNI_V_REDIRECT_DEVMAP)
		count(dst->stats_slot, XDPCNI_V_RX_FASTPATH, bytes);
	return r;
}

/*
 * Stage 4 on tc: rewrite and hand the skb to the peer of the destination's
 * host veth, the destination pod's eth0, which receives it at once (no
 * backlog round, GSO kept). No tx_ports lookup (measured: 0.9% of the CPU
 * of a 64-byte flood): the one writer of these maps, the verbs of
 * ebpf/src/datapath/pod.rs, adds a veth's tx_ports entry before its endpoint
 * records and removes it after them, so an endpoint found here has one; a
 * veth that vanishes under its record makes bpf_redirect_peer drop the
 * frame, where the kernel path would have had no route to it either.
 * The destination's cpumap policy is XDP's: an skb is already on a CPU's
 * receive path.
 */
static __always_inline int rewrite_redirect_peer(struct packet *p, const struct endpoint_info *dst,
						 __u64 bytes)
{
	rewrite(p, dst);
	STAGE_END(4, p->eth, STAGE_STOPPED);
	bpf_redirect_peer(dst->ifindex, 0);
	STAGE_END(5, dst, STAGE_STOPPED);
	count(dst->stats_slot, XDPCNI_V_RX_FASTPATH, bytes);
	return XDPCNI_V_REDIRECT_PEER;
}

/* From a pod on XDP: parse -> validate -> decide -> rewrite+redirect. */
SEC("xdp")
int xdpcni_from_pod(struct xdp_md *ctx)
{
	struct frame f = {
	    .data = (void *)(long)ctx->data,
	    .data_end = (void *)(long)ctx->data_end,
	};
	struct endpoint_info *src, *dst;
	struct packet p = {};
	int r;

#ifdef XDPCNI_UPGRADE_TEST
	/* Same behaviour, other instructions (another tag): tests upgrades. */
	asm volatile("r0 = 0" ::: "r0");
#endif
	f.len = f.data_end - f.data;
	STAGE_END(0, f.data, XDP_PASS);
	r = classify(&p, &f, ctx->ingress_ifindex, &src, &dst, 0);
	RETURN_IF_STOPPED(r, XDP_PASS);
	if (!src)
		return verdict(ctx, r);
	if (r == STAGE_CT || r == STAGE_CT_TO)
		r = ct_check(ctx, &p, &f, 1, r == STAGE_CT_TO);
	if (r == STAGE_OK && ((src->flags | dst->flags) & XDPCNI_EP_POLICY)) {
		struct packet *q = pol_query(&p, &f);

		r = q ? pol_check_xdp(ctx, q, src, dst) : XDPCNI_V_PASS_POLICY;
	}
	if (r == STAGE_OK)
		r = rewrite_redirect(&p, dst, f.len);
	RETURN_IF_STOPPED(r, XDP_PASS);
	count(src->stats_slot, r, f.len);
	return action_of(r);
}

/*
 * From a pod on tc (tcx ingress of its host veth, after any hold): the same
 * stages on the skb, then bpf_redirect_peer to a pod of this node or
 * bpf_redirect_neigh towards another's (lib/remote.h). A VLAN tag the stack
 * carries out of band is a frame the XDP hook would see tagged: not IP.
 */
SEC("classifier")
int xdpcni_tc_from_pod(struct __sk_buff *skb)
{
	struct frame f = {};
	struct endpoint_info *src, *dst;
	struct remote_net *remote = 0;
	struct packet p = {};
	__u32 slot;
	int r;

#ifdef XDPCNI_UPGRADE_TEST
	asm volatile("r0 = 0" ::: "r0");
#endif
	tc_frame(skb, &f);
	STAGE_END(0, f.data, TC_ACT_UNSPEC);
	if (skb->vlan_present) {
		r = XDPCNI_V_PASS_NOT_IP;
		src = 0;
	} else {
		r = classify(&p, &f, skb->ingress_ifindex, &src, &dst, &remote);
	}
	RETURN_IF_STOPPED(r, TC_ACT_UNSPEC);
	/* A reply of a north-south flow (lib/north_south.h): back out of its uplink. */
	if (r == XDPCNI_V_PASS_NO_ENDPOINT && src)
		r = ns_reply(skb, &p);
	if (r == STAGE_CT || r == STAGE_CT_TO)
		r = ct_check(skb, &p, &f, 0, r == STAGE_CT_TO);
	if (r == STAGE_OK && remote)
		r = send_remote(&p, remote);
	if (r == STAGE_OK && ((src->flags | dst->flags) & XDPCNI_EP_POLICY)) {
		struct packet *q = pol_query(&p, &f);

		r = q ? pol_check_tc(skb, q, src, dst) : XDPCNI_V_PASS_POLICY;
	}
	if (r == STAGE_OK)
		r = rewrite_redirect_peer(&p, dst, f.len);
	RETURN_IF_STOPPED(r, TC_ACT_UNSPEC);
	slot = src ? src->stats_slot : slot_of(skb->ingress_ifindex);
	count(slot, r, f.len);
	return tc_action_of(r);
}

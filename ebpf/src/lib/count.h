/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Counting and verdicts: every program counts each packet once, in one
 * (slot, verdict) row of `counters`, and turns its verdict into its hook's
 * action code through one mapping (xdpcni.h's verdict kinds).
 */
#pragma once

#include "maps.h"

/* One array row per (slot, verdict): no hashing, no insert on first use. */
static __always_inline void count(__u32 slot, __u32 verdict, __u64 bytes)
{
	__u32 row;
	struct stats_value *v;

#ifdef XDPCNI_STAGES
	return;
#endif
	if (slot >= XDPCNI_MAX_SLOTS)
		slot = 0;
	row = slot * XDPCNI_V_MAX + verdict;
	v = bpf_map_lookup_elem(&counters, &row);
	if (v) {
		v->packets += 1;
		v->bytes += bytes;
	}
}

/* The counter slot of a host veth, for verdicts reached before its endpoint. */
static __always_inline __u32 slot_of(__u32 ifindex)
{
	__u32 *slot = bpf_map_lookup_elem(&port_slots, &ifindex);

	return slot ? *slot : 0;
}

/*
 * What a verdict does with the frame, by its kind (see xdpcni.h), in the
 * hook's own action codes: the one mapping both programs use.
 */
static __always_inline int action_in(__u32 v, int drop, int redirect, int pass)
{
	__u32 bit = 1u << v;

	if (bit & XDPCNI_DROP_VERDICTS)
		return drop;
	if (bit & XDPCNI_REDIRECT_VERDICTS)
		return redirect;
	return pass;
}

/* On XDP. */
static __always_inline int action_of(__u32 v)
{
	return action_in(v, XDP_DROP, XDP_REDIRECT, XDP_PASS);
}

/* Counts on the ingress veth, found through port_slots: the slow paths. */
static __always_inline int verdict(struct xdp_md *ctx, __u32 v)
{
	count(slot_of(ctx->ingress_ifindex), v, ctx->data_end - ctx->data);
	return action_of(v);
}

/* On tc: a pass lets the next tcx program run, then the stack. */
static __always_inline int tc_action_of(__u32 v)
{
	return action_in(v, TC_ACT_SHOT, TC_ACT_REDIRECT, TC_ACT_UNSPEC);
}

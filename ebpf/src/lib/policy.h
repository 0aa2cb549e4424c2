/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * NetworkPolicy on the fast path: the check of a flow to or from a pod whose
 * endpoint carries XDPCNI_EP_POLICY, after every other stage said the fast
 * path may carry it. The agent compiles each such pod's policies (the model
 * that writes the nftables table too) into pol_pods / pol_peers / pol_ports
 * / pol_named (xdpcni.h); this file only reads them, and keeps pol_flows.
 *
 * Stateful as the kernel path is: a flow's first packet is checked from its
 * own direction (the source's egress, the destination's ingress, the
 * destination's port) and the flow recorded; its later packets, both ways,
 * pass by the record while the record's generation is pol_state's; under a
 * newer one the flow is checked again from its original direction and
 * dropped if no longer allowed (the nftables side does the same with its
 * ruleset generation). Where the fast path cannot know what the kernel path
 * would say, the packet goes there (the nftables rules decide): a TCP packet
 * that is not a SYN with no record (picked up mid-stream), an ICMP echo
 * reply with no record, a UDP packet with no record whose flow conntrack
 * has (begun on the kernel path: it stays there), a pod with no verdicts.
 */
#pragma once

#include "maps.h"
#include "parse.h"
#include "ct.h"

/* One packet per CPU: what the policy check reads (pol_query); not pinned. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct packet);
} pol_scratch SEC(".maps");

/*
 * pol_cache: per CPU, the flows this CPU found recorded and allowed in this
 * tick of the coarse clock, so that their next packets in the same tick skip
 * the flow table (a hash of a 40-byte key: two thirds of the check's cost).
 * Exact, not an approximation: a slot is used only for a packet that would
 * change nothing in the record (no SYN, FIN or RST; the direction the slot
 * saw) under the same generation and in the same tick, and the record's
 * last_ns is that tick already, since the packet that filled the slot wrote
 * it. Direct-mapped by a cheap hash of the flow; a miss costs a compare and
 * the slot's fill. Not pinned: a new program starts with an empty cache.
 */
struct pol_cached {
	struct pol_flow_key key;
	__u64 generation;
	__u64 tick;    /* bpf_ktime_get_coarse_ns() of the packet that filled it */
	__u32 from_lo; /* pol_key()'s result for that packet: its direction */
	__u32 pad;
};

#define XDPCNI_POL_CACHE_SLOTS 256

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XDPCNI_POL_CACHE_SLOTS);
	__type(key, __u32);
	__type(value, struct pol_cached);
} pol_cache SEC(".maps");

#define XDPCNI_NS_PER_S 1000000000ULL
#define TCP_FIN_	0x01
#define TCP_SYN_	0x02
#define TCP_RST_	0x04
#define TCP_ACK_	0x10

/* 16 address bytes, as four words (the arrays are 4-aligned in every struct here). */
static __always_inline void pol_copy16(void *dst, const void *src)
{
	__u32 *d = dst;
	const __u32 *s = src;

	d[0] = s[0];
	d[1] = s[1];
	d[2] = s[2];
	d[3] = s[3];
}

static __always_inline void pol_count(__u32 what)
{
	__u64 *v;

#ifdef XDPCNI_STAGES
	return;
#endif
	v = bpf_map_lookup_elem(&pol_stats, &what);
	if (v)
		*v += 1;
}

/*
 * What the check reads of the L4 header, kept in p->l4_info by the caller
 * (the check is a function of its own, verified once, which cannot read
 * the packet): TCP's flags (unreadable: 0xff, not a plain SYN), ICMP's type.
 */
static __always_inline __u8 pol_l4_info(const struct packet *p, const struct frame *f)
{
	__u8 *flags = (__u8 *)p->l4 + 13;

	if (p->proto != IPPROTO_TCP)
		return ((__u8 *)p->l4)[0];
	if ((void *)(flags + 1) > f->data_end)
		return 0xff;
	return *flags;
}

/*
 * The key of the flow from `from` to `to` with protocol `proto` and ports
 * `sp`, `dp` (an echo's id twice), its lower end first; 1 when `from` is
 * that end.
 */
static __always_inline int pol_key_of(const struct addr *from, const struct addr *to, __u8 proto,
				      __u16 sp, __u16 dp, struct pol_flow_key *k)
{
	const __u32 *s = (const __u32 *)from->addr, *d = (const __u32 *)to->addr;
	int cmp = 0;

#pragma unroll
	for (int i = 0; i < 4; i++)
		if (!cmp && s[i] != d[i])
			cmp = s[i] < d[i] ? -1 : 1;
	if (!cmp)
		cmp = sp <= dp ? -1 : 1;
	k->proto = proto;
	k->family = from->family;
	if (cmp < 0) {
		pol_copy16(k->lo, from->addr);
		pol_copy16(k->hi, to->addr);
		k->lo_port = sp;
		k->hi_port = dp;
		return 1;
	}
	pol_copy16(k->lo, to->addr);
	pol_copy16(k->hi, from->addr);
	k->lo_port = dp;
	k->hi_port = sp;
	return 0;
}

/* The packet's flow's key (pol_key_of). */
static __always_inline int pol_key(const struct packet *p, struct pol_flow_key *k)
{
	__u16 sp = p->sport, dp = p->dport;

	if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP)
		sp = dp = (__u16)p->flow_id;
	return pol_key_of(&p->src, &p->dst, p->proto, sp, dp, k);
}

/* This CPU's cache slot for flow `k`. */
static __always_inline struct pol_cached *pol_cache_slot(const struct pol_flow_key *k)
{
	const __u32 *lo = (const __u32 *)k->lo, *hi = (const __u32 *)k->hi;
	__u32 h = lo[3] ^ hi[3] ^ ((__u32)k->lo_port << 16 | k->hi_port) ^ k->proto;

	h ^= h >> 16;
	h ^= h >> 8;
	h &= XDPCNI_POL_CACHE_SLOTS - 1;
	return bpf_map_lookup_elem(&pol_cache, &h);
}

/* Whether two flow keys are equal (word by word: no memcmp call in BPF). */
static __always_inline int pol_key_eq(const struct pol_flow_key *a, const struct pol_flow_key *b)
{
	const __u32 *x = (const __u32 *)a, *y = (const __u32 *)b;
	__u32 d = 0;

#pragma unroll
	for (int i = 0; i < (int)(sizeof(*a) / 4); i++)
		d |= x[i] ^ y[i];
	return !d;
}

/* Fills slot `c` (NULL: none) with a flow found recorded and allowed now. */
static __always_inline void pol_cache_fill(struct pol_cached *c, const struct pol_flow_key *k,
					   __u64 gen, __u64 now, int from_lo)
{
	if (!c)
		return;
	c->key = *k;
	c->generation = gen;
	c->tick = now;
	c->from_lo = from_lo;
}

/* Whether a recorded flow has been idle longer than conntrack would keep it. */
static __always_inline int pol_expired(const struct pol_flow *fl, __u8 proto, __u64 now)
{
	__u64 t = 30;

	if (proto == IPPROTO_TCP)
		t = fl->state & XDPCNI_POL_RST	     ? 10
		    : fl->state & XDPCNI_POL_FIN     ? 120
		    : fl->state & XDPCNI_POL_REPLIED ? 432000
						     : 120;
	else if (proto == IPPROTO_UDP && (fl->state & XDPCNI_POL_REPLIED))
		t = 120;
	return now > fl->last_ns && now - fl->last_ns > t * XDPCNI_NS_PER_S;
}

/* The verdicts of a pod address, if it has any. */
static __always_inline struct pol_pod *pol_pod_of(const struct addr *a)
{
	struct pol_pod_key k __attribute__((aligned(8))) = {.family = a->family};

	pol_copy16(k.addr, a->addr);
	return bpf_map_lookup_elem(&pol_pods, &k);
}

/*
 * Whether pod `pp` (NULL: no policy isolates it) lets the flow with `peer`
 * at the other end, to destination port `dport`, through in direction `dir`.
 */
static __noinline int pol_allows(const struct pol_pod *pp, __u32 dir, const struct addr *peer,
				 __u8 proto, __u16 dport)
{
	int ported = proto == IPPROTO_TCP || proto == IPPROTO_UDP;
	__u64 peers, ports, *m;

	if (!pp)
		return 1;
	dir &= 1;
	if (!(pp->flags &
	      (dir == XDPCNI_POL_EGRESS ? XDPCNI_POL_ISOLATED_OUT : XDPCNI_POL_ISOLATED_IN)))
		return 1;
	peers = pp->any_peer[dir];
	ports = pp->any_port[dir];
	{
		struct pol_peer_key k __attribute__((aligned(8))) = {
		    .prefixlen = XDPCNI_POL_PEER_FIXED_BITS +
				 (peer->family == XDPCNI_FAMILY_IPV4 ? 32 : 128),
		    .id = pp->id,
		    .dir = dir,
		    .family = peer->family,
		};

		pol_copy16(k.addr, peer->addr);
		m = bpf_map_lookup_elem(&pol_peers, &k);
		if (m)
			peers |= *m;
	}
	if (peers && ported) {
		struct pol_port_key k = {
		    .prefixlen = XDPCNI_POL_PORT_FIXED_BITS + 16,
		    .id = pp->id,
		    .dir = dir,
		    .proto = proto,
		    .port = dport,
		};

		m = bpf_map_lookup_elem(&pol_ports, &k);
		if (m)
			ports |= *m;
	}
	if (peers & ports)
		return 1;
	if (dir == XDPCNI_POL_EGRESS && ported && (pp->flags & XDPCNI_POL_NAMED_OUT)) {
		struct pol_named_key k __attribute__((aligned(8))) = {
		    .id = pp->id,
		    .family = peer->family,
		    .proto = proto,
		    .port = dport,
		};

		pol_copy16(k.addr, peer->addr);
		if (bpf_map_lookup_elem(&pol_named, &k))
			return 1;
	}
	return 0;
}

/* A flow from `a` (verdicts `pa`) to `b` (`pb`), to port `dport`: both ends allow it. */
static __always_inline int pol_flow_allowed(const struct addr *a, const struct pol_pod *pa,
					    const struct addr *b, const struct pol_pod *pb,
					    __u8 proto, __u16 dport)
{
	return pol_allows(pa, XDPCNI_POL_EGRESS, b, proto, dport) &&
	       pol_allows(pb, XDPCNI_POL_INGRESS, a, proto, dport);
}

/*
 * The verdicts of both ends (NULL for an end without XDPCNI_EP_POLICY: no
 * policy isolates it); 0, or the kernel's verdict when an end that should
 * have them has none.
 */
static __always_inline int pol_ends(const struct packet *p, const struct endpoint_info *src,
				    const struct endpoint_info *dst, struct pol_pod **ps,
				    struct pol_pod **pd)
{
	*ps = 0;
	*pd = 0;
	if (src->flags & XDPCNI_EP_POLICY) {
		*ps = pol_pod_of(&p->src);
		if (!*ps)
			return XDPCNI_V_PASS_POLICY;
	}
	if (dst->flags & XDPCNI_EP_POLICY) {
		*pd = pol_pod_of(&p->dst);
		if (!*pd)
			return XDPCNI_V_PASS_POLICY;
	}
	return 0;
}

/* Whether either end is in its window (a new UDP flow is then checked both ways). */
static __always_inline int pol_in_window(const struct pol_pod *a, const struct pol_pod *b,
					 __u64 now)
{
	return (a && a->window_until > now) || (b && b->window_until > now);
}

/*
 * An ICMP error about a flow between its two ends (p->err_proto, lib/parse.h):
 * delivered when that flow is recorded and allowed under the verdicts in
 * force, as conntrack's "related" is on the kernel path; else the kernel's
 * (where no entry relates it: dropped as invalid for an isolated pod).
 */
static __always_inline int pol_error_related(const struct packet *p, struct pol_flow_key *k,
					     __u64 gen, __u64 now)
{
	struct pol_flow *fl;

	/* The quoted packet went from the error's destination to its source. */
	pol_key_of(&p->dst, &p->src, p->err_proto, (__u16)(p->flow_id >> 16), (__u16)p->flow_id, k);
	fl = bpf_map_lookup_elem(&pol_flows, k);
	if (!fl || pol_expired(fl, p->err_proto, now) || fl->generation != gen)
		return 0;
	return 1;
}

/* An allowed packet: its flow in this CPU's cache, counted by how it was allowed. */
static __always_inline int pol_allow(struct pol_cached *c, const struct pol_flow_key *k, __u64 gen,
				     __u64 now, int from_lo, __u32 how)
{
	pol_cache_fill(c, k, gen, now, from_lo);
	pol_count(how);
	return STAGE_OK;
}

/* An allowed packet that changes nothing: counted. */
static __always_inline int pol_hit(void)
{
	pol_count(XDPCNI_POL_HIT);
	return STAGE_OK;
}

static __always_inline int pol_refuse(void)
{
	pol_count(XDPCNI_POL_REFUSED);
	return XDPCNI_V_DROP_POLICY;
}

/* The kernel's rules decide: `r` the verdict (XDPCNI_V_PASS_POLICY, or pol_ends()'s). */
static __always_inline int pol_to_kernel(int r)
{
	pol_count(XDPCNI_POL_KERNEL);
	return r;
}

/* Whether this CPU found the packet's flow recorded and allowed in this tick (pol_cache). */
static __always_inline int pol_cached(const struct pol_cached *c, const struct pol_flow_key *k,
				      __u64 gen, __u64 now, int from_lo)
{
	return c && c->tick == now && c->generation == gen && c->from_lo == (__u32)from_lo &&
	       pol_key_eq(&c->key, k);
}

/* Whether a recorded flow's packet begins a new connection: a SYN the other way, or after a close.
 */
static __always_inline int pol_begins_anew(const struct pol_flow *fl, int orig, __u8 flags)
{
	int syn = (flags & (TCP_SYN_ | TCP_ACK_)) == TCP_SYN_;

	return syn && (!orig || (fl->state & (XDPCNI_POL_FIN | XDPCNI_POL_RST)));
}

/* A recorded flow's state follows its packet: replied, closed, reset. */
static __always_inline void pol_follow(struct pol_flow *fl, int orig, __u8 flags)
{
	__u8 state = fl->state;

	if (!orig)
		state |= XDPCNI_POL_REPLIED;
	if (flags & TCP_FIN_ && flags != 0xff)
		state |= XDPCNI_POL_FIN;
	if (flags & TCP_RST_ && flags != 0xff)
		state |= XDPCNI_POL_RST;
	if (state != fl->state)
		fl->state = state;
}

/*
 * Whether a packet with no record may begin a flow the fast path checks: a
 * TCP SYN, an ICMP echo request, a UDP packet whose flow conntrack does not
 * have (begun on the kernel path: it stays there). Else the kernel's rules.
 */
static __always_inline int pol_may_begin(void *ctx, const struct packet *p, __u8 flags, int xdp)
{
	if (p->proto == IPPROTO_TCP &&
	    (flags == 0xff || (flags & (TCP_SYN_ | TCP_ACK_ | TCP_RST_ | TCP_FIN_)) != TCP_SYN_))
		return 0;
	if (p->proto == IPPROTO_ICMP && p->l4_info != ICMP_ECHO_)
		return 0;
	if (p->proto == IPPROTO_ICMPV6_ && p->l4_info != ICMPV6_ECHO_REQUEST_)
		return 0;
	if (p->proto == IPPROTO_UDP && ct_has(ctx, p, xdp))
		return 0;
	return 1;
}

/*
 * The check: STAGE_OK (the fast path carries it), XDPCNI_V_DROP_POLICY or
 * XDPCNI_V_PASS_POLICY. Three paths: this CPU's cache (pol_cached), a
 * recorded flow (followed by pol_follow, checked again under newer
 * verdicts), a new one (pol_may_begin, then checked and recorded); an ICMP
 * error by the flow it quotes (pol_error_related). One function, not one
 * per path: their locals would not share the stack, and the check's frame
 * with its callers' must fit 512 bytes. `xdp`: a constant in each caller.
 */
static __always_inline int pol_check(void *ctx, const struct packet *p,
				     const struct endpoint_info *src,
				     const struct endpoint_info *dst, int xdp)
{
	struct pol_flow_key k __attribute__((aligned(8))) = {};
	__u8 flags = p->proto == IPPROTO_TCP ? p->l4_info : 0;
	int from_lo = pol_key(p, &k), r, allowed;
	struct pol_pod *ps, *pd;
	struct pol_state *st;
	struct pol_cached *c;
	struct pol_flow *fl;
	__u32 zero = 0;
	__u64 now, gen;

	st = bpf_map_lookup_elem(&pol_state, &zero);
	if (!st)
		return XDPCNI_V_PASS_POLICY;
	gen = st->generation;
	now = bpf_ktime_get_coarse_ns();
	if (p->err_proto)
		return pol_error_related(p, &k, gen, now) ? pol_hit()
							  : pol_to_kernel(XDPCNI_V_PASS_POLICY);
	/* A packet that changes no record: this CPU may have found its flow in this tick. */
	c = flags & (TCP_SYN_ | TCP_FIN_ | TCP_RST_) ? 0 : pol_cache_slot(&k);
	if (pol_cached(c, &k, gen, now, from_lo))
		return pol_hit();
	fl = bpf_map_lookup_elem(&pol_flows, &k);
	if (fl && !pol_expired(fl, p->proto, now) &&
	    !pol_begins_anew(fl, fl->orig_lo == from_lo, flags)) {
		int orig = fl->orig_lo == from_lo;

		pol_follow(fl, orig, flags);
		r = XDPCNI_POL_HIT;
		if (fl->generation != gen) {
			/* Allowed under older verdicts: checked again, as it began. */
			r = pol_ends(p, src, dst, &ps, &pd);
			if (r)
				return pol_to_kernel(r);
			allowed =
			    orig ? pol_flow_allowed(&p->src, ps, &p->dst, pd, p->proto, p->dport)
				 : pol_flow_allowed(&p->dst, pd, &p->src, ps, p->proto, p->sport);
			if (!allowed)
				return pol_refuse();
			fl->generation = gen;
			r = XDPCNI_POL_RECHECK;
		}
		fl->last_ns = now;
		return pol_allow(c, &k, gen, now, from_lo, r);
	}
	/* No record: a new flow, where one may begin; else the kernel's rules. */
	if (!pol_may_begin(ctx, p, flags, xdp))
		return pol_to_kernel(XDPCNI_V_PASS_POLICY);
	r = pol_ends(p, src, dst, &ps, &pd);
	if (r)
		return pol_to_kernel(r);
	allowed = pol_flow_allowed(&p->src, ps, &p->dst, pd, p->proto, p->dport);
	/* In a window (xdpcni.h), a new UDP flow must be allowed whichever end began it. */
	if (allowed && p->proto == IPPROTO_UDP && pol_in_window(ps, pd, now))
		allowed = pol_flow_allowed(&p->dst, pd, &p->src, ps, p->proto, p->sport);
	if (!allowed)
		return pol_refuse();
	{
		struct pol_flow nf = {.generation = gen, .last_ns = now, .orig_lo = from_lo};

		if (bpf_map_update_elem(&pol_flows, &k, &nf, BPF_ANY))
			return pol_to_kernel(XDPCNI_V_PASS_POLICY);
	}
	return pol_allow(c, &k, gen, now, from_lo, XDPCNI_POL_NEW);
}

/*
 * The packet as the check gets it: a copy in this CPU's pol_scratch, with
 * its l4_info set. Not the caller's own: the verifier takes memory on the
 * stack that a global function gets as overwritten (the packet pointers
 * the caller keeps there would be lost), and the stacks of the caller and
 * the check together must fit 512 bytes.
 */
static __always_inline struct packet *pol_query(const struct packet *p, const struct frame *f)
{
	__u32 zero = 0;
	struct packet *q = bpf_map_lookup_elem(&pol_scratch, &zero);

	if (q) {
		*q = *p;
		q->l4_info = pol_l4_info(p, f);
	}
	return q;
}

/*
 * The check as one global function per hook, which the verifier checks once
 * on its own (a static one it checks again for every state a caller reaches
 * it in: four times the instructions verified). Global functions take five
 * arguments at most, and pointers to memory, never into the packet: the
 * caller fills p->l4_info first (pol_l4_info).
 */
__attribute__((noinline)) int pol_check_xdp(struct xdp_md *ctx, const struct packet *p,
					    const struct endpoint_info *src,
					    const struct endpoint_info *dst)
{
	if (!ctx || !p || !src || !dst)
		return XDPCNI_V_PASS_POLICY;
	return pol_check(ctx, p, src, dst, 1);
}

__attribute__((noinline)) int pol_check_tc(struct __sk_buff *ctx, const struct packet *p,
					   const struct endpoint_info *src,
					   const struct endpoint_info *dst)
{
	if (!ctx || !p || !src || !dst)
		return XDPCNI_V_PASS_POLICY;
	return pol_check(ctx, p, src, dst, 0);
}

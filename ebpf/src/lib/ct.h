/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The exact NAT check: whether conntrack NAT'd a packet's flow (kube-proxy's
 * DNAT, portmap's hostPort DNAT, an administrator's rule), asked only for
 * flows on a port where the kernel NATs (the nat_ports map: the cheap test
 * that decides every other flow), through the conntrack kfuncs. A NAT'd flow
 * goes to the kernel both ways (un-DNAT of replies, and conntrack must see
 * every packet of it); a flow conntrack never saw, or saw without NAT, keeps
 * the fast path; anything the lookup cannot answer goes to the kernel.
 *
 * A flow to such a port that conntrack never saw is asked once more, the
 * other way round, when it may be starting (UDP, a TCP SYN): an entry there
 * is another flow (kube-proxy's DNAT from the same client port to the same
 * backend) whose replies look like this flow's. The kernel would NAT the new
 * flow to a port of its own so that its replies stay apart; the fast path
 * cannot, so the flow goes to the kernel, which does.
 */
#pragma once

#include "parse.h"

#define XDPCNI_CT_NAT	  0x30 /* IPS_SRC_NAT | IPS_DST_NAT */
#define XDPCNI_ENOENT	  2
#define XDPCNI_CT_OPTS_SZ 16

/* struct bpf_ct_opts of net/netfilter/nf_conntrack_bpf.c (NF_BPF_CT_OPTS_SZ). */
struct ct_opts {
	__s32 netns_id; /* -1: the namespace of the packet's device */
	__s32 error;	/* out: -ENOENT when conntrack has no entry */
	__u8 l4proto;
	__u8 dir;
	__u16 ct_zone_id;
	__u8 ct_zone_dir;
	__u8 reserved[3];
};

/* The one field read of the kernel's struct nf_conn (its offset relocated at load). */
struct nf_conn___xdpcni {
	unsigned long status;
} __attribute__((preserve_access_index));

/* Called as helpers; the loader makes them kfunc calls (xdpcni.h). */
static struct nf_conn___xdpcni *(*xdpcni_skb_ct_lookup)(
    struct __sk_buff *skb, struct bpf_sock_tuple *tuple, __u32 tuple_sz, struct ct_opts *opts,
    __u32 opts_sz) = (void *)XDPCNI_KFUNC_SKB_CT_LOOKUP;
static struct nf_conn___xdpcni *(*xdpcni_xdp_ct_lookup)(
    struct xdp_md *xdp, struct bpf_sock_tuple *tuple, __u32 tuple_sz, struct ct_opts *opts,
    __u32 opts_sz) = (void *)XDPCNI_KFUNC_XDP_CT_LOOKUP;
static void (*xdpcni_ct_release)(struct nf_conn___xdpcni *ct) = (void *)XDPCNI_KFUNC_CT_RELEASE;

/* The loader sets it when it found the kfuncs; without them every such flow takes the kernel. */
volatile const __u32 xdpcni_ct_kfuncs = 0;

/* The packet's flow as conntrack keys it (either direction finds the entry); its size. */
static __always_inline __u32 ct_tuple(const struct packet *p, struct bpf_sock_tuple *t)
{
	__builtin_memset(t, 0, sizeof(*t));
	if (p->src.family == XDPCNI_FAMILY_IPV4) {
		__builtin_memcpy(&t->ipv4.saddr, p->src.addr, 4);
		__builtin_memcpy(&t->ipv4.daddr, p->dst.addr, 4);
		t->ipv4.sport = p->sport;
		t->ipv4.dport = p->dport;
		return sizeof(t->ipv4);
	}
	__builtin_memcpy(t->ipv6.saddr, p->src.addr, 16);
	__builtin_memcpy(t->ipv6.daddr, p->dst.addr, 16);
	t->ipv6.sport = p->sport;
	t->ipv6.dport = p->dport;
	return sizeof(t->ipv6);
}

/* The tuple of the flow's replies: `t` turned round (the ports at the same offsets in both). */
static __always_inline void ct_turn(const struct packet *p, struct bpf_sock_tuple *t)
{
	if (p->src.family == XDPCNI_FAMILY_IPV4) {
		t->ipv4.saddr = *(__be32 *)p->dst.addr;
		t->ipv4.daddr = *(__be32 *)p->src.addr;
		t->ipv4.sport = p->dport;
		t->ipv4.dport = p->sport;
		return;
	}
	__builtin_memcpy(t->ipv6.saddr, p->dst.addr, 16);
	__builtin_memcpy(t->ipv6.daddr, p->src.addr, 16);
	t->ipv6.sport = p->dport;
	t->ipv6.dport = p->sport;
}

/* Whether a flow may be starting here: UDP, or TCP with SYN and not ACK (unreadable: yes). */
static __always_inline int ct_may_start(const struct packet *p, const struct frame *f)
{
	__u8 *flags = (__u8 *)p->l4 + 13;

	if (p->proto != IPPROTO_TCP)
		return 1;
	if ((void *)(flags + 1) > f->data_end)
		return 1;
	return (*flags & 0x12) == 0x02;
}

/* The verdict of a lookup's answer: STAGE_OK (the fast path may carry it) or PASS_NAT. */
static __always_inline int ct_verdict(struct nf_conn___xdpcni *ct, const struct ct_opts *o)
{
	unsigned long status;

	if (!ct)
		return o->error == -XDPCNI_ENOENT ? STAGE_OK : XDPCNI_V_PASS_NAT;
	status = ct->status;
	xdpcni_ct_release(ct);
	return status & XDPCNI_CT_NAT ? XDPCNI_V_PASS_NAT : STAGE_OK;
}

/* One lookup on a hook (`xdp` a constant in each caller: only its kfunc call is emitted). */
static __always_inline struct nf_conn___xdpcni *ct_lookup(void *ctx, const struct packet *p,
							  struct bpf_sock_tuple *t, __u32 len,
							  struct ct_opts *o, int xdp)
{
	__builtin_memset(o, 0, sizeof(*o));
	o->netns_id = -1;
	o->l4proto = p->proto;
	return xdp ? xdpcni_xdp_ct_lookup(ctx, t, len, o, XDPCNI_CT_OPTS_SZ)
		   : xdpcni_skb_ct_lookup(ctx, t, len, o, XDPCNI_CT_OPTS_SZ);
}

/*
 * The check on a hook: `ctx` its context, `xdp` whether it is XDP's, `to`
 * whether the flow's destination port is the NAT'd one (STAGE_CT_TO).
 */
static __always_inline int ct_check(void *ctx, const struct packet *p, const struct frame *f,
				    int xdp, int to)
{
	struct nf_conn___xdpcni *ct;
	struct bpf_sock_tuple t;
	struct ct_opts o;
	__u32 len;
	int r;

	if (!xdpcni_ct_kfuncs)
		return XDPCNI_V_PASS_NAT;
	len = ct_tuple(p, &t);
	ct = ct_lookup(ctx, p, &t, len, &o, xdp);
	r = ct_verdict(ct, &o);
	if (ct || r != STAGE_OK || !to || !ct_may_start(p, f))
		return r;
	/* Conntrack never saw it: does another flow hold its replies? */
	ct_turn(p, &t);
	ct = ct_lookup(ctx, p, &t, len, &o, xdp);
	if (ct) {
		xdpcni_ct_release(ct);
		return XDPCNI_V_PASS_NAT;
	}
	return o.error == -XDPCNI_ENOENT ? STAGE_OK : XDPCNI_V_PASS_NAT;
}

/*
 * Whether conntrack has the packet's flow (begun on the kernel path: the
 * policy check leaves such a UDP flow to nftables, the uplink's program a
 * north-south one to kube-proxy), or cannot say (the kfuncs missing, an
 * error): 1. A function of its own, so its stack (the tuple, the options)
 * is not added to its callers' (the verifier's 512 bytes are for the
 * deepest chain of calls); unused where an entry file that does not call
 * it is compiled on its own.
 */
static __noinline __attribute__((unused)) int ct_has(void *ctx, const struct packet *p, int xdp)
{
	struct nf_conn___xdpcni *ct;
	struct bpf_sock_tuple t;
	struct ct_opts o;
	__u32 len;

	if (!xdpcni_ct_kfuncs)
		return 1;
	len = ct_tuple(p, &t);
	ct = ct_lookup(ctx, p, &t, len, &o, xdp);
	if (ct) {
		xdpcni_ct_release(ct);
		return 1;
	}
	return o.error != -XDPCNI_ENOENT;
}

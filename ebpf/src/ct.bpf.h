/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The exact NAT check: whether conntrack NAT'd a packet's flow (kube-proxy's
 * DNAT, portmap's hostPort DNAT, an administrator's rule), asked only for
 * flows on a port where the kernel NATs (the nat_ports map: the cheap test
 * that decides every other flow), through the conntrack kfuncs. A NAT'd flow
 * goes to the kernel both ways (un-DNAT of replies, and conntrack must see
 * every packet of it); a flow conntrack never saw, or saw without NAT, keeps
 * the fast path; anything the lookup cannot answer goes to the kernel.
 * Included once, by xdpcni.bpf.c.
 */

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
static __always_inline __u32 ct_tuple(const struct packet *p, struct bpf_sock_tuple *t,
				      struct ct_opts *o)
{
	__builtin_memset(t, 0, sizeof(*t));
	__builtin_memset(o, 0, sizeof(*o));
	o->netns_id = -1;
	o->l4proto = p->proto;
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

/*
 * The check on a hook: `ctx` its context, `xdp` whether it is XDP's (a
 * constant in each caller, so only that hook's kfunc call is emitted).
 */
static __always_inline int ct_check(void *ctx, const struct packet *p, int xdp)
{
	struct nf_conn___xdpcni *ct;
	struct bpf_sock_tuple t;
	struct ct_opts o;
	__u32 len;

	if (!xdpcni_ct_kfuncs)
		return XDPCNI_V_PASS_NAT;
	len = ct_tuple(p, &t, &o);
	ct = xdp ? xdpcni_xdp_ct_lookup(ctx, &t, len, &o, XDPCNI_CT_OPTS_SZ)
		 : xdpcni_skb_ct_lookup(ctx, &t, len, &o, XDPCNI_CT_OPTS_SZ);
	return ct_verdict(ct, &o);
}

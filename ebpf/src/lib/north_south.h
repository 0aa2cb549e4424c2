/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * North-south Services on tc (docs/services.md, "North-south"): a packet
 * that enters the node by an uplink for a node port, an externalIP or a
 * LoadBalancer IP (a frontend keyed with XDPCNI_SVC_OUTSIDE in `services`)
 * is translated to a backend: on this node, handed to its pod, whose
 * replies are translated back and sent out of the uplink the flow came in
 * by; on another node, masqueraded to this node and sent by the kernel's
 * route to it, where it leaves by a device this program runs on, which
 * catches the replies. Per-flow state in svc_nat (two entries per flow,
 * svc_maps.h).
 *
 * What kube-proxy's path would do is the rule, and what this path is not
 * sure to do alike it leaves to kube-proxy (XDPCNI_V_PASS_NAT: the kernel
 * translates it), before it writes anything: a flow it did not see begin
 * (TCP without SYN, UDP conntrack has), a backend on another node whose
 * route leaves by a device without this program, one whose
 * NetworkPolicies the kernel checks, a source outside a LoadBalancer
 * IP's loadBalancerSourceRanges, no ready backend (kube-proxy's rules
 * refuse it as they refuse it), the lease run out, no free reply tuple,
 * under externalTrafficPolicy Local a client in another node's pod CIDR.
 * Only pods on the tc hook are chosen (the agent writes no other), so every
 * reply meets ns_reply().
 */
#pragma once

#include "maps.h"
#include "parse.h"
#include "checks.h"
#include "count.h"
#include "ct.h"
#include "endpoint.h"
#include "remote.h"
#include "svc_maps.h"

#define XDPCNI_IP_CSUM_OFF (ETH_HLEN + offsetof(struct iphdr, check))

static __always_inline int same16(const __u8 *a, const __u8 *b)
{
	const __u32 *x = (const __u32 *)a, *y = (const __u32 *)b;

	return x[0] == y[0] && x[1] == y[1] && x[2] == y[2] && x[3] == y[3];
}

static __always_inline void nat_key_of(const struct packet *p, struct svc_nat_key *k)
{
	__builtin_memset(k, 0, sizeof(*k));
	__builtin_memcpy(k->saddr, p->src.addr, 16);
	__builtin_memcpy(k->daddr, p->dst.addr, 16);
	k->sport = p->sport;
	k->dport = p->dport;
	k->family = p->src.family;
	k->proto = p->proto;
}

/* One address of the packet rewritten, with the checksums that cover it. */
static __always_inline int nat_addr(struct __sk_buff *skb, int v6, __u32 off, __u32 csum_off,
				    __u64 l4flags, const __u8 *from, const __u8 *to)
{
	if (v6) {
		__s64 diff = bpf_csum_diff((__be32 *)from, 16, (__be32 *)to, 16, 0);

		if (diff < 0 ||
		    bpf_l4_csum_replace(skb, csum_off, 0, diff, BPF_F_PSEUDO_HDR | l4flags))
			return -1;
		return bpf_skb_store_bytes(skb, off, to, 16, 0) ? -1 : 0;
	}
	__be32 o = *(const __be32 *)from, n = *(const __be32 *)to;

	if (o == n)
		return 0;
	if (bpf_l4_csum_replace(skb, csum_off, o, n, BPF_F_PSEUDO_HDR | l4flags | sizeof(n)) ||
	    bpf_l3_csum_replace(skb, XDPCNI_IP_CSUM_OFF, o, n, sizeof(n)))
		return -1;
	return bpf_skb_store_bytes(skb, off, &n, sizeof(n), 0) ? -1 : 0;
}

static __always_inline int nat_port(struct __sk_buff *skb, __u32 off, __u32 csum_off, __u64 l4flags,
				    __u16 from, __u16 to)
{
	if (from == to)
		return 0;
	if (bpf_l4_csum_replace(skb, csum_off, from, to, l4flags | sizeof(to)))
		return -1;
	return bpf_skb_store_bytes(skb, off, &to, sizeof(to), 0) ? -1 : 0;
}

/*
 * The packet `p` parsed given the addresses and ports of `to`, its IPv4
 * header and TCP/UDP checksums updated (skb->csum too, for
 * CHECKSUM_COMPLETE; a zero UDP checksum stays "none"). The packet's
 * pointers in `p` are stale afterwards. 0, or -1 if a helper failed.
 */
static __always_inline int nat_rewrite(struct __sk_buff *skb, const struct packet *p,
				       const struct svc_nat *to)
{
	int v6 = p->src.family == XDPCNI_FAMILY_IPV6;
	__u32 l4 = ETH_HLEN + p->l4_off;
	__u32 csum_off = l4 + (p->proto == IPPROTO_TCP ? 16 : 6);
	__u64 l4flags = p->proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
	__u32 saddr =
	    ETH_HLEN + (v6 ? offsetof(struct ipv6hdr, saddr) : offsetof(struct iphdr, saddr));
	__u32 daddr =
	    ETH_HLEN + (v6 ? offsetof(struct ipv6hdr, daddr) : offsetof(struct iphdr, daddr));

	if (nat_addr(skb, v6, saddr, csum_off, l4flags, p->src.addr, to->saddr) ||
	    nat_addr(skb, v6, daddr, csum_off, l4flags, p->dst.addr, to->daddr) ||
	    nat_port(skb, l4, csum_off, l4flags, p->sport, to->sport) ||
	    nat_port(skb, l4 + 2, csum_off, l4flags, p->dport, to->dport))
		return -1;
	return 0;
}

#define XDPCNI_NAT_PORT_TRIES 4
#define XDPCNI_NAT_PORT_MIN   1024
#define XDPCNI_NAT_PORT_END   32768 /* the node's ephemeral ports begin here */

/*
 * Per-CPU room for what the uplink's program would not fit in the
 * verifier's 512 bytes of stack for its deepest chain of calls (a tc
 * program is not re-entered on its CPU before it returns). Not pinned:
 * each load has its own.
 */
struct ns_scratch {
	struct svc_range_key range;
	struct svc_client_key ak;
	struct svc_nat_key rk;
	struct svc_nat rev;
	struct svc_nat fwd;
	struct bpf_fib_lookup fib;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct ns_scratch);
} ns_scratch SEC(".maps");

static __always_inline struct ns_scratch *scratch(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&ns_scratch, &zero);
}

/*
 * The kernel's forwarding route toward `to` for the packet `p` that came in
 * by skb's device, as the stack would forward it after the DNAT: its
 * device, its next hop in *nh (when set), and with `src` set the source
 * MASQUERADE would give there (BPF_FIB_LOOKUP_SRC: the route's preferred
 * source, else the device's). The device, or 0 when the FIB gives no
 * forwarding route (not unicast, forwarding off, no source: the kernel's
 * path decides).
 */
static __noinline __attribute__((unused)) __u32 ns_route(struct __sk_buff *skb,
							 const struct packet *p, const __u8 *to,
							 struct bpf_redir_neigh *nh, __u8 *src)
{
	struct ns_scratch *s = scratch();
	struct bpf_fib_lookup *fib;
	int v6 = p->src.family == XDPCNI_FAMILY_IPV6;
	long rc;

	if (!s)
		return 0;
	fib = &s->fib;
	__builtin_memset(fib, 0, sizeof(*fib));
	fib->family = v6 ? XDPCNI_AF_INET6 : XDPCNI_AF_INET;
	fib->l4_protocol = p->proto;
	fib->ifindex = skb->ingress_ifindex;
	if (v6)
		__builtin_memcpy(fib->ipv6_dst, to, 16);
	else
		__builtin_memcpy(&fib->ipv4_dst, to, 4);
	rc = bpf_fib_lookup(skb, fib, sizeof(*fib),
			    BPF_FIB_LOOKUP_SKIP_NEIGH | (src ? BPF_FIB_LOOKUP_SRC : 0));
	if (rc != BPF_FIB_LKUP_RET_SUCCESS)
		return 0;
	if (nh) {
		/* The gateway, else the address itself (an IPv4 route may have an IPv6 one). */
		__builtin_memset(nh, 0, sizeof(*nh));
		nh->nh_family = fib->family;
		if (fib->family == XDPCNI_AF_INET6)
			__builtin_memcpy(nh->ipv6_nh, fib->ipv6_dst, 16);
		else
			__builtin_memcpy(&nh->ipv4_nh, &fib->ipv4_dst, 4);
	}
	if (src) {
		if (!v6 && !fib->ipv4_src)
			return 0;
		__builtin_memset(src, 0, 16);
		if (v6)
			__builtin_memcpy(src, fib->ipv6_src, 16);
		else
			__builtin_memcpy(src, &fib->ipv4_src, 4);
	}
	return fib->ifindex;
}

/*
 * Whether a new flow from `p`'s source may reach its outside frontend: a
 * LoadBalancer IP with loadBalancerSourceRanges only from within them
 * (svc_source_ranges; a frontend with no entry has none).
 */
static __always_inline int ns_source_allowed(const struct packet *p, struct svc_range_key *k)
{
	__u32 *allow;

	__builtin_memset(k, 0, sizeof(*k));
	k->prefixlen = XDPCNI_RANGE_FIXED_BITS + (p->src.family == XDPCNI_FAMILY_IPV4 ? 32 : 128);
	__builtin_memcpy(k->fe.addr, p->dst.addr, 16);
	k->fe.port = p->dport;
	k->fe.family = p->dst.family | XDPCNI_SVC_OUTSIDE;
	k->fe.proto = p->proto;
	__builtin_memcpy(k->src, p->src.addr, 16);
	allow = bpf_map_lookup_elem(&svc_source_ranges, k);
	return !allow || *allow;
}

/*
 * The backend of a new flow from `client` to frontend `svc`, with its id:
 * under ClientIP affinity the client's last one while it serves and its
 * affinity has not run out (kube-proxy's `recent` match, refreshed by each
 * new flow), else one of the ready backends at random. NULL when there is
 * none. `ak` is the affinity's key, for ns_affinity_record().
 */
static __always_inline struct svc_addr *ns_choose(const struct svc_value *svc,
						  const struct addr *client,
						  struct svc_client_key *ak, __u32 *id)
{
	struct svc_choice *c;
	struct svc_addr *b;
	__u64 now;

	if (!(svc->flags & XDPCNI_SVC_AFFINITY))
		return svc_pick(svc, id);
	__builtin_memset(ak, 0, sizeof(*ak));
	__builtin_memcpy(ak->addr, client->addr, 16);
	ak->id = svc->id;
	ak->family = client->family;
	c = bpf_map_lookup_elem(&svc_client_affinity, ak);
	now = bpf_ktime_get_ns();
	if (c && (!svc->affinity_timeout ||
		  now - c->last_ns <= (__u64)svc->affinity_timeout * 1000000000ULL)) {
		b = bpf_map_lookup_elem(&svc_backends, &c->backend);
		if (b) {
			*id = c->backend;
			return b;
		}
	}
	return svc_pick(svc, id);
}

/* The client's affinity to backend `id` from now (a flow to it was made). */
static __always_inline void ns_affinity_record(const struct svc_value *svc,
					       const struct svc_client_key *ak, __u32 id)
{
	struct svc_choice c = {.backend = id};

	if (!(svc->flags & XDPCNI_SVC_AFFINITY))
		return;
	c.last_ns = bpf_ktime_get_ns();
	bpf_map_update_elem(&svc_client_affinity, ak, &c, BPF_ANY);
}

/*
 * A new flow to frontend `svc` (its first packet: the caller checked
 * ct_may_start()), `k` its forward key: a backend chosen, and the flow's
 * two svc_nat entries made, the reply's first (BPF_NOEXIST: a reply tuple
 * another flow holds is not taken from it; a masqueraded flow tries other
 * ports, as MASQUERADE would, before it leaves the flow to kube-proxy).
 * STAGE_OK, or the verdict that leaves the flow to the kernel.
 */
static __noinline __attribute__((unused)) int ns_new_flow(struct __sk_buff *skb,
							  const struct packet *p,
							  const struct svc_value *svc,
							  const struct svc_nat_key *k)
{
	struct ns_scratch *s = scratch();
	struct svc_nat *out, *rev, *had;
	struct svc_nat_key *rk;
	struct svc_addr *b;
	struct addr ba = {};
	__u32 id = 0, via, i, made;
	int local, masq = !(svc->flags & XDPCNI_SVC_EXT_LOCAL);

	if (!s)
		return XDPCNI_V_PASS_NAT;
	out = &s->fwd;
	rev = &s->rev;
	rk = &s->rk;
	/* Begun before this program saw it: conntrack's (kube-proxy's) to its end. */
	if (p->proto == IPPROTO_UDP && ct_has(skb, p, 0))
		return XDPCNI_V_PASS_NAT;
	if (!svc_leased())
		return XDPCNI_V_PASS_NAT;
	/*
	 * Outside a LoadBalancer's source ranges: kube-proxy's firewall chain
	 * does not translate it (and marks it for a drop that only a packet
	 * for the node itself meets): the kernel's path, as with kube-proxy.
	 */
	if (!ns_source_allowed(p, &s->range))
		return XDPCNI_V_PASS_NAT;
	/*
	 * Under Local, kube-proxy sends a client in the cluster's pod ranges
	 * (another node's pod) to every backend, not the local ones alone.
	 */
	if (!masq && lookup_remote(&p->src))
		return XDPCNI_V_PASS_NAT;
	b = ns_choose(svc, &p->src, &s->ak, &id);
	if (!b || b->family != p->dst.family)
		return XDPCNI_V_PASS_NAT;
	ba.family = b->family;
	__builtin_memcpy(ba.addr, b->addr, 16);
	local = lookup_endpoint(&ba) != 0;
	if (!local && !masq)
		return XDPCNI_V_PASS_NAT; /* Local's backend that is no pod here */
	__builtin_memset(out, 0, sizeof(*out));
	__builtin_memcpy(out->saddr, p->src.addr, 16);
	if (masq) {
		/* Masqueraded as kube-proxy does: to the source of the route to the backend. */
		via = ns_route(skb, p, b->addr, 0, out->saddr);
		if (!via)
			return XDPCNI_V_PASS_NAT;
		/* Another node's: only where its replies meet this program. */
		if (!local) {
			if (!bpf_map_lookup_elem(&svc_uplinks, &via))
				return XDPCNI_V_PASS_NAT;
			out->flags = XDPCNI_NAT_REMOTE;
		}
	}
	__builtin_memcpy(out->daddr, b->addr, 16);
	out->sport = p->sport;
	out->dport = b->port;
	out->ifindex = skb->ingress_ifindex;
	out->backend = id;

	__builtin_memset(rk, 0, sizeof(*rk));
	__builtin_memcpy(rk->saddr, out->daddr, 16);
	__builtin_memcpy(rk->daddr, out->saddr, 16);
	rk->sport = out->dport;
	rk->family = p->src.family;
	rk->proto = p->proto;
	__builtin_memset(rev, 0, sizeof(*rev));
	__builtin_memcpy(rev->saddr, p->dst.addr, 16);
	__builtin_memcpy(rev->daddr, p->src.addr, 16);
	rev->sport = p->dport;
	rev->dport = p->sport;
	rev->ifindex = out->ifindex;
	rev->backend = id;
	rev->flags = XDPCNI_NAT_REPLY | out->flags;
	made = 1;
	for (i = 0; i < XDPCNI_NAT_PORT_TRIES; i++) {
		if (i) {
			/* Taken: another port, as MASQUERADE's random-fully would. */
			if (!masq)
				return XDPCNI_V_PASS_NAT;
			out->sport = bpf_htons(XDPCNI_NAT_PORT_MIN +
					       bpf_get_prandom_u32() %
						   (XDPCNI_NAT_PORT_END - XDPCNI_NAT_PORT_MIN));
		}
		rk->dport = out->sport;
		if (!bpf_map_update_elem(&svc_nat, rk, rev, BPF_NOEXIST))
			break;
		had = bpf_map_lookup_elem(&svc_nat, rk);
		/*
		 * The same client's earlier flow to the same frontend on the same
		 * ports (its port used again) may be replaced; another flow's
		 * replies may not be taken from it.
		 */
		if (had && same16(had->daddr, rev->daddr) && had->dport == rev->dport &&
		    same16(had->saddr, rev->saddr) && had->sport == rev->sport &&
		    !bpf_map_update_elem(&svc_nat, rk, rev, BPF_ANY)) {
			made = 0;
			break;
		}
	}
	if (i == XDPCNI_NAT_PORT_TRIES) {
		nat_count(XDPCNI_NAT_NO_TUPLE, 1);
		return XDPCNI_V_PASS_NAT;
	}
	/* A forward entry replaced (its backend went) is no new key. */
	if (!bpf_map_lookup_elem(&svc_nat, k))
		made++;
	if (bpf_map_update_elem(&svc_nat, k, out, BPF_ANY)) {
		bpf_map_delete_elem(&svc_nat, rk);
		return XDPCNI_V_PASS_NAT;
	}
	nat_count(XDPCNI_NAT_MADE, made);
	ns_affinity_record(svc, &s->ak, id);
	return STAGE_OK;
}

/*
 * A packet of a flow to another node's backend (`n`, its forward entry):
 * TTL, the MTU of the device the kernel's route to it leaves by (still one
 * of svc_uplinks), the translation, then out of that device to the route's
 * next hop (the neighbour table fills the MACs).
 */
static __always_inline int ns_to_node(struct __sk_buff *skb, struct packet *p,
				      const struct svc_nat *n)
{
	struct bpf_redir_neigh nh;
	__u32 mtu = 0, via = ns_route(skb, p, n->daddr, &nh, 0);

	if (!via || !bpf_map_lookup_elem(&svc_uplinks, &via))
		return XDPCNI_V_PASS_NAT;
	if (*p->ttl <= 1)
		return XDPCNI_V_PASS_TTL;
	if (bpf_check_mtu(skb, via, &mtu, 0, 0))
		return XDPCNI_V_PASS_MTU;
	decrement_ttl(p);
	if (nat_rewrite(skb, p, n))
		return XDPCNI_V_PASS_MALFORMED;
	bpf_redirect_neigh(via, &nh, sizeof(nh), 0);
	return XDPCNI_V_NS_TO_NODE;
}

/*
 * The TCP or UDP tuple of a frame addressed to the node (`k`, as svc_nat
 * keys it) and the north-south frontend it would be for (`fe`), read where
 * they lie (no pull: the node's own traffic pays this and two lookups). 0
 * when it is no TCP or UDP over IPv4 or IPv6 (an IPv6 extension header:
 * not one).
 */
static __always_inline int outside_tuple(struct __sk_buff *skb, struct svc_nat_key *k,
					 struct svc_addr *fe)
{
	__u8 vihl = 0;
	__u32 l4;

	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		if (bpf_skb_load_bytes(skb, ETH_HLEN, &vihl, 1) ||
		    bpf_skb_load_bytes(skb, ETH_HLEN + offsetof(struct iphdr, protocol), &k->proto,
				       1) ||
		    bpf_skb_load_bytes(skb, ETH_HLEN + offsetof(struct iphdr, saddr), k->saddr,
				       4) ||
		    bpf_skb_load_bytes(skb, ETH_HLEN + offsetof(struct iphdr, daddr), k->daddr, 4))
			return 0;
		l4 = ETH_HLEN + (vihl & 0xf) * 4;
		k->family = XDPCNI_FAMILY_IPV4;
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		if (bpf_skb_load_bytes(skb, ETH_HLEN + offsetof(struct ipv6hdr, nexthdr), &k->proto,
				       1) ||
		    bpf_skb_load_bytes(skb, ETH_HLEN + offsetof(struct ipv6hdr, saddr), k->saddr,
				       32))
			return 0;
		l4 = ETH_HLEN + sizeof(struct ipv6hdr);
		k->family = XDPCNI_FAMILY_IPV6;
	} else {
		return 0;
	}
	if (k->proto != IPPROTO_TCP && k->proto != IPPROTO_UDP)
		return 0;
	if (bpf_skb_load_bytes(skb, l4, &k->sport, 4))
		return 0;
	__builtin_memcpy(fe->addr, k->daddr, 16);
	fe->port = k->dport;
	fe->family = k->family | XDPCNI_SVC_OUTSIDE;
	fe->proto = k->proto;
	return 1;
}

/* ns_from_outside(): the flow has no entry yet, ns_new_flow() is to make it. */
#define NS_NEW_FLOW (-5)

/*
 * A packet that came in by an uplink for north-south frontend `svc`,
 * parsed (`p`), `k` its svc_nat key: its verdict, XDPCNI_V_NS_TO_POD when it
 * was translated and handed to the backend's pod, XDPCNI_V_NS_TO_NODE when
 * sent on to another node's; NS_NEW_FLOW when the flow has no entry yet
 * (the caller makes it with ns_new_flow() and calls again: two calls of
 * the program, not nested ones, for the stack's sake).
 */
static __noinline __attribute__((unused)) int
ns_from_outside(struct __sk_buff *skb, struct packet *p, const struct frame *f,
		const struct svc_value *svc, const struct svc_nat_key *k)
{
	struct endpoint_info *dst;
	struct svc_nat *e;
	struct addr ba = {};
	int r;

	if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP)
		return XDPCNI_V_PASS_NO_ENDPOINT;
	e = bpf_map_lookup_elem(&svc_nat, k);
	/*
	 * A flow's first packet (a UDP datagram, a TCP SYN: also a tuple used
	 * again) whose backend is gone chooses again, as kube-proxy's flush of
	 * a removed UDP endpoint's conntrack entries gives; an established
	 * TCP flow stays on its backend while its pod lives, as conntrack
	 * keeps it.
	 */
	if (e && (p->proto == IPPROTO_UDP || ct_may_start(p, f)) &&
	    !bpf_map_lookup_elem(&svc_backends, &e->backend))
		e = 0;
	if (!e) {
		/* A TCP flow begun before this program saw it: conntrack's. */
		if (!ct_may_start(p, f))
			return XDPCNI_V_PASS_NAT;
		return NS_NEW_FLOW;
	}
	if (e->flags & XDPCNI_NAT_REMOTE)
		return ns_to_node(skb, p, e);
	ba.family = p->dst.family;
	__builtin_memcpy(ba.addr, e->daddr, 16);
	dst = lookup_endpoint(&ba);
	/* Its pod gone, or now one whose policies the kernel checks: fail closed. */
	if (!dst)
		return XDPCNI_V_PASS_NAT;
	if (dst->flags & (XDPCNI_EP_KERNEL_ONLY | XDPCNI_EP_POLICY))
		return XDPCNI_V_PASS_KERNEL_ONLY;
	if (*p->ttl <= 1)
		return XDPCNI_V_PASS_TTL;
	r = check_mtu(p, f, dst->mtu, dst->mtu);
	if (r != STAGE_OK)
		return r;
	rewrite(p, dst);
	if (nat_rewrite(skb, p, e))
		return XDPCNI_V_PASS_MALFORMED;
	bpf_redirect_peer(dst->ifindex, 0);
	count(dst->stats_slot, XDPCNI_V_RX_FASTPATH, f->len);
	return XDPCNI_V_NS_TO_POD;
}

/*
 * From a pod on tc, for no pod and no other node's pod CIDR (`p` parsed and
 * its source validated): a reply of a north-south flow goes back translated
 * out of the uplink its flow came in by (XDPCNI_V_NS_REPLY); anything else
 * keeps the verdict it had (XDPCNI_V_PASS_NO_ENDPOINT). A function of its
 * own, so its stack is not added to the policy check's (the verifier's 512
 * bytes are for the deepest chain of calls); unused where an entry file
 * that does not call it is compiled on its own.
 */
static __noinline __attribute__((unused)) int ns_reply(struct __sk_buff *skb, struct packet *p)
{
	struct svc_nat_key k;
	struct svc_nat n, *e;
	__u32 mtu = 0;

	if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP)
		return XDPCNI_V_PASS_NO_ENDPOINT;
	nat_key_of(p, &k);
	e = bpf_map_lookup_elem(&svc_nat, &k);
	if (!e || !(e->flags & XDPCNI_NAT_REPLY))
		return XDPCNI_V_PASS_NO_ENDPOINT;
	n = *e;
	if (*p->ttl <= 1)
		return XDPCNI_V_PASS_TTL;
	/* Each frame (or a GSO packet's each segment) fits the uplink, as forwarding checks. */
	if (bpf_check_mtu(skb, n.ifindex, &mtu, 0, 0))
		return XDPCNI_V_PASS_MTU;
	decrement_ttl(p);
	if (nat_rewrite(skb, p, &n))
		return XDPCNI_V_PASS_MALFORMED;
	bpf_redirect_neigh(n.ifindex, 0, 0, 0);
	return XDPCNI_V_NS_REPLY;
}

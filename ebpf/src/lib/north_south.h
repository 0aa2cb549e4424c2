/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * North-south Services on tc (docs/services.md, "North-south"): a packet
 * that enters the node by an uplink for a node port, an externalIP or a
 * LoadBalancer IP (a frontend keyed with XDPCNI_SVC_OUTSIDE in `services`)
 * is translated to a backend on this node and handed to its pod; the pod's
 * replies are translated back and sent out of the uplink the flow came in
 * by. Per-flow state in svc_nat (two entries per flow, svc_maps.h).
 *
 * What kube-proxy's path would do is the rule, and what this path is not
 * sure to do alike it leaves to kube-proxy (XDPCNI_V_PASS_NAT: the kernel
 * translates it), before it writes anything: a flow it did not see begin
 * (TCP without SYN, UDP conntrack has), a backend on another node, one
 * whose NetworkPolicies the kernel checks, ClientIP affinity, no ready
 * backend (kube-proxy's rules refuse it as they refuse it), the lease run
 * out, under externalTrafficPolicy Local a client in another node's pod
 * CIDR. Only pods on the tc hook are chosen (the agent writes no other), so
 * every reply meets ns_reply().
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

/*
 * A new flow to frontend `fe` (`svc`): a backend chosen, and the flow's two
 * svc_nat entries made, the reply's first (BPF_NOEXIST: a reply tuple
 * another flow holds leaves this one to kube-proxy). STAGE_OK with *out the
 * forward entry, or the verdict that leaves the flow to the kernel.
 */
static __always_inline int ns_new_flow(struct __sk_buff *skb, const struct packet *p,
				       const struct frame *f, const struct svc_addr *fe,
				       const struct svc_value *svc, const struct svc_nat_key *k,
				       struct svc_nat *out)
{
	struct svc_nat_key rk = {};
	struct svc_nat rev = {};
	struct svc_ip *masq;
	struct svc_addr *b;
	struct addr ba = {};
	__u32 id = 0;

	/* Begun before this program saw it: conntrack's (kube-proxy's) to its end. */
	if (!ct_may_start(p, f) || (p->proto == IPPROTO_UDP && ct_has(skb, p, 0)))
		return XDPCNI_V_PASS_NAT;
	if (!svc_leased() || (svc->flags & XDPCNI_SVC_AFFINITY))
		return XDPCNI_V_PASS_NAT;
	/*
	 * Under Local, kube-proxy sends a client in the cluster's pod ranges
	 * (another node's pod) to every backend, not the local ones alone.
	 */
	if ((svc->flags & XDPCNI_SVC_EXT_LOCAL) && lookup_remote(&p->src))
		return XDPCNI_V_PASS_NAT;
	b = svc_pick(svc, &id);
	if (!b || b->family != p->dst.family)
		return XDPCNI_V_PASS_NAT;
	ba.family = b->family;
	__builtin_memcpy(ba.addr, b->addr, 16);
	if (!lookup_endpoint(&ba))
		return XDPCNI_V_PASS_NAT; /* another node's: kube-proxy's */
	__builtin_memset(out, 0, sizeof(*out));
	__builtin_memcpy(out->saddr, p->src.addr, 16);
	if (!(svc->flags & XDPCNI_SVC_EXT_LOCAL)) {
		/* Masqueraded as kube-proxy does: the source the agent wrote. */
		masq = bpf_map_lookup_elem(&svc_node_src, fe);
		if (!masq)
			return XDPCNI_V_PASS_NAT;
		__builtin_memcpy(out->saddr, masq->addr, 16);
	}
	__builtin_memcpy(out->daddr, b->addr, 16);
	out->sport = p->sport;
	out->dport = b->port;
	out->ifindex = skb->ingress_ifindex;
	out->backend = id;

	__builtin_memcpy(rk.saddr, out->daddr, 16);
	__builtin_memcpy(rk.daddr, out->saddr, 16);
	rk.sport = out->dport;
	rk.dport = out->sport;
	rk.family = p->src.family;
	rk.proto = p->proto;
	__builtin_memcpy(rev.saddr, p->dst.addr, 16);
	__builtin_memcpy(rev.daddr, p->src.addr, 16);
	rev.sport = p->dport;
	rev.dport = p->sport;
	rev.ifindex = out->ifindex;
	rev.backend = id;
	rev.flags = XDPCNI_NAT_REPLY;
	if (bpf_map_update_elem(&svc_nat, &rk, &rev, BPF_NOEXIST)) {
		struct svc_nat *had = bpf_map_lookup_elem(&svc_nat, &rk);

		/*
		 * The same client's earlier flow to the same frontend on the same
		 * ports (its port used again) may be replaced; another flow's
		 * replies may not be taken from it.
		 */
		if (!had || !same16(had->daddr, rev.daddr) || had->dport != rev.dport ||
		    !same16(had->saddr, rev.saddr) || had->sport != rev.sport ||
		    bpf_map_update_elem(&svc_nat, &rk, &rev, BPF_ANY))
			return XDPCNI_V_PASS_NAT;
	}
	if (bpf_map_update_elem(&svc_nat, k, out, BPF_ANY)) {
		bpf_map_delete_elem(&svc_nat, &rk);
		return XDPCNI_V_PASS_NAT;
	}
	return STAGE_OK;
}

/*
 * The north-south frontend a frame addressed to the node would be for: its
 * destination, protocol and destination port, read where they lie (no pull:
 * the node's own traffic pays this and one lookup). 0 when it is no TCP or
 * UDP over IPv4 or IPv6 (an IPv6 extension header: not one).
 */
static __always_inline int outside_key(struct __sk_buff *skb, struct svc_addr *fe)
{
	__u8 proto = 0, vihl = 0;
	__u32 l4;

	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		if (bpf_skb_load_bytes(skb, ETH_HLEN, &vihl, 1) ||
		    bpf_skb_load_bytes(skb, ETH_HLEN + offsetof(struct iphdr, protocol), &proto,
				       1) ||
		    bpf_skb_load_bytes(skb, ETH_HLEN + offsetof(struct iphdr, daddr), fe->addr, 4))
			return 0;
		l4 = ETH_HLEN + (vihl & 0xf) * 4;
		fe->family = XDPCNI_FAMILY_IPV4;
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		if (bpf_skb_load_bytes(skb, ETH_HLEN + offsetof(struct ipv6hdr, nexthdr), &proto,
				       1) ||
		    bpf_skb_load_bytes(skb, ETH_HLEN + offsetof(struct ipv6hdr, daddr), fe->addr,
				       16))
			return 0;
		l4 = ETH_HLEN + sizeof(struct ipv6hdr);
		fe->family = XDPCNI_FAMILY_IPV6;
	} else {
		return 0;
	}
	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return 0;
	if (bpf_skb_load_bytes(skb, l4 + 2, &fe->port, 2))
		return 0;
	fe->family |= XDPCNI_SVC_OUTSIDE;
	fe->proto = proto;
	return 1;
}

/*
 * A packet that came in by an uplink, parsed (`p`): STAGE_OK when it is for
 * no north-south frontend (the caller goes on as before); else its verdict,
 * XDPCNI_V_NS_TO_POD when it was translated and handed to the backend's pod.
 */
static __always_inline int ns_from_outside(struct __sk_buff *skb, struct packet *p,
					   const struct frame *f)
{
	struct svc_addr fe = {};
	struct svc_nat_key k;
	struct svc_nat n, *e;
	struct svc_value *svc;
	struct endpoint_info *dst;
	struct addr ba = {};
	int r;

	if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP)
		return STAGE_OK;
	__builtin_memcpy(fe.addr, p->dst.addr, 16);
	fe.port = p->dport;
	fe.family = p->dst.family | XDPCNI_SVC_OUTSIDE;
	fe.proto = p->proto;
	svc = bpf_map_lookup_elem(&services, &fe);
	if (!svc)
		return STAGE_OK;
	nat_key_of(p, &k);
	e = bpf_map_lookup_elem(&svc_nat, &k);
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
	if (e) {
		n = *e;
	} else {
		r = ns_new_flow(skb, p, f, &fe, svc, &k, &n);
		if (r != STAGE_OK)
			return r;
	}
	ba.family = p->dst.family;
	__builtin_memcpy(ba.addr, n.daddr, 16);
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
	if (nat_rewrite(skb, p, &n))
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

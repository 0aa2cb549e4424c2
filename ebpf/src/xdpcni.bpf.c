// SPDX-License-Identifier: GPL-2.0-only
/*
 * xdpcni datapath: runs on the host side of every pod veth (the packets the
 * pod sent) and delivers pod-to-pod traffic straight to the destination pod.
 * Two hooks, one set of decisions: the XDP program redirects through a devmap
 * or a cpumap to the destination's host veth; the tc program (tcx ingress)
 * hands the skb to the destination pod's eth0 with bpf_redirect_peer. Both run
 * the same parse -> validate -> decide stages below on a struct frame and
 * count into the same rows; everything they are not sure about goes to the
 * kernel (XDP_PASS, TC_ACT_UNSPEC): kernel routing is always the fallback.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/pkt_cls.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "xdpcni.h"

char LICENSE[] SEC("license") = "GPL";

#include "maps.bpf.h"
#include "parse.bpf.h"
#include "cpu.bpf.h"
#include "ct.bpf.h"
#include "policy.bpf.h"

/*
 * Stage-cost builds (ebpf/build.rs, test objects only, never the product):
 * XDPCNI_STAGES=n stops the fast path at STAGE_END(n, ...), after its
 * n-th stage (returning `ret`: a program's pass, or STAGE_STOPPED from a
 * stage), with what the stages computed kept live, and counts nothing. A
 * stage's cost is the difference between consecutive builds run on the
 * same frame (e2e/src/cost.rs). In the product build STAGE_END is nothing.
 */
#ifdef XDPCNI_STAGES
#define STAGE_STOPPED (-2)
#define STAGE_END(n, live, ret)                                                                    \
	do {                                                                                       \
		if (XDPCNI_STAGES == (n)) {                                                        \
			asm volatile("" ::"r"(live) : "memory");                                   \
			return (ret);                                                              \
		}                                                                                  \
	} while (0)
#define RETURN_IF_STOPPED(r, action)                                                               \
	do {                                                                                       \
		if ((r) == STAGE_STOPPED)                                                          \
			return (action);                                                           \
	} while (0)
#else
#define STAGE_END(n, live, ret)                                                                    \
	do {                                                                                       \
	} while (0)
#define RETURN_IF_STOPPED(r, action)                                                               \
	do {                                                                                       \
	} while (0)
#endif

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

/*
 * The cached record of an address, if its slot holds it (xdpcni.h): an
 * inlined array index into the slot, another into its one-entry inner
 * array, and the address compared.
 */
static __always_inline struct endpoint_info *cached_endpoint(void *cache, const __u32 *w,
							     __u32 words)
{
	__u32 zero = 0, slot = bpf_ntohl(w[words - 1]) & XDPCNI_EPCACHE_MASK;
	struct endpoint_cached *c;
	const __u32 *have;
	void *inner;

	inner = bpf_map_lookup_elem(cache, &slot);
	if (!inner)
		return 0;
	c = bpf_map_lookup_elem(inner, &zero);
	if (!c)
		return 0;
	have = (const __u32 *)c->addr;
	for (__u32 i = 0; i < words; i++)
		if (have[i] != w[i])
			return 0;
	return &c->info;
}

/*
 * The endpoint record of an address: from the cache's slot, else from the
 * hash map of its family. The empty asm keeps each family's lookups apart:
 * merged into one call with a map pointer that depends on the branch, the
 * verifier could not inline them (measured: +25 ns per packet).
 */
static __always_inline struct endpoint_info *lookup_endpoint(const struct addr *a)
{
	const __u32 *w = (const __u32 *)a->addr;
	struct endpoint_info *ep;

	if (a->family == XDPCNI_FAMILY_IPV4) {
		ep = cached_endpoint(&epcache4, w, 1);
		asm volatile("" ::: "memory");
		if (!ep)
			ep = bpf_map_lookup_elem(&endpoints4, a->addr);
		asm volatile("" ::: "memory");
		return ep;
	}
	ep = cached_endpoint(&epcache6, w, 4);
	asm volatile("" ::: "memory");
	if (!ep)
		ep = bpf_map_lookup_elem(&endpoints6, a->addr);
	return ep;
}

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

/* Verdicts given before the source is known: no address to validate. */
static __always_inline int before_source(int r)
{
	/* ND and multicast use link-local sources. */
	return r == XDPCNI_V_PASS_NOT_IP || r == XDPCNI_V_PASS_MALFORMED ||
	       r == XDPCNI_V_PASS_MULTICAST || r == XDPCNI_V_PASS_ND;
}

/*
 * Stage 2, validate: the source address must be one of the endpoint on the
 * ingress veth (what rp_filter does on the kernel path).
 */
static __always_inline struct endpoint_info *validate(const struct packet *p, __u32 ingress)
{
	struct endpoint_info *src = lookup_endpoint(&p->src);

	return src && src->ifindex == ingress ? src : 0;
}

static __always_inline int mac_equal(const __u8 *a, const __u8 *b)
{
	return *(const __u32 *)a == *(const __u32 *)b &&
	       *(const __u16 *)(a + 4) == *(const __u16 *)(b + 4);
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

/* Kernel-only, but for a pod whose policies this program enforces (XDPCNI_EP_POLICY). */
static __always_inline int kernel_only(const struct endpoint_info *ep)
{
	return (ep->flags & (XDPCNI_EP_KERNEL_ONLY | XDPCNI_EP_POLICY)) == XDPCNI_EP_KERNEL_ONLY;
}

/*
 * Stage 3, decide: STAGE_OK with *dst set when the fast path may deliver the
 * packet exactly as kernel routing would, STAGE_CT with *dst set when it may
 * unless conntrack NAT'd its flow; otherwise the kernel's verdict.
 */
static __always_inline int decide(const struct packet *p, const struct frame *f,
				  const struct endpoint_info *src, struct endpoint_info **dst_out)
{
	int r;

	struct endpoint_info *dst;

	/* Not addressed to the host veth: the kernel would not route it. */
	if (!mac_equal(p->eth->h_dest, src->host_mac))
		return XDPCNI_V_PASS_OTHERHOST;
	if (kernel_only(src))
		return XDPCNI_V_PASS_KERNEL_ONLY;
	dst = lookup_endpoint(&p->dst);
	if (!dst)
		return XDPCNI_V_PASS_NO_ENDPOINT;
	if (kernel_only(dst))
		return XDPCNI_V_PASS_KERNEL_ONLY;
	if (*p->ttl <= 1)
		return XDPCNI_V_PASS_TTL;
	/*
	 * Longer than the sender's own MTU: no wire frame, a GSO super-packet
	 * (generic and tc modes keep the pod's TSO). XDP redirecting it would
	 * drop it (xdp_ok_fwd_dev): the kernel path segments it.
	 */
	r = check_mtu(p, f, src->mtu, dst->mtu);
	if (r != STAGE_OK)
		return r;
	*dst_out = dst;
	return nat_stage(p, !(src->flags & XDPCNI_EP_NO_NAT_PORTS),
			 !(dst->flags & XDPCNI_EP_NO_NAT_PORTS));
}

/* TTL and MACs as the kernel's forwarding would set them. */
static __always_inline void rewrite(struct packet *p, const struct endpoint_info *dst)
{
	decrement_ttl(p);
	__builtin_memcpy(p->eth->h_dest, dst->pod_mac, ETH_ALEN);
	__builtin_memcpy(p->eth->h_source, dst->host_mac, ETH_ALEN);
}

/* On tc: a pass lets the next tcx program run, then the stack. */
static __always_inline int tc_action_of(__u32 v)
{
	return action_in(v, TC_ACT_SHOT, TC_ACT_REDIRECT, TC_ACT_UNSPEC);
}

/* Headers the stages read, at most: Ethernet, IPv6 (or IPv4 without options), a TCP header. */
#define XDPCNI_TC_PULL (ETH_HLEN + 40 + 60)

/*
 * An skb as the stages see it, its headers pulled into the linear part
 * where the sender's stack did not put them (a frame short and linear
 * already is not touched).
 */
static __always_inline void tc_frame(struct __sk_buff *skb, struct frame *f)
{
	__u32 head = skb->len < XDPCNI_TC_PULL ? skb->len : XDPCNI_TC_PULL;

	if ((void *)(long)skb->data + head > (void *)(long)skb->data_end)
		bpf_skb_pull_data(skb, head);
	f->data = (void *)(long)skb->data;
	f->data_end = (void *)(long)skb->data_end;
	f->len = skb->len;
	f->gso_size = skb->gso_size;
}

#include "node.bpf.h"

/*
 * Stages 1-3 on either hook: STAGE_OK with *src and *dst set when the fast
 * path may deliver the frame, or (`remote` non-NULL: the tc hook) with
 * *src and *remote set when another node's pod CIDR's route may carry it;
 * otherwise its verdict, with *src set once the source is validated (the
 * verdict counts on the sender's slot) and NULL before (on the ingress
 * veth's).
 */
static __always_inline int classify(struct packet *p, const struct frame *f, __u32 ingress,
				    struct endpoint_info **src, struct endpoint_info **dst,
				    struct remote_net **remote)
{
	int r = parse(p, f);

	*src = 0;
	*dst = 0;
	STAGE_END(1, p, STAGE_STOPPED);
	if (before_source(r))
		return r;
	*src = validate(p, ingress);
	STAGE_END(2, *src, STAGE_STOPPED);
	if (!*src)
		return XDPCNI_V_DROP_SPOOFED;
	if (r != STAGE_OK && !p->err_proto)
		return r;
	r = decide(p, f, *src, dst);
	STAGE_END(3, *dst, STAGE_STOPPED);
	if (r == XDPCNI_V_PASS_NO_ENDPOINT && remote)
		return decide_remote(p, f, *src, remote);
	if (r == STAGE_OK && !*dst)
		return XDPCNI_V_PASS_NO_ENDPOINT;
	/*
	 * An ICMP error about a flow between its two ends goes on only where
	 * the policy check may find that flow recorded; else to the kernel, as
	 * every other ICMP error.
	 */
	if (p->err_proto &&
	    (r != STAGE_OK || !(((*src)->flags | (*dst)->flags) & XDPCNI_EP_POLICY)))
		return XDPCNI_V_PASS_L4;
	return r;
}

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
 * bpf_redirect_neigh towards another's (node.bpf.h). A VLAN tag the stack
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

#include "hold.bpf.h"

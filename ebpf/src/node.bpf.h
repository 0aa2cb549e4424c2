/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The fast path between nodes, both halves (xdpcni.h, remote_nets).
 *
 * Sending, in the tc program of a pod's host veth: a packet for no pod of
 * this node but for another node's pod CIDR leaves by the device of that
 * CIDR's route with bpf_redirect_neigh to the route's gateway: the
 * neighbour table fills the MACs (and resolves the gateway as the kernel
 * would), the skb keeps its GSO and its socket's backpressure. The checks
 * are the same-node ones (source validated, neither end kernel-only, TTL,
 * MTU against the route's device, the NAT check) and the route's own.
 *
 * Receiving, in xdpcni_tc_from_node on that device's tcx ingress: a frame
 * addressed to this node, from another node's pod CIDR whose route leaves
 * by the device it came in on (what rp_filter checks), to a pod of this
 * node, goes to the pod's eth0 with bpf_redirect_peer under the same
 * checks. Everything else (the node's own traffic first of all: one
 * endpoint lookup finds no pod) goes on to the stack untouched.
 * Included once, by xdpcni.bpf.c.
 */

#define XDPCNI_AF_INET	   2
#define XDPCNI_AF_INET6	   10
#define XDPCNI_PACKET_HOST 0

/* The route of another node's pod CIDR holding `a`, if the agent made one. */
static __always_inline struct remote_net *lookup_remote(const struct addr *a)
{
	struct remote_key k = {
	    .prefixlen = XDPCNI_REMOTE_FIXED_BITS + (a->family == XDPCNI_FAMILY_IPV4 ? 32 : 128),
	    .family = a->family,
	};

	__builtin_memcpy(k.addr, a->addr, 16);
	return bpf_map_lookup_elem(&remote_nets, &k);
}

/*
 * Stage 3 for a destination that is no pod of this node: STAGE_OK with
 * *out set when the route of another node's pod CIDR may carry it as the
 * kernel would (STAGE_CT / STAGE_CT_TO: unless conntrack NAT'd it), else
 * the kernel's verdict.
 */
static __always_inline int decide_remote(const struct packet *p, const struct frame *f,
					 const struct endpoint_info *src, struct remote_net **out)
{
	struct remote_net *rn;
	int r;

	/* An ICMP error is the kernel's to send on (it may translate it). */
	if (p->err_proto)
		return XDPCNI_V_PASS_L4;
	rn = lookup_remote(&p->dst);
	if (!rn)
		return XDPCNI_V_PASS_NO_ENDPOINT;
	/* A pod whose policies the datapath checks: its egress is the kernel's here. */
	if (src->flags & XDPCNI_EP_KERNEL_ONLY)
		return XDPCNI_V_PASS_KERNEL_ONLY;
	if (*p->ttl <= 1)
		return XDPCNI_V_PASS_TTL;
	r = check_mtu(p, f, src->mtu, rn->mtu);
	if (r != STAGE_OK)
		return r;
	*out = rn;
	return nat_stage(p, !(src->flags & XDPCNI_EP_NO_NAT_PORTS), 1);
}

/*
 * Stage 4 on tc for another node's pod: TTL as the kernel's forwarding
 * sets it, then out of the route's device to its gateway (the MACs are the
 * neighbour table's).
 */
static __always_inline int send_remote(struct packet *p, const struct remote_net *rn)
{
	struct bpf_redir_neigh nh = {};

	if (rn->via != XDPCNI_VIA_GATEWAY)
		return XDPCNI_V_PASS_NO_ENDPOINT;
	if (rn->nh_family == XDPCNI_FAMILY_IPV4) {
		nh.nh_family = XDPCNI_AF_INET;
		__builtin_memcpy(&nh.ipv4_nh, rn->nexthop, 4);
	} else {
		nh.nh_family = XDPCNI_AF_INET6;
		__builtin_memcpy(nh.ipv6_nh, rn->nexthop, 16);
	}
	decrement_ttl(p);
	bpf_redirect_neigh(rn->ifindex, &nh, sizeof(nh), 0);
	return XDPCNI_V_REDIRECT_NEIGH;
}

/*
 * Stages 1-3 for a frame that came in on a node's device `ingress`:
 * STAGE_OK (or STAGE_CT, STAGE_CT_TO) with *dst set when the fast path may
 * deliver it, else the kernel's verdict.
 */
static __always_inline int from_node(struct packet *p, const struct frame *f, __u32 ingress,
				     struct endpoint_info **dst_out)
{
	struct endpoint_info *dst;
	struct remote_net *rn;
	int r = parse(p, f);

	if (r != STAGE_OK)
		return r;
	dst = lookup_endpoint(&p->dst);
	if (!dst)
		return XDPCNI_V_PASS_NO_ENDPOINT;
	rn = lookup_remote(&p->src);
	if (!rn || rn->ifindex != ingress)
		return XDPCNI_V_PASS_NOT_REMOTE_POD;
	if (dst->flags & XDPCNI_EP_KERNEL_ONLY)
		return XDPCNI_V_PASS_KERNEL_ONLY;
	if (*p->ttl <= 1)
		return XDPCNI_V_PASS_TTL;
	r = check_mtu(p, f, rn->mtu, dst->mtu);
	if (r != STAGE_OK)
		return r;
	*dst_out = dst;
	return nat_stage(p, 1, !(dst->flags & XDPCNI_EP_NO_NAT_PORTS));
}

/*
 * Whether the frame is addressed to no pod of this node (the node's own
 * traffic, most of what the device receives): its destination address is
 * read where it lies, even in the skb's fragments, so such a frame costs
 * one lookup and no pull of its headers. Not sure (not IP, too short): 0.
 */
static __always_inline int to_no_pod(struct __sk_buff *skb)
{
	struct addr a = {};

	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		a.family = XDPCNI_FAMILY_IPV4;
		if (bpf_skb_load_bytes(skb, ETH_HLEN + offsetof(struct iphdr, daddr), a.addr, 4))
			return 0;
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		a.family = XDPCNI_FAMILY_IPV6;
		if (bpf_skb_load_bytes(skb, ETH_HLEN + offsetof(struct ipv6hdr, daddr), a.addr, 16))
			return 0;
	} else {
		return 0;
	}
	return !lookup_endpoint(&a);
}

/*
 * From another node (tcx ingress of the device its pod CIDRs' routes leave
 * by): a pod of this node gets the frame at once; anything else goes on
 * to the stack as it came. Counted on the device's slot (the node's own
 * traffic as pass_no_endpoint) and, delivered, on the pod's.
 */
SEC("classifier")
int xdpcni_tc_from_node(struct __sk_buff *skb)
{
	struct endpoint_info *dst = 0;
	struct packet p = {};
	struct frame f = {};
	int r;

	f.len = skb->len;
	if (skb->vlan_present) {
		r = XDPCNI_V_PASS_NOT_IP;
	} else if (skb->pkt_type != XDPCNI_PACKET_HOST) {
		r = XDPCNI_V_PASS_OTHERHOST;
	} else if (to_no_pod(skb)) {
		r = XDPCNI_V_PASS_NO_ENDPOINT;
	} else {
		tc_frame(skb, &f);
		r = from_node(&p, &f, skb->ingress_ifindex, &dst);
	}
	if (r == STAGE_CT || r == STAGE_CT_TO)
		r = ct_check(skb, &p, &f, 0, r == STAGE_CT_TO);
	if (r == STAGE_OK && dst) {
		rewrite(&p, dst);
		bpf_redirect_peer(dst->ifindex, 0);
		count(dst->stats_slot, XDPCNI_V_RX_FASTPATH, f.len);
		r = XDPCNI_V_FROM_NODE_PEER;
	}
	if (r < 0)
		r = XDPCNI_V_PASS_NO_ENDPOINT;
	count(slot_of(skb->ingress_ifindex), r, f.len);
	return tc_action_of(r);
}

/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * From another node: xdpcni_tc_from_node on the tcx ingress of the device
 * another node's pod CIDRs' routes leave by (the wire, or xdpcni.vxlan). A
 * frame addressed to this node, from another node's pod CIDR whose route
 * leaves by the device it came in on (what rp_filter checks), to a pod of
 * this node, goes to the pod's eth0 with bpf_redirect_peer under the same
 * checks as every hop (lib/checks.h). A frame for a north-south Service
 * frontend (a node port, an externalIP, a LoadBalancer IP) is translated to
 * a backend, on this node or another, and another node's backend's replies
 * translated back (lib/north_south.h). Everything else (the node's own
 * traffic first of all: one endpoint lookup finds no pod, one Service
 * lookup no frontend, one NAT lookup no reply) goes on to the stack
 * untouched. The sending half is lib/remote.h.
 */
#include "lib/common.h"
#include "lib/maps.h"
#include "lib/parse.h"
#include "lib/count.h"
#include "lib/ct.h"
#include "lib/endpoint.h"
#include "lib/checks.h"
#include "lib/remote.h"
#include "lib/north_south.h"

#define XDPCNI_PACKET_HOST 0

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
	*dst_out = dst;
	return forward_checks(p, f, dst->flags & XDPCNI_EP_KERNEL_ONLY, rn->mtu, dst->mtu, 1,
			      !(dst->flags & XDPCNI_EP_NO_NAT_PORTS));
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

/* A svc_nat entry that is the reply direction of a flow to another node's backend. */
static __always_inline int is_remote_reply(const struct svc_nat *e)
{
	return e && (e->flags & XDPCNI_NAT_REPLY) && (e->flags & XDPCNI_NAT_REMOTE);
}

/* The frame parsed: a function of its own, for the stack's sake. */
static __noinline int tc_parse(struct __sk_buff *skb, struct packet *p, struct frame *f)
{
	tc_frame(skb, f);
	return parse(p, f);
}

/*
 * A frame for a pod of this node (`p`, `f` the caller's, for the stack's
 * sake: the verifier's 512 bytes are for the deepest chain of calls):
 * delivered to the pod when the checks pass, else the kernel's verdict.
 */
static __noinline int to_pod(struct __sk_buff *skb, struct packet *p, struct frame *f)
{
	struct endpoint_info *dst = 0;
	int r;

	tc_frame(skb, f);
	r = from_node(p, f, skb->ingress_ifindex, &dst);
	if (r == STAGE_CT || r == STAGE_CT_TO)
		r = ct_check(skb, p, f, 0, r == STAGE_CT_TO);
	if (r == STAGE_OK && dst) {
		rewrite(p, dst);
		bpf_redirect_peer(dst->ifindex, 0);
		count(dst->stats_slot, XDPCNI_V_RX_FASTPATH, f->len);
		return XDPCNI_V_FROM_NODE_PEER;
	}
	return r < 0 ? XDPCNI_V_PASS_NO_ENDPOINT : r;
}

/*
 * From another node or from outside (tcx ingress of the device its pod
 * CIDRs' routes leave by, and of the uplinks north-south Services come in
 * by): a pod of this node gets the frame at once, a north-south frontend's
 * is translated to its backend (this node's pod, or another node's), and
 * another node's backend's reply back; anything else goes on to the stack
 * as it came. Counted on the device's slot (the node's own traffic as
 * pass_no_endpoint) and, delivered, on the pod's.
 */
SEC("classifier")
int xdpcni_tc_from_node(struct __sk_buff *skb)
{
	struct svc_nat_key k = {};
	struct svc_addr fe = {};
	struct packet p = {};
	struct frame f = {};
	struct svc_value *svc;
	__u32 len = skb->len;
	int r;

	if (skb->vlan_present) {
		r = XDPCNI_V_PASS_NOT_IP;
	} else if (skb->pkt_type != XDPCNI_PACKET_HOST) {
		r = XDPCNI_V_PASS_OTHERHOST;
	} else if (to_no_pod(skb)) {
		r = XDPCNI_V_PASS_NO_ENDPOINT;
		if (outside_tuple(skb, &k, &fe)) {
			svc = bpf_map_lookup_elem(&services, &fe);
			if (svc || is_remote_reply(bpf_map_lookup_elem(&svc_nat, &k))) {
				r = tc_parse(skb, &p, &f);
				if (r == STAGE_OK) {
					/* As parsed (the read above is no parse). */
					nat_key_of(&p, &k);
					r = svc ? ns_from_outside(skb, &p, &f, svc, &k)
						: ns_reply(skb, &p);
				}
				if (r == NS_NEW_FLOW) {
					r = ns_new_flow(skb, &p, svc, &k);
					if (r == STAGE_OK)
						r = ns_from_outside(skb, &p, &f, svc, &k);
				}
				if (r < 0)
					r = XDPCNI_V_PASS_NO_ENDPOINT;
			}
		}
	} else {
		r = to_pod(skb, &p, &f);
	}
	count(slot_of(skb->ingress_ifindex), r, len);
	return tc_action_of(r);
}

/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The fast path between nodes (xdpcni.h, remote_nets): the route of another
 * node's pod CIDR as the agent wrote it beside the kernel's, and the sending
 * half, run by the tc program of a pod's host veth (pod.bpf.c). A packet for
 * no pod of this node but for another node's pod CIDR leaves by the device
 * of that CIDR's route with bpf_redirect_neigh to the route's gateway: the
 * neighbour table fills the MACs (and resolves the gateway as the kernel
 * would), the skb keeps its GSO and its socket's backpressure. The checks
 * are the same-node ones (checks.h: source validated, neither end
 * kernel-only, TTL, MTU against the route's device, the NAT check) and the
 * route's own. The receiving half is node.bpf.c.
 */
#pragma once

#include "maps.h"
#include "parse.h"
#include "checks.h"

#define XDPCNI_AF_INET	2
#define XDPCNI_AF_INET6 10

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
 * the kernel's verdict. A pod whose policies the datapath checks sends to
 * other nodes by the kernel (the raw XDPCNI_EP_KERNEL_ONLY flag).
 */
static __always_inline int decide_remote(const struct packet *p, const struct frame *f,
					 const struct endpoint_info *src, struct remote_net **out)
{
	struct remote_net *rn;

	/* An ICMP error is the kernel's to send on (it may translate it). */
	if (p->err_proto)
		return XDPCNI_V_PASS_L4;
	rn = lookup_remote(&p->dst);
	if (!rn)
		return XDPCNI_V_PASS_NO_ENDPOINT;
	*out = rn;
	return forward_checks(p, f, src->flags & XDPCNI_EP_KERNEL_ONLY, src->mtu, rn->mtu,
			      !(src->flags & XDPCNI_EP_NO_NAT_PORTS), 1);
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

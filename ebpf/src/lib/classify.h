/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * classify(), stages 1-3 of a packet a pod sent, on either hook: parse
 * (parse.h), validate (endpoint.h), decide (here, over checks.h; and
 * remote.h for a destination on another node). The entries of pod.bpf.c run
 * it and then their hook's stage 4.
 */
#pragma once

#include "parse.h"
#include "endpoint.h"
#include "checks.h"
#include "remote.h"

/* Verdicts given before the source is known: no address to validate. */
static __always_inline int before_source(int r)
{
	/* ND and multicast use link-local sources. */
	return r == XDPCNI_V_PASS_NOT_IP || r == XDPCNI_V_PASS_MALFORMED ||
	       r == XDPCNI_V_PASS_MULTICAST || r == XDPCNI_V_PASS_ND;
}

/*
 * Stage 3, decide: STAGE_OK with *dst set when the fast path may deliver the
 * packet exactly as kernel routing would, STAGE_CT with *dst set when it may
 * unless conntrack NAT'd its flow; otherwise the kernel's verdict.
 */
static __always_inline int decide(const struct packet *p, const struct frame *f,
				  const struct endpoint_info *src, struct endpoint_info **dst_out)
{
	struct endpoint_info *dst;

	/* Not addressed to the host veth: the kernel would not route it. */
	if (!mac_equal(p->eth->h_dest, src->host_mac))
		return XDPCNI_V_PASS_OTHERHOST;
	if (kernel_only(src))
		return XDPCNI_V_PASS_KERNEL_ONLY;
	dst = lookup_endpoint(&p->dst);
	if (!dst)
		return XDPCNI_V_PASS_NO_ENDPOINT;
	*dst_out = dst;
	return forward_checks(p, f, kernel_only(dst), src->mtu, dst->mtu,
			      !(src->flags & XDPCNI_EP_NO_NAT_PORTS),
			      !(dst->flags & XDPCNI_EP_NO_NAT_PORTS));
}

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

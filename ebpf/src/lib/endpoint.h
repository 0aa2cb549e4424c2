/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The endpoints of this node: an address's record (the per-slot cache, then
 * the hash map of its family), and stage 2, validate, that reads it.
 */
#pragma once

#include "maps.h"
#include "parse.h"

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

/* Kernel-only, but for a pod whose policies this program enforces (XDPCNI_EP_POLICY). */
static __always_inline int kernel_only(const struct endpoint_info *ep)
{
	return (ep->flags & (XDPCNI_EP_KERNEL_ONLY | XDPCNI_EP_POLICY)) == XDPCNI_EP_KERNEL_ONLY;
}

/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The cpumap redirect's choice of a CPU: one flow, one CPU, among the CPUs
 * its destination allows.
 */
#pragma once

#include "parse.h"

/*
 * Picks the n-th allowed CPU, n = hash mod the number of allowed CPUs. The
 * usual mask, every CPU from 0 up (no `cpus` annotation, or "0-k"), is n
 * itself: no walk over the bits.
 */
static __always_inline __u32 pick_cpu(__u64 mask, __u32 hash)
{
	__u32 allowed = __builtin_popcountll(mask);
	__u32 n, seen = 0;

	if (!allowed)
		return 0;
	n = hash % allowed;
	if (!(mask & (mask + 1)))
		return n;
	for (__u32 cpu = 0; cpu < XDPCNI_MAX_CPUS; cpu++) {
		if (!(mask & (1ULL << cpu)))
			continue;
		if (seen == n)
			return cpu;
		seen++;
	}
	return 0;
}

static __always_inline __u32 mix(__u32 h)
{
	h ^= h >> 16;
	h *= 0x7feb352d;
	h ^= h >> 15;
	h *= 0x846ca68b;
	h ^= h >> 16;
	return h;
}

/*
 * One flow, one CPU: the ports (or echo id) and the addresses folded into
 * one word (the destination's turned half-way round, so a flow and its
 * reply differ), mixed once. Computed only for cpumap redirects; an IPv4
 * address is one word (the rest of `addr` is zero).
 */
static __always_inline __u32 flow_hash(const struct packet *p)
{
	const __u32 *s = (const __u32 *)p->src.addr;
	const __u32 *d = (const __u32 *)p->dst.addr;
	__u32 h = p->flow_id ^ s[0] ^ ((d[0] << 16) | (d[0] >> 16));

	if (p->src.family == XDPCNI_FAMILY_IPV6)
		for (int i = 1; i < 4; i++)
			h ^= s[i] ^ ((d[i] << 16) | (d[i] >> 16));
	return mix(h);
}

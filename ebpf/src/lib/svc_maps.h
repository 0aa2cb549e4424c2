/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The Service maps two objects share: services.bpf.c (the socket programs,
 * whose loader pins them in svc-layout-<N>) and the datapath's node device
 * program (north_south.h), whose loader opens the same pins by path
 * (ebpf/src/datapath/load.rs), so the datapath's own layout and its
 * migration are not involved. One definition here: the two objects cannot
 * disagree on a map's shape.
 */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "xdpcni.h"

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPCNI_MAX_SERVICES);
	__type(key, struct svc_addr);
	__type(value, struct svc_value);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} services SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPCNI_MAX_SVC_BACKENDS);
	__type(key, struct svc_slot_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} svc_slots SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPCNI_MAX_SVC_BACKENDS);
	__type(key, __u32);
	__type(value, struct svc_addr);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} svc_backends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} svc_lease SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, XDPCNI_MAX_SVC_NAT);
	__type(key, struct svc_nat_key);
	__type(value, struct svc_nat);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} svc_nat SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, XDPCNI_MAX_SVC_RANGES);
	__type(key, struct svc_range_key);
	__type(value, __u32);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} svc_source_ranges SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, XDPCNI_MAX_SVC_AFFINITY);
	__type(key, struct svc_client_key);
	__type(value, struct svc_choice);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} svc_client_affinity SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XDPCNI_NAT_STATS);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} svc_nat_stats SEC(".maps");

/* Adds `n` to row `row` of svc_nat_stats. */
static __always_inline void nat_count(__u32 row, __u64 n)
{
	__u64 *v = bpf_map_lookup_elem(&svc_nat_stats, &row);

	if (v)
		*v += n;
}

/*
 * The devices the node device's program runs on (ifindex -> 1), written by
 * the datapath as it attaches and detaches it: a flow to another node's
 * backend is made only where the route to it leaves by one of them, so
 * the backend's replies meet the program that translates them back.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPCNI_MAX_SVC_UPLINKS);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} svc_uplinks SEC(".maps");

/* Whether the writer's lease on the maps still runs. */
static __always_inline int svc_leased(void)
{
	__u32 zero = 0;
	__u64 *until = bpf_map_lookup_elem(&svc_lease, &zero);

	return until && bpf_ktime_get_ns() < *until;
}

/* One of `svc`'s ready backends at random, with its id; NULL when there is none. */
static __always_inline struct svc_addr *svc_pick(const struct svc_value *svc, __u32 *id)
{
	struct svc_slot_key slot = {.id = svc->id};
	__u32 *pid;

	if (!svc->count || svc->count > XDPCNI_SVC_MAX_CHOICES)
		return 0;
	slot.index = bpf_get_prandom_u32() % svc->count;
	pid = bpf_map_lookup_elem(&svc_slots, &slot);
	if (!pid)
		return 0;
	*id = *pid;
	return bpf_map_lookup_elem(&svc_backends, pid);
}

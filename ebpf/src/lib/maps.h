/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The datapath's maps, pinned by name: their definitions are the layout
 * (xdpcni.h's twins on the Rust side, ebpf/src/abi.rs).
 */
#pragma once

#include "common.h"

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPCNI_MAX_ENDPOINTS);
	__type(key, __u32);
	__type(value, struct endpoint_info);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} endpoints4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPCNI_MAX_ENDPOINTS);
	__type(key, struct endpoint6_key);
	__type(value, struct endpoint_info);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} endpoints6 SEC(".maps");

/*
 * One cached record: the inner maps of epcache4/6 (xdpcni.h). Sizes, not
 * types: clang emits a type reached through two pointers as a forward
 * declaration, which BTF loaders refuse; the kernel matches inner maps by
 * type, sizes, flags and max_entries alone.
 */
struct epcache_entry {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, sizeof(struct endpoint_cached));
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, XDPCNI_EPCACHE_SLOTS);
	__type(key, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__array(values, struct epcache_entry);
} epcache4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, XDPCNI_EPCACHE_SLOTS);
	__type(key, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__array(values, struct epcache_entry);
} epcache6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_DEVMAP_HASH);
	__uint(max_entries, XDPCNI_MAX_TX_PORTS);
	__type(key, __u32);
	__type(value, struct bpf_devmap_val);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} tx_ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_CPUMAP);
	__uint(max_entries, XDPCNI_MAX_CPUS);
	__type(key, __u32);
	__type(value, struct bpf_cpumap_val);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cpu_map SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPCNI_MAX_NAT_PORTS);
	__type(key, struct nat_port_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} nat_ports SEC(".maps");

/* Per-CPU counter rows, slot * XDPCNI_V_MAX + verdict (see xdpcni.h). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XDPCNI_STATS_ROWS);
	__type(key, __u32);
	__type(value, struct stats_value);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} counters SEC(".maps");

/* Host veth ifindex -> its counter slot. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPCNI_MAX_TX_PORTS);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} port_slots SEC(".maps");

/* Counter slot -> the ifindex that owns it: written only by userspace. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPCNI_MAX_SLOTS);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} slot_owners SEC(".maps");

/* What this pinned datapath is: its layout, state and build (xdpcni.h). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct datapath_meta);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} meta SEC(".maps");

/* Namespaces with NetworkPolicies, for the CNI's hold decision (xdpcni.h). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPCNI_MAX_POLICY_NS);
	__type(key, struct policy_ns_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} policy_namespaces SEC(".maps");

/* Whether policy_namespaces is complete (xdpcni.h). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct policy_gate);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} policy_gate SEC(".maps");

/* NetworkPolicy verdicts and the flows they allowed (xdpcni.h, lib/policy.h). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPCNI_MAX_POL_PODS);
	__type(key, struct pol_pod_key);
	__type(value, struct pol_pod);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pol_pods SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, XDPCNI_MAX_POL_PEERS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct pol_peer_key);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pol_peers SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, XDPCNI_MAX_POL_PORTS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct pol_port_key);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pol_ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPCNI_MAX_POL_NAMED);
	__type(key, struct pol_named_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pol_named SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, XDPCNI_MAX_POL_FLOWS);
	__type(key, struct pol_flow_key);
	__type(value, struct pol_flow);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pol_flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct pol_state);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pol_state SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XDPCNI_POL_STATS);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} pol_stats SEC(".maps");

/* Other nodes' pod CIDRs and how to reach them (xdpcni.h, node.bpf.c). */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, XDPCNI_MAX_REMOTE_NETS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct remote_key);
	__type(value, struct remote_net);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} remote_nets SEC(".maps");

// SPDX-License-Identifier: GPL-2.0-only
/*
 * Benchmark helper, not part of the datapath: drops every frame at the host
 * veth and counts it. Attached where the datapath would run, it gives the
 * ceiling any forwarding path on the machine can reach for a given sender.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "GPL";

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} drop_count SEC(".maps");

SEC("xdp")
int xdp_drop_count(struct xdp_md *ctx)
{
	__u32 key = 0;
	__u64 *n = bpf_map_lookup_elem(&drop_count, &key);

	if (n)
		*n += 1;
	return XDP_DROP;
}

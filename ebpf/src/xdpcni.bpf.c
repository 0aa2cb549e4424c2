/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The xdpcni datapath object: one ELF, loaded whole by ebpf/src/datapath,
 * whose maps (lib/maps.h) every program shares. Each entry program lives in
 * the file of its hook, over the stage headers of lib/ (each includes what
 * it uses; ebpf/build.rs compiles each file on its own too):
 *
 *   pod.bpf.c     xdpcni_from_pod (XDP), xdpcni_tc_from_pod (tcx ingress):
 *                 a pod's host veth, the packets the pod sent
 *   node.bpf.c    xdpcni_tc_from_node: the device other nodes' pods come in by
 *   cpumap.bpf.c  xdpcni_cpumap: a cpumap redirect's second stage
 *   hold.bpf.c    xdpcni_hold: a new pod's veth until the agent classified it
 *
 * The stages every entry shares: parse (lib/parse.h), validate
 * (lib/endpoint.h), decide (lib/classify.h over lib/checks.h and
 * lib/remote.h), north-south Services (lib/north_south.h), the NAT check
 * (lib/ct.h), NetworkPolicy (lib/policy.h),
 * counting (lib/count.h).
 */
#include "lib/common.h"

char LICENSE[] SEC("license") = "GPL";

#include "pod.bpf.c"
#include "node.bpf.c"
#include "cpumap.bpf.c"
#include "hold.bpf.c"

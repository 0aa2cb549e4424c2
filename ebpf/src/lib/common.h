/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * What every part of the datapath object starts from: the kernel's UAPI
 * headers, libbpf's helpers, the shared layout (xdpcni.h), and the
 * stage-cost build's switches.
 *
 * The object is xdpcni.bpf.c: one compilation unit that includes each entry
 * program's file (pod.bpf.c, node.bpf.c, cpumap.bpf.c, hold.bpf.c). Each of
 * those, and each header here, includes what it uses and compiles on its own
 * (ebpf/build.rs checks it), so a new entry is a new .c over these headers.
 */
#pragma once

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/pkt_cls.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "xdpcni.h"

/*
 * Stage-cost builds (ebpf/build.rs, test objects only, never the product):
 * XDPCNI_STAGES=n stops the fast path at STAGE_END(n, ...), after its
 * n-th stage (returning `ret`: a program's pass, or STAGE_STOPPED from a
 * stage), with what the stages computed kept live, and counts nothing. A
 * stage's cost is the difference between consecutive builds run on the
 * same frame (e2e/src/cost.rs). In the product build STAGE_END is nothing.
 */
#ifdef XDPCNI_STAGES
#define STAGE_STOPPED (-2)
#define STAGE_END(n, live, ret)                                                                    \
	do {                                                                                       \
		if (XDPCNI_STAGES == (n)) {                                                        \
			asm volatile("" ::"r"(live) : "memory");                                   \
			return (ret);                                                              \
		}                                                                                  \
	} while (0)
#define RETURN_IF_STOPPED(r, action)                                                               \
	do {                                                                                       \
		if ((r) == STAGE_STOPPED)                                                          \
			return (action);                                                           \
	} while (0)
#else
#define STAGE_END(n, live, ret)                                                                    \
	do {                                                                                       \
	} while (0)
#define RETURN_IF_STOPPED(r, action)                                                               \
	do {                                                                                       \
	} while (0)
#endif

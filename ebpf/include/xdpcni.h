/* SPDX-License-Identifier: (GPL-2.0-only OR Apache-2.0) */
/*
 * xdpcni datapath ABI: every map key, value and constant shared between the
 * XDP programs under ebpf/src/ and userspace.
 *
 * WARNING: each struct here has a #[repr(C)] twin in ebpf/src/abi.rs, with
 * compile-time size and offset assertions. Change both together. Padding is
 * written out as named fields so neither side has implicit holes.
 */
#ifndef XDPCNI_H
#define XDPCNI_H

#include <linux/types.h>

/* Capacities of the pinned maps. */
#define XDPCNI_MAX_ENDPOINTS 65536 /* pod addresses, per family */
#define XDPCNI_MAX_TX_PORTS  16384 /* host veths that can be redirect targets */
#define XDPCNI_MAX_CPUS	     64	   /* cpumap size, and bits of cpu_mask */
#define XDPCNI_MAX_NAT_PORTS 65536 /* (address, protocol, port) the kernel NATs */
#define XDPCNI_MAX_SLOTS     1024  /* counter slots: host veths with their own counters */

/* nat_port_key.family */
#define XDPCNI_FAMILY_IPV4 4
#define XDPCNI_FAMILY_IPV6 6

/*
 * Pod addresses are keyed per family, so the hash the datapath computes twice
 * per packet is over 4 bytes for IPv4: endpoints4 maps an IPv4 address (a
 * __u32 in network byte order) and endpoints6 an endpoint6_key to an
 * endpoint_info.
 */
struct endpoint6_key {
	__u8 addr[16];
};

/* endpoint_info.redirect: how frames *to* this endpoint are delivered. */
#define XDPCNI_REDIRECT_DEVMAP 0 /* straight to the host veth through tx_ports */
#define XDPCNI_REDIRECT_CPUMAP 1 /* via a cpumap CPU picked from cpu_mask */

/* endpoint_info.flags */
#define XDPCNI_EP_KERNEL_ONLY (1U << 0) /* never fast-path to or from it */
/*
 * No port of this address is in nat_ports: the datapath skips those lookups.
 * Unset is the safe default (look them up); userspace sets it only after
 * checking nat_ports, and clears it before adding a port of the address.
 */
#define XDPCNI_EP_NO_NAT_PORTS (1U << 1)

/* What the datapath knows of a pod address. */
struct endpoint_info {
	__u32 ifindex;	  /* host-side veth */
	__u8 pod_mac[6];  /* pod's eth0: destination MAC after rewrite */
	__u8 host_mac[6]; /* host veth: source MAC after rewrite */
	__u32 flags;	  /* XDPCNI_EP_* */
	__u32 redirect;	  /* XDPCNI_REDIRECT_* */
	__u32 mtu;	  /* pod's eth0 MTU; larger packets go to the kernel */
	__u32 stats_slot; /* its veth's counter slot (see port_slots), 0: shared */
	__u64 cpu_mask;	  /* cpumap CPUs allowed to deliver to it */
};

/*
 * A port the kernel translates: a Service backend or hostPort target. Packets
 * from (addr, proto, port) may be replies that conntrack must un-DNAT, and
 * packets to it are requests conntrack must see for those replies to be valid:
 * both go to the kernel.
 */
struct nat_port_key {
	__u8 family; /* XDPCNI_FAMILY_* */
	__u8 proto;  /* IPPROTO_TCP or IPPROTO_UDP */
	__u16 port;  /* network byte order */
	__u8 addr[16];
};

/*
 * Verdicts counted per (host veth, verdict) in the counters map: a per-CPU array
 * of XDPCNI_MAX_SLOTS * XDPCNI_V_MAX rows, row slot * XDPCNI_V_MAX + verdict.
 * Each host veth with counters owns a slot (port_slots: ifindex -> slot,
 * slot_owners: slot -> ifindex, claimed with BPF_NOEXIST so two writers never
 * share one); endpoint records carry their veth's slot, so the fast path
 * counts without a hash lookup. Slot 0 is shared by veths without one. The
 * veth is the one the packet came in on, except XDPCNI_V_RX_FASTPATH which
 * is counted on the destination's host veth.
 */
enum xdpcni_verdict {
	XDPCNI_V_REDIRECT_DEVMAP = 0,	/* sent to the destination veth via devmap */
	XDPCNI_V_REDIRECT_CPUMAP = 1,	/* queued to a cpumap CPU */
	XDPCNI_V_CPUMAP_DELIVERED = 2,	/* second stage sent it on to the destination */
	XDPCNI_V_PASS_NOT_IP = 3,	/* ARP and other ethertypes */
	XDPCNI_V_PASS_MULTICAST = 4,	/* broadcast, multicast, link-local scope */
	XDPCNI_V_PASS_ND = 5,		/* ICMPv6 router/neighbour discovery */
	XDPCNI_V_PASS_NO_ENDPOINT = 6,	/* destination is not a pod of this node */
	XDPCNI_V_PASS_TTL = 7,		/* TTL/hop limit would expire: kernel sends ICMP */
	XDPCNI_V_PASS_KERNEL_ONLY = 8,	/* source or destination flagged kernel-only */
	XDPCNI_V_PASS_MTU = 9,		/* larger than the destination MTU (a real frame) */
	XDPCNI_V_PASS_NAT = 10,		/* from or to a port the kernel NATs */
	XDPCNI_V_PASS_L4 = 11,		/* fragments, IPv6 ext headers, other protocols */
	XDPCNI_V_PASS_NO_TARGET = 12,	/* no devmap/cpumap entry for the destination */
	XDPCNI_V_PASS_MALFORMED = 13,	/* truncated or invalid headers */
	XDPCNI_V_DROP_SPOOFED = 14,	/* source address is not the sender's */
	XDPCNI_V_DROP_CPUMAP_LOST = 15, /* destination vanished between the two stages */
	XDPCNI_V_RX_FASTPATH = 16,	/* delivered to this endpoint by the fast path */
	XDPCNI_V_PASS_GSO = 17,		/* longer than the sender's MTU: a GSO super-packet */
	XDPCNI_V_MAX = 18,
};

/* Per-CPU value of the counters map. */
struct stats_value {
	__u64 packets;
	__u64 bytes;
};

#define XDPCNI_STATS_ROWS (XDPCNI_MAX_SLOTS * XDPCNI_V_MAX)

#endif /* XDPCNI_H */

/* SPDX-License-Identifier: (GPL-2.0-only OR Apache-2.0) */
/*
 * xdpcni datapath ABI: every map key, value and constant shared between the
 * programs under ebpf/src/ (XDP and tc) and userspace.
 *
 * WARNING: each struct here has a #[repr(C)] twin in ebpf/src/abi.rs or one of
 * its modules (ebpf/src/abi/policy.rs, remote.rs, services.rs), with
 * compile-time size and offset assertions. Change both together. Padding is
 * written out as named fields so neither side has implicit holes.
 */
#ifndef XDPCNI_H
#define XDPCNI_H

#include <linux/types.h>

/*
 * The layout of the pinned datapath: the names, types, keys, values and
 * capacities of its maps. Any change to one of them bumps it. Each layout pins
 * its maps and programs in a directory of its own, layout-<N> under the pin
 * directory, so binaries of two layouts never open each other's maps.
 * The links directory is shared: a pod's link moves from one layout's program
 * to the next one's (bpf_link_update). An agent that finds the previous layout
 * fills its own from it, moves every link, then pins its own objects under
 * the previous layout's names (docs/upgrades.md). Layout 3 adds the endpoint
 * cache (epcache4/6) to layout 2's maps.
 */
#define XDPCNI_LAYOUT 3

/* datapath_meta.state */
#define XDPCNI_META_FILLING  0 /* new, or being filled from an older layout: not in use yet */
#define XDPCNI_META_COMPLETE 1 /* complete: the CNI plugin may use it */
#define XDPCNI_BUILD_LEN     48

/*
 * meta[0]: what a pinned datapath is, readable without loading anything (the
 * CNI plugin, `xdpcni-agent status`, the agent's xdpcni_datapath_info metric).
 * Written by the agent only; no program reads it.
 */
struct datapath_meta {
	__u32 layout;		      /* XDPCNI_LAYOUT of the agent that created it */
	__u32 state;		      /* XDPCNI_META_* */
	__u8 build[XDPCNI_BUILD_LEN]; /* its programs' build, NUL-padded: "<version>+<tag>" */
};

/* Capacities of the pinned maps. */
#define XDPCNI_MAX_ENDPOINTS 65536 /* pod addresses, per family */
#define XDPCNI_MAX_TX_PORTS  16384 /* host veths that can be redirect targets */
#define XDPCNI_MAX_CPUS	     64	   /* cpumap size, and bits of cpu_mask */
#define XDPCNI_MAX_NAT_PORTS 65536 /* (address, protocol, port) the kernel NATs */
#define XDPCNI_MAX_SLOTS     1024  /* counter slots: host veths with their own counters */
#define XDPCNI_MAX_POLICY_NS 16384 /* namespaces holding NetworkPolicies (policy_namespaces) */
#define XDPCNI_NS_NAME_LEN   64	   /* a namespace name (a DNS label: 63 bytes) and its NUL */

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
/*
 * Set with XDPCNI_EP_KERNEL_ONLY on a pod a NetworkPolicy isolates whose
 * verdicts are in the pol_* maps: these programs carry its flows that the
 * policies allow (lib/policy.h). A program that does not know this bit sees
 * KERNEL_ONLY alone and leaves the pod to the kernel path and its nftables
 * rules: a rollback fails closed.
 */
#define XDPCNI_EP_POLICY (1U << 2)

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
 * The endpoint cache (epcache4, epcache6): the records of endpoints4/6 again,
 * direct-mapped by an address's low bits, so that the two lookups each packet
 * makes cost an array index and a compare instead of a hash (measured: 3-4 ns
 * against 25-33 ns, docs/benchmark.md). Slot = the address's last 32 bits in
 * host order & XDPCNI_EPCACHE_MASK (IPv4: the address itself). Each slot is
 * an inner array of one endpoint_cached: the writers replace a record by
 * swapping the inner map (one pointer, under RCU), never by writing it in
 * place, so a program reads the old record or the new one, never half of
 * each. The hash maps stay the truth: a slot that is empty or holds another
 * address (two addresses with the same low bits) sends the program to them.
 * A slot is never newer or older than the hash entry of its address once
 * the writing verb returns (ebpf/src/datapath/maps/writes.rs).
 */
#define XDPCNI_EPCACHE_SLOTS 16384
#define XDPCNI_EPCACHE_MASK  (XDPCNI_EPCACHE_SLOTS - 1)

struct endpoint_cached {
	__u8 addr[16];		   /* the address (IPv4: its 4 bytes, then zeros) */
	struct endpoint_info info; /* its record, as in endpoints4/6 */
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
 * The policy gate: what a CNI ADD needs to know, without the agent, to hold a
 * new pod that a NetworkPolicy may select (drop every IP packet to and from
 * it until the agent has classified it). Written by the agent only; read by
 * the CNI plugin; no program reads them. They live in the datapath's pins so
 * that they share its fate: a fresh datapath (boot, pins removed) starts
 * with complete = 0, and every new pod is held until the agent fills them.
 *
 * policy_namespaces: a namespace that holds at least one NetworkPolicy ->
 * how many (informational). Key: the name, NUL-padded.
 */
struct policy_ns_key {
	__u8 name[XDPCNI_NS_NAME_LEN];
};

/* policy_gate[0]. */
struct policy_gate {
	__u32 complete;	  /* 1: policy_namespaces lists every namespace with policies */
	__u32 pad;	  /* written as 0 */
	__u64 generation; /* bumped by each agent write: a test and `status` read it */
};

/*
 * The verdict list, written once: X(NAME, value, kind, "when"). kind is
 * FORWARD (the sender's program redirected it: one count per delivery),
 * KERNEL (passed to the kernel stack), DROP, or one of the two kinds that
 * count a delivery again further along, never summed with FORWARD:
 * CPUMAP_STAGE (the cpumap's second stage sent it on) and RECEIVED (counted
 * on the destination's host veth). build/layout.c turns this list into the Rust twin (enum Verdict,
 * its labels, kinds and descriptions), from which the agent's metric labels
 * and the README's verdict table (checked by a test) follow. Values are the
 * counters map's row offsets: append, never renumber.
 */
#define XDPCNI_VERDICTS(X)                                                                         \
	X(REDIRECT_DEVMAP, 0, FORWARD,                                                             \
	  "destination is a local pod whose policy is devmap: MACs rewritten, TTL/hop limit "      \
	  "decremented (RFC 1624 incremental IPv4 checksum), sent to its host veth")               \
	X(REDIRECT_CPUMAP, 1, FORWARD,                                                             \
	  "same, queued to a CPU picked by flow hash among the destination's allowed CPUs")        \
	X(CPUMAP_DELIVERED, 2, CPUMAP_STAGE,                                                       \
	  "the cpumap's second stage, on the picked CPU, sent it on to the destination veth")      \
	X(PASS_NOT_IP, 3, KERNEL, "ARP and other ethertypes")                                      \
	X(PASS_MULTICAST, 4, KERNEL,                                                               \
	  "broadcast or multicast MAC or IP, IPv6 link-local destinations")                        \
	X(PASS_ND, 5, KERNEL,                                                                      \
	  "ICMPv6 router solicitation/advertisement, neighbour discovery, "                        \
	  "redirect")                                                                              \
	X(PASS_NO_ENDPOINT, 6, KERNEL,                                                             \
	  "destination is no pod of this node, and no other node's pod CIDR the fast path may "    \
	  "send to (Services, the host, the world; other nodes' pods from an XDP-mode pod or "     \
	  "with the fast path between nodes off)")                                                 \
	X(PASS_TTL, 7, KERNEL, "TTL/hop limit would expire: the kernel sends the ICMP error")      \
	X(PASS_KERNEL_ONLY, 8, KERNEL,                                                             \
	  "source or destination endpoint flagged kernel-only (a NetworkPolicy isolates it and "   \
	  "its verdicts are not in the datapath, a FORWARD rule names it)")                        \
	X(PASS_MTU, 9, KERNEL,                                                                     \
	  "L3 length above the destination's MTU (a real frame): the kernel fragments or sends "   \
	  "PTB")                                                                                   \
	X(PASS_NAT, 10, KERNEL,                                                                    \
	  "a flow conntrack NAT'd (asked for flows whose source or destination is in nat_ports), " \
	  "or one conntrack could not be asked about: the kernel translates it; on an uplink, a "  \
	  "north-south flow left to kube-proxy's rules (docs/services.md)")                        \
	X(PASS_L4, 11, KERNEL,                                                                     \
	  "IPv4 fragments, IPv6 extension headers, protocols other than TCP/UDP/ICMP echo, ICMP "  \
	  "errors (but one end's about a flow the policy check recorded)")                         \
	X(PASS_NO_TARGET, 12, KERNEL,                                                              \
	  "the destination has no devmap/cpumap entry; the frame is left untouched")               \
	X(PASS_MALFORMED, 13, KERNEL, "truncated or inconsistent headers")                         \
	X(DROP_SPOOFED, 14, DROP,                                                                  \
	  "source address is not an address of the endpoint on the ingress veth (what rp_filter "  \
	  "does on the kernel path)")                                                              \
	X(DROP_CPUMAP_LOST, 15, DROP, "the destination vanished between the two cpumap stages")    \
	X(RX_FASTPATH, 16, RECEIVED,                                                               \
	  "counted on the destination's host veth for each frame the fast path delivered to it")   \
	X(PASS_GSO, 17, KERNEL,                                                                    \
	  "L3 length above the sender's MTU: a GSO super-packet (generic and tc modes keep the "   \
	  "pod's TSO) that XDP cannot redirect, or on tc one whose segments exceed the MTU: the "  \
	  "kernel path segments it")                                                               \
	X(PASS_OTHERHOST, 18, KERNEL,                                                              \
	  "destination MAC is unicast but not the ingress host veth's: the kernel drops it "       \
	  "(PACKET_OTHERHOST), so must the fast path")                                             \
	X(PASS_IP_OPTIONS, 19, KERNEL,                                                             \
	  "IPv4 header options: the kernel's forwarding processes them (record route, "            \
	  "timestamps, source routes)")                                                            \
	X(PASS_BAD_LENGTH, 20, KERNEL,                                                             \
	  "the IP length field disagrees with the frame: truncated (the kernel drops it) or "      \
	  "with trailing bytes (the kernel trims them)")                                           \
	X(PASS_BAD_CHECKSUM, 21, KERNEL, "IPv4 header checksum is wrong: the kernel drops it")     \
	X(DROP_HELD, 22, DROP,                                                                     \
	  "to or from a pod held since its CNI ADD until the agent has classified it (its "        \
	  "namespace has NetworkPolicies, or the agent has not listed them yet); counted by the "  \
	  "tc hold program, ARP and neighbour discovery excepted")                                 \
	X(REDIRECT_PEER, 23, FORWARD,                                                              \
	  "tc mode: MACs rewritten, TTL/hop limit decremented as for redirect_devmap, handed to "  \
	  "the destination pod's eth0 with bpf_redirect_peer (GSO super-packets included)")        \
	X(DROP_POLICY, 24, DROP,                                                                   \
	  "a NetworkPolicy refuses it: a new flow its policies do not allow, or a flow allowed "   \
	  "before a policy change that no longer is (what the nftables rules drop on the kernel "  \
	  "path)")                                                                                 \
	X(PASS_POLICY, 25, KERNEL,                                                                 \
	  "to or from a pod with policies, not decidable here: a flow begun on the kernel path "   \
	  "(conntrack has it), TCP mid-stream, an ICMP echo reply with no request, verdicts "      \
	  "missing: the nftables rules decide")                                                    \
	X(REDIRECT_NEIGH, 26, FORWARD,                                                             \
	  "tc mode, to a pod of another node: TTL/hop limit decremented, sent out of the uplink "  \
	  "to that node with bpf_redirect_neigh (the neighbour table fills the MACs)")             \
	X(FROM_NODE_PEER, 27, FORWARD,                                                             \
	  "on a node's uplink, from a pod of another node to a pod of this one: MACs rewritten, "  \
	  "TTL/hop limit decremented, handed to the pod's eth0 with bpf_redirect_peer")            \
	X(PASS_NOT_REMOTE_POD, 28, KERNEL,                                                         \
	  "on a node's uplink, to a pod of this node from an address that is not another "         \
	  "node's pod reached through that uplink (the node, a client outside, a NodePort)")       \
	X(NS_TO_POD, 29, FORWARD,                                                                  \
	  "on a node's uplink, for a node port, externalIP or LoadBalancer IP (north-south): "     \
	  "translated to a backend on this node (svc_nat), TTL/hop limit decremented, handed to "  \
	  "its pod's eth0 with bpf_redirect_peer")                                                 \
	X(NS_REPLY, 30, FORWARD,                                                                   \
	  "tc mode, from a pod, a reply of a north-south flow (svc_nat): translated back to the "  \
	  "frontend, TTL/hop limit decremented, sent out of the uplink the flow came in by with "  \
	  "bpf_redirect_neigh; on an uplink, the same for a reply of another node's backend")      \
	X(NS_TO_NODE, 31, FORWARD,                                                                 \
	  "on a node's uplink, for a north-south frontend: translated to a backend on another "    \
	  "node, masqueraded to this node (svc_nat), TTL/hop limit decremented, sent out of the "  \
	  "device of the kernel's route to it (bpf_fib_lookup) with bpf_redirect_neigh")

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
#define XDPCNI_VERDICT_ENUM(name, value, kind, when) XDPCNI_V_##name = value,
	XDPCNI_VERDICTS(XDPCNI_VERDICT_ENUM)
#undef XDPCNI_VERDICT_ENUM
	/* Counter rows per slot: room for verdicts to come without resizing the map. */
	XDPCNI_V_MAX = 32,
};

/* Verdict kinds, and the verdicts of each kind as a bit mask (bit = value). */
#define XDPCNI_KIND_FORWARD	 0
#define XDPCNI_KIND_KERNEL	 1
#define XDPCNI_KIND_DROP	 2
#define XDPCNI_KIND_CPUMAP_STAGE 3
#define XDPCNI_KIND_RECEIVED	 4
#define XDPCNI_VERDICT_BIT(want, kind, value)                                                      \
	((XDPCNI_KIND_##kind == XDPCNI_KIND_##want) ? (1u << (value)) : 0u)
/* The verdicts a program returns XDP_REDIRECT for: the sender's and the cpumap stage's. */
#define XDPCNI_REDIRECT_BIT(name, value, kind, when)                                               \
	| XDPCNI_VERDICT_BIT(FORWARD, kind, value) | XDPCNI_VERDICT_BIT(CPUMAP_STAGE, kind, value)
#define XDPCNI_DROP_BIT(name, value, kind, when) | XDPCNI_VERDICT_BIT(DROP, kind, value)
#define XDPCNI_REDIRECT_VERDICTS		 (0u XDPCNI_VERDICTS(XDPCNI_REDIRECT_BIT))
#define XDPCNI_DROP_VERDICTS			 (0u XDPCNI_VERDICTS(XDPCNI_DROP_BIT))

/* Per-CPU value of the counters map. */
struct stats_value {
	__u64 packets;
	__u64 bytes;
};

#define XDPCNI_STATS_ROWS (XDPCNI_MAX_SLOTS * XDPCNI_V_MAX)

/*
 * NetworkPolicy in the datapath (lib/policy.h): the verdicts of each pod a
 * policy isolates, compiled by the agent from the model that also writes the
 * nftables table, and a flow table of the flows they allowed. Added to
 * layout 3 beside its maps: an older binary of the layout never opens them
 * and its programs keep such pods on the kernel path (XDPCNI_EP_POLICY).
 */
#define XDPCNI_MAX_POL_PODS   65536  /* addresses of pods with verdicts here */
#define XDPCNI_MAX_POL_PEERS  524288 /* peer prefixes, over every pod and direction */
#define XDPCNI_MAX_POL_PORTS  131072 /* port prefixes, over every pod and direction */
#define XDPCNI_MAX_POL_NAMED  65536  /* egress named ports resolved on peer pods */
#define XDPCNI_MAX_POL_FLOWS  262144 /* LRU: flows the policies allowed */
#define XDPCNI_POL_MAX_GROUPS 64     /* rule groups (distinct port sets) per pod and direction */

/* Directions, the index of pol_pod's arrays and the dir of the keys. */
#define XDPCNI_POL_INGRESS 0
#define XDPCNI_POL_EGRESS  1

/* pol_pod.flags */
#define XDPCNI_POL_ISOLATED_IN	(1U << 0) /* only what the ingress groups allow comes in */
#define XDPCNI_POL_ISOLATED_OUT (1U << 1) /* only what the egress groups allow goes out */
#define XDPCNI_POL_NAMED_OUT	(1U << 2) /* pol_named holds egress ports of this id */

/* pol_pods: a pod address (struct pol_pod_key) -> its verdicts' id and masks. */
struct pol_pod_key {
	__u8 addr[16]; /* IPv4: the first 4 bytes, the rest 0 */
	__u8 family;   /* XDPCNI_FAMILY_* */
	__u8 pad[3];
};

/*
 * A pod's rules fall in groups (those with the same ports); bit g of a mask
 * is group g. A flow is allowed in a direction when a group allows both its
 * peer and its port: (peer mask | any_peer) & (port mask | any_port) != 0,
 * or (egress) pol_named has its (peer, protocol, port).
 */
struct pol_pod {
	__u32 id;	    /* the key of its entries in pol_peers, pol_ports, pol_named */
	__u32 flags;	    /* XDPCNI_POL_* */
	__u64 any_peer[2];  /* groups allowing every peer, by direction */
	__u64 any_port[2];  /* groups allowing every port and protocol, by direction */
	__u64 window_until; /* bpf_ktime_get_ns() until which a new UDP flow is checked both ways */
};

/* pol_peers (LPM trie): (id, direction, family, peer prefix) -> group mask. */
struct pol_peer_key {
	__u32 prefixlen; /* XDPCNI_POL_PEER_FIXED_BITS + the address prefix's length */
	__u32 id;
	__u8 dir;
	__u8 family;
	__u8 pad[2];
	__u8 addr[16];
};
#define XDPCNI_POL_PEER_FIXED_BITS 64

/* pol_ports (LPM trie): (id, direction, protocol, port prefix) -> group mask. */
struct pol_port_key {
	__u32 prefixlen; /* XDPCNI_POL_PORT_FIXED_BITS + the port prefix's length */
	__u32 id;
	__u8 dir;
	__u8 proto;
	__u16 port; /* network order */
};
#define XDPCNI_POL_PORT_FIXED_BITS 48

/* pol_named: an egress destination's named port, resolved on that pod -> 1. */
struct pol_named_key {
	__u32 id;
	__u8 family;
	__u8 proto;
	__u16 port; /* network order */
	__u8 addr[16];
};

/*
 * pol_flows (LRU): a flow the policies allowed, keyed the same from both
 * ends (the lower address, with its port, first), with the direction it
 * began in, the generation of the verdicts it was allowed under, and enough
 * TCP state to expire as conntrack would.
 */
struct pol_flow_key {
	__u8 lo[16];
	__u8 hi[16];
	__u16 lo_port; /* network order; ICMP echo: the identifier, both */
	__u16 hi_port;
	__u8 proto;
	__u8 family;
	__u8 pad[2];
};

/* pol_flow.state */
#define XDPCNI_POL_REPLIED (1U << 0) /* a packet came back */
#define XDPCNI_POL_FIN	   (1U << 1) /* TCP FIN seen */
#define XDPCNI_POL_RST	   (1U << 2) /* TCP RST seen */

struct pol_flow {
	__u64 generation; /* pol_state's when it was last allowed */
	__u64 last_ns;	  /* bpf_ktime_get_coarse_ns() of its last packet */
	__u8 orig_lo;	  /* 1: it began from lo */
	__u8 state;	  /* XDPCNI_POL_* */
	__u8 pad[6];
};

/*
 * pol_state[0]: the generation of the verdicts, bumped by the agent after each
 * change: a flow allowed under another generation is checked again at its next
 * packet (a policy change reaches established flows). 64 bits: never wraps.
 */
struct pol_state {
	__u64 generation;
};

/* pol_stats (per-CPU array of __u64): what the policy check decided. */
#define XDPCNI_POL_NEW	   0 /* a new flow allowed and recorded */
#define XDPCNI_POL_HIT	   1 /* a packet of a recorded flow (either way) */
#define XDPCNI_POL_RECHECK 2 /* a recorded flow allowed again under a new generation */
#define XDPCNI_POL_REFUSED 3 /* dropped: the policies refuse it */
#define XDPCNI_POL_KERNEL  4 /* to the kernel: begun there, mid-stream, or not decidable */
#define XDPCNI_POL_STATS   5

/*
 * The fast path between nodes (lib/remote.h, node.bpf.c). remote_nets (LPM trie): every
 * other node's pod CIDR the agent routes, and how: the same pass of the
 * agent that makes a route writes its entry after it and removes the entry
 * before the route, so a program never sends where the kernel has no
 * route. The tc program of a pod sends a packet for such a CIDR out of the
 * entry's device; the tc program on that device (the uplink, or the VXLAN
 * device) delivers one from such a CIDR to a pod of this node. Added to
 * layout 3 beside its maps: a program that does not know it passes those
 * packets to the kernel.
 */
#define XDPCNI_MAX_REMOTE_NETS	 16384 /* other nodes' pod CIDRs */
#define XDPCNI_REMOTE_FIXED_BITS 32    /* family and pad before the address */

struct remote_key {
	__u32 prefixlen; /* XDPCNI_REMOTE_FIXED_BITS + the CIDR's prefix length */
	__u8 family;	 /* XDPCNI_FAMILY_* */
	__u8 pad[3];
	__u8 addr[16];
};

/*
 * remote_net.via. XDPCNI_VIA_GATEWAY: bpf_redirect_neigh to nexthop out of
 * ifindex, the uplink (host-gateway) or the agent's VXLAN device (whose
 * neighbour and FDB entries give the peer's VTEP, as on the kernel path).
 */
#define XDPCNI_VIA_GATEWAY 1

struct remote_net {
	__u32 ifindex;	/* the device the route leaves by (uplink or VXLAN) */
	__u32 via;	/* XDPCNI_VIA_* */
	__u32 mtu;	/* the largest IP packet that path carries (the device's MTU) */
	__u8 nh_family; /* XDPCNI_FAMILY_* of nexthop */
	__u8 pad[3];
	__u8 nexthop[16]; /* the route's gateway: the InternalIP, or the tunnel gateway */
};

/*
 * Kernel functions the datapath calls (the conntrack kfuncs). aya 0.14
 * cannot relocate a kfunc call (it has no .ksyms), so the C source calls
 * each as a helper with one of these numbers (far above any kernel
 * helper's), and the loader rewrites each such call into a call of the
 * kernel function by its BTF id (ebpf/src/datapath/kfunc.rs).
 */
#define XDPCNI_KFUNC_SKB_CT_LOOKUP 0x7c7f0001 /* bpf_skb_ct_lookup */
#define XDPCNI_KFUNC_XDP_CT_LOOKUP 0x7c7f0002 /* bpf_xdp_ct_lookup */
#define XDPCNI_KFUNC_CT_RELEASE	   0x7c7f0003 /* bpf_ct_release */

/*
 * Services translated at the socket (services.bpf.c, cgroup sock_addr
 * hooks): a layout of their own, pinned beside the datapath's under
 * svc-layout-<N>, so that they change without migrating the pods' maps.
 * The agent writes them from the API; a program only reads them, but for
 * the per-socket records (revnat, svc_sticky, affinity) it keeps itself.
 */
#define XDPCNI_SVC_LAYOUT	1
#define XDPCNI_MAX_SERVICES	65536  /* frontends: (address, port, protocol) */
#define XDPCNI_MAX_SVC_BACKENDS 262144 /* (service, backend) pairs */
#define XDPCNI_MAX_SVC_NETNS	16384  /* pod network namespaces translated */
#define XDPCNI_MAX_SVC_OWN	32768  /* (pod namespace, its own address) pairs */
#define XDPCNI_MAX_SVC_SOCKETS	262144 /* LRU: sockets' reverse and sticky records */
#define XDPCNI_MAX_SVC_AFFINITY 65536  /* LRU: ClientIP affinity records */
#define XDPCNI_SVC_MAX_CHOICES	1024   /* backends a service chooses among */
#define XDPCNI_MAX_SVC_NAT	262144 /* LRU: north-south flows' NAT entries, two per flow */

/* An address with its port: a Service frontend or a backend. */
struct svc_addr {
	__u8 addr[16]; /* IPv4: the first 4 bytes, the rest 0 */
	__u16 port;    /* network order */
	__u8 family;   /* XDPCNI_FAMILY_* */
	__u8 proto;    /* IPPROTO_TCP or IPPROTO_UDP */
};

/*
 * A frontend that clients outside the node reach (north-south: a node port at
 * a node address, an externalIP, a LoadBalancer IP) is keyed in `services`
 * with this bit in svc_addr.family, beside the same address for the node's
 * own sockets: under externalTrafficPolicy Local the two choose among
 * different backends (an outside client only the node's own). The socket
 * programs never build such a key; the node device's program only those.
 */
#define XDPCNI_SVC_OUTSIDE 0x80

/* svc_value.flags */
#define XDPCNI_SVC_AFFINITY  (1U << 0) /* sessionAffinity: ClientIP */
#define XDPCNI_SVC_NODE_ONLY (1U << 1) /* for the node's own sockets alone (a node port, ...) */
#define XDPCNI_SVC_EXT_LOCAL (1U << 2) /* outside: externalTrafficPolicy Local, the client kept */

/* services: a frontend (struct svc_addr) -> what a connect to it chooses. */
struct svc_value {
	__u32 id;		/* its backends: svc_slots[(id, 0 .. count-1)] */
	__u32 count;		/* ready backends to choose among; 0: the kernel decides */
	__u32 flags;		/* XDPCNI_SVC_* */
	__u32 affinity_timeout; /* seconds, with XDPCNI_SVC_AFFINITY */
};

/* svc_slots: (service id, index) -> backend id. */
struct svc_slot_key {
	__u32 id;
	__u32 index;
};

/*
 * svc_backends: backend id -> the backend (struct svc_addr). An id names one
 * (service, backend) pair and is never reused while a record may name it.
 */

/*
 * svc_own: a pod's own addresses, by its network namespace: a backend that
 * is the calling pod itself (hairpin) is left to kube-proxy, which shows
 * the pod the node's address as the client (its masquerade), where a
 * translated connect would show the pod its own.
 */
struct svc_own_key {
	__u64 netns; /* the pod's network namespace cookie */
	__u8 addr[16];
	__u8 family; /* XDPCNI_FAMILY_* */
	__u8 pad[7];
};

/*
 * svc_netns values: which sockets a namespace's are. A pod's (1), or the
 * node's own (host processes, hostNetwork pods): those also take the
 * source address kube-proxy would give them (svc_node_src).
 */
#define XDPCNI_SVC_NS_POD  (1U << 0)
#define XDPCNI_SVC_NS_NODE (1U << 1)

/*
 * svc_node_src: a frontend (struct svc_addr) -> the source (struct svc_ip)
 * a socket of the node's own binds to when its call to that frontend is
 * translated. kube-proxy DNATs a node's packet after its source was chosen
 * by the route toward the frontend, and keeps that source unless it
 * masquerades it (by the kind of frontend and the clusterCIDR): the agent
 * writes the route's source here for the frontends it keeps, and nothing
 * for the masqueraded ones, whose source the route toward the backend
 * chooses, as MASQUERADE does. A frontend flagged XDPCNI_SVC_NODE_ONLY (a
 * node port, an external or LoadBalancer IP) is not translated for pods.
 */
struct svc_ip {
	__u8 addr[16]; /* IPv4: the first 4 bytes, the rest 0 */
	__u8 family;   /* XDPCNI_FAMILY_* */
	__u8 pad[3];
};

/* svc_revnat (LRU): what a socket connected or sent to, shown back as the Service. */
struct svc_revnat_key {
	__u64 cookie;	    /* the socket's cookie */
	struct svc_addr to; /* the backend it was translated to */
	__u32 pad;
};

/*
 * svc_sticky (LRU): an unconnected UDP socket's backend per service, so its
 * datagrams to one frontend go to one backend, as conntrack keeps them on
 * the kernel path. svc_affinity (LRU): ClientIP affinity, by the client's
 * network namespace (one pod: one client address).
 */
struct svc_choice_key {
	__u64 cookie; /* socket cookie (svc_sticky) or netns cookie (svc_affinity) */
	__u32 id;     /* service id */
	__u32 pad;
};

/*
 * svc_source_ranges (LPM trie, the uplink's program): a LoadBalancer IP's
 * loadBalancerSourceRanges, as outside frontend (fixed bits) + source
 * prefix. The frontend alone (prefixlen XDPCNI_RANGE_FIXED_BITS) maps to 0,
 * each range to 1: a new flow's source that only the frontend's entry
 * matches is refused; a frontend with no entry has no ranges.
 */
struct svc_range_key {
	__u32 prefixlen;
	struct svc_addr fe; /* an outside frontend (XDPCNI_SVC_OUTSIDE) */
	__u8 src[16];	    /* IPv4: the first 4 bytes */
};

#define XDPCNI_RANGE_FIXED_BITS (8 * sizeof(struct svc_addr))
#define XDPCNI_MAX_SVC_RANGES	16384

/*
 * svc_client_affinity (LRU, the uplink's program): ClientIP affinity of a
 * north-south frontend, by the outside client's address (value: struct
 * svc_choice). Per frontend (kube-proxy shares one client's affinity among
 * every frontend of a Service port: docs/services.md).
 */
struct svc_client_key {
	__u8 addr[16]; /* IPv4: the first 4 bytes, the rest 0 */
	__u32 id;      /* frontend id */
	__u8 family;   /* XDPCNI_FAMILY_* */
	__u8 pad[3];
};

struct svc_choice {
	__u64 last_ns; /* bpf_ktime_get_ns() of its last use (affinity) */
	__u32 backend; /* backend id */
	__u32 pad;
};

/*
 * svc_stats (per-CPU array of __u64): what the programs did with a call
 * (connect or unconnected sendmsg) of a pod to a frontend.
 */
#define XDPCNI_SVC_TRANSLATED 0 /* sent to a backend chosen here */
#define XDPCNI_SVC_NO_BACKEND 1 /* no ready backend: left to kube-proxy, which refuses */
#define XDPCNI_SVC_LEFT	      2 /* left to kube-proxy otherwise (hairpin, full record, bound) */
#define XDPCNI_SVC_EXPIRED    3 /* the writer's lease ran out: left to kube-proxy */
#define XDPCNI_SVC_STATS      4

/*
 * svc_nat (LRU): a north-south flow (lib/north_south.h), two entries: the
 * client's packet as it enters the node (client -> frontend) and the
 * backend's reply as its pod sends it (backend -> client, or -> the node's
 * address when the node masquerades the client), each to the addresses
 * and ports its packets are given. Made by a flow's first packet alone (a
 * TCP SYN; a UDP datagram conntrack has no entry for), so flows kube-proxy
 * carried before stay its own. A flow to another node's backend
 * (XDPCNI_NAT_REMOTE) is masqueraded to the source the kernel's route to it
 * gives, on a port of its own when the client's is taken (1024-32767, below
 * the node's ephemeral ports), and its replies are caught on the device
 * they come back by (one of svc_uplinks).
 */
struct svc_nat_key {
	__u8 saddr[16]; /* IPv4: the first 4 bytes, the rest 0 */
	__u8 daddr[16];
	__u16 sport; /* network order */
	__u16 dport;
	__u8 family; /* XDPCNI_FAMILY_* */
	__u8 proto;  /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 pad[2];
};

struct svc_nat {
	__u8 saddr[16]; /* the packet's new source */
	__u8 daddr[16]; /* and destination */
	__u16 sport;
	__u16 dport;
	__u32 ifindex; /* the uplink the flow came in by (replies leave by it) */
	__u32
	    backend; /* the backend's id (svc_backends): a UDP flow whose backend went re-chooses */
	__u32 flags; /* XDPCNI_NAT_* */
};

/*
 * svc_nat_stats rows (per-CPU, summed by the agent): svc_nat entries the
 * programs made (keys new to the table; the programs remove none of their
 * own, so the table's evictions are those made less those in it), and new
 * flows left to kube-proxy because no reply tuple was free.
 */
#define XDPCNI_NAT_MADE	    0
#define XDPCNI_NAT_NO_TUPLE 1
#define XDPCNI_NAT_STATS    8 /* rows: room for more without a new map */

#define XDPCNI_NAT_REPLY       (1U << 0) /* the reply direction's entry */
#define XDPCNI_NAT_REMOTE      (1U << 1) /* the backend is another node's: routed by the FIB */
#define XDPCNI_MAX_SVC_UPLINKS 64

/*
 * svc_lease (array, one __u64): the bpf_ktime_get_ns() (CLOCK_MONOTONIC)
 * until which the agent vouches for the maps; it renews it while it runs.
 * Past it nothing new is translated and kube-proxy decides, so a writer
 * that stopped (a rollback to a release without these programs, an agent
 * gone longer than the lease) never leaves a removed backend chosen.
 */

#endif /* XDPCNI_H */

// SPDX-License-Identifier: Apache-2.0
/*
 * Built and run on the host by build.rs: prints the layout of every struct in
 * include/xdpcni.h as Rust constants, so src/abi.rs can assert at compile
 * time that its #[repr(C)] twins match the C side field by field, and the
 * verdict list (XDPCNI_VERDICTS) as one invocation of abi.rs's `verdicts!`
 * macro: the Rust enum is generated from the header, not written twice.
 */
#include <ctype.h>
#include <stddef.h>
#include <stdio.h>

#include <linux/bpf.h>

#include "xdpcni.h"

#define SIZE(t)	  printf("pub const SIZEOF_%s: usize = %zu;\n", #t, sizeof(struct t))
#define OFF(t, f) printf("pub const OFFSETOF_%s_%s: usize = %zu;\n", #t, #f, offsetof(struct t, f))
#define VAL(n)	  printf("pub const %s: u32 = %u;\n", #n, (unsigned)(n))

/* NAME_IN_CAPS as a Rust variant (CamelCase) or a label (snake_case). */
static void print_camel(const char *name)
{
	int up = 1;

	for (; *name; name++) {
		if (*name == '_') {
			up = 1;
			continue;
		}
		putchar(up ? *name : tolower((unsigned char)*name));
		up = 0;
	}
}

static void print_lower(const char *name)
{
	for (; *name; name++)
		putchar(tolower((unsigned char)*name));
}

static void print_str(const char *s)
{
	putchar('"');
	for (; *s; s++) {
		if (*s == '"' || *s == '\\')
			putchar('\\');
		putchar(*s);
	}
	putchar('"');
}

static void verdict(const char *name, unsigned value, const char *kind, const char *when)
{
	printf("    ");
	print_camel(name);
	printf(" = %u, ", value);
	print_str(name);
	printf(", \"");
	print_lower(name);
	printf("\", ");
	print_camel(kind);
	printf(", ");
	print_str(when);
	printf(";\n");
}

int main(void)
{
	/* The context a tc test run passes in (e2e's testrun::tc_run). */
	SIZE(__sk_buff);
	OFF(__sk_buff, ingress_ifindex);
	OFF(__sk_buff, ifindex);
	SIZE(endpoint6_key);
	OFF(endpoint6_key, addr);
	SIZE(endpoint_info);
	OFF(endpoint_info, ifindex);
	OFF(endpoint_info, pod_mac);
	OFF(endpoint_info, host_mac);
	OFF(endpoint_info, flags);
	OFF(endpoint_info, redirect);
	OFF(endpoint_info, mtu);
	OFF(endpoint_info, stats_slot);
	OFF(endpoint_info, cpu_mask);
	SIZE(endpoint_cached);
	OFF(endpoint_cached, addr);
	OFF(endpoint_cached, info);
	SIZE(nat_port_key);
	OFF(nat_port_key, family);
	OFF(nat_port_key, proto);
	OFF(nat_port_key, port);
	OFF(nat_port_key, addr);
	SIZE(policy_ns_key);
	OFF(policy_ns_key, name);
	SIZE(datapath_meta);
	OFF(datapath_meta, layout);
	OFF(datapath_meta, state);
	OFF(datapath_meta, build);
	SIZE(policy_gate);
	OFF(policy_gate, complete);
	OFF(policy_gate, pad);
	OFF(policy_gate, generation);
	SIZE(stats_value);
	OFF(stats_value, packets);
	OFF(stats_value, bytes);
	SIZE(svc_addr);
	OFF(svc_addr, addr);
	OFF(svc_addr, port);
	OFF(svc_addr, family);
	OFF(svc_addr, proto);
	SIZE(svc_value);
	OFF(svc_value, id);
	OFF(svc_value, count);
	OFF(svc_value, flags);
	OFF(svc_value, affinity_timeout);
	SIZE(svc_slot_key);
	OFF(svc_slot_key, id);
	OFF(svc_slot_key, index);
	SIZE(svc_own_key);
	OFF(svc_own_key, netns);
	OFF(svc_own_key, addr);
	OFF(svc_own_key, family);
	OFF(svc_own_key, pad);
	SIZE(svc_ip);
	OFF(svc_ip, addr);
	OFF(svc_ip, family);
	OFF(svc_ip, pad);
	SIZE(svc_revnat_key);
	OFF(svc_revnat_key, cookie);
	OFF(svc_revnat_key, to);
	OFF(svc_revnat_key, pad);
	SIZE(svc_choice_key);
	OFF(svc_choice_key, cookie);
	OFF(svc_choice_key, id);
	OFF(svc_choice_key, pad);
	SIZE(svc_range_key);
	OFF(svc_range_key, prefixlen);
	OFF(svc_range_key, fe);
	OFF(svc_range_key, src);
	VAL(XDPCNI_RANGE_FIXED_BITS);
	VAL(XDPCNI_MAX_SVC_RANGES);
	SIZE(svc_client_key);
	OFF(svc_client_key, addr);
	OFF(svc_client_key, id);
	OFF(svc_client_key, family);
	OFF(svc_client_key, pad);
	SIZE(svc_choice);
	OFF(svc_choice, last_ns);
	OFF(svc_choice, backend);
	OFF(svc_choice, pad);
	SIZE(svc_nat_key);
	OFF(svc_nat_key, saddr);
	OFF(svc_nat_key, daddr);
	OFF(svc_nat_key, sport);
	OFF(svc_nat_key, dport);
	OFF(svc_nat_key, family);
	OFF(svc_nat_key, proto);
	OFF(svc_nat_key, pad);
	SIZE(svc_nat);
	OFF(svc_nat, saddr);
	OFF(svc_nat, daddr);
	OFF(svc_nat, sport);
	OFF(svc_nat, dport);
	OFF(svc_nat, ifindex);
	OFF(svc_nat, backend);
	OFF(svc_nat, flags);
	SIZE(pol_pod_key);
	OFF(pol_pod_key, addr);
	OFF(pol_pod_key, family);
	OFF(pol_pod_key, pad);
	SIZE(pol_pod);
	OFF(pol_pod, id);
	OFF(pol_pod, flags);
	OFF(pol_pod, any_peer);
	OFF(pol_pod, any_port);
	OFF(pol_pod, window_until);
	SIZE(pol_peer_key);
	OFF(pol_peer_key, prefixlen);
	OFF(pol_peer_key, id);
	OFF(pol_peer_key, dir);
	OFF(pol_peer_key, family);
	OFF(pol_peer_key, pad);
	OFF(pol_peer_key, addr);
	SIZE(pol_port_key);
	OFF(pol_port_key, prefixlen);
	OFF(pol_port_key, id);
	OFF(pol_port_key, dir);
	OFF(pol_port_key, proto);
	OFF(pol_port_key, port);
	SIZE(pol_named_key);
	OFF(pol_named_key, id);
	OFF(pol_named_key, family);
	OFF(pol_named_key, proto);
	OFF(pol_named_key, port);
	OFF(pol_named_key, addr);
	SIZE(pol_flow_key);
	OFF(pol_flow_key, lo);
	OFF(pol_flow_key, hi);
	OFF(pol_flow_key, lo_port);
	OFF(pol_flow_key, hi_port);
	OFF(pol_flow_key, proto);
	OFF(pol_flow_key, family);
	OFF(pol_flow_key, pad);
	SIZE(pol_flow);
	OFF(pol_flow, generation);
	OFF(pol_flow, last_ns);
	OFF(pol_flow, orig_lo);
	OFF(pol_flow, state);
	OFF(pol_flow, pad);
	SIZE(pol_state);
	OFF(pol_state, generation);
	SIZE(remote_key);
	OFF(remote_key, prefixlen);
	OFF(remote_key, family);
	OFF(remote_key, pad);
	OFF(remote_key, addr);
	SIZE(remote_net);
	OFF(remote_net, ifindex);
	OFF(remote_net, via);
	OFF(remote_net, mtu);
	OFF(remote_net, nh_family);
	OFF(remote_net, pad);
	OFF(remote_net, nexthop);
	VAL(XDPCNI_MAX_REMOTE_NETS);
	VAL(XDPCNI_REMOTE_FIXED_BITS);
	VAL(XDPCNI_VIA_GATEWAY);
	VAL(XDPCNI_MAX_POL_PODS);
	VAL(XDPCNI_MAX_POL_PEERS);
	VAL(XDPCNI_MAX_POL_PORTS);
	VAL(XDPCNI_MAX_POL_NAMED);
	VAL(XDPCNI_MAX_POL_FLOWS);
	VAL(XDPCNI_POL_MAX_GROUPS);
	VAL(XDPCNI_POL_INGRESS);
	VAL(XDPCNI_POL_EGRESS);
	VAL(XDPCNI_POL_ISOLATED_IN);
	VAL(XDPCNI_POL_ISOLATED_OUT);
	VAL(XDPCNI_POL_NAMED_OUT);
	VAL(XDPCNI_POL_PEER_FIXED_BITS);
	VAL(XDPCNI_POL_PORT_FIXED_BITS);
	VAL(XDPCNI_POL_REPLIED);
	VAL(XDPCNI_POL_FIN);
	VAL(XDPCNI_POL_RST);
	VAL(XDPCNI_POL_NEW);
	VAL(XDPCNI_POL_HIT);
	VAL(XDPCNI_POL_RECHECK);
	VAL(XDPCNI_POL_REFUSED);
	VAL(XDPCNI_POL_KERNEL);
	VAL(XDPCNI_POL_STATS);
	VAL(XDPCNI_EP_POLICY);
	VAL(XDPCNI_KFUNC_SKB_CT_LOOKUP);
	VAL(XDPCNI_KFUNC_XDP_CT_LOOKUP);
	VAL(XDPCNI_KFUNC_CT_RELEASE);
	VAL(XDPCNI_SVC_LAYOUT);
	VAL(XDPCNI_MAX_SERVICES);
	VAL(XDPCNI_MAX_SVC_BACKENDS);
	VAL(XDPCNI_MAX_SVC_NETNS);
	VAL(XDPCNI_MAX_SVC_OWN);
	VAL(XDPCNI_MAX_SVC_SOCKETS);
	VAL(XDPCNI_MAX_SVC_AFFINITY);
	VAL(XDPCNI_SVC_MAX_CHOICES);
	VAL(XDPCNI_SVC_AFFINITY);
	VAL(XDPCNI_SVC_NODE_ONLY);
	VAL(XDPCNI_SVC_EXT_LOCAL);
	VAL(XDPCNI_SVC_OUTSIDE);
	VAL(XDPCNI_MAX_SVC_NAT);
	VAL(XDPCNI_NAT_REPLY);
	VAL(XDPCNI_NAT_REMOTE);
	VAL(XDPCNI_NAT_MADE);
	VAL(XDPCNI_NAT_NO_TUPLE);
	VAL(XDPCNI_NAT_STATS);
	VAL(XDPCNI_MAX_SVC_UPLINKS);
	VAL(XDPCNI_SVC_NS_POD);
	VAL(XDPCNI_SVC_NS_NODE);
	VAL(XDPCNI_SVC_TRANSLATED);
	VAL(XDPCNI_SVC_NO_BACKEND);
	VAL(XDPCNI_SVC_LEFT);
	VAL(XDPCNI_SVC_EXPIRED);
	VAL(XDPCNI_SVC_STATS);
	VAL(XDPCNI_MAX_ENDPOINTS);
	VAL(XDPCNI_MAX_TX_PORTS);
	VAL(XDPCNI_MAX_CPUS);
	VAL(XDPCNI_MAX_NAT_PORTS);
	VAL(XDPCNI_MAX_SLOTS);
	VAL(XDPCNI_STATS_ROWS);
	VAL(XDPCNI_MAX_POLICY_NS);
	VAL(XDPCNI_LAYOUT);
	VAL(XDPCNI_EPCACHE_SLOTS);
	VAL(XDPCNI_EPCACHE_MASK);
	VAL(XDPCNI_META_FILLING);
	VAL(XDPCNI_META_COMPLETE);
	VAL(XDPCNI_BUILD_LEN);
	VAL(XDPCNI_NS_NAME_LEN);
	VAL(XDPCNI_FAMILY_IPV4);
	VAL(XDPCNI_FAMILY_IPV6);
	VAL(XDPCNI_REDIRECT_DEVMAP);
	VAL(XDPCNI_REDIRECT_CPUMAP);
	VAL(XDPCNI_EP_KERNEL_ONLY);
	VAL(XDPCNI_EP_NO_NAT_PORTS);
	VAL(XDPCNI_V_MAX);
#define XDPCNI_VERDICT_RUST(name, value, kind, when) verdict(#name, value, #kind, when);
	printf("verdicts! {\n");
	XDPCNI_VERDICTS(XDPCNI_VERDICT_RUST)
	printf("}\n");
	return 0;
}

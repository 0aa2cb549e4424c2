// SPDX-License-Identifier: Apache-2.0
/*
 * Built and run on the host by build.rs: prints the layout of every struct in
 * include/xdpcni.h as Rust constants, so src/abi.rs can assert at compile
 * time that its #[repr(C)] twins match the C side field by field.
 */
#include <stddef.h>
#include <stdio.h>

#include "xdpcni.h"

#define SIZE(t)	  printf("pub const SIZEOF_%s: usize = %zu;\n", #t, sizeof(struct t))
#define OFF(t, f) printf("pub const OFFSETOF_%s_%s: usize = %zu;\n", #t, #f, offsetof(struct t, f))
#define VAL(n)	  printf("pub const %s: u32 = %u;\n", #n, (unsigned)(n))

int main(void)
{
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
	SIZE(nat_port_key);
	OFF(nat_port_key, family);
	OFF(nat_port_key, proto);
	OFF(nat_port_key, port);
	OFF(nat_port_key, addr);
	SIZE(stats_value);
	OFF(stats_value, packets);
	OFF(stats_value, bytes);
	VAL(XDPCNI_MAX_ENDPOINTS);
	VAL(XDPCNI_MAX_TX_PORTS);
	VAL(XDPCNI_MAX_CPUS);
	VAL(XDPCNI_MAX_NAT_PORTS);
	VAL(XDPCNI_MAX_SLOTS);
	VAL(XDPCNI_STATS_ROWS);
	VAL(XDPCNI_FAMILY_IPV4);
	VAL(XDPCNI_FAMILY_IPV6);
	VAL(XDPCNI_REDIRECT_DEVMAP);
	VAL(XDPCNI_REDIRECT_CPUMAP);
	VAL(XDPCNI_EP_KERNEL_ONLY);
	VAL(XDPCNI_EP_NO_NAT_PORTS);
	VAL(XDPCNI_V_REDIRECT_DEVMAP);
	VAL(XDPCNI_V_REDIRECT_CPUMAP);
	VAL(XDPCNI_V_CPUMAP_DELIVERED);
	VAL(XDPCNI_V_PASS_NOT_IP);
	VAL(XDPCNI_V_PASS_MULTICAST);
	VAL(XDPCNI_V_PASS_ND);
	VAL(XDPCNI_V_PASS_NO_ENDPOINT);
	VAL(XDPCNI_V_PASS_TTL);
	VAL(XDPCNI_V_PASS_KERNEL_ONLY);
	VAL(XDPCNI_V_PASS_MTU);
	VAL(XDPCNI_V_PASS_NAT);
	VAL(XDPCNI_V_PASS_L4);
	VAL(XDPCNI_V_PASS_NO_TARGET);
	VAL(XDPCNI_V_PASS_MALFORMED);
	VAL(XDPCNI_V_DROP_SPOOFED);
	VAL(XDPCNI_V_DROP_CPUMAP_LOST);
	VAL(XDPCNI_V_RX_FASTPATH);
	VAL(XDPCNI_V_PASS_GSO);
	VAL(XDPCNI_V_MAX);
	return 0;
}

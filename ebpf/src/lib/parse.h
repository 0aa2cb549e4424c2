/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Stage 1 of classify(), parse: a frame from either hook (struct frame) read
 * into a struct packet (Ethernet, IPv4/IPv6, the L4 head), or the verdict
 * of a frame the fast path does not handle.
 */
#pragma once

#include "common.h"

#define IPPROTO_ICMPV6_	     58
#define ICMP_ECHOREPLY_	     0
#define ICMP_ECHO_	     8
#define ICMPV6_ECHO_REQUEST_ 128
#define ICMPV6_ECHO_REPLY_   129
#define ICMPV6_ND_FIRST	     133 /* router solicitation */
#define ICMPV6_ND_LAST	     137 /* redirect */
#define IP_MF_		     0x2000
#define IP_OFFSET_	     0x1fff

static __always_inline int is_ipv6_multicast_or_link_local(const __u8 *a)
{
	return a[0] == 0xff || (a[0] == 0xfe && (a[1] & 0xc0) == 0x80);
}

/* The first 4 bytes of TCP, UDP and ICMP headers that the datapath reads. */
struct l4_head {
	__u16 a; /* source port, or ICMP type+code */
	__u16 b; /* destination port, or ICMP checksum */
	__u16 c; /* ICMP echo identifier */
};

/* An address as the program carries it: family, then 4 or 16 bytes. */
struct addr {
	__u8 family; /* XDPCNI_FAMILY_* */
	__u8 pad[3];
	__u8 addr[16];
};

/*
 * What the stages see of a frame, whichever hook it came from: its linear
 * bytes, its whole length (an skb's may extend past data_end), and for an
 * skb its GSO segment size (0: one wire frame; always 0 on XDP, which cannot
 * redirect a super-packet).
 */
struct frame {
	void *data;
	void *data_end;
	__u32 len;
	__u32 gso_size;
};

struct packet {
	struct ethhdr *eth;
	void *l4;     /* the L4 header, checked readable for its first 6 bytes */
	__u32 l4_off; /* its offset from the L3 header */
	struct addr src;
	struct addr dst;
	__u32 l3_len;  /* IPv4 total length or IPv6 payload + 40 */
	__u32 flow_id; /* ports, or the ICMP echo id: with the addresses, a flow */
	__u8 proto;
	__u8 l4_info;	/* set for the policy check only: TCP flags or ICMP type (lib/policy.h) */
	__u16 sport;	/* network order, 0 for ICMP */
	__u16 dport;	/* network order, 0 for ICMP */
	__u8 err_proto; /* an ICMP error about a flow between its own two ends: the flow's protocol
			 * (flow_id its ports, or its echo id twice), else 0 (icmp_error()) */
	__u8 pad2;
	__u8 *ttl;   /* TTL or hop limit byte */
	__u16 *csum; /* IPv4 header checksum, NULL for IPv6 */
};

enum stage_result {
	STAGE_OK = -1,	  /* the next stage runs; anything >= 0 is the packet's verdict */
	STAGE_CT = -3,	  /* decided, but for the NAT check of its hook (lib/ct.h) */
	STAGE_CT_TO = -4, /* the same, the flow to a port where the kernel NATs */
};

/* An ICMP or ICMPv6 error: its head, then the start of the packet it quotes. */
struct icmp_err4 {
	__u8 type, code;
	__u16 csum;
	__u32 unused;
	struct iphdr ip;
	struct l4_head l4;
};

struct icmp_err6 {
	__u8 type, code;
	__u16 csum;
	__u32 unused;
	struct ipv6hdr ip;
	struct l4_head l4;
};

/* Whether the `words` 32-bit words at `a` (in the packet) and `b` are equal. */
static __always_inline int same_addr(const void *a, const __u8 *b, int words)
{
	const __u32 *x = a, *y = (const __u32 *)b;
	__u32 diff = 0;

#pragma unroll
	for (int i = 0; i < 4; i++)
		if (i < words)
			diff |= x[i] ^ y[i];
	return diff == 0;
}

/* The quoted packet's flow, as ports (or its echo id twice): 0 if unsure. */
static __always_inline __u8 quoted_flow(struct packet *p, __u8 proto, const struct l4_head *h,
					int v6)
{
	switch (proto) {
	case IPPROTO_TCP:
	case IPPROTO_UDP:
		p->flow_id = ((__u32)h->a << 16) | h->b;
		return proto;
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6_:
		if ((proto == IPPROTO_ICMPV6_) != v6 ||
		    ((__u8 *)h)[0] != (v6 ? ICMPV6_ECHO_REQUEST_ : ICMP_ECHO_))
			return 0;
		p->flow_id = ((__u32)h->c << 16) | h->c;
		return proto;
	default:
		return 0;
	}
}

/*
 * An ICMP error (destination unreachable, time exceeded, parameter problem;
 * for IPv6 packet too big too) that quotes a packet of the flow between its
 * own two ends, the other way (what a pod answers about a packet it got):
 * sets p->err_proto and p->flow_id to that flow. The verdict stays
 * pass_l4 (the kernel's, which may have to translate the quoted headers)
 * unless the policy check finds the flow recorded (lib/policy.h).
 */
static __always_inline void icmp_error(struct packet *p, void *l4, void *data_end, int v6)
{
	__u8 type = ((__u8 *)l4)[0];

	if (v6) {
		struct icmp_err6 *e = l4;

		if (type < 1 || type > 4 || (void *)(e + 1) > data_end || e->ip.version != 6)
			return;
		if (!same_addr(&e->ip.saddr, p->dst.addr, 4) ||
		    !same_addr(&e->ip.daddr, p->src.addr, 4))
			return;
		p->err_proto = quoted_flow(p, e->ip.nexthdr, &e->l4, 1);
		return;
	}
	struct icmp_err4 *e = l4;

	if ((type != 3 && type != 11 && type != 12) || (void *)(e + 1) > data_end ||
	    e->ip.version != 4 || e->ip.ihl != 5 ||
	    (e->ip.frag_off & bpf_htons(IP_MF_ | IP_OFFSET_)))
		return;
	if (!same_addr(&e->ip.saddr, p->dst.addr, 1) || !same_addr(&e->ip.daddr, p->src.addr, 1))
		return;
	p->err_proto = quoted_flow(p, e->ip.protocol, &e->l4, 0);
}

/* Reads the L4 head shared by IPv4 and IPv6: ports or ICMP echo. */
static __always_inline int parse_l4(struct packet *p, void *l4, void *data_end, int v6)
{
	struct l4_head *h = l4;

	if ((void *)(h + 1) > data_end)
		return XDPCNI_V_PASS_MALFORMED;
	p->l4 = l4;
	switch (p->proto) {
	case IPPROTO_TCP:
	case IPPROTO_UDP:
		p->sport = h->a;
		p->dport = h->b;
		p->flow_id = ((__u32)h->a << 16) | h->b;
		return STAGE_OK;
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6_: {
		__u8 type = ((__u8 *)l4)[0];

		if (v6 && type >= ICMPV6_ND_FIRST && type <= ICMPV6_ND_LAST)
			return XDPCNI_V_PASS_ND;
		/*
		 * Only echo is fast-pathed: ICMP errors quote inner headers that
		 * the kernel may have to translate.
		 */
		if (v6 ? (type != ICMPV6_ECHO_REQUEST_ && type != ICMPV6_ECHO_REPLY_)
		       : (type != ICMP_ECHO_ && type != ICMP_ECHOREPLY_)) {
			icmp_error(p, l4, data_end, v6);
			return XDPCNI_V_PASS_L4;
		}
		p->flow_id = h->c;
		return STAGE_OK;
	}
	default:
		return XDPCNI_V_PASS_L4;
	}
}

/* Whether the 20-byte IPv4 header sums to 0xffff, as ip_rcv() requires. */
static __always_inline int ipv4_header_ok(const struct iphdr *iph)
{
	const __u16 *w = (const __u16 *)iph;
	__u32 sum = 0;

#pragma unroll
	for (int i = 0; i < 10; i++)
		sum += w[i];
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return sum == 0xffff;
}

/*
 * The IPv4 checks of ip_rcv() that decide whether the kernel would forward
 * the packet at all, in its order, then the addresses (for source
 * validation), then what only the kernel's forwarding does (options,
 * fragments).
 */
static __always_inline int parse_ipv4(struct packet *p, void *l3, const struct frame *f)
{
	void *data_end = f->data_end;
	struct iphdr *iph = l3;
	__u32 hlen;

	if ((void *)(iph + 1) > data_end)
		return XDPCNI_V_PASS_MALFORMED;
	if (iph->version != 4 || iph->ihl < 5)
		return XDPCNI_V_PASS_MALFORMED;
	hlen = iph->ihl * 4;
	if (l3 + hlen > data_end)
		return XDPCNI_V_PASS_MALFORMED;
	p->l3_len = bpf_ntohs(iph->tot_len);
	if (p->l3_len < hlen)
		return XDPCNI_V_PASS_MALFORMED;
	/* 224.0.0.0/4 and the limited broadcast. */
	if ((bpf_ntohl(iph->daddr) & 0xf0000000) == 0xe0000000 || iph->daddr == 0xffffffff)
		return XDPCNI_V_PASS_MULTICAST;

	p->src.family = XDPCNI_FAMILY_IPV4;
	p->dst.family = XDPCNI_FAMILY_IPV4;
	__builtin_memcpy(p->src.addr, &iph->saddr, 4);
	__builtin_memcpy(p->dst.addr, &iph->daddr, 4);
	p->proto = iph->protocol;
	p->ttl = &iph->ttl;
	p->csum = &iph->check;
	/* Options: the kernel's forwarding rewrites some (record route). */
	if (hlen > sizeof(*iph))
		return XDPCNI_V_PASS_IP_OPTIONS;
	if (!ipv4_header_ok(iph))
		return XDPCNI_V_PASS_BAD_CHECKSUM;
	/* Truncated (dropped) or padded (trimmed): the kernel's business. */
	if (ETH_HLEN + p->l3_len != f->len)
		return XDPCNI_V_PASS_BAD_LENGTH;
	/* Non-first fragments carry no ports: leave reassembly to the kernel. */
	if (iph->frag_off & bpf_htons(IP_MF_ | IP_OFFSET_))
		return XDPCNI_V_PASS_L4;
	p->l4_off = hlen;
	return parse_l4(p, l3 + hlen, data_end, 0);
}

static __always_inline int parse_ipv6(struct packet *p, void *l3, const struct frame *f)
{
	void *data_end = f->data_end;
	struct ipv6hdr *ip6h = l3;

	if ((void *)(ip6h + 1) > data_end)
		return XDPCNI_V_PASS_MALFORMED;
	if (ip6h->version != 6)
		return XDPCNI_V_PASS_MALFORMED;
	p->l3_len = bpf_ntohs(ip6h->payload_len) + sizeof(*ip6h);
	if (is_ipv6_multicast_or_link_local(ip6h->daddr.in6_u.u6_addr8))
		return XDPCNI_V_PASS_MULTICAST;

	p->src.family = XDPCNI_FAMILY_IPV6;
	p->dst.family = XDPCNI_FAMILY_IPV6;
	__builtin_memcpy(p->src.addr, &ip6h->saddr, 16);
	__builtin_memcpy(p->dst.addr, &ip6h->daddr, 16);
	p->proto = ip6h->nexthdr;
	p->ttl = &ip6h->hop_limit;
	p->csum = 0;
	/* Truncated, padded, or a jumbogram (payload length 0). */
	if (ETH_HLEN + p->l3_len != f->len)
		return XDPCNI_V_PASS_BAD_LENGTH;
	/* Extension headers (fragments included) take the kernel path. */
	p->l4_off = sizeof(*ip6h);
	return parse_l4(p, ip6h + 1, data_end, 1);
}

/*
 * Stage 1, parse: Ethernet, IPv4/IPv6, the L4 head. STAGE_OK, or the verdict
 * of a frame the fast path does not handle.
 */
static __always_inline int parse(struct packet *p, const struct frame *f)
{
	struct ethhdr *eth = f->data;

	if ((void *)(eth + 1) > f->data_end)
		return XDPCNI_V_PASS_MALFORMED;
	p->eth = eth;
	if (eth->h_dest[0] & 1)
		return XDPCNI_V_PASS_MULTICAST;
	if (eth->h_proto == bpf_htons(ETH_P_IP))
		return parse_ipv4(p, eth + 1, f);
	if (eth->h_proto == bpf_htons(ETH_P_IPV6))
		return parse_ipv6(p, eth + 1, f);
	return XDPCNI_V_PASS_NOT_IP;
}

/* Headers the stages read, at most: Ethernet, IPv6 (or IPv4 without options), a TCP header. */
#define XDPCNI_TC_PULL (ETH_HLEN + 40 + 60)

/*
 * An skb as the stages see it, its headers pulled into the linear part
 * where the sender's stack did not put them (a frame short and linear
 * already is not touched).
 */
static __always_inline void tc_frame(struct __sk_buff *skb, struct frame *f)
{
	__u32 head = skb->len < XDPCNI_TC_PULL ? skb->len : XDPCNI_TC_PULL;

	if ((void *)(long)skb->data + head > (void *)(long)skb->data_end)
		bpf_skb_pull_data(skb, head);
	f->data = (void *)(long)skb->data;
	f->data_end = (void *)(long)skb->data_end;
	f->len = skb->len;
	f->gso_size = skb->gso_size;
}

// SPDX-License-Identifier: GPL-2.0-only
/*
 * Services at the socket: the cgroup sock_addr hooks translate a connect or
 * send to a Service frontend into one to a backend before there is a
 * packet, and show the frontend again where the application reads the peer
 * (recvmsg, getpeername). The packet then leaves the pod addressed to the
 * backend pod: no DNAT, no conntrack state, and the datapath's fast path
 * carries it like any pod-to-pod packet.
 *
 * Scope: only sockets of a network namespace in svc_netns (the node's pods,
 * and the node's own namespace when the agent is told to translate it,
 * written by the agent): never another node's pods on the same machine.
 * The node's own sockets also take the source address kube-proxy's path
 * would give them (svc_node_src). Anything not translated here (no ready backend,
 * another protocol, an IPv4-mapped address) goes on unchanged, and
 * kube-proxy's rules on the kernel path decide it, as for every client the
 * agent does not serve.
 */
#include <linux/bpf.h>
#include <linux/in.h>
#include <linux/in6.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "xdpcni.h"
#include "lib/svc_maps.h"

char LICENSE[] SEC("license") = "GPL";

#ifndef AF_INET
#define AF_INET 2
#endif
#ifndef AF_INET6
#define AF_INET6 10
#endif

/* A sock_addr program lets the call go on with 1 (0 would refuse it: EPERM). */
#define SOCK_GO_ON 1

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPCNI_MAX_SVC_NETNS);
	__type(key, __u64);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} svc_netns SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPCNI_MAX_SVC_OWN);
	__type(key, struct svc_own_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} svc_own SEC(".maps");

/* The source a node's call to a frontend keeps (the socket programs' alone). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPCNI_MAX_SERVICES);
	__type(key, struct svc_addr);
	__type(value, struct svc_ip);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} svc_node_src SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, XDPCNI_MAX_SVC_SOCKETS);
	__type(key, struct svc_revnat_key);
	__type(value, struct svc_addr);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} svc_revnat SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, XDPCNI_MAX_SVC_SOCKETS);
	__type(key, struct svc_choice_key);
	__type(value, struct svc_choice);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} svc_sticky SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, XDPCNI_MAX_SVC_AFFINITY);
	__type(key, struct svc_choice_key);
	__type(value, struct svc_choice);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} svc_affinity SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XDPCNI_SVC_STATS);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} svc_stats SEC(".maps");

static __always_inline void count(__u32 what)
{
	__u64 *n = bpf_map_lookup_elem(&svc_stats, &what);

	if (n)
		*n += 1;
}

/* The caller's namespace's XDPCNI_SVC_NS_* flags: 0 when it is not translated. */
static __always_inline __u32 in_scope(struct bpf_sock_addr *ctx)
{
	__u64 ns = bpf_get_netns_cookie(ctx);
	__u32 *flags = bpf_map_lookup_elem(&svc_netns, &ns);

	return flags ? *flags : 0;
}

/* The address the call names (the destination, or the peer for recvmsg/getpeername). */
static __always_inline void read_addr(struct bpf_sock_addr *ctx, struct svc_addr *a, int v6)
{
	__u32 *w = (__u32 *)a->addr;

	__builtin_memset(a, 0, sizeof(*a));
	if (v6) {
		w[0] = ctx->user_ip6[0];
		w[1] = ctx->user_ip6[1];
		w[2] = ctx->user_ip6[2];
		w[3] = ctx->user_ip6[3];
		a->family = XDPCNI_FAMILY_IPV6;
	} else {
		w[0] = ctx->user_ip4;
		a->family = XDPCNI_FAMILY_IPV4;
	}
	a->port = (__u16)ctx->user_port;
	a->proto = ctx->protocol;
}

static __always_inline void write_addr(struct bpf_sock_addr *ctx, const struct svc_addr *a, int v6)
{
	const __u32 *w = (const __u32 *)a->addr;

	if (v6) {
		ctx->user_ip6[0] = w[0];
		ctx->user_ip6[1] = w[1];
		ctx->user_ip6[2] = w[2];
		ctx->user_ip6[3] = w[3];
	} else {
		ctx->user_ip4 = w[0];
	}
	ctx->user_port = a->port;
}

/* A recorded choice, if its backend still serves (a removed one never is chosen). */
static __always_inline struct svc_addr *recorded(void *map, const struct svc_choice_key *k,
						 __u64 max_age_ns, __u64 now, __u32 *id)
{
	struct svc_choice *c = bpf_map_lookup_elem(map, k);
	struct svc_addr *b;

	if (!c || (max_age_ns && now - c->last_ns > max_age_ns))
		return 0;
	b = bpf_map_lookup_elem(&svc_backends, &c->backend);
	if (!b)
		return 0;
	c->last_ns = now;
	*id = c->backend;
	return b;
}

static __always_inline void record(void *map, const struct svc_choice_key *k, __u32 id, __u64 now)
{
	struct svc_choice c = {.last_ns = now, .backend = id};

	bpf_map_update_elem(map, k, &c, BPF_ANY);
}

/*
 * The backend for a call to frontend `fe` from this socket: the client's
 * ClientIP affinity if the service has one and it has not expired, else
 * (unconnected UDP) the socket's earlier choice, else one of the ready
 * backends at random. NULL when the kernel path should decide.
 */
static __always_inline struct svc_addr *choose(struct bpf_sock_addr *ctx,
					       const struct svc_value *svc, int sticky)
{
	struct svc_choice_key ak = {.cookie = bpf_get_netns_cookie(ctx), .id = svc->id};
	struct svc_choice_key sk = {.cookie = bpf_get_socket_cookie(ctx), .id = svc->id};
	__u64 now = bpf_ktime_get_ns();
	struct svc_addr *b = 0;
	__u32 id = 0;

	if (svc->flags & XDPCNI_SVC_AFFINITY)
		b = recorded(&svc_affinity, &ak, (__u64)svc->affinity_timeout * 1000000000ULL, now,
			     &id);
	if (!b && sticky)
		b = recorded(&svc_sticky, &sk, 0, now, &id);
	if (!b) {
		b = svc_pick(svc, &id);
		if (!b)
			return 0;
	}
	if (svc->flags & XDPCNI_SVC_AFFINITY)
		record(&svc_affinity, &ak, id, now);
	if (sticky)
		record(&svc_sticky, &sk, id, now);
	return b;
}

/* Whether backend `b` is the calling pod itself (hairpin: kube-proxy's, see svc_own). */
static __always_inline int is_own(struct bpf_sock_addr *ctx, const struct svc_addr *b)
{
	struct svc_own_key k = {.netns = bpf_get_netns_cookie(ctx), .family = b->family};

	__builtin_memcpy(k.addr, b->addr, 16);
	return bpf_map_lookup_elem(&svc_own, &k) != 0;
}

/* Whether a socket of the node's own already has a source address (its application chose it). */
static __always_inline int has_source(struct bpf_sock_addr *ctx, int v6, int sticky)
{
	struct bpf_sock *sk = ctx->sk;

	if (sticky) /* sendmsg: the bound address, or one the call names (IP_PKTINFO) */
		return v6 ? (ctx->msg_src_ip6[0] | ctx->msg_src_ip6[1] | ctx->msg_src_ip6[2] |
			     ctx->msg_src_ip6[3]) != 0
			  : ctx->msg_src_ip4 != 0;
	if (!sk)
		return 1;
	return v6 ? (sk->src_ip6[0] | sk->src_ip6[1] | sk->src_ip6[2] | sk->src_ip6[3]) != 0
		  : sk->src_ip4 != 0;
}

/*
 * A translated call of the node's own takes the source kube-proxy's path
 * gives it: the route's toward the frontend where the agent wrote it in
 * svc_node_src (kube-proxy keeps that source), else the route's toward the
 * backend (as MASQUERADE chooses it). A socket whose application chose its
 * source is left to kube-proxy, whose masquerade depends on that source;
 * so is a connect that cannot bind (a socket bound to a port alone).
 * Returns 0 to go on translating.
 */
static __always_inline int node_source(struct bpf_sock_addr *ctx, const struct svc_addr *fe, int v6,
				       int sticky)
{
	struct sockaddr_in6 sa6 = {.sin6_family = AF_INET6};
	struct sockaddr_in sa4 = {.sin_family = AF_INET};
	struct svc_ip *src;

	if (has_source(ctx, v6, sticky))
		return -1;
	src = bpf_map_lookup_elem(&svc_node_src, fe);
	if (!src)
		return 0;
	if (sticky) {
		const __u32 *w = (const __u32 *)src->addr;

		if (v6) {
			ctx->msg_src_ip6[0] = w[0];
			ctx->msg_src_ip6[1] = w[1];
			ctx->msg_src_ip6[2] = w[2];
			ctx->msg_src_ip6[3] = w[3];
		} else {
			ctx->msg_src_ip4 = w[0];
		}
		return 0;
	}
	if (v6) {
		__builtin_memcpy(&sa6.sin6_addr, src->addr, 16);
		return bpf_bind(ctx, (struct sockaddr *)&sa6, sizeof(sa6)) ? -1 : 0;
	}
	__builtin_memcpy(&sa4.sin_addr, src->addr, 4);
	return bpf_bind(ctx, (struct sockaddr *)&sa4, sizeof(sa4)) ? -1 : 0;
}

/* connect() and unconnected sendmsg(): frontend -> backend, remembered per socket. */
static __always_inline int translate(struct bpf_sock_addr *ctx, int v6, int sticky)
{
	struct svc_revnat_key rk = {};
	struct svc_value *svc;
	struct svc_addr fe, *b;
	__u32 scope = in_scope(ctx);

	if (!scope)
		return SOCK_GO_ON;
	read_addr(ctx, &fe, v6);
	if (fe.proto != IPPROTO_TCP && fe.proto != IPPROTO_UDP)
		return SOCK_GO_ON;
	svc = bpf_map_lookup_elem(&services, &fe);
	if (!svc || ((svc->flags & XDPCNI_SVC_NODE_ONLY) && !(scope & XDPCNI_SVC_NS_NODE)))
		return SOCK_GO_ON;
	if (!svc_leased()) {
		count(XDPCNI_SVC_EXPIRED);
		return SOCK_GO_ON;
	}
	if (!svc->count) {
		count(XDPCNI_SVC_NO_BACKEND);
		return SOCK_GO_ON;
	}
	/*
	 * The choice is recorded (affinity, a socket's earlier datagrams) even
	 * when it is the pod itself: its later calls go to kube-proxy too,
	 * whose conntrack and affinity then keep them on one backend.
	 */
	b = choose(ctx, svc, sticky);
	if (!b || b->family != fe.family || is_own(ctx, b)) {
		count(XDPCNI_SVC_LEFT);
		return SOCK_GO_ON;
	}
	if ((scope & XDPCNI_SVC_NS_NODE) && node_source(ctx, &fe, v6, sticky)) {
		count(XDPCNI_SVC_LEFT);
		return SOCK_GO_ON;
	}
	rk.cookie = bpf_get_socket_cookie(ctx);
	rk.to = *b;
	rk.to.proto = fe.proto;
	/* Without its reverse record, replies would show the backend: leave it. */
	if (bpf_map_update_elem(&svc_revnat, &rk, &fe, BPF_ANY)) {
		count(XDPCNI_SVC_LEFT);
		return SOCK_GO_ON;
	}
	write_addr(ctx, b, v6);
	count(XDPCNI_SVC_TRANSLATED);
	return SOCK_GO_ON;
}

/* recvmsg() and getpeername(): a backend this socket was sent to shown as its frontend. */
static __always_inline int reverse(struct bpf_sock_addr *ctx, int v6)
{
	struct svc_revnat_key rk = {};
	struct svc_addr *fe;

	if (!in_scope(ctx))
		return SOCK_GO_ON;
	read_addr(ctx, &rk.to, v6);
	rk.cookie = bpf_get_socket_cookie(ctx);
	fe = bpf_map_lookup_elem(&svc_revnat, &rk);
	if (fe)
		write_addr(ctx, fe, v6);
	return SOCK_GO_ON;
}

SEC("cgroup/connect4")
int xdpcni_connect4(struct bpf_sock_addr *ctx)
{
	return translate(ctx, 0, 0);
}

SEC("cgroup/connect6")
int xdpcni_connect6(struct bpf_sock_addr *ctx)
{
	return translate(ctx, 1, 0);
}

SEC("cgroup/sendmsg4")
int xdpcni_sendmsg4(struct bpf_sock_addr *ctx)
{
	return translate(ctx, 0, 1);
}

SEC("cgroup/sendmsg6")
int xdpcni_sendmsg6(struct bpf_sock_addr *ctx)
{
	return translate(ctx, 1, 1);
}

SEC("cgroup/recvmsg4")
int xdpcni_recvmsg4(struct bpf_sock_addr *ctx)
{
	return reverse(ctx, 0);
}

SEC("cgroup/recvmsg6")
int xdpcni_recvmsg6(struct bpf_sock_addr *ctx)
{
	return reverse(ctx, 1);
}

SEC("cgroup/getpeername4")
int xdpcni_getpeername4(struct bpf_sock_addr *ctx)
{
	return reverse(ctx, 0);
}

SEC("cgroup/getpeername6")
int xdpcni_getpeername6(struct bpf_sock_addr *ctx)
{
	return reverse(ctx, 1);
}

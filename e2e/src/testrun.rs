//! BPF_PROG_TEST_RUN of the datapath program on hand-built frames.

use anyhow::{Context, Result};
use aya::programs::{SchedClassifier, TestRun, TestRunOptions, Xdp};
use xdpcni_ebpf::abi::c_layout;

/// XDP verdicts as the kernel numbers them.
pub const XDP_DROP: u32 = 1;
/// Pass to the stack.
pub const XDP_PASS: u32 = 2;
/// Redirect.
pub const XDP_REDIRECT: u32 = 4;

/// tc verdicts as the kernel numbers them.
pub const TC_ACT_UNSPEC: u32 = u32::MAX;
/// Drop.
pub const TC_ACT_SHOT: u32 = 2;
/// Redirect (bpf_redirect_peer).
pub const TC_ACT_REDIRECT: u32 = 7;

/// Result of one run.
#[derive(Debug)]
pub struct Run {
    /// The program's return value.
    pub action: u32,
    /// The frame after the program.
    pub frame: Vec<u8>,
    /// Average time per run as the kernel measured it.
    pub ns_per_run: f64,
}

/// Runs `prog` `repeat` times on `frame` as if it arrived on `ingress_ifindex`
/// (resolved in the calling thread's network namespace).
pub fn xdp_run(prog: &Xdp, ingress_ifindex: u32, frame: &[u8], repeat: u32) -> Result<Run> {
    let len = u32::try_from(frame.len())?;
    // struct xdp_md { data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex }
    let mut ctx = Vec::with_capacity(24);
    for word in [0, len, 0, ingress_ifindex, 0, 0] {
        ctx.extend_from_slice(&u32::to_ne_bytes(word));
    }
    run(prog, &ctx, frame, repeat).context("BPF_PROG_TEST_RUN (XDP)")
}

/// Runs the tc program `prog` `repeat` times on `frame` as an skb received
/// on `ingress_ifindex` (that device, in the calling thread's network
/// namespace, is the skb's too): the context's `ingress_ifindex` and
/// `ifindex`, at their offsets in the kernel's `struct __sk_buff`.
pub fn tc_run(
    prog: &SchedClassifier,
    ingress_ifindex: u32,
    frame: &[u8],
    repeat: u32,
) -> Result<Run> {
    let mut ctx = vec![0u8; c_layout::SIZEOF___sk_buff];
    for off in [
        c_layout::OFFSETOF___sk_buff_ingress_ifindex,
        c_layout::OFFSETOF___sk_buff_ifindex,
    ] {
        ctx[off..off + 4].copy_from_slice(&ingress_ifindex.to_ne_bytes());
    }
    run(prog, &ctx, frame, repeat).context("BPF_PROG_TEST_RUN (tc)")
}

/// One BPF_PROG_TEST_RUN of either hook's program with context `ctx`.
fn run<P>(prog: &P, ctx: &[u8], frame: &[u8], repeat: u32) -> Result<Run>
where
    P: for<'a> TestRun<Opts<'a> = TestRunOptions<'a>, Result = aya::TestRunResult>,
{
    let mut out = vec![0u8; frame.len() + 512];
    let mut opts = TestRunOptions::new();
    opts.data_in = Some(frame);
    opts.data_out = Some(&mut out);
    opts.ctx_in = Some(ctx);
    opts.repeat = repeat.max(1);
    let r = prog.test_run(opts)?;
    out.truncate(r.data_size_out as usize);
    Ok(Run {
        action: r.return_value,
        frame: out,
        ns_per_run: r.duration.as_nanos() as f64,
    })
}

//! The datapath owner: one thread that alone holds the [`Reconciler`] (the
//! agent's one writer of the pinned datapath) and runs the work the agent's
//! tasks send it, one job at a time, in the order they came. Nothing else in
//! the agent can reach the reconciler: a task that wants the datapath changed
//! sends a closure through an [`Owner`] ([`Owner::run`], or
//! [`Owner::run_blocking`] from a blocking thread) and awaits its answer. The
//! owner makes syscalls (netlink, bpf) on its own thread, so no tokio worker
//! ever blocks on them and no lock is held across an await.
//!
//! A new datapath command is a method of the [`Reconciler`], in the module
//! of its capability (`reconciler/`: pods, `services.rs`, `policy.rs`,
//! `remote.rs`), called as `owner.run(move |r| r.method(..))`: nothing here
//! changes. `ebpf/tests/one_writer.rs` fails when another module of the agent
//! holds a `Datapath` or the Service programs itself.
//!
//! The thread ends when the last [`Owner`] is dropped.

use std::sync::mpsc;

use tokio::sync::oneshot;
use tracing::Span;

use crate::reconciler::Reconciler;

/// The datapath owner did not answer: its thread is gone, or the job
/// panicked (a bug; the thread goes on with the next job).
#[derive(Debug, thiserror::Error)]
#[error("the datapath owner stopped")]
pub struct OwnerGone;

/// One job for the owner's thread: it runs with the reconciler and sends
/// its own answer.
type Job = Box<dyn FnOnce(&mut Reconciler) + Send>;

/// A handle on the datapath owner (cheap to clone; every task of the agent
/// that changes the datapath holds one).
#[derive(Clone)]
pub struct Owner {
    tx: mpsc::Sender<(Span, Job)>,
}

impl Owner {
    /// Starts the owner's thread with `reconciler`, which from now on only
    /// that thread touches.
    pub fn start(reconciler: Reconciler) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<(Span, Job)>();
        std::thread::Builder::new()
            .name("datapath".into())
            .spawn(move || {
                let mut reconciler = reconciler;
                while let Ok((span, job)) = rx.recv() {
                    let _entered = span.enter();
                    // A panic in one job (a bug) drops its reply, so its
                    // asker sees `OwnerGone`; the thread goes on with the
                    // next, as a poisoned lock was taken over before.
                    let run = std::panic::AssertUnwindSafe(|| job(&mut reconciler));
                    if std::panic::catch_unwind(run).is_err() {
                        tracing::error!("a datapath job panicked; going on with the next");
                    }
                }
            })?;
        Ok(Self { tx })
    }

    /// Queues `work` for the owner's thread (in the caller's span); the
    /// receiver of its answer.
    fn send<T, F>(&self, work: F) -> Result<oneshot::Receiver<T>, OwnerGone>
    where
        T: Send + 'static,
        F: FnOnce(&mut Reconciler) -> T + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        // A dropped reply means the asker went away (shutdown, a cancelled
        // future): the work is done all the same.
        let job: Job = Box::new(move |r| {
            let _ = reply.send(work(r));
        });
        self.tx
            .send((Span::current(), job))
            .map_err(|_| OwnerGone)?;
        Ok(answer)
    }

    /// Runs `work` on the owner's thread, after the jobs queued before it;
    /// its answer.
    pub async fn run<T, F>(&self, work: F) -> Result<T, OwnerGone>
    where
        T: Send + 'static,
        F: FnOnce(&mut Reconciler) -> T + Send + 'static,
    {
        self.send(work)?.await.map_err(|_| OwnerGone)
    }

    /// [`Owner::run`] from a thread that may block (never a runtime
    /// worker): the routing pass, on its blocking thread, writes the
    /// datapath between its netlink requests.
    pub fn run_blocking<T, F>(&self, work: F) -> Result<T, OwnerGone>
    where
        T: Send + 'static,
        F: FnOnce(&mut Reconciler) -> T + Send + 'static,
    {
        self.send(work)?.blocking_recv().map_err(|_| OwnerGone)
    }
}

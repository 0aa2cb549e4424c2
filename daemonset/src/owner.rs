//! The datapath owner: one thread that alone holds the [`Reconciler`] (the
//! agent's one writer of the pinned datapath) and runs the commands the
//! agent's tasks send it, one at a time, in the order they came. Nothing
//! else in the agent can reach the reconciler: a task that wants the
//! datapath changed sends a command through an [`Owner`] and awaits the
//! answer. The owner makes syscalls (netlink, bpf) on its own thread, so no
//! tokio worker ever blocks on them and no lock is held across an await.
//!
//! The thread ends when the last [`Owner`] is dropped.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::PathBuf,
    sync::{mpsc, Arc},
};

use tokio::sync::oneshot;
use tracing::Span;
use xdpcni_ebpf::{
    abi::{RemoteNet, SvcAddr},
    L4Proto, PodVerdicts, PolicySynced, RemoteCidr, ServiceWant,
};
use xdpcni_host::state::Record;

use crate::{
    apply::ApplyError,
    reconciler::{PodInput, PodOutcome, Reconciler, RemoteDone, ServicesSynced},
};

/// The datapath owner did not answer: its thread is gone, or the command
/// panicked (a bug; the thread goes on with the next command).
#[derive(Debug, thiserror::Error)]
#[error("the datapath owner stopped")]
pub struct OwnerGone;

type Reply<T> = oneshot::Sender<T>;
/// Each isolated pod's addresses, its verdicts, and when its window closes
/// (CLOCK_MONOTONIC ns).
pub type PolicyWant = Vec<(Vec<IpAddr>, PodVerdicts, u64)>;
type DatapathResult<T> = Result<T, xdpcni_ebpf::Error>;

/// What the owner can be asked to do: each is one method of the
/// [`Reconciler`].
enum Command {
    /// Apply a pod's input to one of its records.
    Reconcile(
        Box<(Record, PodInput)>,
        Reply<Result<PodOutcome, ApplyError>>,
    ),
    /// Write the policy gate the CNI reads (namespaces with policies).
    WriteGate(BTreeMap<String, u32>, Reply<DatapathResult<bool>>),
    /// Re-create the datapath if its pins were removed.
    EnsurePinned(Reply<DatapathResult<bool>>),
    /// Collect what deleted pods left behind, given the live records.
    Collect(Arc<Vec<Record>>, Reply<DatapathResult<usize>>),
    /// Make the NAT'd ports equal the given set.
    SyncNatPorts(
        BTreeSet<(IpAddr, L4Proto, u16)>,
        Reply<DatapathResult<(usize, usize)>>,
    ),
    /// Make the NetworkPolicy verdicts in the datapath these.
    SyncPolicy(PolicyWant, Reply<DatapathResult<PolicySynced>>),
    /// Load and attach the Service programs (pin directory, cgroup).
    OpenServices(Box<(PathBuf, PathBuf)>, Reply<DatapathResult<()>>),
    /// Renew the lease on the Service maps.
    RenewServicesLease(Reply<DatapathResult<bool>>),
    /// Make the Service maps hold these frontends for these namespaces.
    SyncServices(
        Box<(
            BTreeMap<SvcAddr, ServiceWant>,
            crate::services::PodNamespaces,
        )>,
        Reply<DatapathResult<ServicesSynced>>,
    ),
    /// Keep only the `remote_nets` entries routed through these next hops.
    RetainRemote(BTreeMap<RemoteCidr, IpAddr>, Reply<DatapathResult<usize>>),
    /// Make `remote_nets` these, the uplink program run on these devices.
    SyncRemote(
        Box<(BTreeMap<RemoteCidr, RemoteNet>, Vec<u32>)>,
        Reply<DatapathResult<RemoteDone>>,
    ),
}

impl Command {
    fn run(self, r: &mut Reconciler) {
        // A dropped reply means the asker went away (shutdown, a cancelled
        // future): the work is done all the same.
        match self {
            Self::Reconcile(job, reply) => {
                let (rec, input) = *job;
                let _ = reply.send(r.reconcile(&rec, &input));
            }
            Self::WriteGate(namespaces, reply) => {
                let _ = reply.send(r.write_gate(&namespaces));
            }
            Self::EnsurePinned(reply) => {
                let _ = reply.send(r.ensure_pinned());
            }
            Self::Collect(records, reply) => {
                let _ = reply.send(r.collect(&records));
            }
            Self::SyncNatPorts(want, reply) => {
                let _ = reply.send(r.sync_nat_ports(&want));
            }
            Self::SyncPolicy(want, reply) => {
                let _ = reply.send(r.sync_policy(&want));
            }
            Self::OpenServices(at, reply) => {
                let _ = reply.send(r.open_services(&at.0, &at.1));
            }
            Self::RenewServicesLease(reply) => {
                let _ = reply.send(r.renew_services_lease());
            }
            Self::SyncServices(job, reply) => {
                let _ = reply.send(r.sync_services(&job.0, &job.1));
            }
            Self::RetainRemote(gateways, reply) => {
                let _ = reply.send(r.retain_remote(&gateways));
            }
            Self::SyncRemote(job, reply) => {
                let _ = reply.send(r.sync_remote(&job.0, &job.1));
            }
        }
    }
}

/// A handle on the datapath owner (cheap to clone; every task of the agent
/// that changes the datapath holds one).
#[derive(Clone)]
pub struct Owner {
    tx: mpsc::Sender<(Span, Command)>,
}

impl Owner {
    /// Starts the owner's thread with `reconciler`, which from now on only
    /// that thread touches.
    pub fn start(reconciler: Reconciler) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<(Span, Command)>();
        std::thread::Builder::new()
            .name("datapath".into())
            .spawn(move || {
                let mut reconciler = reconciler;
                while let Ok((span, cmd)) = rx.recv() {
                    let _entered = span.enter();
                    // A panic in one command (a bug) drops its reply, so
                    // its asker sees `OwnerGone`; the thread goes on with
                    // the next, as a poisoned lock was taken over before.
                    let run = std::panic::AssertUnwindSafe(|| cmd.run(&mut reconciler));
                    if std::panic::catch_unwind(run).is_err() {
                        tracing::error!("a datapath command panicked; going on with the next");
                    }
                }
            })?;
        Ok(Self { tx })
    }

    async fn ask<T>(&self, cmd: impl FnOnce(Reply<T>) -> Command) -> Result<T, OwnerGone> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send((Span::current(), cmd(reply)))
            .map_err(|_| OwnerGone)?;
        answer.await.map_err(|_| OwnerGone)
    }

    /// [`Owner::ask`] from a thread that may block (never a runtime
    /// worker): the routing pass, on its blocking thread, writes the datapath
    /// between its netlink requests.
    fn ask_blocking<T>(&self, cmd: impl FnOnce(Reply<T>) -> Command) -> Result<T, OwnerGone> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send((Span::current(), cmd(reply)))
            .map_err(|_| OwnerGone)?;
        answer.blocking_recv().map_err(|_| OwnerGone)
    }

    /// [`Reconciler::retain_remote`], from a blocking thread.
    pub fn retain_remote_blocking(
        &self,
        gateways: BTreeMap<RemoteCidr, IpAddr>,
    ) -> Result<DatapathResult<usize>, OwnerGone> {
        self.ask_blocking(|r| Command::RetainRemote(gateways, r))
    }

    /// [`Reconciler::sync_remote`], from a blocking thread.
    pub fn sync_remote_blocking(
        &self,
        want: BTreeMap<RemoteCidr, RemoteNet>,
        uplinks: Vec<u32>,
    ) -> Result<DatapathResult<RemoteDone>, OwnerGone> {
        self.ask_blocking(|r| Command::SyncRemote(Box::new((want, uplinks)), r))
    }

    /// [`Reconciler::reconcile`].
    pub async fn reconcile(
        &self,
        rec: Record,
        input: PodInput,
    ) -> Result<Result<PodOutcome, ApplyError>, OwnerGone> {
        self.ask(|r| Command::Reconcile(Box::new((rec, input)), r))
            .await
    }

    /// [`Reconciler::write_gate`].
    pub async fn write_gate(
        &self,
        namespaces: BTreeMap<String, u32>,
    ) -> Result<DatapathResult<bool>, OwnerGone> {
        self.ask(|r| Command::WriteGate(namespaces, r)).await
    }

    /// [`Reconciler::ensure_pinned`].
    pub async fn ensure_pinned(&self) -> Result<DatapathResult<bool>, OwnerGone> {
        self.ask(Command::EnsurePinned).await
    }

    /// [`Reconciler::collect`].
    pub async fn collect(
        &self,
        records: Arc<Vec<Record>>,
    ) -> Result<DatapathResult<usize>, OwnerGone> {
        self.ask(|r| Command::Collect(records, r)).await
    }

    /// [`Reconciler::open_services`].
    pub async fn open_services(
        &self,
        pin_dir: PathBuf,
        cgroup: PathBuf,
    ) -> Result<DatapathResult<()>, OwnerGone> {
        self.ask(|r| Command::OpenServices(Box::new((pin_dir, cgroup)), r))
            .await
    }

    /// [`Reconciler::renew_services_lease`].
    pub async fn renew_services_lease(&self) -> Result<DatapathResult<bool>, OwnerGone> {
        self.ask(Command::RenewServicesLease).await
    }

    /// [`Reconciler::sync_services`].
    pub async fn sync_services(
        &self,
        want: BTreeMap<SvcAddr, ServiceWant>,
        netns: crate::services::PodNamespaces,
    ) -> Result<DatapathResult<ServicesSynced>, OwnerGone> {
        self.ask(|r| Command::SyncServices(Box::new((want, netns)), r))
            .await
    }

    /// [`Reconciler::sync_nat_ports`].
    pub async fn sync_nat_ports(
        &self,
        want: BTreeSet<(IpAddr, L4Proto, u16)>,
    ) -> Result<DatapathResult<(usize, usize)>, OwnerGone> {
        self.ask(|r| Command::SyncNatPorts(want, r)).await
    }

    /// [`Reconciler::sync_policy`].
    pub async fn sync_policy(
        &self,
        want: PolicyWant,
    ) -> Result<DatapathResult<PolicySynced>, OwnerGone> {
        self.ask(|r| Command::SyncPolicy(want, r)).await
    }
}

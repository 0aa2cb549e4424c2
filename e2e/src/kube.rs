//! A real Kubernetes control plane for the agent's tests: etcd (Debian) and
//! kube-apiserver 1.20.2 (built from Debian's source by
//! scripts/k8s-build.sh) started inside a node's network namespace, with
//! a token kubeconfig. Both processes are killed by PID and their data
//! removed on Drop.

use std::{
    future::Future,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::{
    cni::{NodeProcess, TempDir},
    netns::{run, Netns},
};

/// Where scripts/k8s-build.sh puts the binary: `$XDPCNI_K8S_CACHE/bin`
/// (default /var/cache/xdpcni-k8s), or XDPCNI_KUBE_APISERVER.
pub fn apiserver_binary() -> Result<PathBuf> {
    match std::env::var("XDPCNI_KUBE_APISERVER") {
        Ok(p) => built(PathBuf::from(p)),
        Err(_) => k8s_binary("kube-apiserver"),
    }
}

/// The Kubernetes binary `name` scripts/k8s-build.sh built (kube-proxy,
/// kube-apiserver, ...), in `$XDPCNI_K8S_CACHE/bin` (default
/// /var/cache/xdpcni-k8s).
pub fn k8s_binary(name: &str) -> Result<PathBuf> {
    let cache =
        std::env::var("XDPCNI_K8S_CACHE").unwrap_or_else(|_| "/var/cache/xdpcni-k8s".into());
    built(PathBuf::from(cache).join("bin").join(name))
}

fn built(p: PathBuf) -> Result<PathBuf> {
    if !p.is_file() {
        bail!(
            "{} is missing: run scripts/k8s-build.sh (scripts/setup.sh does)",
            p.display()
        );
    }
    Ok(p)
}

/// etcd + kube-apiserver inside a namespace.
#[derive(Debug)]
pub struct ApiServer {
    apiserver: Option<NodeProcess>,
    etcd: Option<NodeProcess>,
    dir: TempDir,
    /// A kubeconfig for it (system:masters token).
    pub kubeconfig: PathBuf,
}

const TOKEN: &str = "xdpcni-test-token";

impl ApiServer {
    /// Starts both in `node` and waits until the `default` namespace exists.
    pub fn start(node: &Netns) -> Result<Self> {
        Self::start_on(node, "127.0.0.1")
    }

    /// [`ApiServer::start`] with the API server bound to `bind` (`0.0.0.0`
    /// to serve other namespaces over a link too; see [`Self::kubeconfig_via`]).
    pub fn start_on(node: &Netns, bind: &str) -> Result<Self> {
        let bin = apiserver_binary()?;
        let dir = TempDir::new("xdpcni-kube-")?;
        let d = dir.path();
        let key = d.join("sa.key");
        let key_s = key.to_string_lossy().to_string();
        run(&["openssl", "genrsa", "-out", &key_s, "2048"])?;
        let pubk = d.join("sa.pub");
        run(&[
            "openssl",
            "rsa",
            "-in",
            &key_s,
            "-pubout",
            "-out",
            &pubk.to_string_lossy(),
        ])?;
        std::fs::write(
            d.join("tokens.csv"),
            format!("{TOKEN},admin,admin,system:masters\n"),
        )?;
        let etcd = NodeProcess::spawn(
            node,
            Path::new("/usr/bin/etcd"),
            &[
                "--data-dir",
                &d.join("etcd").to_string_lossy(),
                "--listen-client-urls",
                "http://127.0.0.1:2379",
                "--advertise-client-urls",
                "http://127.0.0.1:2379",
                "--listen-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-advertise-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-cluster",
                "t=http://127.0.0.1:2380",
                "--name",
                "t",
            ],
            &d.join("etcd.log"),
        )?;
        let apiserver = NodeProcess::spawn(
            node,
            &bin,
            &[
                "--etcd-servers=http://127.0.0.1:2379",
                &format!("--bind-address={bind}"),
                "--secure-port=6443",
                &format!("--cert-dir={}", d.join("certs").display()),
                &format!("--token-auth-file={}", d.join("tokens.csv").display()),
                "--authorization-mode=RBAC",
                &format!("--service-account-key-file={}", pubk.display()),
                &format!("--service-account-signing-key-file={}", key.display()),
                "--service-account-issuer=https://kubernetes.default.svc",
                // Dual-stack Services (ipFamilyPolicy) take an IPv6 address too.
                "--service-cluster-ip-range=10.96.0.0/16,fd96::/112",
                "--insecure-port=0",
                "--advertise-address=127.0.0.1",
                "--disable-admission-plugins=ServiceAccount",
                // As kubeadm and every CNI-carrying cluster: DaemonSets like
                // ours run privileged.
                "--allow-privileged=true",
                // 1.20 keeps only the first of a Node's podCIDRs without it.
                "--feature-gates=IPv6DualStack=true",
            ],
            &d.join("apiserver.log"),
        )?;
        let kubeconfig = d.join("kubeconfig");
        std::fs::write(&kubeconfig, kubeconfig_text("127.0.0.1"))?;
        let s = Self {
            apiserver: Some(apiserver),
            etcd: Some(etcd),
            dir,
            kubeconfig,
        };
        let start = Instant::now();
        loop {
            let ok = s.with_client(node, |c| async move {
                let ns: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(c);
                Ok(ns.get("default").await.is_ok())
            });
            if matches!(ok, Ok(true)) {
                return Ok(s);
            }
            if start.elapsed() > Duration::from_secs(60) {
                bail!(
                    "kube-apiserver not ready after 60 s: {}",
                    std::fs::read_to_string(s.dir.path().join("apiserver.log")).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Runs `f` with a client, on a thread inside `node` (where the API
    /// server listens) with its own single-threaded runtime.
    pub fn with_client<T, F, Fut>(&self, node: &Netns, f: F) -> Result<T>
    where
        T: Send,
        F: FnOnce(kube::Client) -> Fut + Send,
        Fut: Future<Output = Result<T>>,
    {
        let path = self.kubeconfig.clone();
        crate::in_netns(node, move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let kc = kube::config::Kubeconfig::read_from(&path)?;
                let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
                    .await
                    .context("kubeconfig")?;
                let client = kube::Client::try_from(cfg)?;
                f(client).await
            })
        })
    }

    /// A kubeconfig reaching the API server at `address` (from another
    /// namespace linked to this one, when it was started on `0.0.0.0`).
    pub fn kubeconfig_via(&self, address: &str) -> Result<PathBuf> {
        let p = self.dir.path().join(format!("kubeconfig-{address}"));
        std::fs::write(&p, kubeconfig_text(address))?;
        Ok(p)
    }

    /// The API server's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("apiserver.log")).unwrap_or_default()
    }
}

/// A token kubeconfig for the API server at `address`:6443.
fn kubeconfig_text(address: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: t\n  cluster:\n    server: https://{address}:6443\n    insecure-skip-tls-verify: true\nusers:\n- name: admin\n  user:\n    token: {TOKEN}\ncontexts:\n- name: t\n  context:\n    cluster: t\n    user: admin\n    namespace: default\ncurrent-context: t\n"
    )
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        // SIGKILL: a graceful stop waits up to a minute for open watches, and
        // the data directory goes with the test anyway.
        if let Some(a) = self.apiserver.take() {
            let _ = a.stop(libc::SIGKILL);
        }
        if let Some(e) = self.etcd.take() {
            let _ = e.stop(libc::SIGKILL);
        }
    }
}

//! The datapath crate is the one writer of pinned maps: no product crate
//! (the CNI plugin, the agent, the shared host crate) opens a map with aya
//! itself or reaches for the test-only raw writes. The map types' write
//! methods are private to the crate (a product crate that called one would
//! not compile; `scripts/test.sh` builds the product crates alone, without
//! the e2e crate's `test-objects`, to prove it); this test catches the two
//! ways around that.
#![allow(clippy::expect_used)] // tests may panic

use std::path::{Path, PathBuf};

/// What a product source file must not name: aya's map and pin types (a map
/// opened outside this crate), and the raw writes of `xdpcni_ebpf::testing`.
const FORBIDDEN: &[&str] = &[
    "aya::maps",
    "MapData::from_pin",
    "xdpcni_ebpf::testing",
    "RawMaps",
    "RawDatapath",
    "test-objects",
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") || p.ends_with("Cargo.toml") {
            out.push(p);
        }
    }
}

#[test]
fn one_writer_no_product_crate_writes_a_pinned_map() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root");
    let mut files = Vec::new();
    for krate in ["cni-plugin", "daemonset", "host"] {
        sources(&root.join(krate).join("src"), &mut files);
        files.push(root.join(krate).join("Cargo.toml"));
    }
    assert!(
        files.len() > 30,
        "found only {} product source files: the walk is wrong",
        files.len()
    );
    let found = scan(&files);
    assert!(
        found.is_empty(),
        "product code writing the datapath's maps outside its verbs:\n{}",
        found.join("\n")
    );
}

/// Every line of `files` naming a forbidden word, as `path:line: word`.
fn scan(files: &[PathBuf]) -> Vec<String> {
    let mut found = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).expect("readable source");
        for (n, line) in text.lines().enumerate() {
            for word in FORBIDDEN {
                if line.contains(word) {
                    found.push(format!("{}:{}: {word}", f.display(), n + 1));
                }
            }
        }
    }
    found
}

#[test]
fn one_writer_the_scan_finds_a_raw_write() {
    // The positive control: a file written as a writer around the verbs
    // would write it is found, line and word.
    let dir = std::env::temp_dir().join(format!("xdpcni-one-writer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let f = dir.join("writer.rs");
    std::fs::write(
        &f,
        "fn f() {}\nuse xdpcni_ebpf::testing::RawMaps;\nlet m = aya::maps::MapData::from_pin(p);\n",
    )
    .expect("write");
    let found = scan(std::slice::from_ref(&f));
    std::fs::remove_dir_all(&dir).expect("cleanup");
    assert_eq!(found.len(), 4, "{found:?}");
    assert!(found[0].ends_with(":2: xdpcni_ebpf::testing"), "{found:?}");
}

/// The agent's modules that may hold the datapath or the Service programs:
/// the owner, its reconciler (by capability), and `apply.rs`, which the
/// reconciler's pods call. Every other module of the agent asks the owner
/// (`Owner::run`), so a datapath write has one road (daemonset/src/owner.rs).
const AGENT_OWNER: &[&str] = &["owner.rs", "reconciler/", "apply.rs"];

/// Where `text` names the datapath or the Service programs: a
/// `use xdpcni_ebpf::...` that imports `Datapath` or `Services`, or a path
/// `xdpcni_ebpf::Datapath`, `xdpcni_ebpf::Services`, `xdpcni_ebpf::svc::`.
/// Comments are skipped.
fn holds_datapath(text: &str) -> Vec<usize> {
    let code: Vec<&str> = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or_default())
        .collect();
    let names = |s: &str| {
        s.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .any(|w| w == "Datapath" || w == "Services")
    };
    let mut found = Vec::new();
    let mut in_use: Option<usize> = None;
    for (n, line) in code.iter().enumerate() {
        let t = line.trim_start();
        if t.starts_with("use xdpcni_ebpf::") || t.starts_with("pub use xdpcni_ebpf::") {
            in_use = Some(n);
        }
        if let Some(start) = in_use {
            if names(line) {
                found.push(start + 1);
                in_use = None;
            } else if line.contains(';') {
                in_use = None;
            }
        }
        for path in [
            "xdpcni_ebpf::Datapath",
            "xdpcni_ebpf::Services",
            "xdpcni_ebpf::svc::",
        ] {
            if line.contains(path) {
                found.push(n + 1);
            }
        }
    }
    found.sort_unstable();
    found.dedup();
    found
}

#[test]
fn one_writer_only_the_agents_owner_modules_hold_the_datapath() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .join("daemonset/src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let (owner, others): (Vec<_>, Vec<_>) = files.iter().partition(|f| {
        let rel = f
            .strip_prefix(&src)
            .expect("under src")
            .to_string_lossy()
            .to_string();
        AGENT_OWNER
            .iter()
            .any(|o| rel == *o || (o.ends_with('/') && rel.starts_with(o)))
    });
    assert!(
        others.len() > 30,
        "found only {} agent modules: the walk is wrong",
        others.len()
    );
    // The owner's modules do hold it: the scan is looking at the right thing.
    assert!(
        owner
            .iter()
            .any(|f| !holds_datapath(&std::fs::read_to_string(f).expect("source")).is_empty()),
        "no owner module names the datapath: the scan is wrong"
    );
    let found: Vec<String> = others
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).expect("readable source");
            holds_datapath(&text)
                .into_iter()
                .map(move |n| format!("{}:{n}", f.display()))
        })
        .collect();
    assert!(
        found.is_empty(),
        "agent modules holding the datapath outside its owner (ask it with Owner::run):\n{}",
        found.join("\n")
    );
}

#[test]
fn one_writer_the_agent_scan_finds_a_second_road() {
    // The control: an import, a path and a multi-line import are found;
    // a comment, a metrics stage and an error variant of that name are not.
    let text = "use xdpcni_ebpf::{Datapath, Maps};\n// xdpcni_ebpf::Datapath in a comment\nlet s = xdpcni_ebpf::Services::open(p);\nuse xdpcni_ebpf::{\n    abi::X,\n    Services,\n};\nm.error(Stage::Services);\nSelf::Datapath(e) => 1,\n";
    assert_eq!(holds_datapath(text), vec![1, 3, 4]);
}

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

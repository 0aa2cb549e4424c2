//! docs/architecture.md's crate map stays true: every source file of the
//! workspace is named there, and every path the document names exists.
//!
//! The map is the section "## Crates and files": one bullet per directory,
//! whose first code span is the directory (`daemonset/src/kube/`); the other
//! code spans of the bullet that are file names (`mod.rs`) name files of that
//! directory, and those with a `/` are paths from the directory, its crate
//! or the workspace root.
#![allow(clippy::expect_used)] // tests may panic

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

/// What the map must cover: the crates' sources, the datapath's C, the e2e harness.
const COVERED: &[&str] = &[
    "ebpf/src",
    "ebpf/include",
    "ebpf/build",
    "ebpf/tests",
    "host/src",
    "cni-plugin/src",
    "daemonset/src",
    "e2e/src",
];

/// Top-level directories a path from the root starts with.
const ROOTS: &[&str] = &[
    "ebpf/",
    "host/",
    "cni-plugin/",
    "daemonset/",
    "e2e/",
    "charts/",
    "scripts/",
    "docs/",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("readable dir").flatten() {
        let p = e.path();
        if p.is_dir() {
            walk(&p, out);
        } else {
            out.push(p);
        }
    }
}

/// The code spans of `text`.
fn spans(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// Whether a code span reads as a path or file name (not code, not a URL path).
fn is_path(s: &str) -> bool {
    let chars_ok = s
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "._-/".contains(c));
    let file_like = s.ends_with('/')
        || [
            ".rs", ".c", ".h", ".toml", ".json", ".md", ".sh", ".py", ".yaml",
        ]
        .iter()
        .any(|x| s.ends_with(x));
    chars_ok && file_like && !s.starts_with('/') && !s.starts_with('.')
}

/// The crate map's bullets, each joined onto one line.
fn bullets(doc: &str) -> Vec<String> {
    let start = doc
        .find("\n## Crates and files\n")
        .expect("docs/architecture.md has a '## Crates and files' section");
    let section = &doc[start + 1..];
    let end = section[3..].find("\n## ").map_or(section.len(), |e| e + 3);
    let mut out: Vec<String> = Vec::new();
    for line in section[..end].lines() {
        if let Some(rest) = line.strip_prefix("- ") {
            out.push(rest.to_string());
        } else if line.starts_with("  ") && !out.is_empty() {
            let last = out.len() - 1;
            out[last].push(' ');
            out[last].push_str(line.trim());
        }
    }
    out
}

/// What the map names: (files it covers, paths that do not exist).
fn read_map(doc: &str, root: &Path) -> (BTreeSet<PathBuf>, Vec<String>) {
    let mut named = BTreeSet::new();
    let mut missing = Vec::new();
    for b in bullets(doc) {
        let mut it = spans(&b).into_iter().filter(|s| is_path(s));
        let Some(dir) = it.next() else {
            missing.push(format!("a bullet without its directory: {b}"));
            continue;
        };
        if !dir.ends_with('/') || !root.join(dir).is_dir() {
            missing.push(format!("{dir} (a bullet's directory)"));
            continue;
        }
        let krate = dir.split('/').next().unwrap_or_default();
        for s in it {
            let tries: Vec<PathBuf> = if ROOTS.iter().any(|r| s.starts_with(r)) {
                vec![root.join(s)]
            } else if s.contains('/') {
                vec![root.join(dir).join(s), root.join(krate).join(s)]
            } else {
                vec![root.join(dir).join(s)]
            };
            match tries.into_iter().find(|p| p.exists()) {
                Some(p) => {
                    named.insert(p);
                }
                None => missing.push(format!("{s} (in the bullet of {dir})")),
            }
        }
    }
    (named, missing)
}

#[test]
fn docs_architecture_names_every_source_file_and_no_missing_path() {
    let root = root();
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).expect("the doc");
    let (named, mut missing) = read_map(&doc, &root);
    // Every path from the root the document names anywhere exists too.
    for s in spans(&doc).into_iter().filter(|s| is_path(s)) {
        if ROOTS.iter().any(|r| s.starts_with(r)) && !root.join(s).exists() {
            missing.push(format!("{s} (named in the text)"));
        }
    }
    let mut files = Vec::new();
    for d in COVERED {
        walk(&root.join(d), &mut files);
    }
    files.push(root.join("ebpf/build.rs"));
    assert!(
        files.len() > 120,
        "found only {} files: the walk is wrong",
        files.len()
    );
    let unnamed: Vec<String> = files
        .iter()
        .filter(|f| !named.contains(*f))
        .map(|f| f.strip_prefix(&root).unwrap_or(f).display().to_string())
        .collect();
    assert!(
        unnamed.is_empty() && missing.is_empty(),
        "docs/architecture.md's crate map is out of date.\nfiles it does not name:\n  {}\npaths it names that do not exist:\n  {}",
        unnamed.join("\n  "),
        missing.join("\n  ")
    );
}

#[test]
fn docs_architecture_the_check_finds_a_missing_file_and_a_stale_path() {
    // The control: a map naming a file that is gone, and missing one that is there.
    let root = root();
    let doc = "# Doc\n\n## Crates and files\n\n- `host/src/`: `lib.rs`, `gone.rs`,\n  `pod.rs`.\n\n## Next\n- `host/src/`: `ignored.rs`\n";
    let (named, missing) = read_map(doc, &root);
    assert!(named.contains(&root.join("host/src/lib.rs")));
    assert!(
        named.contains(&root.join("host/src/pod.rs")),
        "a continued bullet is read"
    );
    assert!(
        !named.contains(&root.join("host/src/gate.rs")),
        "an unnamed file is not named"
    );
    assert_eq!(
        missing,
        vec!["gone.rs (in the bullet of host/src/)".to_string()]
    );
}

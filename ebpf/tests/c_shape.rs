//! The C datapath's shape (ebpf/src/xdpcni.bpf.c): every program section
//! lives in a `.c` file of its hook, never in a header, so a newcomer finds
//! each entry program where its hook is named and every header is only
//! stages. (That each header and entry file compiles on its own is checked by
//! ebpf/build.rs at every build.)
#![allow(clippy::expect_used)] // tests may panic

use std::path::{Path, PathBuf};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("readable dir").flatten() {
        let p = e.path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "h" || x == "c") {
            out.push(p);
        }
    }
}

/// The `SEC("...")` sections of `text` other than maps and the licence.
fn program_sections(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| {
            let at = l.find("SEC(\"")?;
            let name = l[at + 5..].split('"').next()?.to_string();
            (name != ".maps" && name != "license").then_some(name)
        })
        .collect()
}

#[test]
fn c_shape_no_program_section_in_a_header() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, &mut all);
    let (headers, sources): (Vec<_>, Vec<_>) = all
        .iter()
        .partition(|p| p.extension().is_some_and(|x| x == "h"));
    assert!(
        headers.len() >= 10,
        "found {} headers: the walk is wrong",
        headers.len()
    );
    let mut found = Vec::new();
    for h in &headers {
        let text = std::fs::read_to_string(h).expect("readable header");
        for s in program_sections(&text) {
            found.push(format!("{}: SEC(\"{s}\")", h.display()));
        }
    }
    assert!(
        found.is_empty(),
        "program sections in headers:\n{}",
        found.join("\n")
    );
    // And the entries are where the layout says: one file per hook.
    let entries: Vec<String> = sources
        .iter()
        .filter(|p| {
            let text = std::fs::read_to_string(p).expect("readable source");
            !program_sections(&text).is_empty()
        })
        .filter_map(|p| p.file_name()?.to_str().map(str::to_string))
        .collect();
    for want in ["pod.bpf.c", "node.bpf.c", "cpumap.bpf.c", "hold.bpf.c"] {
        assert!(
            entries.iter().any(|e| e == want),
            "{want} has no program: {entries:?}"
        );
    }
}

#[test]
fn c_shape_the_scan_finds_a_program_section() {
    // The positive control: a header with a program section is found, its
    // maps and licence are not.
    let text = "struct {} m SEC(\".maps\");\nchar L[] SEC(\"license\") = \"GPL\";\nSEC(\"classifier\")\nint f(void) { return 0; }\n";
    assert_eq!(program_sections(text), vec!["classifier".to_string()]);
}

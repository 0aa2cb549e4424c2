//! Builds the XDP datapath with clang (`-target bpf`, BTF maps) and generates
//! the C-side layout constants that `src/abi.rs` checks its twins against.

use std::{env, path::PathBuf, process::Command};

use anyhow::{bail, Context, Result};

fn run(cmd: &mut Command) -> Result<Vec<u8>> {
    let out = cmd
        .output()
        .with_context(|| format!("spawning {cmd:?} (is clang installed? see .ci/run)"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out.stdout)
}

/// The stage-cost builds, stopped after stage 0 (entry) to 5; the product
/// build is the last stage (counters). src/lib.rs embeds them.
const STAGE_BUILDS: usize = 6;

fn main() -> Result<()> {
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let include = manifest.join("include");
    let clang = env::var("CLANG").unwrap_or_else(|_| "clang".into());

    // Every C source: the objects' roots and entry files (src/*.bpf.c), the
    // stage headers (src/lib/*.h), the shared layout and the layout probe.
    let mut sources = vec![include.join("xdpcni.h"), manifest.join("build/layout.c")];
    sources.extend(c_files(&manifest.join("src"), ".bpf.c")?);
    let headers = c_files(&manifest.join("src/lib"), ".h")?;
    sources.extend(headers.iter().cloned());
    for path in &sources {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    println!("cargo:rerun-if-env-changed=CLANG");

    // BPF needs the multiarch asm/ headers of the build host.
    let multiarch = run(Command::new("gcc").arg("-print-multiarch"))
        .map(|o| String::from_utf8_lossy(&o).trim().to_string())
        .unwrap_or_else(|_| "x86_64-linux-gnu".into());

    // Each stage header and each entry file compiles on its own: each
    // includes what it uses, whatever the object root includes before it.
    // (A header alone may leave its helpers unused.)
    let entries = ["pod.bpf.c", "node.bpf.c", "cpumap.bpf.c", "hold.bpf.c"];
    let alone = headers
        .iter()
        .map(|h| (h.clone(), ["-x", "c-header", "-Wno-unused-function"]));
    let entries = entries.iter().map(|e| {
        (
            manifest.join("src").join(e),
            ["-x", "c", "-Wunused-function"],
        )
    });
    for (path, lang) in alone.chain(entries) {
        run(Command::new(&clang)
            .args(["-O2", "-target", "bpf", "-Wall", "-Werror", "-fsyntax-only"])
            .args(lang)
            .arg("-I")
            .arg(&include)
            .arg(format!("-I/usr/include/{multiarch}"))
            .arg(&path))
        .with_context(|| format!("{} does not compile on its own", path.display()))?;
    }

    // The datapath, a build of it that differs only in its instructions,
    // which the tests use to exercise an in-place upgrade, and the
    // stage-cost builds: the fast path stopped after each of its stages
    // (XDPCNI_STAGES in src/lib/common.h; tests and the benchmark only).
    let mut builds = vec![
        ("xdpcni.bpf.o".to_string(), "src/xdpcni.bpf.c", None),
        (
            "xdpcni-upgrade-test.bpf.o".into(),
            "src/xdpcni.bpf.c",
            Some("-DXDPCNI_UPGRADE_TEST".to_string()),
        ),
        ("bench.bpf.o".into(), "src/bench.bpf.c", None),
        ("services.bpf.o".into(), "src/services.bpf.c", None),
    ];
    for n in 0..STAGE_BUILDS {
        builds.push((
            format!("xdpcni-stage{n}.bpf.o"),
            "src/xdpcni.bpf.c",
            Some(format!("-DXDPCNI_STAGES={n}")),
        ));
    }
    for (name, src, define) in builds {
        run(Command::new(&clang)
            .args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"])
            .args(define)
            .arg("-I")
            .arg(&include)
            .arg(format!("-I/usr/include/{multiarch}"))
            .arg("-c")
            .arg(manifest.join(src))
            .arg("-o")
            .arg(out_dir.join(name)))?;
    }

    let layout_bin = out_dir.join("layout");
    run(Command::new(&clang)
        .args(["-O0", "-Wall", "-Werror"])
        .arg("-I")
        .arg(&include)
        .arg(manifest.join("build/layout.c"))
        .arg("-o")
        .arg(&layout_bin))?;
    let layout = run(&mut Command::new(&layout_bin))?;
    std::fs::write(out_dir.join("c_layout.rs"), layout)?;
    Ok(())
}

/// The files of `dir` whose names end in `suffix`, sorted.
fn c_files(dir: &std::path::Path, suffix: &str) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.ends_with(suffix))
        {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

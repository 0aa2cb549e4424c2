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

fn main() -> Result<()> {
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let include = manifest.join("include");
    let clang = env::var("CLANG").unwrap_or_else(|_| "clang".into());

    for rel in [
        "include/xdpcni.h",
        "src/xdpcni.bpf.c",
        "src/maps.bpf.h",
        "src/parse.bpf.h",
        "src/bench.bpf.c",
        "build/layout.c",
    ] {
        println!("cargo:rerun-if-changed={}", manifest.join(rel).display());
    }
    println!("cargo:rerun-if-env-changed=CLANG");

    // BPF needs the multiarch asm/ headers of the build host.
    let multiarch = run(Command::new("gcc").arg("-print-multiarch"))
        .map(|o| String::from_utf8_lossy(&o).trim().to_string())
        .unwrap_or_else(|_| "x86_64-linux-gnu".into());

    // The datapath, and a build of it that differs only in its instructions,
    // which the tests use to exercise an in-place upgrade.
    for (name, src, defines) in [
        ("xdpcni.bpf.o", "src/xdpcni.bpf.c", &[][..]),
        (
            "xdpcni-upgrade-test.bpf.o",
            "src/xdpcni.bpf.c",
            &["-DXDPCNI_UPGRADE_TEST"][..],
        ),
        ("bench.bpf.o", "src/bench.bpf.c", &[][..]),
    ] {
        run(Command::new(&clang)
            .args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"])
            .args(defines)
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

//! Builds `cairn-init` as a static executable and hands its path and hash to
//! the crate, which embeds it: one `cairn` binary carries everything a
//! sandbox needs, and the init runs in any image, with or without a libc.
//! Compiles the seccomp policy of native sandboxes once, for the crate to
//! embed (`seccomp.bpf`), so that no sandbox start compiles it.

use std::env;
use std::path::PathBuf;
use std::process::Command;

/// The policy `src/native/seccomp.rs` includes.
#[allow(dead_code)]
mod seccomp_policy {
    pub type BpfInstruction = (u16, u8, u8, u32);
    include!("src/native/seccomp/policy.rs");

    pub fn compiled() -> Vec<BpfInstruction> {
        program(&[]).expect("the seccomp policy compiles")
    }
}

/// Writes the policy's program as `struct sock_filter`s, little-endian.
fn write_seccomp(out: &std::path::Path) {
    println!("cargo:rerun-if-changed=src/native/seccomp/policy.rs");
    let mut bytes = Vec::new();
    for (code, jt, jf, k) in seccomp_policy::compiled() {
        bytes.extend(code.to_le_bytes());
        bytes.extend([jt, jf]);
        bytes.extend(k.to_le_bytes());
    }
    std::fs::write(out.join("seccomp.bpf"), bytes).expect("cannot write seccomp.bpf");
}

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let workspace = manifest.parent().and_then(|p| p.parent()).unwrap().to_path_buf();
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let target = env::var("TARGET").unwrap();
    write_seccomp(&out);
    let target_dir = out.join("init-target");
    for dir in ["crates/cairn-init", "crates/cairn-protocol"] {
        println!("cargo:rerun-if-changed={}", workspace.join(dir).display());
    }
    println!("cargo:rerun-if-changed={}", workspace.join("Cargo.lock").display());

    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.arg("build")
        .arg("--release")
        .args(["-p", "cairn-init", "--target", &target])
        .arg("--target-dir")
        .arg(&target_dir)
        .arg("--manifest-path")
        .arg(workspace.join("Cargo.toml"))
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env(
            "CARGO_ENCODED_RUSTFLAGS",
            "-Ctarget-feature=+crt-static\x1f-Cstrip=symbols",
        );
    // Inherited profile settings would turn the nested build into a debug one.
    for (key, _) in env::vars() {
        if key.starts_with("CARGO_PROFILE_") || key.starts_with("CARGO_CFG_") || key == "CARGO_MAKEFLAGS" {
            cmd.env_remove(key);
        }
    }
    let status = cmd.status().expect("cannot run cargo to build cairn-init");
    assert!(status.success(), "building the static cairn-init failed");
    let binary = target_dir.join(&target).join("release").join("cairn-init");
    let bytes = std::fs::read(&binary).expect("cairn-init binary missing after build");
    let hash = blake3::hash(&bytes).to_hex();
    println!("cargo:rustc-env=CAIRN_INIT_PATH={}", binary.display());
    println!("cargo:rustc-env=CAIRN_INIT_HASH={}", &hash[..16]);
}

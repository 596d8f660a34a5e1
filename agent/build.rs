//! Embeds the eBPF object built by `cargo xtask build-ebpf`, so weir-agent is one binary.
use std::{env, path::PathBuf};

fn main() {
    println!("cargo:rerun-if-env-changed=WEIR_EBPF_OBJECT");
    let object = env::var_os("WEIR_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../target/ebpf/bpfel-unknown-none/release/weir-ebpf")
        });
    if !object.exists() {
        panic!(
            "the eBPF object {} is missing: run `cargo xtask build-ebpf` first \
             (or set WEIR_EBPF_OBJECT to a built object)",
            object.display()
        );
    }
    let object = object.canonicalize().expect("canonical eBPF object path");
    println!("cargo:rerun-if-changed={}", object.display());
    println!("cargo:rustc-env=WEIR_EBPF_OBJECT={}", object.display());
}

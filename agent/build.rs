//! Embeds the eBPF object built by `cargo xtask build-ebpf`, so weir-agent is one binary, and
//! generates the ZDS message types from `proto/zds.proto`.
use std::{env, path::PathBuf};

fn main() {
    embed_ebpf_object();
    generate_zds();
}

/// Without a built object (a fresh clone, `cargo check`), an empty stub stands in: the crate
/// builds, and a datapath started from it fails with what to run, as aya's template does.
fn embed_ebpf_object() {
    println!("cargo:rerun-if-env-changed=WEIR_EBPF_OBJECT");
    let object = env::var_os("WEIR_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../target/ebpf/bpfel-unknown-none/release/weir-ebpf")
        });
    println!("cargo:rerun-if-changed={}", object.display());
    let object = if object.exists() {
        object.canonicalize().expect("canonical eBPF object path")
    } else {
        println!(
            "cargo:warning=the eBPF object {} is missing: this weir-agent cannot load its \
             programs. Run `cargo xtask build-ebpf` (or set WEIR_EBPF_OBJECT) and build again.",
            object.display()
        );
        let stub = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"))
            .join("weir-ebpf-missing");
        std::fs::write(&stub, []).expect("writing the stub eBPF object");
        stub
    };
    println!("cargo:rustc-env=WEIR_EBPF_OBJECT={}", object.display());
}

/// Writes `$OUT_DIR/istio.workload.zds.rs` for `src/zds/proto.rs` to include. protox parses the
/// `.proto` in Rust, so building weir needs no `protoc`.
fn generate_zds() {
    const PROTO: &str = "proto/zds.proto";
    // prost-build leaves this to the caller.
    println!("cargo:rerun-if-changed={PROTO}");
    let descriptors = protox::compile([PROTO], ["proto"])
        .unwrap_or_else(|err| panic!("{PROTO} does not compile: {err:?}"));
    prost_build::Config::new()
        .compile_fds(descriptors)
        .unwrap_or_else(|err| panic!("generating the ZDS types from {PROTO}: {err}"));
}

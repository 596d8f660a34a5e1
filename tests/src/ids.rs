//! Names and identifiers that never collide between tests, test processes, or leftovers of
//! earlier (killed) runs.

use std::fmt::Write as _;
use std::fs::File;
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// What every network namespace (and anything else a test leaves on the system) is named after;
/// `cargo xtask sweep` removes leftovers by this prefix.
pub const PREFIX: &str = "weir-t-";

/// `weir-t-<run><seq>-<role>`: `run` is random per process (two test binaries running at once, or
/// a leftover of a killed run, never share it) and `seq` counts within the process.
pub fn unique_name(role: &str) -> String {
    static RUN: OnceLock<String> = OnceLock::new();
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let run = RUN.get_or_init(|| hex(&random_bytes::<3>()));
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    format!("{PREFIX}{run}{seq:x}-{role}")
}

/// A random version-4 UUID, the shape of a Kubernetes `metadata.uid`.
pub fn uuid_v4() -> String {
    let mut b = random_bytes::<16>();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    format!(
        "{}-{}-{}-{}-{}",
        hex(&b[..4]),
        hex(&b[4..6]),
        hex(&b[6..8]),
        hex(&b[8..10]),
        hex(&b[10..])
    )
}

/// A random container id: 64 hex digits, like containerd's sandbox ids.
pub fn container_id() -> String {
    hex(&random_bytes::<32>())
}

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut bytes = [0; N];
    File::open("/dev/urandom")
        .and_then(|mut urandom| urandom.read_exact(&mut bytes))
        .expect("cannot read /dev/urandom");
    bytes
}

fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut out, b| {
            let _ = write!(out, "{b:02x}");
            out
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_prefixed() {
        let (a, b) = (unique_name("node"), unique_name("node"));
        assert_ne!(a, b);
        assert!(a.starts_with(PREFIX) && a.ends_with("-node"), "{a}");
    }

    #[test]
    fn uuid_has_the_kubernetes_shape() {
        let uid = uuid_v4();
        let groups: Vec<usize> = uid.split('-').map(str::len).collect();
        assert_eq!(groups, [8, 4, 4, 4, 12], "{uid}");
        assert_eq!(&uid[14..15], "4");
        assert_eq!(container_id().len(), 64);
    }
}

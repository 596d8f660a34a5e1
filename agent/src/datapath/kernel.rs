//! The running kernel, as far as weir's choices depend on it: the floor it refuses to run below,
//! and the version a kernel-specific path is chosen by.
use std::fs;

use anyhow::{bail, Context, Result};

/// The oldest kernel weir runs on: every program and hook it uses is there (cgroup getpeername
/// 5.8, sk_lookup 5.9, socket map updates from tc 5.10).
const OLDEST: (u32, u32) = (5, 10);

pub(super) struct Kernel {
    pub release: String,
    version: (u32, u32),
}

impl Kernel {
    /// The running kernel; an error naming what weir needs when it is older than that.
    pub(super) fn running() -> Result<Self> {
        let release = fs::read_to_string("/proc/sys/kernel/osrelease")
            .context("reading the kernel release")?
            .trim()
            .to_owned();
        let version = version(&release)
            .with_context(|| format!("kernel release {release:?} has no version"))?;
        if version < OLDEST {
            bail!(
                "Linux {release}: weir needs Linux {}.{} or later",
                OLDEST.0,
                OLDEST.1
            );
        }
        Ok(Self { release, version })
    }

    pub(super) fn is_at_least(&self, major: u32, minor: u32) -> bool {
        self.version >= (major, minor)
    }
}

/// `(major, minor)` of a kernel release such as `6.1.0-50-amd64`.
fn version(release: &str) -> Option<(u32, u32)> {
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .map(str::parse::<u32>);
    Some((numbers.next()?.ok()?, numbers.next()?.ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_from_distribution_releases() {
        assert_eq!(version("6.1.0-50-amd64"), Some((6, 1)));
        assert_eq!(version("5.10.0-32-amd64"), Some((5, 10)));
        assert_eq!(version("6.12.95+deb12-amd64"), Some((6, 12)));
        assert_eq!(version("6.18.0"), Some((6, 18)));
        assert_eq!(version("weird"), None);
        assert!(version("5.4.0-42-generic").unwrap() < OLDEST);
    }
}

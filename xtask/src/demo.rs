//! `cargo xtask demo`: weir's main job on a throwaway demo node.

use anyhow::{bail, Result};

pub fn run() -> Result<()> {
    bail!("`cargo xtask demo` is not yet implemented")
}

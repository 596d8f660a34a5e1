//! `cargo xtask bench`: measurements of weir's datapath.

use anyhow::{bail, Result};

pub fn run() -> Result<()> {
    bail!("`cargo xtask bench` is not yet implemented")
}

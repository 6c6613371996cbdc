//! `cairn bench`: medians and p95 of the operations DESIGN.md sets targets for.

use anyhow::Result;
use cairn_engine::Home;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Which {
    Start,
    Exec,
    Cp,
    Throughput,
}

pub fn run(_home: Home, _which: &[Which], _runs: usize, _json: bool) -> Result<i32> {
    anyhow::bail!("the benchmark is not built yet")
}

//! What the benchmark binaries share: starting `kruntimes up` and the async runtime, and
//! reading percentiles from samples.

use std::time::Duration;

use anyhow::{Context, Result};
use kruntimes_testkit::{Options, Server};

/// Starts `kruntimes up` with `options` and a multi-threaded async runtime to drive it.
pub fn start(options: Options) -> Result<(Server, tokio::runtime::Runtime)> {
    let server = Server::start_with(options).context(
        "start kruntimes up (build it first: cargo build --release -p kruntimes -p kruntimes-runtime-server)",
    )?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    Ok((server, runtime))
}

/// Prints the report as one JSON line on stdout.
pub fn print(report: &serde_json::Value) -> Result<()> {
    println!("{}", serde_json::to_string(report)?);
    Ok(())
}

/// Sorts `samples` and returns a function giving the sample at percentile `p` (0..=100),
/// nearest rank; zero for no samples.
pub fn percentile_of(samples: &mut [Duration]) -> impl Fn(f64) -> Duration + '_ {
    samples.sort_unstable();
    move |p: f64| {
        if samples.is_empty() {
            return Duration::ZERO;
        }
        let index = ((p / 100.0) * (samples.len() - 1) as f64).round() as usize;
        samples[index.min(samples.len() - 1)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let mut samples: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        let at = percentile_of(&mut samples);
        assert_eq!(at(0.0), Duration::from_millis(1));
        assert_eq!(at(50.0), Duration::from_millis(51));
        assert_eq!(at(100.0), Duration::from_millis(100));
        let mut none: Vec<Duration> = Vec::new();
        assert_eq!(percentile_of(&mut none)(50.0), Duration::ZERO);
    }
}

//! A simple timed loop: rounds of calls, the median of the rounds' per-call times.

use std::time::Instant;

#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Per call of the measured closure, the median over the rounds.
    pub median_ns: f64,
    pub rounds: usize,
    pub per_round: usize,
}

/// Runs `f` once to warm up, then `rounds` rounds of `per_round` calls.
pub fn measure(rounds: usize, per_round: usize, f: &mut dyn FnMut()) -> Timing {
    f();
    let mut samples: Vec<f64> = (0..rounds)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..per_round {
                f();
            }
            start.elapsed().as_nanos() as f64 / per_round as f64
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    Timing {
        median_ns: samples[samples.len() / 2],
        rounds,
        per_round,
    }
}

pub fn show(ns: f64) -> String {
    if ns >= 1e9 {
        format!("{:.2} s", ns / 1e9)
    } else if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

pub fn bytes(n: usize) -> String {
    if n >= 1 << 20 {
        format!("{:.1} MiB", n as f64 / f64::from(1 << 20))
    } else if n >= 1 << 10 {
        format!("{:.1} KiB", n as f64 / 1024.0)
    } else {
        format!("{n} B")
    }
}

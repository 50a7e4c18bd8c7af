//! Percentiles of a series of durations.

use std::time::Duration;

use serde_json::{Value, json};

/// Nearest-rank percentile of sorted values.
fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The middle value (the upper one of an even count); NaN for none.
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// `{name, n, min, p50, p90, p99, max, mean}` in milliseconds.
pub fn summary(name: &str, samples: &[Duration]) -> Value {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    ms.sort_by(f64::total_cmp);
    let mean = if ms.is_empty() {
        f64::NAN
    } else {
        ms.iter().sum::<f64>() / ms.len() as f64
    };
    let r = |v: f64| (v * 1000.0).round() / 1000.0;
    json!({
        "name": name,
        "n": ms.len(),
        "min_ms": r(pct(&ms, 0.0)),
        "p50_ms": r(pct(&ms, 50.0)),
        "p90_ms": r(pct(&ms, 90.0)),
        "p99_ms": r(pct(&ms, 99.0)),
        "max_ms": r(pct(&ms, 100.0)),
        "mean_ms": r(mean),
    })
}

/// `[{n, p50, p99}]` in milliseconds, one per round: `starts` are the indexes in `samples` where
/// each round's samples begin.
pub fn per_round(samples: &[Duration], starts: &[usize]) -> Value {
    let ends = starts.iter().skip(1).copied().chain([samples.len()]);
    let rounds: Vec<Value> = starts
        .iter()
        .zip(ends)
        .map(|(&a, b)| {
            let mut ms: Vec<f64> = samples
                .get(a..b)
                .unwrap_or_default()
                .iter()
                .map(|d| d.as_secs_f64() * 1000.0)
                .collect();
            ms.sort_by(f64::total_cmp);
            let r = |v: f64| (v * 1000.0).round() / 1000.0;
            json!({ "n": ms.len(), "p50_ms": r(pct(&ms, 50.0)), "p99_ms": r(pct(&ms, 99.0)) })
        })
        .collect();
    Value::Array(rounds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(pct(&v, 50.0), 50.0);
        assert_eq!(pct(&v, 99.0), 99.0);
        assert_eq!(pct(&v, 100.0), 100.0);
        assert_eq!(pct(&v, 0.0), 1.0);
        assert_eq!(pct(&[3.0], 99.0), 3.0);
    }

    #[test]
    fn rounds_split_at_their_starts() {
        let ms = |v: &[u64]| {
            v.iter()
                .map(|&m| Duration::from_millis(m))
                .collect::<Vec<_>>()
        };
        let r = per_round(&ms(&[1, 2, 3, 10, 20]), &[0, 3]);
        assert_eq!(r[0]["n"], 3);
        assert_eq!(r[0]["p50_ms"], 2.0);
        assert_eq!(r[1]["n"], 2);
        assert_eq!(r[1]["p99_ms"], 20.0);
    }
}

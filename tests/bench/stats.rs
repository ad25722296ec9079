//! Measurement helpers: a log-linear latency histogram (about 1.6% relative precision,
//! exact min/max, mergeable across tasks and processes), medians of repeated runs, and a
//! small deterministic random number generator (no extra dependency).

use serde_json::{json, Value};
use std::time::Duration;

/// Sub-buckets per power of two (64: relative error of a bucket's midpoint <= 1/128).
const SUB_BITS: u32 = 6;
const SUB: u64 = 1 << SUB_BITS;
/// Values below `2 * SUB` ns get a bucket each.
const LINEAR: u64 = 2 * SUB;
const BUCKETS: usize = (LINEAR + (64 - SUB_BITS as u64 - 1) * SUB) as usize;

/// A latency histogram over nanoseconds.
#[derive(Clone, Debug)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    min: u64,
    max: u64,
    sum: u128,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
            total: 0,
            min: u64::MAX,
            max: 0,
            sum: 0,
        }
    }
}

fn bucket_of(v: u64) -> usize {
    if v < LINEAR {
        return v as usize;
    }
    let e = 63 - v.leading_zeros(); // >= SUB_BITS + 1
    let sub = (v >> (e - SUB_BITS)) & (SUB - 1);
    (LINEAR + (e as u64 - SUB_BITS as u64 - 1) * SUB + sub) as usize
}

/// Midpoint of a bucket, in ns.
fn value_of(i: usize) -> u64 {
    let i = i as u64;
    if i < LINEAR {
        return i;
    }
    let k = i - LINEAR;
    let e = k / SUB + SUB_BITS as u64 + 1;
    let sub = k % SUB;
    let shift = e - SUB_BITS as u64;
    let low = (SUB + sub) << shift;
    low + (1u64 << shift) / 2
}

impl Histogram {
    pub fn record(&mut self, d: Duration) {
        self.record_ns(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }

    pub fn record_ns(&mut self, ns: u64) {
        self.counts[bucket_of(ns)] += 1;
        self.total += 1;
        self.min = self.min.min(ns);
        self.max = self.max.max(ns);
        self.sum += u128::from(ns);
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
        self.sum += other.sum;
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    /// The `q` quantile (0..=1) in ns; exact at the extremes.
    pub fn quantile_ns(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        if q >= 1.0 {
            return self.max;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return value_of(i).clamp(self.min, self.max);
            }
        }
        self.max
    }

    /// The `q` quantile in microseconds.
    pub fn q_us(&self, q: f64) -> f64 {
        self.quantile_ns(q) as f64 / 1e3
    }

    pub fn max_us(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.max as f64 / 1e3
        }
    }

    pub fn mean_us(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.sum as f64 / self.total as f64 / 1e3
        }
    }

    /// Sparse form for sending between processes.
    pub fn to_json(&self) -> Value {
        let buckets: Vec<[u64; 2]> = self
            .counts
            .iter()
            .enumerate()
            .filter(|(_, &c)| c > 0)
            .map(|(i, &c)| [i as u64, c])
            .collect();
        json!({
            "buckets": buckets,
            "total": self.total,
            "min": self.min,
            "max": self.max,
            "sum": self.sum.to_string(),
        })
    }

    pub fn from_json(v: &Value) -> Option<Histogram> {
        let mut h = Histogram::default();
        for b in v.get("buckets")?.as_array()? {
            let i = usize::try_from(b.get(0)?.as_u64()?).ok()?;
            *h.counts.get_mut(i)? += b.get(1)?.as_u64()?;
        }
        h.total = v.get("total")?.as_u64()?;
        h.min = v.get("min")?.as_u64()?;
        h.max = v.get("max")?.as_u64()?;
        h.sum = v.get("sum")?.as_str()?.parse().ok()?;
        Some(h)
    }
}

/// Median of a set of values (mean of the middle two for an even count; 0 when empty).
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// SplitMix64: small, fast, deterministic for a seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi]` (inclusive).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_trip_within_precision() {
        for v in [0u64, 1, 127, 128, 129, 1000, 65_432, 1 << 40, u64::MAX / 3] {
            let mid = value_of(bucket_of(v));
            let err = (mid as f64 - v as f64).abs() / (v.max(1) as f64);
            assert!(err <= 1.0 / 64.0, "{v} -> {mid}");
        }
        assert!(bucket_of(u64::MAX) < BUCKETS);
    }

    #[test]
    fn quantiles_and_merge() {
        let mut a = Histogram::default();
        for us in 1..=100u64 {
            a.record_ns(us * 1000);
        }
        assert!((a.q_us(0.5) - 50.0).abs() < 1.0);
        assert!((a.q_us(0.99) - 99.0).abs() < 2.0);
        assert_eq!(a.max_us(), 100.0);
        let b = Histogram::from_json(&a.to_json()).unwrap();
        a.merge(&b);
        assert_eq!(a.count(), 200);
        assert!((a.q_us(0.5) - 50.0).abs() < 1.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}

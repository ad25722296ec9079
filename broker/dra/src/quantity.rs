//! Kubernetes resource quantities ("8Gi", "1500M", "2097152", "1.5Gi") as whole bytes, and
//! bytes written back as a quantity the API server keeps as is.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
#[error("{0:?} is not a quantity of bytes")]
pub struct BadQuantity(pub String);

/// The bytes `q` stands for, rounded up to a whole byte (as Kubernetes rounds a
/// fractional request).
pub fn parse_bytes(q: &str) -> Result<u64, BadQuantity> {
    let bad = || BadQuantity(q.to_string());
    let s = q.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    if num.is_empty() {
        return Err(bad());
    }
    let (mul, exp10): (u128, u32) = match suffix {
        "" => (1, 0),
        "Ki" => (1 << 10, 0),
        "Mi" => (1 << 20, 0),
        "Gi" => (1 << 30, 0),
        "Ti" => (1 << 40, 0),
        "Pi" => (1 << 50, 0),
        "Ei" => (1 << 60, 0),
        "k" => (1, 3),
        "M" => (1, 6),
        "G" => (1, 9),
        "T" => (1, 12),
        "P" => (1, 15),
        "E" => (1, 18),
        s if s.starts_with(['e', 'E']) => (1, s[1..].parse::<u32>().map_err(|_| bad())?),
        _ => return Err(bad()),
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() || frac.contains('.') {
        return Err(bad());
    }
    let digits: u128 = format!("{int}{frac}").parse().map_err(|_| bad())?;
    let scale = 10u128.checked_pow(frac.len() as u32).ok_or_else(bad)?;
    let top = digits
        .checked_mul(mul)
        .and_then(|v| v.checked_mul(10u128.checked_pow(exp10)?))
        .ok_or_else(bad)?;
    let bytes = top.div_ceil(scale);
    u64::try_from(bytes).map_err(|_| bad())
}

/// `bytes` as a quantity: binary-suffixed when exact ("8Gi", "2Mi"), else plain bytes.
pub fn format_bytes(bytes: u64) -> String {
    for (shift, suffix) in [(40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki")] {
        if bytes != 0 && bytes.is_multiple_of(1u64 << shift) {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_of_bytes_parse_and_format() {
        for (q, want) in [
            ("8Gi", 8u64 << 30),
            ("2Mi", 2 << 20),
            ("1.5Gi", 3 << 29),
            ("1500M", 1_500_000_000),
            ("2097152", 2 << 20),
            ("1e3", 1000),
            ("0.5", 1),
            ("125Gi", 125 << 30),
        ] {
            assert_eq!(parse_bytes(q), Ok(want), "{q}");
        }
        for q in ["", "Gi", "8Qi", "1.2.3", "-1", "99999999Ei"] {
            assert!(parse_bytes(q).is_err(), "{q}");
        }
        assert_eq!(format_bytes(8 << 30), "8Gi");
        assert_eq!(format_bytes(3 << 20), "3Mi");
        assert_eq!(format_bytes(1000), "1000");
        assert_eq!(format_bytes(0), "0");
        for b in [1u64, 4095, 1 << 20, 125 << 30, 12345678] {
            assert_eq!(parse_bytes(&format_bytes(b)), Ok(b));
        }
    }
}

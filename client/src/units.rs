//! Human units for operators: byte sizes in (`8GiB`, `512MiB`, `1.5GB`, `4096`) and
//! out (`8.0 GiB`, binary units always), and ages of timestamps (`3m12s`). Parsing
//! goes through `bytesize`, with overflow refused instead of silently saturated.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytesize::ByteSize;

/// Parses a byte size: plain bytes (`4096`), binary (`8GiB`, `512 MiB`, `2Ki`) or
/// decimal (`1.5GB`, `10k`) units, case-insensitive.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("empty size".into());
    }
    if let Ok(bytes) = text.parse::<u64>() {
        return Ok(bytes);
    }
    let size: ByteSize = text
        .parse()
        .map_err(|e: String| format!("invalid size {text:?}: {e}"))?;
    if size.as_u64() == u64::MAX {
        return Err(format!("size {text:?} is too large"));
    }
    Ok(size.as_u64())
}

/// Formats bytes with binary units and one decimal: `512 B`, `1.5 KiB`, `8.0 GiB`.
pub fn format_bytes(bytes: u64) -> String {
    ByteSize::b(bytes).display().iec().to_string()
}

/// Formats a duration compactly: `950ms`, `42s`, `3m12s`, `5h03m`, `2d04h`.
pub fn format_duration(d: Duration) -> String {
    let secs = d.as_secs();
    if secs == 0 {
        return format!("{}ms", d.as_millis());
    }
    let (days, hours, mins, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    if days > 0 {
        format!("{days}d{hours:02}h")
    } else if hours > 0 {
        format!("{hours}h{mins:02}m")
    } else if mins > 0 {
        format!("{mins}m{s:02}s")
    } else {
        format!("{s}s")
    }
}

/// How long ago a Unix-epoch millisecond timestamp was, relative to `now`
/// (`-` for 0 or unknown, `0ms` for timestamps in the future).
pub fn format_age_at(unix_ms: i64, now: SystemTime) -> String {
    if unix_ms <= 0 {
        return "-".into();
    }
    let then = UNIX_EPOCH + Duration::from_millis(unix_ms.unsigned_abs());
    format_duration(now.duration_since(then).unwrap_or_default())
}

/// [`format_age_at`] relative to the current time.
pub fn format_age(unix_ms: i64) -> String {
    format_age_at(unix_ms, SystemTime::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    #[test]
    fn parses_units() {
        assert_eq!(parse_bytes("8GiB"), Ok(8 * GIB));
        assert_eq!(parse_bytes("8 GiB"), Ok(8 * GIB));
        assert_eq!(parse_bytes("8gib"), Ok(8 * GIB));
        assert_eq!(parse_bytes("512MiB"), Ok(512 * MIB));
        assert_eq!(parse_bytes("2Gi"), Ok(2 * GIB));
        assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("1.5GiB"), Ok(GIB + GIB / 2));
        assert_eq!(parse_bytes("10k"), Ok(10_000));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes(" 4096 "), Ok(4096));
        assert_eq!(parse_bytes("0"), Ok(0));
        assert_eq!(parse_bytes("18446744073709551615"), Ok(u64::MAX));
    }

    #[test]
    fn refuses_garbage() {
        for bad in [
            "",
            "  ",
            "GiB",
            "-1GiB",
            "8 gibibytes",
            "1.2.3GB",
            "8XB",
            "100000000EiB",
            "16EiB",
            "16384PiB",
            "16.5EiB",
        ] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn formats_binary_units() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(1536), "1.5 KiB");
        assert_eq!(format_bytes(8 * GIB), "8.0 GiB");
        assert_eq!(format_bytes(512 * MIB), "512.0 MiB");
        assert_eq!(format_bytes(2 * MIB), "2.0 MiB");
    }

    #[test]
    fn formats_durations_and_ages() {
        assert_eq!(format_duration(Duration::from_millis(950)), "950ms");
        assert_eq!(format_duration(Duration::from_secs(42)), "42s");
        assert_eq!(format_duration(Duration::from_secs(192)), "3m12s");
        assert_eq!(
            format_duration(Duration::from_secs(5 * 3600 + 180)),
            "5h03m"
        );
        assert_eq!(
            format_duration(Duration::from_secs(2 * 86_400 + 4 * 3600)),
            "2d04h"
        );
        let now = UNIX_EPOCH + Duration::from_secs(1_000_000);
        assert_eq!(format_age_at(1_000_000_000 - 65_000, now), "1m05s");
        assert_eq!(format_age_at(0, now), "-");
        assert_eq!(format_age_at(2_000_000_000, now), "0ms");
    }
}

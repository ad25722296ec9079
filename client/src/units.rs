//! Human units for operators: byte sizes in (`8GiB`, `512MiB`, `1.5GB`, `4096`) and
//! out (`8.0 GiB`, binary units always), and ages of timestamps (`3m12s`). Parsing
//! goes through `bytesize`, with overflow refused instead of silently saturated.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytesize::ByteSize;

/// Parses a byte size written with its unit: binary (`8GiB`, `512 MiB`, `2Ki`), decimal
/// (`1.5GB`, `10k`) or bytes (`4096B`), case-insensitive. A bare number other than `0` is
/// refused with a hint: `4096` could mean bytes or anything else, and a limit mistyped by a
/// factor of a billion is worse than a refusal. Sizes past `u64::MAX` are refused too.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("empty size".into());
    }
    if text.bytes().all(|b| b.is_ascii_digit()) {
        return match text.parse::<u64>() {
            Ok(0) => Ok(0),
            _ => Err(format!(
                "size {text:?} has no unit: write {text}B for bytes, or a unit such as \
                 MiB or GiB (binary) or MB or GB (decimal)"
            )),
        };
    }
    let size: ByteSize = text
        .parse()
        .map_err(|e: String| format!("invalid size {text:?}: {e}"))?;
    // bytesize saturates what does not fit in u64.
    if size.as_u64() == u64::MAX {
        return Err(format!("size {text:?} is too large (more than 16 EiB)"));
    }
    Ok(size.as_u64())
}

/// Whether `text` (a size [`parse_bytes`] accepts) is written in decimal units (`4GB`,
/// `10k`): their bytes differ from the binary unit of the same letter, which a reader of
/// `4.0 GiB`-style output may not expect.
pub fn is_decimal(text: &str) -> bool {
    let unit: String = text
        .trim()
        .trim_start_matches(|c: char| c.is_ascii_digit() || c == '.' || c == ' ')
        .to_ascii_lowercase();
    !unit.is_empty() && unit != "b" && !unit.contains('i')
}

/// A line saying what a decimal size is in bytes and in binary units (`4GB` is
/// 4000000000 bytes, 3.7 GiB); `None` for a binary or byte size.
pub fn decimal_note(text: &str) -> Option<String> {
    if !is_decimal(text) {
        return None;
    }
    let bytes = parse_bytes(text).ok()?;
    Some(format!(
        "{} is a decimal size: {bytes} bytes ({}); binary units are written KiB, MiB, GiB",
        text.trim(),
        format_bytes(bytes)
    ))
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
        assert_eq!(parse_bytes("4096B"), Ok(4096));
        assert_eq!(parse_bytes(" 4096 B "), Ok(4096));
        assert_eq!(parse_bytes("0"), Ok(0));
    }

    #[test]
    fn a_bare_number_is_refused_with_a_hint() {
        for bare in [
            "4096",
            " 10 ",
            "18446744073709551615",
            "99999999999999999999999",
        ] {
            let e = parse_bytes(bare).unwrap_err();
            assert!(
                e.contains("has no unit") && e.contains("GiB"),
                "{bare:?}: {e}"
            );
        }
    }

    #[test]
    fn sizes_past_u64_are_refused_not_saturated() {
        for big in ["16EiB", "17EiB", "20EB", "100000000EiB"] {
            let e = parse_bytes(big).unwrap_err();
            assert!(
                e.contains("too large") || e.contains("invalid"),
                "{big:?}: {e}"
            );
        }
        assert_eq!(parse_bytes("15EiB"), Ok(15 << 60));
    }

    #[test]
    fn decimal_sizes_are_told_apart_and_explained() {
        assert!(is_decimal("4GB") && is_decimal("10k") && is_decimal("1.5 gb"));
        assert!(!is_decimal("4GiB") && !is_decimal("2Ki") && !is_decimal("4096B"));
        let note = decimal_note("4GB").unwrap();
        assert!(
            note.contains("4000000000 bytes") && note.contains("3.7 GiB"),
            "{note}"
        );
        assert_eq!(decimal_note("4GiB"), None);
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

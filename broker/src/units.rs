//! Units: byte sizes (rounding to a granularity, human units in messages), durations as
//! flags write them, and wall-clock times as milliseconds since the Unix epoch (what the
//! API carries).

pub use gpu_broker_core::units::{human, round_up, show};

/// Parses `8GiB`, `512MiB`, `1.5GB`, `1048576B` (a bare number other than 0 is refused:
/// the client crate's [`parse_bytes`](gpu_broker_client::units::parse_bytes), one parser
/// for every size an operator writes).
pub fn parse(s: &str) -> Result<u64, String> {
    gpu_broker_client::units::parse_bytes(s)
}

/// Parses a duration (`5s`, `100ms`, `5m`), as flags and config files write them.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("invalid duration {s:?}: {e}"))
}

/// Milliseconds since the Unix epoch (0 for times before it).
pub fn unix_ms(t: std::time::SystemTime) -> i64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_up_to_granularity() {
        let g = 2 << 20;
        assert_eq!(round_up(1, g), Some(g));
        assert_eq!(round_up(g, g), Some(g));
        assert_eq!(round_up(g + 1, g), Some(2 * g));
        assert_eq!(round_up(u64::MAX, g), None);
    }

    #[test]
    fn parses_human_units() {
        assert_eq!(parse("8GiB").unwrap(), 8 << 30);
        assert_eq!(parse("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse("1048576B").unwrap(), 1 << 20);
        assert!(parse("lots").is_err());
        assert!(parse("1048576").is_err(), "a bare number has no unit");
        assert!(
            parse("16EiB").is_err(),
            "past u64 is refused, not saturated"
        );
    }

    #[test]
    fn refuses_sizes_past_u64_instead_of_saturating() {
        for big in [
            "16EiB",
            "16 EiB",
            "17EiB",
            "16384PiB",
            "99999999999EiB",
            "16.5EiB",
        ] {
            let e = parse(big).unwrap_err();
            assert!(e.contains("too large"), "{big}: {e}");
        }
        // The largest sizes written with a unit still are.
        assert_eq!(parse("15EiB"), Ok(15 << 60));
        assert_eq!(parse("16383PiB"), Ok(16383 << 50));
    }

    #[test]
    fn unix_ms_counts_from_the_epoch() {
        use std::time::{Duration, UNIX_EPOCH};
        assert_eq!(unix_ms(UNIX_EPOCH + Duration::from_millis(1234)), 1234);
        assert_eq!(unix_ms(UNIX_EPOCH - Duration::from_secs(1)), 0);
    }

    #[test]
    fn shows_exact_bytes() {
        assert!(show(8 << 30).contains("8589934592"));
    }
}

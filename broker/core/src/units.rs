//! Byte sizes: rounding to a granularity, and human units in messages.

/// Rounds `bytes` up to a multiple of `granularity` (a power of two); `None` on overflow.
pub fn round_up(bytes: u64, granularity: u64) -> Option<u64> {
    debug_assert!(granularity.is_power_of_two());
    bytes
        .checked_add(granularity - 1)
        .map(|b| b & !(granularity - 1))
}

/// `8589934592` -> `"8.0 GiB"`: sizes as operators read them, binary units, as the CLI
/// prints them (both are `bytesize`'s IEC display).
pub fn human(bytes: u64) -> String {
    bytesize::ByteSize::b(bytes).display().iec().to_string()
}

/// `8589934592` -> `"8.0 GiB (8589934592 bytes)"`: exact and readable in error messages.
pub fn show(bytes: u64) -> String {
    format!("{} ({bytes} bytes)", human(bytes))
}

//! Input bounds: the longest string the broker accepts in each kind of request field, and
//! the check that refuses a longer one with `INVALID_ARGUMENT` naming the field and the
//! limit — never echoing the input. Error messages are also capped where they become a
//! gRPC status (`error::status_message`), so no input can make `grpc-message` exceed what
//! a client's header limit accepts.

use crate::error::BrokerError;

/// Ids (lease, session, turn ids are 36-character UUIDs).
pub const MAX_ID_BYTES: usize = 64;
/// Tenant names (the ledger also restricts their characters).
pub const MAX_TENANT_BYTES: usize = 64;
/// Labels, session names, token descriptions.
pub const MAX_TEXT_BYTES: usize = 256;
/// Revoke reasons (stored, logged and sent to the holder).
pub const MAX_REASON_BYTES: usize = 256;
/// A token or token id given to `RevokeToken` (tokens are 68 bytes).
pub const MAX_TOKEN_BYTES: usize = 128;

/// Refuses `value` when it is longer than `max` bytes.
pub fn check(field: &str, value: &str, max: usize) -> Result<(), BrokerError> {
    if value.len() > max {
        Err(BrokerError::InvalidArgument(format!(
            "{field} is {} bytes, over the limit of {max} bytes",
            value.len()
        )))
    } else {
        Ok(())
    }
}

/// A tenant-name field (empty allowed: the caller decides what empty means).
pub fn tenant(field: &str, value: &str) -> Result<(), BrokerError> {
    check(field, value, MAX_TENANT_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_inputs_are_named_not_echoed() {
        let big = "x".repeat(1 << 20);
        let e = check("label", &big, MAX_TEXT_BYTES).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("label") && m.contains("256") && m.len() < 100,
            "{m}"
        );
        assert!(check("label", "short", MAX_TEXT_BYTES).is_ok());
    }
}

//! Which local CUDA device a broker device is. The broker numbers its devices itself (its
//! `--devices`, in its own `CUDA_VISIBLE_DEVICES`); a worker's CUDA ordinals follow the
//! worker's `CUDA_VISIBLE_DEVICES` — under `gpu-brokerctl run` just the granted device, by
//! UUID, so it is ordinal 0 whatever its broker index. The UUID (`GPU-…`, as NVML and
//! `nvidia-smi` print it; every lease carries its device's) is what both sides agree on:
//! [`ordinal_for`] maps a broker device to the local ordinal with its UUID, [`index_for`]
//! a local ordinal to the broker device with its UUID. Either falls back to the number it
//! was given when no UUID matches (or none is known), which is right when both sides see
//! the same devices in the same order. Pure functions: the CUDA side (`cuDeviceGetUuid`)
//! is in [`crate::cuda`].

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` of a 16-byte device UUID, as NVML prints it.
pub fn format_uuid(bytes: &[u8; 16]) -> String {
    let h: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

fn same(a: &str, b: &str) -> bool {
    !a.is_empty() && a.eq_ignore_ascii_case(b)
}

/// The local CUDA ordinal of the broker device `index` whose UUID is `uuid`, given the
/// UUIDs of the local ordinals in order (`None`: unknown); `index` when none matches.
pub fn ordinal_for(local: &[Option<String>], uuid: &str, index: u32) -> u32 {
    local
        .iter()
        .position(|l| l.as_deref().is_some_and(|l| same(l, uuid)))
        .map(|i| i as u32)
        .unwrap_or(index)
}

/// The broker device index of the local CUDA ordinal `ordinal` whose UUID is
/// `local_uuid`, given the broker's device UUIDs in index order; `ordinal` when none
/// matches.
pub fn index_for(broker: &[String], local_uuid: Option<&str>, ordinal: u32) -> u32 {
    local_uuid
        .and_then(|u| broker.iter().position(|b| same(b, u)))
        .map(|i| i as u32)
        .unwrap_or(ordinal)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "GPU-0a1b2c3d-0000-1111-2222-333344445555";
    const B: &str = "GPU-99999999-8888-7777-6666-555544443333";

    #[test]
    fn a_uuid_prints_as_nvml_does() {
        let bytes = [
            0x0a, 0x1b, 0x2c, 0x3d, 0x00, 0x00, 0x11, 0x11, 0x22, 0x22, 0x33, 0x33, 0x44, 0x44,
            0x55, 0x55,
        ];
        assert_eq!(format_uuid(&bytes), A);
    }

    #[test]
    fn a_run_child_sees_its_granted_device_as_ordinal_0() {
        // The broker owns A (index 0) and B (index 1); `run` granted B and narrowed
        // CUDA_VISIBLE_DEVICES to it, so the child's only ordinal is B.
        let local = vec![Some(B.to_string())];
        assert_eq!(ordinal_for(&local, B, 1), 0);
        let broker = vec![A.to_string(), B.to_string()];
        assert_eq!(index_for(&broker, Some(B), 0), 1);
        // Case does not matter.
        assert_eq!(ordinal_for(&local, &B.to_uppercase(), 1), 0);
    }

    #[test]
    fn reordered_devices_map_by_uuid() {
        let local = vec![Some(B.to_string()), Some(A.to_string())];
        assert_eq!(ordinal_for(&local, A, 0), 1);
        assert_eq!(ordinal_for(&local, B, 1), 0);
        let broker = vec![A.to_string(), B.to_string()];
        assert_eq!(index_for(&broker, Some(A), 1), 0);
        assert_eq!(index_for(&broker, Some(B), 0), 1);
    }

    #[test]
    fn without_a_matching_uuid_the_number_is_kept() {
        // No UUID known (an old broker, a host device, no CUDA here): index == ordinal.
        assert_eq!(ordinal_for(&[], A, 3), 3);
        assert_eq!(ordinal_for(&[None, None], A, 1), 1);
        assert_eq!(
            ordinal_for(&[Some(B.into())], "", 2),
            2,
            "an empty UUID matches nothing"
        );
        assert_eq!(ordinal_for(&[Some(String::new())], "", 0), 0);
        assert_eq!(index_for(&[], Some(A), 2), 2);
        assert_eq!(index_for(&[A.into()], None, 5), 5);
        assert_eq!(index_for(&[B.into()], Some(A), 0), 0);
        assert_eq!(index_for(&[String::new()], Some(""), 4), 4);
    }
}

//! The compute mode of each device, read through NVML (never changed: that is the
//! operator's). `Default` lets a program that drops the MPS variables run beside MPS,
//! outside its limits; `ExclusiveProcess` admits one context per device, which under MPS
//! is the MPS server's, so every CUDA process on the device must be an MPS client (the
//! broker too: see `docs/mps.md`).

/// The names the broker reports.
pub const DEFAULT: &str = "Default";
pub const EXCLUSIVE_PROCESS: &str = "ExclusiveProcess";
pub const PROHIBITED: &str = "Prohibited";
pub const UNKNOWN: &str = "unknown";

/// The compute mode of each CUDA device index in `indices` ("unknown" where NVML cannot
/// tell, e.g. without a driver).
pub fn read(indices: &[u32]) -> Vec<String> {
    use nvml_wrapper::enum_wrappers::device::ComputeMode;
    let Ok(nvml) = nvml_wrapper::Nvml::init() else {
        return vec![UNKNOWN.to_string(); indices.len()];
    };
    indices
        .iter()
        .map(|&i| {
            match nvml.device_by_index(i).and_then(|d| d.compute_mode()) {
                Ok(ComputeMode::Default) => DEFAULT,
                Ok(ComputeMode::ExclusiveProcess) => EXCLUSIVE_PROCESS,
                Ok(ComputeMode::Prohibited) => PROHIBITED,
                Ok(ComputeMode::ExclusiveThread) => "ExclusiveThread",
                Err(_) => UNKNOWN,
            }
            .to_string()
        })
        .collect()
}

/// Whether the broker's own CUDA context must go through MPS: in `ExclusiveProcess` mode
/// the MPS server is the one context a device admits, so a broker outside MPS could not
/// open the device while the server runs (nor the server start while the broker holds it).
pub fn broker_must_join(modes: &[String]) -> bool {
    modes.iter().any(|m| m == EXCLUSIVE_PROCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_exclusive_process_makes_the_broker_a_client() {
        assert!(!broker_must_join(&[DEFAULT.into(), UNKNOWN.into()]));
        assert!(broker_must_join(&[
            DEFAULT.into(),
            EXCLUSIVE_PROCESS.into()
        ]));
        assert!(!broker_must_join(&[]));
    }
}

//! The MPS daemon's state in the admin service's device list (`GetDevices`): every
//! device the daemon serves shows its state, one-line detail, client count and the
//! device's compute mode.

use crate::mps::MpsStatus;
use gpu_broker_proto::v1 as pb;

/// Writes `status` into each of `devices`.
pub fn fill(status: &MpsStatus, devices: &mut [pb::DeviceInfo]) {
    let detail = crate::error::status_message(status.summary());
    for d in devices {
        d.mps_state = status.state.as_str().to_string();
        d.mps_detail = detail.clone();
        d.mps_clients = status.clients.len() as u32;
        d.compute_mode = status
            .compute_modes
            .get(d.index as usize)
            .cloned()
            .unwrap_or_default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mps::MpsState;

    #[test]
    fn every_device_shows_the_daemon_and_its_own_compute_mode() {
        let mut s = MpsStatus::new(vec!["Default".into(), "ExclusiveProcess".into()]);
        s.state = MpsState::Running;
        s.daemon_pid = Some(9);
        s.servers = vec![10];
        s.clients = vec![11, 12];
        let mut devices = vec![
            pb::DeviceInfo {
                index: 0,
                ..Default::default()
            },
            pb::DeviceInfo {
                index: 1,
                ..Default::default()
            },
        ];
        fill(&s, &mut devices);
        assert_eq!(devices[0].mps_state, "running");
        assert_eq!(devices[1].mps_clients, 2);
        assert_eq!(devices[0].compute_mode, "Default");
        assert_eq!(devices[1].compute_mode, "ExclusiveProcess");
        assert!(
            devices[0].mps_detail.contains("pid 9"),
            "{}",
            devices[0].mps_detail
        );
        s.state = MpsState::Down;
        s.last_error = "stopped answering".into();
        fill(&s, &mut devices);
        assert_eq!(devices[1].mps_state, "down");
        assert_eq!(devices[1].mps_detail, "down: stopped answering");
    }
}

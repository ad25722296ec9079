//! The process collector: the standard `process_*` series every Prometheus client library
//! exports (open and maximum descriptors, resident and virtual memory, CPU seconds, start
//! time), read from `/proc/self` at each scrape. Descriptors matter most here: each lease,
//! connection and watcher holds one.

use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

/// Registers the process's series (without the broker's prefix) in `reg`; a reading that
/// fails leaves its series out rather than reporting a wrong number.
pub fn register(reg: &mut Registry) {
    let Ok(me) = procfs::process::Process::myself() else {
        return;
    };
    if let Ok(n) = me.fd_count() {
        reg.register(
            "process_open_fds",
            "Number of open file descriptors",
            ConstGauge::new(n as i64),
        );
    }
    if let Ok(limits) = me.limits() {
        if let procfs::process::LimitValue::Value(max) = limits.max_open_files.soft_limit {
            reg.register(
                "process_max_fds",
                "Maximum number of open file descriptors",
                ConstGauge::new(max as i64),
            );
        }
    }
    let Ok(stat) = me.stat() else { return };
    let page = procfs::page_size();
    reg.register_with_unit(
        "process_resident_memory",
        "Resident memory size",
        Unit::Bytes,
        ConstGauge::new((stat.rss * page) as i64),
    );
    reg.register_with_unit(
        "process_virtual_memory",
        "Virtual memory size",
        Unit::Bytes,
        ConstGauge::new(stat.vsize as i64),
    );
    let ticks = procfs::ticks_per_second() as f64;
    reg.register_with_unit(
        "process_cpu",
        "Total user and system CPU time spent",
        Unit::Seconds,
        ConstCounter::new((stat.utime + stat.stime) as f64 / ticks),
    );
    if let Ok(boot) = procfs::boot_time_secs() {
        reg.register_with_unit(
            "process_start_time",
            "Start time of the process since the Unix epoch",
            Unit::Seconds,
            ConstGauge::new(boot as f64 + stat.starttime as f64 / ticks),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_process_series_count_this_processs_descriptors() {
        let mut reg = Registry::default();
        let before = std::fs::read_dir("/proc/self/fd").unwrap().count();
        let held: Vec<std::fs::File> = (0..20)
            .map(|_| std::fs::File::open("/proc/self/stat").unwrap())
            .collect();
        register(&mut reg);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        let open: i64 = text
            .lines()
            .find_map(|l| l.strip_prefix("process_open_fds "))
            .unwrap_or_else(|| panic!("no process_open_fds in\n{text}"))
            .parse()
            .unwrap();
        // Other test threads open and close files meanwhile: at least what this one holds.
        assert!(
            open as usize >= before + held.len() - 5,
            "{open} vs {before}+20"
        );
        for name in [
            "process_max_fds ",
            "process_resident_memory_bytes ",
            "process_virtual_memory_bytes ",
            "process_cpu_seconds_total ",
            "process_start_time_seconds ",
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(name)),
                "{name} in\n{text}"
            );
        }
    }
}

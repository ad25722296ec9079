//! A big request among small ones (`oversub --big-waiter`, and phase 4 of `abuse`): on
//! its own 1 GiB broker, a tenant holding nothing asks (waiting up to `wait`) for 768 MiB
//! while another holds 512 MiB for `hold`; twelve tenants of the same priority loop 64 MiB
//! requests with no wait (each held 20 ms). Reported per broker variant: the small grants
//! and refusals while the big request waits, the device's utilization while it waits
//! (mean of samples every 20 ms), and the big request's time to grant after the held
//! memory came back and in all. The variants run one after the other in one run: brokers
//! with several `--overtake-age` values and, with `--before-broker-bin`, another build.

use anyhow::Result;
use gpu_broker_client::{Client, QuotaSpec};
use serde_json::json;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::report::{bytes, count, json_line, us, Table};
use crate::stats::median;
use crate::Common;

const MIB: u64 = 1 << 20;
/// Tenants looping small requests: together they ask for more than the memory not held
/// (12 x 64 MiB against 512 MiB), so they keep it all in use, and after the release they
/// could keep the big request from ever fitting if nothing stopped them.
const SMALL_TENANTS: u32 = 12;

/// One broker to run the scenario against.
pub struct Variant {
    pub name: String,
    /// Its binary (None: the bench's usual one).
    pub bin: Option<std::path::PathBuf>,
    pub extra: Vec<String>,
}

/// What one variant gave.
struct Outcome {
    small_ok: u64,
    small_refused: u64,
    utilization: f64,
    granted: Result<u64, String>,
    after_release: Duration,
    in_all: Duration,
}

async fn scenario(common: &Common, v: &Variant, hold: Duration, wait: Duration) -> Result<Outcome> {
    let c = common.with_broker_bin(v.bin.clone());
    let mut target = c.target_with("1GiB", None, v.extra.clone())?;
    let admin = target.admin().await?;
    let (_, h) = target
        .tenant("fair-holder", QuotaSpec::new(1 << 30))
        .await?;
    let (_, b) = target.tenant("fair-big", QuotaSpec::new(1 << 30)).await?;
    let holder = Client::connect(&target.uri, h).await?;
    let hs = holder.session("h").await?;
    let held = hs.lease(512 * MIB).await?;
    let big = Client::connect(&target.uri, b).await?;
    let bs = big.session("big").await?;
    let waiting = Arc::new(AtomicBool::new(true));
    let t0 = Instant::now();
    let big_task = {
        let waiting = waiting.clone();
        tokio::spawn(async move {
            let r = bs.lease_request(768 * MIB).wait(wait).send().await;
            waiting.store(false, Ordering::Relaxed);
            (
                r.map(|l| l.bytes()).map_err(|e| e.to_string()),
                Instant::now(),
            )
        })
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut smalls = Vec::new();
    for i in 0..SMALL_TENANTS {
        let (_, t) = target
            .tenant(&format!("fair-small{i}"), QuotaSpec::new(1 << 30))
            .await?;
        let c = Client::connect(&target.uri, t).await?;
        let s = c.session("s").await?;
        let (stop, waiting, ok, refused) =
            (stop.clone(), waiting.clone(), ok.clone(), refused.clone());
        smalls.push(tokio::spawn(async move {
            let _c = c;
            while !stop.load(Ordering::Relaxed) {
                let r = s.lease(64 * MIB).await;
                // Counted only while the big request waits.
                let during = waiting.load(Ordering::Relaxed);
                match r {
                    Ok(l) => {
                        if during {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        let _ = l.release().await;
                    }
                    Err(_) => {
                        if during {
                            refused.fetch_add(1, Ordering::Relaxed);
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
        }));
    }
    // Utilization while the big request waits, sampled every 20 ms; the held memory comes
    // back after `hold`.
    let mut util = Vec::new();
    let mut held = Some(held);
    let mut released = None;
    while waiting.load(Ordering::Relaxed) {
        if let Some(d) = admin.get_devices().await?.first() {
            util.push(d.leased_bytes as f64 / d.leasable_bytes.max(1) as f64);
        }
        if released.is_none() && t0.elapsed() >= hold {
            released = Some(Instant::now());
            if let Some(l) = held.take() {
                l.release().await?;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (granted, at) = big_task.await?;
    stop.store(true, Ordering::Relaxed);
    for s in smalls {
        let _ = s.await;
    }
    if let Some(l) = held.take() {
        l.release().await?;
    }
    let released = released.unwrap_or(at);
    Ok(Outcome {
        small_ok: ok.load(Ordering::Relaxed),
        small_refused: refused.load(Ordering::Relaxed),
        utilization: util.iter().sum::<f64>() / util.len().max(1) as f64,
        granted,
        after_release: at.saturating_duration_since(released),
        in_all: at.duration_since(t0),
    })
}

/// Runs the scenario against every variant, one after the other, `rounds` times
/// (interleaved: every variant once per round), and prints one table of medians over the
/// rounds (grants and refusals: per round, median).
pub async fn run(
    common: &Common,
    variants: &[Variant],
    hold: Duration,
    wait: Duration,
    rounds: u32,
) -> Result<()> {
    let rounds = rounds.max(1);
    let mut outcomes: Vec<Vec<Outcome>> = variants.iter().map(|_| Vec::new()).collect();
    for _ in 0..rounds {
        for (i, v) in variants.iter().enumerate() {
            outcomes[i].push(scenario(common, v, hold, wait).await?);
        }
    }
    let mut t = Table::new(
        format!(
            "a 768 MiB request waits (up to {:.0} s) while 512 MiB of 1 GiB are held for {:.1} s; {SMALL_TENANTS} tenants of its priority loop 64 MiB requests (no wait, held 20 ms); medians of {rounds} round(s)",
            wait.as_secs_f64(),
            hold.as_secs_f64()
        ),
        &[
            "broker",
            "small grants",
            "small refused",
            "utilization while it waits",
            "big request granted",
            "granted after the release",
            "waited in all",
        ],
    );
    for (v, os) in variants.iter().zip(&outcomes) {
        let med = |f: &dyn Fn(&Outcome) -> f64| median(&os.iter().map(f).collect::<Vec<_>>());
        let granted = os.iter().filter(|o| o.granted.is_ok()).count();
        let after: Vec<f64> = os
            .iter()
            .filter(|o| o.granted.is_ok())
            .map(|o| o.after_release.as_secs_f64() * 1e6)
            .collect();
        t.row(vec![
            v.name.clone(),
            count(med(&|o| o.small_ok as f64) as u64),
            count(med(&|o| o.small_refused as f64) as u64),
            format!("{:.0}%", med(&|o| o.utilization) * 100.0),
            match os.iter().find_map(|o| o.granted.as_ref().ok()) {
                Some(b) if granted == os.len() => format!("{} ({granted}/{})", bytes(*b), os.len()),
                _ => format!("{granted}/{}", os.len()),
            },
            if after.is_empty() {
                "-".into()
            } else {
                us(median(&after))
            },
            us(med(&|o| o.in_all.as_secs_f64() * 1e6)),
        ]);
        for o in os {
            json_line(
                common.json,
                &json!({"mode": "big_waiter", "broker": v.name, "small_ok": o.small_ok,
                        "small_refused": o.small_refused, "utilization": o.utilization,
                        "big_granted": o.granted.is_ok(),
                        "big_after_release_us": o.after_release.as_secs_f64() * 1e6,
                        "big_in_all_us": o.in_all.as_secs_f64() * 1e6}),
            );
        }
    }
    t.print();
    Ok(())
}

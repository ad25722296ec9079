//! `turn-gate`: compute turns for a program in any language, one line at a time. It opens
//! a session for its tenant and reads commands on stdin: `a` asks for the turn on the
//! device (waiting up to `--wait`) and answers `g` once granted (or `e <why>`); `r` gives
//! the turn back and answers `r <held_us>`. End of input ends the session (and any turn).
//! `examples/turn_step_worker.py` uses it to take one turn per step of a PyTorch model.
//!
//! ```text
//! GPU_BROKER_TOKEN=gpb_... turn-gate --device 0
//! ```

use anyhow::{Context, Result};
use clap::Parser;
use gpu_broker_client::Client;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

#[derive(Parser)]
#[command(about = "Take and give back gpu-broker compute turns on stdin commands (a / r)")]
struct Args {
    /// Device to take turns on.
    #[arg(long, default_value_t = 0)]
    device: u32,
    /// Longest wait for one turn.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    wait: Duration,
    /// Session name shown to operators.
    #[arg(long, default_value = "turn-gate")]
    name: String,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let args = Args::parse();
    let addr = std::env::var("GPU_BROKER_ADDR")
        .unwrap_or_else(|_| "unix:///run/gpu-broker/broker.sock".into());
    let token = match std::env::var("GPU_BROKER_TOKEN") {
        Ok(t) => t,
        Err(_) => {
            let f = std::env::var("GPU_BROKER_TOKEN_FILE")
                .context("set GPU_BROKER_TOKEN or GPU_BROKER_TOKEN_FILE")?;
            std::fs::read_to_string(&f).with_context(|| format!("reading {f}"))?
        }
    };
    let client = Client::connect(&addr, token.trim()).await?;
    let session = client.session(args.name.clone()).await?;
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut out = tokio::io::stdout();
    let mut held = None;
    while let Some(line) = lines.next_line().await? {
        let reply = match line.trim() {
            "a" if held.is_none() => match session.turn(args.device).wait(args.wait).await {
                Ok(t) => {
                    held = Some(t);
                    "g\n".to_string()
                }
                Err(e) => format!("e {e}\n"),
            },
            "r" => match held.take() {
                Some(t) => match t.release().await {
                    Ok(end) => format!("r {}\n", end.held.as_micros()),
                    Err(e) => format!("e {e}\n"),
                },
                None => "e no turn held\n".to_string(),
            },
            other => format!("e unknown command {other:?} (a: acquire, r: release)\n"),
        };
        out.write_all(reply.as_bytes()).await?;
        out.flush().await?;
    }
    Ok(())
}

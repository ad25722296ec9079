//! `gpu-brokerctl top`: the status screen, refreshed live in the terminal (ratatui over
//! crossterm, alternate screen). Device bars are coloured by state; `q`, Esc or Ctrl-C
//! quits. [`draw`] paints one snapshot on any ratatui backend (the tests use
//! `TestBackend`); [`run`] is the loop.

use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use ratatui::backend::Backend;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Paragraph};
use ratatui::Terminal;

use gpu_broker_client::AdminClient;

use super::status::{render_fit, Snapshot};

/// The colour of a status line's bar cells.
fn cell_style(c: char) -> Style {
    match c {
        '#' => Style::default().fg(Color::Green),
        'r' => Style::default().fg(Color::Magenta),
        'c' => Style::default().fg(Color::Cyan),
        'q' => Style::default().fg(Color::Yellow),
        'x' => Style::default().fg(Color::Red),
        'h' => Style::default().fg(Color::DarkGray),
        _ => Style::default(),
    }
}

/// A status line, with the cells of a `[...]` usage bar coloured.
fn styled(line: &str) -> Line<'static> {
    let (Some(open), Some(close)) = (line.find('['), line.find(']')) else {
        return Line::from(line.to_string());
    };
    if close < open {
        return Line::from(line.to_string());
    }
    let mut spans = vec![Span::raw(line[..=open].to_string())];
    for c in line[open + 1..close].chars() {
        spans.push(Span::styled(c.to_string(), cell_style(c)));
    }
    spans.push(Span::raw(line[close..].to_string()));
    Line::from(spans)
}

/// Paints one snapshot (or the last error) on `terminal`.
pub fn draw<B: Backend>(
    terminal: &mut Terminal<B>,
    snapshot: Result<&Snapshot, &str>,
    interval: Duration,
    now: SystemTime,
) -> Result<()>
where
    B::Error: Send + Sync + 'static,
{
    // Inside the border: the status fits the terminal's width; a short terminal cuts the
    // last sections (the lease lists) first.
    let width = usize::from(terminal.size()?.width.saturating_sub(2));
    let lines: Vec<Line> = match snapshot {
        Ok(s) => render_fit(s, now, width).lines().map(styled).collect(),
        Err(e) => vec![Line::styled(
            format!("cannot read the broker: {e}"),
            Style::default().fg(Color::Red),
        )],
    };
    let title = format!(
        " gpu-brokerctl top: every {} s, q to quit ",
        interval.as_secs_f64()
    );
    terminal.draw(|f| {
        let block = Block::default().borders(Borders::ALL).title(Span::styled(
            title,
            Style::default().add_modifier(Modifier::BOLD),
        ));
        f.render_widget(Paragraph::new(lines).block(block), f.area());
    })?;
    Ok(())
}

/// Runs until the operator quits: read, draw, wait `interval` for a key.
pub async fn run(admin: &AdminClient, broker: &str, interval: Duration) -> Result<()> {
    let mut terminal = ratatui::try_init().context("cannot use this terminal")?;
    let result = run_loop(&mut terminal, admin, broker, interval).await;
    ratatui::restore();
    result
}

async fn run_loop(
    terminal: &mut ratatui::DefaultTerminal,
    admin: &AdminClient,
    broker: &str,
    interval: Duration,
) -> Result<()> {
    loop {
        let snap = Snapshot::fetch(admin, broker).await;
        let err = snap.as_ref().err().map(|e| format!("{e:#}"));
        let shown = match (&snap, &err) {
            (Ok(s), _) => Ok(s),
            (Err(_), Some(e)) => Err(e.as_str()),
            (Err(_), None) => Err("unknown error"),
        };
        draw(terminal, shown, interval, SystemTime::now())?;
        let deadline = std::time::Instant::now() + interval;
        while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
            // Blocking is fine: nothing else runs on the CLI's single thread meanwhile.
            let key = if event::poll(left)? {
                Some(event::read()?)
            } else {
                None
            };
            match key {
                Some(Event::Key(k)) if k.kind == KeyEventKind::Press => {
                    let ctrl_c =
                        k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                    if matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c {
                        return Ok(());
                    }
                }
                Some(Event::Resize(..)) => break,
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::status::tests::{now, snapshot};
    use super::*;
    use ratatui::backend::TestBackend;

    fn screen(t: &Terminal<TestBackend>) -> String {
        let buf = t.backend().buffer();
        let mut out = String::new();
        for y in 0..buf.area.height {
            for x in 0..buf.area.width {
                out.push_str(buf[(x, y)].symbol());
            }
            out.push('\n');
        }
        out
    }

    #[test]
    fn top_draws_the_status_with_coloured_bars() {
        let mut t = Terminal::new(TestBackend::new(100, 40)).unwrap();
        let s = snapshot();
        draw(&mut t, Ok(&s), Duration::from_secs(2), now()).unwrap();
        let text = screen(&t);
        assert!(text.contains("gpu-brokerctl top: every 2 s"), "{text}");
        assert!(text.contains("GPU 0  NVIDIA H200"), "{text}");
        assert!(text.contains("training"), "{text}");
        // The first leased cell of the bar is green.
        let buf = t.backend().buffer();
        let (x, y) = (0..buf.area.height)
            .flat_map(|y| (0..buf.area.width).map(move |x| (x, y)))
            .find(|&(x, y)| buf[(x, y)].symbol() == "#")
            .expect("a bar cell");
        assert_eq!(buf[(x, y)].fg, Color::Green);

        // Process reservations: their bar cells, line and table show too.
        let mut s = snapshot();
        s.devices[0].process_reserved_bytes = 7 << 30;
        s.tenants[1].usage.process_reserved_bytes = 7 << 30;
        s.tenants[1].usage.process_reservations = 1;
        s.sessions = vec![gpu_broker_client::SessionInfo {
            tenant: "inference".into(),
            name: "run:serve".into(),
            peer_pid: 4242,
            process_reserved_bytes: 7 << 30,
            ..Default::default()
        }];
        draw(&mut t, Ok(&s), Duration::from_secs(2), now()).unwrap();
        let text = screen(&t);
        assert!(text.contains("r reserved for processes 7.0 GiB"), "{text}");
        assert!(text.contains("PROCESS RESERVATIONS"), "{text}");
        let buf = t.backend().buffer();
        let bar_row = (0..buf.area.height)
            .find(|&y| (0..buf.area.width).any(|x| buf[(x, y)].symbol() == "#"))
            .expect("the bar's row");
        let r = (0..buf.area.width)
            .find(|&x| buf[(x, bar_row)].symbol() == "r")
            .expect("a reserved cell in the bar");
        assert_eq!(buf[(r, bar_row)].fg, Color::Magenta);

        draw(
            &mut t,
            Err("connection refused"),
            Duration::from_secs(2),
            now(),
        )
        .unwrap();
        assert!(screen(&t).contains("cannot read the broker: connection refused"));
    }

    /// On an 80x24 terminal every size column of the tenants and the waiting requests
    /// still show, nothing runs past the border, and every device state is named.
    #[test]
    fn top_fits_an_80_by_24_terminal() {
        let mut t = Terminal::new(TestBackend::new(80, 24)).unwrap();
        let mut s = snapshot();
        s.devices[0].draining = true;
        s.devices[0].unhealthy = true;
        s.devices[0].health_reason = "Xid 79".into();
        s.tenants[0].usage.waiting_requests = 2;
        draw(&mut t, Ok(&s), Duration::from_secs(2), now()).unwrap();
        let text = screen(&t);
        for want in [
            "UNHEALTHY (Xid 79), DRAINING",
            "HELD",
            "LIMIT",
            "GUARANTEED",
            "QUARANTINED",
            "WAITING REQUESTS",
            "training: 2 waiting",
        ] {
            assert!(text.contains(want), "{want:?} on the 80x24 screen:\n{text}");
        }
        // What the frame shows is all there is: no rendered line is wider than its inside.
        let inside = render_fit(&s, now(), 78);
        for line in inside.lines() {
            assert!(line.chars().count() <= 78, "{line:?} is cut by the frame");
        }
    }
}

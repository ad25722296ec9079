//! Output: aligned tables on stdout, and with `--json` one JSON object per line as well
//! (every such line starts with `{`, so `grep '^{'` extracts them). Progress goes to stderr.

use serde_json::Value;

/// A table of results: a title, column headers, rows of cells.
pub struct Table {
    title: String,
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(title: impl Into<String>, headers: &[&str]) -> Table {
        Table {
            title: title.into(),
            headers: headers.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table as text: first column left-aligned, the others right-aligned.
    pub fn render(&self) -> String {
        let cols = self.headers.len();
        let mut width = vec![0usize; cols];
        for r in std::iter::once(&self.headers).chain(&self.rows) {
            for (i, c) in r.iter().enumerate().take(cols) {
                width[i] = width[i].max(c.chars().count());
            }
        }
        let line = |r: &Vec<String>| {
            let cells: Vec<String> = (0..cols)
                .map(|i| {
                    let c = r.get(i).map(String::as_str).unwrap_or("");
                    if i == 0 {
                        format!("{c:<w$}", w = width[i])
                    } else {
                        format!("{c:>w$}", w = width[i])
                    }
                })
                .collect();
            cells.join("  ").trim_end().to_string()
        };
        let mut out = format!("{}\n", self.title);
        out.push_str(&line(&self.headers));
        out.push('\n');
        let total: usize = width.iter().sum::<usize>() + 2 * cols.saturating_sub(1);
        out.push_str(&"-".repeat(total));
        out.push('\n');
        for r in &self.rows {
            out.push_str(&line(r));
            out.push('\n');
        }
        out
    }

    pub fn print(&self) {
        println!("{}", self.render());
    }
}

/// Prints `value` as one JSON line when JSON output is on.
pub fn json_line(enabled: bool, value: &Value) {
    if enabled {
        println!("{value}");
    }
}

/// Microseconds with sensible precision.
pub fn us(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// Bytes in binary units (`2.0 MiB`).
pub fn bytes(v: u64) -> String {
    gpu_broker_client::units::format_bytes(v)
}

/// A count with thousands separators.
pub fn count(v: u64) -> String {
    let digits: Vec<char> = v.to_string().chars().collect();
    let groups: Vec<String> = digits
        .rchunks(3)
        .rev()
        .map(|g| g.iter().collect())
        .collect();
    groups.join(",")
}

/// Progress note on stderr.
pub fn note(msg: impl AsRef<str>) {
    eprintln!("[bench] {}", msg.as_ref());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_aligned() {
        let mut t = Table::new("T", &["size", "p50"]);
        t.row(vec!["2.0 MiB".into(), "41.0".into()]);
        t.row(vec!["1.0 GiB".into(), "1234".into()]);
        let s = t.render();
        assert!(s.contains("size      p50\n"), "{s}");
        assert!(s.contains("2.0 MiB  41.0\n"), "{s}");
        assert_eq!(count(1234567), "1,234,567");
        assert_eq!(count(12), "12");
    }
}

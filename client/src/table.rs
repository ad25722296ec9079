//! A tiny text-table formatter for the CLI: a header row and data rows, each column as
//! wide as its widest cell (counted in characters), columns two spaces apart, chosen
//! columns right-aligned (numbers and sizes), no trailing whitespace. [`Table::fit`]
//! bounds the width: chosen text columns (names, labels) are cut with `…` until the
//! table fits.

/// How a column's cells line up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    /// Pad on the right (text).
    Left,
    /// Pad on the left (numbers, sizes).
    Right,
}

/// Rows of cells under a header, rendered with aligned columns.
#[derive(Debug, Clone)]
pub struct Table {
    header: Vec<String>,
    align: Vec<Align>,
    rows: Vec<Vec<String>>,
    /// Columns that may be cut to fit `max_width`.
    flex: Vec<usize>,
    max_width: Option<usize>,
}

/// Narrowest a cut column gets (its header may be cut too).
const MIN_FLEX: usize = 6;

impl Table {
    /// A table with these column titles, all left-aligned.
    pub fn new<I, S>(header: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let header: Vec<String> = header.into_iter().map(Into::into).collect();
        let align = vec![Align::Left; header.len()];
        Table {
            header,
            align,
            rows: Vec::new(),
            flex: Vec::new(),
            max_width: None,
        }
    }

    /// Lets the table be at most `width` characters wide (`None`: no bound) by cutting
    /// the `flex` columns (widest first) with `…`. Other columns are never cut.
    pub fn fit(mut self, width: Option<usize>, flex: &[usize]) -> Self {
        self.max_width = width;
        self.flex = flex.to_vec();
        self
    }

    /// Right-aligns the columns at these indices (out-of-range ones are ignored).
    pub fn right(mut self, columns: &[usize]) -> Self {
        for &c in columns {
            if let Some(a) = self.align.get_mut(c) {
                *a = Align::Right;
            }
        }
        self
    }

    /// Appends a row; missing cells render empty, extra cells are dropped.
    pub fn row<I, S>(&mut self, cells: I)
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut row: Vec<String> = cells.into_iter().map(Into::into).collect();
        row.resize(self.header.len(), String::new());
        self.rows.push(row);
    }

    /// Number of data rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// True when there are no data rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The table as text, one line per row (header first), each ending in `\n`.
    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = (0..self.header.len())
            .map(|c| {
                std::iter::once(&self.header)
                    .chain(&self.rows)
                    .map(|r| r[c].chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        if let Some(max) = self.max_width {
            shrink(&mut widths, &self.flex, max);
        }
        let mut out = String::new();
        for row in std::iter::once(&self.header).chain(&self.rows) {
            let mut line = String::new();
            for (c, cell) in row.iter().enumerate() {
                if c > 0 {
                    line.push_str("  ");
                }
                let cut = cut(cell, widths[c]);
                let cell = cut.as_str();
                let pad = widths[c].saturating_sub(cell.chars().count());
                match self.align[c] {
                    Align::Left => {
                        line.push_str(cell);
                        line.extend(std::iter::repeat_n(' ', pad));
                    }
                    Align::Right => {
                        line.extend(std::iter::repeat_n(' ', pad));
                        line.push_str(cell);
                    }
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// Narrows the widest flexible column, one character at a time, until the columns and
/// their two-space gaps fit in `max` (or every flexible column is at [`MIN_FLEX`]).
fn shrink(widths: &mut [usize], flex: &[usize], max: usize) {
    let total = |w: &[usize]| w.iter().sum::<usize>() + 2 * w.len().saturating_sub(1);
    while total(widths) > max {
        let widest = flex
            .iter()
            .copied()
            .filter(|&c| widths.get(c).is_some_and(|&w| w > MIN_FLEX))
            .max_by_key(|&c| widths[c]);
        match widest {
            Some(c) => widths[c] -= 1,
            None => return,
        }
    }
}

/// `cell` cut to `width` characters, ending in `…` when cut.
fn cut(cell: &str, width: usize) -> String {
    if cell.chars().count() <= width {
        return cell.to_string();
    }
    let mut s: String = cell.chars().take(width.saturating_sub(1)).collect();
    s.push('…');
    s
}

impl std::fmt::Display for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.render())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligns_columns_by_content() {
        let mut t = Table::new(["TENANT", "LIMIT", "NOTE"]).right(&[1]);
        t.row(["a", "8.0 GiB", "x"]);
        t.row(["longer-name", "512 B", ""]);
        assert_eq!(
            t.render(),
            concat!(
                "TENANT         LIMIT  NOTE\n",
                "a            8.0 GiB  x\n",
                "longer-name    512 B\n",
            )
        );
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn header_only_and_ragged_rows() {
        let mut t = Table::new(["A", "B"]);
        assert!(t.is_empty());
        assert_eq!(t.render(), "A  B\n");
        t.row(["x"]);
        t.row(["y", "z", "dropped"]);
        assert_eq!(t.render(), "A  B\nx\ny  z\n");
    }

    #[test]
    fn fit_cuts_flexible_columns_widest_first() {
        let mut t = Table::new(["ID", "NAME", "LABEL"]).fit(Some(30), &[1, 2]);
        t.row(["0123456789", "a-very-long-tenant-name", "short"]);
        let text = t.render();
        for line in text.lines() {
            assert!(line.chars().count() <= 30, "{line:?}");
        }
        assert!(text.contains("0123456789"), "ids are never cut: {text}");
        assert!(text.contains("a-very-lon…"), "{text}");
        assert!(text.contains("short"), "{text}");
        let mut t = Table::new(["ID", "NAME"]).fit(None, &[1]);
        t.row(["x", "a-very-long-tenant-name"]);
        assert!(t.render().contains("a-very-long-tenant-name"));
    }

    #[test]
    fn counts_characters_not_bytes() {
        let mut t = Table::new(["NAME", "N"]);
        t.row(["héllo", "1"]);
        assert_eq!(t.render(), "NAME   N\nhéllo  1\n");
    }
}

//! A tiny text-table formatter for the CLI: a header row and data rows, each column as
//! wide as its widest cell (counted in characters), columns two spaces apart, chosen
//! columns right-aligned (numbers and sizes), no trailing whitespace.

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
}

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
        }
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
        let widths: Vec<usize> = (0..self.header.len())
            .map(|c| {
                std::iter::once(&self.header)
                    .chain(&self.rows)
                    .map(|r| r[c].chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for row in std::iter::once(&self.header).chain(&self.rows) {
            let mut line = String::new();
            for (c, cell) in row.iter().enumerate() {
                if c > 0 {
                    line.push_str("  ");
                }
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
    fn counts_characters_not_bytes() {
        let mut t = Table::new(["NAME", "N"]);
        t.row(["héllo", "1"]);
        assert_eq!(t.render(), "NAME   N\nhéllo  1\n");
    }
}

//! verl's `trainer.rollout_data_dir` / `trainer.validation_data_dir`: every scored row of a step
//! (or of a validation pass) as one JSON line in `<dir>/<global_step>.jsonl`, with verl's keys
//! (`input`, `output`, `gts`, `score`, `step`, then each reward extra-info column), so the tools
//! people point at verl's dumps read ours.
//!
//! Across ranks the rows are gathered in rank order and rank 0 writes the file, which then holds
//! exactly what a 1-rank run would have written.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use super::reduce::Ranks;

/// The rows one rank contributes, column-wise (floats as bits so gathering is exact).
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub(crate) struct DumpRows {
    pub input: Vec<String>,
    pub output: Vec<String>,
    pub gts: Vec<serde_json::Value>,
    score: Vec<u64>,
    extra: BTreeMap<String, Vec<u64>>,
}

impl DumpRows {
    pub fn push(
        &mut self,
        input: String,
        output: String,
        gts: serde_json::Value,
        score: f64,
        extra: impl IntoIterator<Item = (String, f64)>,
    ) {
        let before = self.input.len();
        self.input.push(input);
        self.output.push(output);
        self.gts.push(gts);
        self.score.push(score.to_bits());
        for (k, v) in extra {
            let col = self
                .extra
                .entry(k)
                .or_insert_with(|| vec![f64::NAN.to_bits(); before]);
            col.resize(before, f64::NAN.to_bits());
            col.push(v.to_bits());
        }
        for col in self.extra.values_mut() {
            col.resize(before + 1, f64::NAN.to_bits());
        }
    }

    pub fn len(&self) -> usize {
        self.input.len()
    }

    pub fn append(&mut self, other: DumpRows) {
        let before = self.len();
        let added = other.len();
        self.input.extend(other.input);
        self.output.extend(other.output);
        self.gts.extend(other.gts);
        self.score.extend(other.score);
        for (k, v) in other.extra {
            let col = self
                .extra
                .entry(k)
                .or_insert_with(|| vec![f64::NAN.to_bits(); before]);
            col.resize(before, f64::NAN.to_bits());
            col.extend(v);
        }
        for col in self.extra.values_mut() {
            col.resize(before + added, f64::NAN.to_bits());
        }
    }

    /// The JSON lines verl writes: one object per row. Non-finite floats (a row whose reward
    /// plugin lacks an extra column) become `null`, as JSON has no NaN.
    fn lines(&self, step: u64) -> Vec<String> {
        let num = |bits: u64| {
            let x = f64::from_bits(bits);
            serde_json::Number::from_f64(x)
                .map(serde_json::Value::Number)
                .unwrap_or(serde_json::Value::Null)
        };
        (0..self.len())
            .map(|r| {
                let mut o = serde_json::Map::new();
                o.insert("input".into(), self.input[r].clone().into());
                o.insert("output".into(), self.output[r].clone().into());
                o.insert("gts".into(), self.gts[r].clone());
                o.insert("score".into(), num(self.score[r]));
                o.insert("step".into(), step.into());
                for (k, v) in &self.extra {
                    if !o.contains_key(k) {
                        o.insert(k.clone(), num(v[r]));
                    }
                }
                serde_json::Value::Object(o).to_string()
            })
            .collect()
    }
}

/// Gathers `rows` from every rank and has rank 0 write `<dir>/<step>.jsonl`. Returns the path on
/// the rank that wrote it.
pub(crate) fn dump_generations(
    dir: &str,
    step: u64,
    rows: DumpRows,
    ranks: Ranks<'_>,
) -> anyhow::Result<Option<PathBuf>> {
    let all = if ranks.is_single() {
        rows
    } else {
        let parts = ranks.gather(rows)?;
        if !ranks.is_first() {
            return Ok(None);
        }
        let mut all = DumpRows::default();
        for p in parts {
            all.append(p);
        }
        all
    };
    let dir = Path::new(dir);
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating the generations dump folder {}", dir.display()))?;
    let path = dir.join(format!("{step}.jsonl"));
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(&path)
            .with_context(|| format!("creating the generations dump {}", path.display()))?,
    );
    for line in all.lines(step) {
        writeln!(f, "{line}").with_context(|| format!("writing {}", path.display()))?;
    }
    f.flush()
        .with_context(|| format!("writing {}", path.display()))?;
    tracing::info!(path = %path.display(), rows = all.len(), "dumped generations");
    Ok(Some(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_become_verl_lines_with_extra_columns_aligned() {
        let mut a = DumpRows::default();
        a.push(
            "q1".into(),
            "r1".into(),
            "3".into(),
            1.0,
            [("acc".to_string(), 1.0)],
        );
        a.push("q2".into(), "r2".into(), "4".into(), 0.0, []);
        let mut b = DumpRows::default();
        b.push(
            "q3".into(),
            "r3".into(),
            "5".into(),
            0.5,
            [("fmt".to_string(), 0.25)],
        );
        a.append(b);
        let lines: Vec<serde_json::Value> = a
            .lines(7)
            .iter()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3);
        let keys: Vec<&str> = lines[0]
            .as_object()
            .unwrap()
            .keys()
            .map(|s| s.as_str())
            .collect();
        assert_eq!(&keys[..5], ["input", "output", "gts", "score", "step"]);
        assert_eq!(lines[0]["acc"], 1.0);
        assert!(lines[1]["acc"].is_null());
        assert!(lines[0]["fmt"].is_null());
        assert_eq!(lines[2]["fmt"], 0.25);
        assert_eq!(lines[2]["input"], "q3");
        assert_eq!(lines[2]["gts"], "5");
        assert_eq!(lines[1]["step"], 7);
    }

    #[test]
    fn one_rank_writes_the_step_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut rows = DumpRows::default();
        rows.push("p".into(), "o".into(), "1".into(), 1.0, []);
        let sub = dir.path().join("gen");
        let path = dump_generations(sub.to_str().unwrap(), 12, rows, Ranks::default())
            .unwrap()
            .unwrap();
        assert_eq!(path, sub.join("12.jsonl"));
        let text = std::fs::read_to_string(path).unwrap();
        assert_eq!(text.lines().count(), 1);
        assert!(text.contains("\"score\":1.0"));
    }
}

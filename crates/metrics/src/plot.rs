//! Line charts of a run's metrics over steps (`verl plot RUN_DIR`), read back from the JSONL file or
//! TensorBoard events the sinks wrote. Text is drawn with DejaVu Sans bundled by the `dejavu` crate, so neither
//! the SVG nor the PNG output depends on system fonts.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::Value;

use crate::error::{io, MetricsError, Result};
use crate::logger::default_columns;
use crate::tfevents::read_events;

/// Every metric of a run: name → step → value (the last value logged for a step wins, so a resumed run that
/// re-logs steps shows its latest attempt).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunHistory {
    series: BTreeMap<String, BTreeMap<u64, f64>>,
}

impl RunHistory {
    /// Load a run from a `.jsonl` metrics file, a tfevents file, or a folder holding either: one `.jsonl` file
    /// (or `metrics.jsonl` among several), else its `events.out.tfevents.*` files merged.
    pub fn load(path: &Path) -> Result<Self> {
        let (jsonl, events) = locate(path)?;
        let mut h = RunHistory::default();
        if let Some(file) = jsonl {
            h.read_jsonl(&file)?;
        } else {
            for file in events {
                for ev in read_events(&file)? {
                    for (tag, v) in ev.scalars {
                        h.insert(&tag, ev.step.max(0) as u64, v as f64);
                    }
                }
            }
        }
        Ok(h)
    }

    fn insert(&mut self, name: &str, step: u64, value: f64) {
        self.series
            .entry(name.to_string())
            .or_default()
            .insert(step, value);
    }

    fn read_jsonl(&mut self, path: &Path) -> Result<()> {
        let text = fs::read_to_string(path).map_err(io("read", path))?;
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let bad = |expected: &'static str, found: String| MetricsError::BadJsonl {
                path: path.to_path_buf(),
                line: i + 1,
                expected,
                found,
            };
            let v: Value = match serde_json::from_str(line) {
                Ok(v) => v,
                // A crash mid-write can only tear the last line; everything before it is good.
                Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => continue,
                Err(e) => return Err(bad("a JSON object", e.to_string())),
            };
            let step = v
                .get("step")
                .and_then(Value::as_u64)
                .ok_or_else(|| bad("a non-negative integer `step`", short(&v)))?;
            let data = v
                .get("data")
                .or_else(|| v.get("metrics"))
                .and_then(Value::as_object)
                .ok_or_else(|| bad("a `data` (or `metrics`) object", short(&v)))?;
            for (k, x) in data {
                // null is how NaN/inf were written: keep it as NaN so the chart breaks its line there.
                // Strings and other non-scalars are not plottable.
                if x.is_null() {
                    self.insert(k, step, f64::NAN);
                } else if let Some(x) = x.as_f64() {
                    self.insert(k, step, x);
                }
            }
        }
        Ok(())
    }

    /// Metric names, sorted.
    pub fn metric_names(&self) -> Vec<&str> {
        self.series.keys().map(String::as_str).collect()
    }

    /// `(step, value)` of `name`, by step.
    pub fn series(&self, name: &str) -> Option<Vec<(u64, f64)>> {
        self.series
            .get(name)
            .map(|m| m.iter().map(|(&s, &v)| (s, v)).collect())
    }

    /// The metrics to plot when none are named: the console table's key metrics and `val-core/*`, where present.
    pub fn default_metrics(&self) -> Vec<String> {
        let mut out: Vec<String> = default_columns()
            .into_iter()
            .filter_map(|c| c.keys.into_iter().find(|k| self.series.contains_key(k)))
            .collect();
        out.extend(
            self.series
                .keys()
                .filter(|k| k.starts_with("val-core/"))
                .cloned(),
        );
        out
    }

    /// Resolve requested names; a trailing `*` matches by prefix (`val-core/*`).
    fn select(&self, wanted: &[&str], source: &Path) -> Result<Vec<String>> {
        let mut out = Vec::new();
        for w in wanted {
            let found: Vec<String> = match w.strip_suffix('*') {
                Some(prefix) => self
                    .series
                    .keys()
                    .filter(|k| k.starts_with(prefix))
                    .cloned()
                    .collect(),
                None => self
                    .series
                    .contains_key(*w)
                    .then(|| w.to_string())
                    .into_iter()
                    .collect(),
            };
            if found.is_empty() {
                return Err(MetricsError::NothingToPlot {
                    path: source.to_path_buf(),
                    expected: format!("a metric matching `{w}`"),
                    found: format!("metrics [{}]", self.metric_names().join(", ")),
                });
            }
            for f in found {
                if !out.contains(&f) {
                    out.push(f);
                }
            }
        }
        Ok(out)
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 80 {
        format!(
            "{}...",
            &s[..s.char_indices().nth(77).map_or(s.len(), |(i, _)| i)]
        )
    } else {
        s
    }
}

fn sorted_files(dir: &Path, keep: impl Fn(&str) -> bool) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).map_err(io("list", dir))? {
        let entry = entry.map_err(io("list", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if keep(&name) && entry.path().is_file() {
            files.push(entry.path());
        }
    }
    files.sort();
    Ok(files)
}

fn is_events(name: &str) -> bool {
    name.contains("tfevents")
}

/// The JSONL file, or else the event files, that `path` stands for.
fn locate(path: &Path) -> Result<(Option<PathBuf>, Vec<PathBuf>)> {
    let meta = fs::metadata(path).map_err(io("open the run", path))?;
    if meta.is_file() {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        return Ok(if is_events(&name) {
            (None, vec![path.to_path_buf()])
        } else {
            (Some(path.to_path_buf()), Vec::new())
        });
    }
    let jsonl = sorted_files(path, |n| n.ends_with(".jsonl"))?;
    match jsonl.len() {
        1 => return Ok((jsonl.into_iter().next(), Vec::new())),
        0 => {}
        _ => {
            if let Some(m) = jsonl.iter().find(|p| p.ends_with("metrics.jsonl")) {
                return Ok((Some(m.clone()), Vec::new()));
            }
            return Err(MetricsError::NothingToPlot {
                path: path.to_path_buf(),
                expected: "one .jsonl metrics file (or metrics.jsonl); name the file to plot"
                    .into(),
                found: jsonl
                    .iter()
                    .filter_map(|p| p.file_name())
                    .map(|n| n.to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
    }
    let events = sorted_files(path, is_events)?;
    if events.is_empty() {
        return Err(MetricsError::NothingToPlot {
            path: path.to_path_buf(),
            expected: "a .jsonl metrics file or events.out.tfevents.* files".into(),
            found: "neither".into(),
        });
    }
    Ok((None, events))
}

/// Output format, from the output file's extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlotFormat {
    /// `.svg`.
    Svg,
    /// `.png`.
    Png,
}

impl PlotFormat {
    /// `.png` → PNG; `.svg` or anything else → SVG.
    pub fn from_path(path: &Path) -> Self {
        match path.extension().and_then(|e| e.to_str()) {
            Some(e) if e.eq_ignore_ascii_case("png") => PlotFormat::Png,
            _ => PlotFormat::Svg,
        }
    }
}

const PANEL_W: u32 = 640;
const PANEL_H: u32 = 300;

static FONT: Once = Once::new();

fn register_font() {
    FONT.call_once(|| {
        // On failure text is skipped and plotters reports the missing font when drawing.
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        );
    });
}

/// Chart `metrics` of the run at `run` (see [`RunHistory::load`]; empty `metrics` means
/// [`RunHistory::default_metrics`]) into `out`, one panel per metric, SVG or PNG by extension. Returns the
/// metrics drawn.
pub fn plot_run(run: &Path, metrics: &[&str], out: &Path) -> Result<Vec<String>> {
    let history = RunHistory::load(run)?;
    let names = if metrics.is_empty() {
        history.default_metrics()
    } else {
        history.select(metrics, run)?
    };
    if names.is_empty() {
        return Err(MetricsError::NothingToPlot {
            path: run.to_path_buf(),
            expected: "any of the default metrics (score, losses, lengths, timing, val-core/*)"
                .into(),
            found: format!("metrics [{}]", history.metric_names().join(", ")),
        });
    }
    let panels: Vec<(String, Vec<(u64, f64)>)> = names
        .iter()
        .map(|n| (n.clone(), history.series(n).unwrap_or_default()))
        .collect();
    plot_series(&panels, out)?;
    Ok(names)
}

/// Chart the given `(name, points)` panels into `out` (SVG or PNG by extension).
pub fn plot_series(panels: &[(String, Vec<(u64, f64)>)], out: &Path) -> Result<()> {
    register_font();
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).map_err(io("create the folder of", out))?;
    }
    let cols = if panels.len() > 3 { 2 } else { 1 };
    let rows = panels.len().div_ceil(cols).max(1);
    let size = (PANEL_W * cols as u32, PANEL_H * rows as u32);
    let drawn = match PlotFormat::from_path(out) {
        PlotFormat::Svg => draw(
            SVGBackend::new(out, size).into_drawing_area(),
            panels,
            (rows, cols),
        ),
        PlotFormat::Png => draw(
            BitMapBackend::new(out, size).into_drawing_area(),
            panels,
            (rows, cols),
        ),
    };
    drawn.map_err(|message| MetricsError::Draw {
        path: out.to_path_buf(),
        message,
    })
}

fn padded_range(lo: f64, hi: f64) -> (f64, f64) {
    if !lo.is_finite() || !hi.is_finite() {
        return (0.0, 1.0);
    }
    if lo == hi {
        let pad = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        return (lo - pad, hi + pad);
    }
    let pad = (hi - lo) * 0.05;
    (lo - pad, hi + pad)
}

/// Runs of consecutive finite points: a NaN (logged as null) breaks the line instead of bending it.
fn finite_segments(points: &[(u64, f64)]) -> Vec<Vec<(f64, f64)>> {
    let mut segs: Vec<Vec<(f64, f64)>> = vec![Vec::new()];
    for &(s, v) in points {
        if v.is_finite() {
            segs.last_mut().expect("non-empty").push((s as f64, v));
        } else if !segs.last().expect("non-empty").is_empty() {
            segs.push(Vec::new());
        }
    }
    segs.retain(|s| !s.is_empty());
    segs
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    panels: &[(String, Vec<(u64, f64)>)],
    grid: (usize, usize),
) -> std::result::Result<(), String> {
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
    root.fill(&WHITE).map_err(e)?;
    let areas = root.split_evenly(grid);
    for ((name, points), area) in panels.iter().zip(areas.iter()) {
        let finite: Vec<&(u64, f64)> = points.iter().filter(|(_, v)| v.is_finite()).collect();
        let (x0, x1) = padded_range(
            finite
                .iter()
                .map(|p| p.0 as f64)
                .fold(f64::INFINITY, f64::min),
            finite
                .iter()
                .map(|p| p.0 as f64)
                .fold(f64::NEG_INFINITY, f64::max),
        );
        let (y0, y1) = padded_range(
            finite.iter().map(|p| p.1).fold(f64::INFINITY, f64::min),
            finite.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max),
        );
        let mut chart = ChartBuilder::on(area)
            .caption(name, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(32)
            .y_label_area_size(64)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .x_labels(8)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_labels(6)
            .label_style(("sans-serif", 13))
            .draw()
            .map_err(e)?;
        for seg in finite_segments(points) {
            if seg.len() == 1 {
                chart
                    .draw_series(std::iter::once(Circle::new(seg[0], 3, BLUE.filled())))
                    .map_err(e)?;
            } else {
                chart
                    .draw_series(LineSeries::new(seg, BLUE.stroke_width(2)))
                    .map_err(e)?;
            }
        }
    }
    root.present().map_err(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nan_breaks_a_line_into_segments() {
        let pts = [
            (1, 1.0),
            (2, f64::NAN),
            (3, 3.0),
            (4, 4.0),
            (5, f64::INFINITY),
        ];
        assert_eq!(
            finite_segments(&pts),
            vec![vec![(1.0, 1.0)], vec![(3.0, 3.0), (4.0, 4.0)]]
        );
    }

    #[test]
    fn flat_series_get_a_visible_range() {
        assert_eq!(padded_range(2.0, 2.0), (1.8, 2.2));
        assert_eq!(padded_range(0.0, 0.0), (-1.0, 1.0));
        assert_eq!(padded_range(f64::INFINITY, f64::NEG_INFINITY), (0.0, 1.0));
    }
}

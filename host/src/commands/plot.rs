//! `verl plot`: a run's metrics as PNG or SVG.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Plots `metrics` (default: the key metrics) of `run` to `out` (default `<run>/metrics.png`).
pub fn run(run: &Path, metrics: &[String], out: Option<&PathBuf>) -> anyhow::Result<ExitCode> {
    let out = out.cloned().unwrap_or_else(|| {
        if run.is_dir() {
            run.join("metrics.png")
        } else {
            run.with_extension("png")
        }
    });
    let names: Vec<&str> = metrics.iter().map(String::as_str).collect();
    let plotted = verl_metrics::plot_run(run, &names, &out)?;
    println!(
        "{} ({} metric(s): {})",
        out.display(),
        plotted.len(),
        plotted.join(", ")
    );
    Ok(ExitCode::SUCCESS)
}

//! `MetricsLogger`: verl's `Tracking` (and its `ValidationGenerationsLogger`) — console, JSONL file and
//! TensorBoard sinks written here, and wandb, mlflow and swanlab through their Python clients in sidecar
//! processes ([`crate::tracking`]).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{Number, Value};

use crate::error::{io, MetricsError, Result};
use crate::generations::{tensorboard_text, ValGeneration, VAL_GENERATIONS_KEY};
use crate::sink::Sink;
use crate::tfevents::EventWriter;
use crate::tracking::{check_tracking, TrackingOptions, TrackingSink};

/// verl loggers that verl-rs does not provide: selecting one is an error.
const UNSUPPORTED: [&str; 4] = ["vemlp_wandb", "clearml", "trackio", "rl_insight"];
const AVAILABLE: &str =
    "console, file (alias jsonl), tensorboard, wandb (alias tracking), mlflow, swanlab";

/// A `trainer.logger` value, resolved.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Backend {
    Console,
    File,
    Tensorboard,
    /// wandb, mlflow or swanlab.
    Python(&'static str),
}

/// The backends `names` select, each once, in order; the deprecated `tracking` alias adds a warning.
fn resolve(names: &[String], warnings: &mut Vec<String>) -> Result<Vec<Backend>> {
    let mut out: Vec<Backend> = Vec::new();
    for name in names {
        let backend = match name.as_str() {
            "console" => Backend::Console,
            "file" | "jsonl" => Backend::File,
            "tensorboard" => Backend::Tensorboard,
            "wandb" => Backend::Python("wandb"),
            "tracking" => {
                warnings.push(
                    "trainer.logger: `tracking` is deprecated (as in verl); use `wandb`"
                        .to_string(),
                );
                Backend::Python("wandb")
            }
            "mlflow" => Backend::Python("mlflow"),
            "swanlab" => Backend::Python("swanlab"),
            other if UNSUPPORTED.contains(&other) => {
                return Err(MetricsError::UnsupportedBackend {
                    found: other.to_string(),
                    available: AVAILABLE.to_string(),
                })
            }
            other => {
                return Err(MetricsError::UnknownBackend {
                    found: other.to_string(),
                    expected: AVAILABLE.to_string(),
                })
            }
        };
        if !out.contains(&backend) {
            out.push(backend);
        }
    }
    Ok(out)
}

/// Where and how the sinks selected by `trainer.logger` write.
#[derive(Debug, Clone, PartialEq)]
pub struct LoggerOptions {
    /// `trainer.logger`.
    pub backends: Vec<String>,
    /// Console: print every metric (`step:N - key:value - ...`, verl's console format) instead of the table.
    pub console_full: bool,
    /// The `file`/`jsonl` sink's file.
    pub jsonl_path: PathBuf,
    /// The `tensorboard` sink's folder.
    pub tensorboard_dir: PathBuf,
    /// What wandb, mlflow and swanlab are given.
    pub tracking: TrackingOptions,
}

impl LoggerOptions {
    /// verl's defaults for `trainer.project_name`/`experiment_name`: the JSONL file is
    /// `$VERL_FILE_LOGGER_PATH`, else `${VERL_FILE_LOGGER_ROOT:-.}/<project>/<experiment>.jsonl`; TensorBoard
    /// writes to `$TENSORBOARD_DIR`, else `tensorboard_log/<project>/<experiment>`. wandb, mlflow and swanlab
    /// run with `$VERL_PYTHON`, else `python3`, and get no config until [`with_run_config`](Self::with_run_config).
    pub fn from_verl(project_name: &str, experiment_name: &str, backends: &[String]) -> Self {
        let env = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let jsonl_path = env("VERL_FILE_LOGGER_PATH").unwrap_or_else(|| {
            let root = env("VERL_FILE_LOGGER_ROOT").unwrap_or_else(|| PathBuf::from("."));
            expand_home(&root)
                .join(project_name)
                .join(format!("{experiment_name}.jsonl"))
        });
        let tensorboard_dir = env("TENSORBOARD_DIR").unwrap_or_else(|| {
            Path::new("tensorboard_log")
                .join(project_name)
                .join(experiment_name)
        });
        LoggerOptions {
            backends: backends.to_vec(),
            console_full: false,
            jsonl_path,
            tensorboard_dir,
            tracking: TrackingOptions::new(project_name, experiment_name),
        }
    }

    /// Give the Python-client loggers the resolved job config (wandb's run config, MLflow's params).
    pub fn with_run_config(mut self, config: Value) -> Self {
        self.tracking.config = config;
        self
    }
}

fn expand_home(p: &Path) -> PathBuf {
    match (p.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => p.to_path_buf(),
    }
}

/// Fans each step's metrics out to the selected sinks.
pub struct MetricsLogger {
    sinks: Vec<Box<dyn Sink>>,
    warnings: Vec<String>,
}

impl std::fmt::Debug for MetricsLogger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsLogger")
            .field("sinks", &self.sink_names())
            .field("warnings", &self.warnings)
            .finish()
    }
}

impl MetricsLogger {
    /// Open the sinks `options.backends` names. The Python-client loggers start side by side and each must
    /// have its run before this returns: a missing package, a bad tracking URI or an unreachable server is an
    /// error here, before training. verl loggers that verl-rs lacks, and names verl does not know, are errors.
    pub fn new(options: &LoggerOptions) -> Result<Self> {
        let mut logger = MetricsLogger::with_sinks(Vec::new());
        let backends = resolve(&options.backends, &mut logger.warnings)?;
        let mut python = Vec::new();
        for backend in backends {
            match backend {
                Backend::Console => logger.add_sink(Box::new(if options.console_full {
                    ConsoleSink::full(Box::new(std::io::stdout()))
                } else {
                    ConsoleSink::table(Box::new(std::io::stdout()))
                })),
                Backend::File => logger.add_sink(Box::new(JsonlSink::open(&options.jsonl_path)?)),
                Backend::Tensorboard => {
                    logger.add_sink(Box::new(TensorboardSink::create(&options.tensorboard_dir)?))
                }
                Backend::Python(name) => python.push(name),
            }
        }
        // Started last, once the local sinks are open, so that their errors leave no run behind.
        let starting = python
            .into_iter()
            .map(|name| TrackingSink::spawn(name, &options.tracking))
            .collect::<Result<Vec<_>>>()?;
        for mut sink in starting {
            sink.wait_ready()?;
            logger.add_sink(Box::new(sink));
        }
        Ok(logger)
    }

    /// A logger over the given sinks.
    pub fn with_sinks(sinks: Vec<Box<dyn Sink>>) -> Self {
        MetricsLogger {
            sinks,
            warnings: Vec::new(),
        }
    }

    /// Add a sink.
    pub fn add_sink(&mut self, sink: Box<dyn Sink>) {
        self.sinks.push(sink);
    }

    /// Names of the open sinks.
    pub fn sink_names(&self) -> Vec<&str> {
        self.sinks.iter().map(|s| s.name()).collect()
    }

    /// Warnings from opening the sinks (the deprecated `tracking` alias), for the host to print.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Send `metrics` of `step` to every sink. Every sink is tried; the first error is returned.
    pub fn log(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()> {
        let mut first = None;
        for sink in &mut self.sinks {
            if let Err(e) = sink.log(step, metrics) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Send the validation samples of `step` (chosen with
    /// [`select_val_generations`](crate::select_val_generations)) to every sink: wandb re-logs its table of
    /// every validation so far, MLflow gets a `val_step<step>.json` artifact, swanlab a table, TensorBoard a
    /// text; console and file log nothing. No samples (`trainer.log_val_generations=0`) logs nothing. Every sink
    /// is tried; the first error is returned.
    pub fn log_generations(&mut self, step: u64, samples: &[ValGeneration]) -> Result<()> {
        if samples.is_empty() {
            return Ok(());
        }
        let mut first = None;
        for sink in &mut self.sinks {
            if let Err(e) = sink.log_generations(step, samples) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Flush and close every sink.
    pub fn finish(&mut self) -> Result<()> {
        let mut first = None;
        for sink in &mut self.sinks {
            if let Err(e) = sink.finish() {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

/// What `--dry-run` can verify cheaply: every `trainer.logger` value is known and provided, and each
/// Python-client logger can start (its package imports with `options.tracking.python`; MLflow's tracking server
/// answers, or its local store's folder is writable). No run is created and nothing is written. Returns one line
/// per logger on what was found.
pub fn check_loggers(options: &LoggerOptions) -> Result<Vec<String>> {
    let mut warnings = Vec::new();
    let backends = resolve(&options.backends, &mut warnings)?;
    // The checks run side by side: each pays a Python start and an import.
    let checks: Vec<_> = backends
        .iter()
        .filter_map(|b| match *b {
            Backend::Python(name) => {
                let tracking = options.tracking.clone();
                Some((
                    name,
                    std::thread::spawn(move || check_tracking(name, &tracking)),
                ))
            }
            _ => None,
        })
        .collect();
    let mut lines = warnings;
    for backend in &backends {
        match backend {
            Backend::Console => lines.push("console: ok".to_string()),
            Backend::File => lines.push(format!("file: {}", options.jsonl_path.display())),
            Backend::Tensorboard => lines.push(format!(
                "tensorboard: {}",
                options.tensorboard_dir.display()
            )),
            Backend::Python(_) => {}
        }
    }
    let mut first = None;
    for (name, handle) in checks {
        let checked = handle.join().unwrap_or_else(|_| {
            Err(MetricsError::SidecarFailed {
                logger: name.to_string(),
                op: format!("{name} check"),
                message: "the checking thread panicked".into(),
                hint: "",
            })
        });
        match checked {
            Ok(detail) => lines.push(format!(
                "{name}: {detail} (python `{}`)",
                options.tracking.python.display()
            )),
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first {
        return Err(e);
    }
    Ok(lines)
}

// ---- console ------------------------------------------------------------------------------------------------

/// One column of the console table: the first of `keys` present in a step's metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct Column {
    /// Header text.
    pub header: String,
    /// Candidate metric names, first present wins.
    pub keys: Vec<String>,
}

impl Column {
    /// A column showing the first present of `keys`.
    pub fn new(header: &str, keys: &[&str]) -> Self {
        Column {
            header: header.to_string(),
            keys: keys.iter().map(|k| k.to_string()).collect(),
        }
    }
}

/// The key metrics of a PPO/GRPO step: score, policy loss, KL, entropy, response length and timing.
pub fn default_columns() -> Vec<Column> {
    vec![
        Column::new("score", &["critic/score/mean"]),
        Column::new("pg_loss", &["actor/pg_loss"]),
        Column::new(
            "kl",
            &["actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl"],
        ),
        Column::new("entropy", &["actor/entropy"]),
        Column::new("resp_len", &["response_length/mean"]),
        Column::new("gen_s", &["timing_s/gen"]),
        Column::new("step_s", &["timing_s/step"]),
    ]
}

const COL_WIDTH: usize = 11;
const HEADER_EVERY: usize = 20;

enum ConsoleMode {
    Table { columns: Vec<Column>, rows: usize },
    Full,
}

/// Prints metrics to a terminal: an aligned table of key metrics (validation metrics on their own lines), or
/// every metric in verl's `step:N - key:value` form.
pub struct ConsoleSink {
    out: Box<dyn Write + Send>,
    mode: ConsoleMode,
}

impl ConsoleSink {
    /// The compact table with [`default_columns`].
    pub fn table(out: Box<dyn Write + Send>) -> Self {
        Self::with_columns(out, default_columns())
    }

    /// The compact table with the given columns.
    pub fn with_columns(out: Box<dyn Write + Send>, columns: Vec<Column>) -> Self {
        ConsoleSink {
            out,
            mode: ConsoleMode::Table { columns, rows: 0 },
        }
    }

    /// Every metric on one line per step, like verl's console logger.
    pub fn full(out: Box<dyn Write + Send>) -> Self {
        ConsoleSink {
            out,
            mode: ConsoleMode::Full,
        }
    }
}

fn format_cell(v: f64) -> String {
    let a = v.abs();
    if v == 0.0 {
        "0".to_string()
    } else if !v.is_finite() {
        format!("{v}")
    } else if (1e-3..1e5).contains(&a) {
        format!("{v:.4}")
    } else {
        format!("{v:.3e}")
    }
}

fn render_table_step(
    columns: &[Column],
    rows: usize,
    step: u64,
    metrics: &[(String, f64)],
) -> String {
    let lookup = |k: &str| metrics.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
    let mut text = String::new();
    let has_train_metric = columns
        .iter()
        .any(|c| c.keys.iter().any(|k| lookup(k).is_some()));
    if has_train_metric {
        if rows % HEADER_EVERY == 0 {
            text.push_str(&format!("{:>7}", "step"));
            for c in columns {
                text.push_str(&format!(" {:>w$}", c.header, w = COL_WIDTH));
            }
            text.push('\n');
        }
        text.push_str(&format!("{step:>7}"));
        for c in columns {
            let cell = c
                .keys
                .iter()
                .find_map(|k| lookup(k))
                .map_or_else(|| "-".to_string(), format_cell);
            text.push_str(&format!(" {cell:>w$}", w = COL_WIDTH));
        }
        text.push('\n');
    }
    for (k, v) in metrics.iter().filter(|(k, _)| k.starts_with("val-core/")) {
        text.push_str(&format!("{step:>7}  {k} = {}\n", format_cell(*v)));
    }
    text
}

impl Sink for ConsoleSink {
    fn name(&self) -> &str {
        "console"
    }

    fn log(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()> {
        let text = match &mut self.mode {
            ConsoleMode::Table { columns, rows } => {
                let t = render_table_step(columns, *rows, step, metrics);
                if t.lines().any(|l| !l.contains(" = ")) {
                    *rows += 1;
                }
                t
            }
            ConsoleMode::Full => {
                let mut line = format!("step:{step}");
                for (k, v) in metrics {
                    line.push_str(&format!(" - {k}:{v:?}"));
                }
                line.push('\n');
                line
            }
        };
        self.out
            .write_all(text.as_bytes())
            .and_then(|()| self.out.flush())
            .map_err(io("write to", "the console"))
    }
}

// ---- JSONL --------------------------------------------------------------------------------------------------

/// verl's `file` logger: one `{"step": N, "data": {...}}` line per step, written whole and flushed each step.
/// Unlike verl (which truncates) it appends, so a resumed run keeps its history; readers take the last line
/// of a repeated step. Non-finite values are written as `null`, as verl's `orjson` does.
pub struct JsonlSink {
    path: PathBuf,
    file: File,
}

impl JsonlSink {
    /// Open `path` for appending, creating it and its folder.
    pub fn open(path: &Path) -> Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io("create the folder of", path))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(io("open for appending", path))?;
        Ok(JsonlSink {
            path: path.to_path_buf(),
            file,
        })
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The JSON line for one step, metrics in the order given (built by hand so that the order does not depend
/// on serde_json's map features).
pub fn jsonl_line(step: u64, metrics: &[(String, f64)]) -> String {
    let mut line = format!("{{\"step\":{step},\"data\":{{");
    for (i, (k, v)) in metrics.iter().enumerate() {
        if i > 0 {
            line.push(',');
        }
        line.push_str(&Value::from(k.as_str()).to_string());
        line.push(':');
        match Number::from_f64(*v) {
            Some(n) => line.push_str(&n.to_string()),
            None => line.push_str("null"),
        }
    }
    line.push_str("}}\n");
    line
}

impl Sink for JsonlSink {
    fn name(&self) -> &str {
        "file"
    }

    fn log(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()> {
        // One write per line: a crash leaves whole lines, at worst a torn last one that readers skip.
        self.file
            .write_all(jsonl_line(step, metrics).as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(io("append to", &self.path))
    }

    fn finish(&mut self) -> Result<()> {
        self.file.sync_all().map_err(io("fsync", &self.path))
    }
}

// ---- TensorBoard --------------------------------------------------------------------------------------------

/// verl's `tensorboard` logger: scalars, and validation samples as Markdown text, into a native tfevents file.
pub struct TensorboardSink {
    writer: EventWriter,
}

impl TensorboardSink {
    /// A new event file in `dir`.
    pub fn create(dir: &Path) -> Result<Self> {
        Ok(TensorboardSink {
            writer: EventWriter::create(dir)?,
        })
    }

    /// The event file written.
    pub fn path(&self) -> &Path {
        self.writer.path()
    }
}

impl Sink for TensorboardSink {
    fn name(&self) -> &str {
        "tensorboard"
    }

    fn log(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()> {
        self.writer.add_scalars(step as i64, metrics)?;
        self.writer.flush()
    }

    /// One Markdown text per validation under `val/generations/text_summary`, in verl's layout.
    fn log_generations(&mut self, step: u64, samples: &[ValGeneration]) -> Result<()> {
        let text = tensorboard_text(step, samples);
        self.writer
            .add_text(step as i64, VAL_GENERATIONS_KEY, &text)?;
        self.writer.flush()
    }

    fn finish(&mut self) -> Result<()> {
        self.writer.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_shows_missing_metrics_as_dashes_and_validation_on_its_own_line() {
        let cols = default_columns();
        let m = vec![
            ("critic/score/mean".to_string(), 0.5),
            ("actor/reward_kl_penalty".to_string(), 0.0012),
            ("val-core/gsm8k/acc/mean@1".to_string(), 0.25),
        ];
        let text = render_table_step(&cols, 0, 3, &m);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].trim_start().starts_with("step") && lines[0].contains("score"));
        let cells: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(cells, ["3", "0.5000", "-", "0.0012", "-", "-", "-", "-"]);
        assert_eq!(lines[2].trim(), "3  val-core/gsm8k/acc/mean@1 = 0.2500");
        // Header only every HEADER_EVERY rows.
        assert_eq!(render_table_step(&cols, 1, 4, &m).lines().count(), 2);
    }

    #[test]
    fn cells_use_fixed_or_scientific_notation_by_magnitude() {
        assert_eq!(format_cell(1234.5678), "1234.5678");
        assert_eq!(format_cell(1.5e-6), "1.500e-6");
        assert_eq!(format_cell(0.0), "0");
        assert_eq!(format_cell(f64::NAN), "NaN");
    }

    #[test]
    fn jsonl_line_nulls_non_finite_values() {
        let line = jsonl_line(7, &[("a".into(), 1.5), ("b".into(), f64::NAN)]);
        assert_eq!(line, "{\"step\":7,\"data\":{\"a\":1.5,\"b\":null}}\n");
    }
}

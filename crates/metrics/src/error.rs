//! The crate's single error type.

use std::path::PathBuf;

/// Everything that can go wrong while computing, logging, reading back or plotting metrics.
///
/// Variants name the input, file or config key involved, what was expected and what was found.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)]
pub enum MetricsError {
    // ---- inputs ----------------------------------------------------------------------------------------
    /// A per-row or per-token input has the wrong number of entries.
    #[error("{op}: `{input}` has {found} entries, expected {expected} ({why})")]
    Length {
        op: &'static str,
        input: &'static str,
        expected: usize,
        found: usize,
        why: &'static str,
    },

    /// A named data column has the wrong number of entries.
    #[error("{op}: column `{column}` has {found} entries, expected {expected} (one per sample)")]
    ColumnLength {
        op: &'static str,
        column: String,
        expected: usize,
        found: usize,
    },

    /// A statistic was asked of nothing (verl's torch reductions raise on empty tensors too).
    #[error("{op}: no {what} to reduce (expected at least one)")]
    Empty { op: &'static str, what: String },

    /// Every response in the batch is empty; verl raises "All samples are aborted".
    #[error(
        "compute_data_metrics: all {rows} samples are aborted (response length 0); expected at least one response"
    )]
    AllAborted { rows: usize },

    /// A timing section needed by a metric is missing.
    #[error("{op}: timing section `{section}` is missing; found sections [{found}]")]
    MissingTiming {
        op: &'static str,
        section: &'static str,
        found: String,
    },

    // ---- configuration ----------------------------------------------------------------------------------
    /// `trainer.logger` names a backend verl does not know either.
    #[error("trainer.logger: unknown logger `{found}`; expected one of {expected}")]
    UnknownBackend { found: String, expected: String },

    /// `trainer.logger` names a verl logger that verl-rs does not provide.
    #[error(
        "trainer.logger: `{found}` is a verl logger that verl-rs does not provide; available: {available}"
    )]
    UnsupportedBackend { found: String, available: String },

    // ---- Python-client loggers (wandb, mlflow, swanlab) ----------------------------------------------------
    /// The interpreter meant to run a logger's sidecar cannot be started.
    #[error(
        "trainer.logger: `{logger}` runs its Python client with `{}` ($VERL_PYTHON, else python3 on PATH), which \
         cannot be started: {source}; point VERL_PYTHON at a Python with `{logger}` installed, or set \
         trainer.logger=[console]",
        python.display()
    )]
    PythonSpawn {
        logger: String,
        python: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The logger's Python package does not import.
    #[error(
        "trainer.logger: `{logger}` needs the Python package `{package}`, which `{}` cannot import \
         ({import_error}); install it (`{} -m pip install {package}`) or set trainer.logger=[console]",
        python.display(),
        python.display()
    )]
    MissingPackage {
        logger: String,
        python: PathBuf,
        package: String,
        import_error: String,
    },

    /// The client raised: starting the run (bad tracking URI, unreachable server, no credentials), logging a
    /// step or finishing.
    #[error("trainer.logger: `{logger}`: {op} failed: {message}{hint}")]
    SidecarFailed {
        logger: String,
        op: String,
        message: String,
        hint: &'static str,
    },

    /// The sidecar process is gone.
    #[error(
        "trainer.logger: the `{logger}` sidecar (`{}`, pid {pid}) {what}; its last stderr lines: \
         {stderr_tail}",
        python.display()
    )]
    SidecarDied {
        logger: String,
        python: PathBuf,
        pid: u32,
        /// Its exit status and what it was doing (`exited with code 1 while logging step 3`).
        what: String,
        stderr_tail: String,
    },

    /// The sidecar did not answer in time and was killed.
    #[error("trainer.logger: the `{logger}` sidecar (pid {pid}) did not answer {during} within {secs} s and was killed")]
    SidecarTimeout {
        logger: String,
        pid: u32,
        during: String,
        secs: u64,
    },

    // ---- files ------------------------------------------------------------------------------------------
    /// A filesystem operation failed.
    #[error("metrics: cannot {op} `{}`: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A JSONL metrics line is not `{"step": N, "data"|"metrics": {...}}`.
    #[error("`{}` line {line}: expected {expected}; found {found}", path.display())]
    BadJsonl {
        path: PathBuf,
        line: usize,
        expected: &'static str,
        found: String,
    },

    /// A tfevents file is truncated, fails its CRC or does not decode.
    #[error("`{}` at byte {offset}: {what}", path.display())]
    BadEvents {
        path: PathBuf,
        offset: u64,
        what: String,
    },

    /// Nothing to plot: no metrics file in a run folder, or none of the requested metrics in it.
    #[error("plot `{}`: expected {expected}; found {found}", path.display())]
    NothingToPlot {
        path: PathBuf,
        expected: String,
        found: String,
    },

    /// The plotting backend failed.
    #[error("plot `{}`: drawing failed: {message}", path.display())]
    Draw { path: PathBuf, message: String },
}

/// Shorthand for this crate's results.
pub type Result<T, E = MetricsError> = std::result::Result<T, E>;

pub(crate) fn io(
    op: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> MetricsError {
    let path = path.into();
    move |source| MetricsError::Io { op, path, source }
}

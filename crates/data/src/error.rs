use std::fmt;
use std::path::PathBuf;

/// Every failure this crate reports. Messages name the file, row, column or key involved,
/// what was expected and what was found, so a user can fix their data without a debugger.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read `{path}`: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("cannot write `{path}`: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error(
        "`{path}`: unknown data file extension `{extension}`; expected one of .parquet, \
         .arrow, .feather, .ipc (Arrow IPC file format), .jsonl, .json (one JSON object per line)"
    )]
    UnknownExtension { path: PathBuf, extension: String },

    #[error("no data files given (data.train_files / data.val_files is empty)")]
    NoFiles,

    #[error("`{path}`: invalid parquet file: {source}")]
    Parquet {
        path: PathBuf,
        #[source]
        source: parquet::errors::ParquetError,
    },

    #[error("`{path}`: invalid Arrow data: {source}")]
    Arrow {
        path: PathBuf,
        #[source]
        source: arrow_schema::ArrowError,
    },

    #[error("`{path}` line {line}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },

    #[error("`{path}` line {line}: expected a JSON object (one row per line), found {found}")]
    JsonNotObject {
        path: PathBuf,
        line: usize,
        found: String,
    },

    #[error(
        "`{path}`{}: missing column `{column}`; columns present: [{}]",
        row.map(|r| format!(" row {r}")).unwrap_or_default(),
        present.join(", ")
    )]
    MissingColumn {
        path: PathBuf,
        /// `None` when the file's schema lacks the column (every row), `Some` for a JSONL line.
        row: Option<usize>,
        column: String,
        present: Vec<String>,
    },

    #[error("`{path}` row {row}, column `{column}`: expected {expected}, found {found}")]
    WrongType {
        path: PathBuf,
        row: usize,
        column: String,
        expected: String,
        found: String,
    },

    #[error(
        "dataset from [{}] is empty after filtering: {filtered} of {total} prompts removed ({reason})",
        paths.iter().map(|p| format!("`{}`", p.display())).collect::<Vec<_>>().join(", ")
    )]
    EmptyAfterFilter {
        paths: Vec<PathBuf>,
        total: usize,
        filtered: usize,
        reason: String,
    },

    #[error("`{path}` row {row} carries media in column `{column}` ({key}): verl-rs trains text-only models, and training on the text alone would not be the job you asked for; drop the column, or point {key} at a column the data does not have")]
    MultimodalRow {
        path: PathBuf,
        row: usize,
        column: String,
        key: String,
    },

    #[error("dataset from [{}] has no rows", paths.iter().map(|p| format!("`{}`", p.display())).collect::<Vec<_>>().join(", "))]
    EmptyDataset { paths: Vec<PathBuf> },

    #[error("prompt-length function failed on sample {index} (`{path}` row {row}): {source}")]
    PromptLength {
        index: usize,
        path: PathBuf,
        row: usize,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    #[error(
        "filter_overlong_prompts is true but no prompt-length function was given \
         (the length is measured after the chat template; pass one to Dataset::prepare)"
    )]
    MissingPromptLengthFn,

    #[error(
        "sample {index}: prompt is {length} tokens, longer than max_prompt_length={max} \
         (data.truncation=error; set it to left, right or middle, or enable data.filter_overlong_prompts)"
    )]
    PromptTooLong {
        index: usize,
        length: usize,
        max: usize,
    },

    #[error("config key `{key}`: expected {expected}, found `{found}`")]
    InvalidConfig {
        key: String,
        expected: String,
        found: String,
    },

    #[error(
        "data loader would yield no batch: {num_samples} samples, batch size {batch_size}, \
         drop_last={drop_last}"
    )]
    EmptyLoader {
        num_samples: usize,
        batch_size: usize,
        drop_last: bool,
    },

    #[error(
        "cannot resume data loader: saved state has {field}={saved}, current run has {current}"
    )]
    StateMismatch {
        field: &'static str,
        saved: String,
        current: String,
    },

    #[error("`{path}` line {line}: {message}")]
    Preprocess {
        path: PathBuf,
        line: usize,
        message: String,
    },

    #[error("`{dir}`: no `{split}` split: expected {expected}")]
    MissingSplit {
        dir: PathBuf,
        split: String,
        /// The file layouts that were looked for.
        expected: String,
    },

    #[error(
        "`{path}` row {row}, column `{column}`: expected a final `\\boxed{{...}}` or \
         `\\boxed ...` answer (verl's last_boxed_only_string + remove_boxed), found {reason}"
    )]
    NoBoxedAnswer {
        path: PathBuf,
        row: usize,
        column: String,
        reason: Unboxed,
    },
}

pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// Why a solution has no answer verl can extract. verl's script raises on each (the whole run
/// stops), so we refuse the row instead of writing something verl never would.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unboxed {
    /// Neither `\boxed` nor `\fbox` occurs (verl: `TypeError` in `remove_boxed(None)`).
    Missing,
    /// The braces after the last `\boxed`/`\fbox` never balance (verl: `TypeError`).
    Unclosed { from: String },
    /// The last boxed expression is an `\fbox{..}`, or a `\boxed` not directly followed by `{`
    /// (verl: `AssertionError` in `remove_boxed`).
    NotBoxedBrace { found: String },
}

impl fmt::Display for Unboxed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unboxed::Missing => write!(
                f,
                "no `\\boxed` or `\\fbox` (verl raises TypeError in remove_boxed)"
            ),
            Unboxed::Unclosed { from } => write!(
                f,
                "`{from}` whose braces never close (verl raises TypeError in remove_boxed)"
            ),
            Unboxed::NotBoxedBrace { found } => write!(
                f,
                "`{found}`, which is not `\\boxed{{...}}` (verl's remove_boxed asserts)"
            ),
        }
    }
}

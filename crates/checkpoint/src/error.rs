//! The crate's single error type.

use std::path::PathBuf;

/// What a checkpoint writer callback may return: any error, boxed (`anyhow::Error` converts with `.into()`).
pub type WriterError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong while saving, finding or resuming a checkpoint.
///
/// Each variant names the file or config key involved, what was expected and what was found.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)]
pub enum CheckpointError {
    /// A filesystem operation failed.
    #[error("checkpoint: cannot {op} `{}`: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// `trainer.resume_mode` is not one of verl's values.
    #[error(
        "trainer.resume_mode: expected one of `auto`, `disable`, `resume_path`; found `{found}`"
    )]
    UnknownResumeMode { found: String },

    /// `trainer.resume_mode=resume_path` without `trainer.resume_from_path`.
    #[error(
        "trainer.resume_mode=resume_path: expected trainer.resume_from_path to name a `global_step_N` folder; \
         found it unset"
    )]
    ResumePathUnset,

    /// `trainer.resume_from_path` does not name an existing `global_step_N` folder.
    #[error(
        "trainer.resume_from_path `{}`: expected an existing `global_step_N` directory; found {found}",
        path.display()
    )]
    ResumePathInvalid { path: PathBuf, found: String },

    /// `latest_checkpointed_iteration.txt` does not hold a step number.
    #[error("`{}`: expected a decimal global step number; found {found:?}", path.display())]
    BadTracker { path: PathBuf, found: String },

    /// A JSON state file is unreadable or cannot be written.
    #[error("`{}`: expected {what} as JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },

    /// A role's writer callback returned an error; the half-written checkpoint was discarded.
    #[error(
        "{role} checkpoint writer for global_step_{step} failed while writing into `{}` \
         (the partial checkpoint was discarded): {source}",
        dir.display()
    )]
    WriterFailed {
        role: String,
        step: u64,
        dir: PathBuf,
        #[source]
        source: WriterError,
    },

    /// A role's writer callback panicked; the half-written checkpoint was discarded.
    #[error(
        "{role} checkpoint writer for global_step_{step} panicked while writing into `{}` \
         (the partial checkpoint was discarded): {message}",
        dir.display()
    )]
    WriterPanicked {
        role: String,
        step: u64,
        dir: PathBuf,
        message: String,
    },

    /// A pending checkpoint whose writer failed was committed anyway.
    #[error("global_step_{step}: cannot commit a checkpoint that was discarded because {reason}")]
    Discarded { step: u64, reason: String },

    /// A resumed checkpoint lacks a role's folder (pruned by `max_*_ckpt_to_keep`, or never saved).
    #[error("`{}`: expected a `{role}` folder to resume from; found none (pruned or never saved)", dir.display())]
    MissingRole { role: String, dir: PathBuf },

    /// The same role or state file was written twice into one pending checkpoint.
    #[error(
        "global_step_{step}: `{name}` was already written into this checkpoint; expected each once"
    )]
    DuplicateEntry { step: u64, name: String },
}

/// Shorthand for this crate's results.
pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;

pub(crate) fn io(
    op: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let path = path.into();
    move |source| CheckpointError::Io { op, path, source }
}

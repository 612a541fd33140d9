//! The crate's one error type. Every message names the config key, column, file or training step
//! involved, what was expected and what was found.

use std::path::PathBuf;

use verl_plugin_api::{Error as ApiError, ErrorKind};

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A config key holds a value this backend cannot use.
    #[error("config key `{key}`: expected {expected}, found {found}")]
    Config {
        key: String,
        expected: String,
        found: String,
    },

    /// An input column is unusable (beyond what the ABI contract checks already caught).
    #[error("{call}: column `{column}`: expected {expected}, found {found}")]
    Input {
        call: &'static str,
        column: String,
        expected: String,
        found: String,
    },

    /// A loss or gradient norm is NaN/inf: the optimizer step was not taken, the weights are unchanged.
    #[error(
        "{role} update, global step {step}, epoch {epoch}, mini-batch {mini_batch}{micro}: `{metric}` is not finite ({value}); the optimizer step was skipped and the weights are unchanged"
    )]
    NonFinite {
        role: &'static str,
        step: u64,
        epoch: usize,
        mini_batch: usize,
        /// `", micro-batch N"` when the value belongs to one micro-batch.
        micro: String,
        metric: String,
        value: f64,
    },

    /// A checkpoint folder is missing a file or holds something else than this backend wrote.
    #[error("checkpoint {path}: {message}")]
    Checkpoint { path: PathBuf, message: String },

    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A collective or the rendezvous of the data-parallel group failed; when another rank failed
    /// first, `source` names it and carries its message.
    #[error("data-parallel {op}: {source}")]
    Comm {
        op: &'static str,
        #[source]
        source: verl_comm::CommError,
    },

    #[error(transparent)]
    Model(#[from] verl_nn::NnError),

    #[error(transparent)]
    Loss(#[from] verl_losses::LossError),

    #[error("libtorch: {context}: {source}")]
    Torch {
        context: String,
        #[source]
        source: tch::TchError,
    },

    /// A libtorch entry point reached through the torch-ext shim (fused AdamW).
    #[error(transparent)]
    TorchExt(#[from] verl_torch_ext::TorchExtError),

    #[error(transparent)]
    Api(#[from] ApiError),
}

pub type Result<T> = std::result::Result<T, BackendError>;

impl BackendError {
    pub fn config(
        key: impl Into<String>,
        expected: impl Into<String>,
        found: impl ToString,
    ) -> Self {
        BackendError::Config {
            key: key.into(),
            expected: expected.into(),
            found: found.to_string(),
        }
    }
}

/// Adds a short description of the operation to tch errors.
pub trait TorchContext<T> {
    fn ctx(self, context: &str) -> Result<T>;
}

impl<T> TorchContext<T> for std::result::Result<T, tch::TchError> {
    fn ctx(self, context: &str) -> Result<T> {
        self.map_err(|source| BackendError::Torch {
            context: context.to_string(),
            source,
        })
    }
}

impl From<BackendError> for ApiError {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::Api(inner) => inner,
            BackendError::Input { .. } => {
                ApiError::with_kind(ErrorKind::InvalidInput, e.to_string())
            }
            BackendError::Io { .. } => ApiError::with_kind(ErrorKind::Io, e.to_string()),
            other => ApiError::failed(other.to_string()),
        }
    }
}

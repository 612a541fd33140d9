//! The crate's one error type. Every message names the config key, column, file, parallel group or
//! training step involved, what was expected and what was found.

use std::path::PathBuf;

use verl_plugin_api::Error as ApiError;

#[derive(Debug, thiserror::Error)]
pub enum MegatronError {
    /// A call into the torch extension (CUDA allocator, kernels) failed.
    #[error("torch extension: {0}")]
    Ext(#[from] verl_torch_ext::TorchExtError),

    /// The parallel layout does not fit the world size or the model (the message shows the
    /// arithmetic and the values that would work).
    #[error("config key `{key}`: {message}")]
    Layout { key: String, message: String },

    /// A configuration this backend understands but does not implement yet (expert or context
    /// parallelism, ...).
    #[error("config key `{key}`: {what} is not implemented by the megatron backend yet")]
    Unsupported { key: String, what: String },

    /// A collective of one of the parallel groups failed; when another rank failed first, `source`
    /// names it and carries its message.
    #[error("{group} {op}: {source}")]
    Comm {
        group: &'static str,
        op: &'static str,
        #[source]
        source: Box<verl_comm::CommError>,
    },

    #[error(transparent)]
    Model(#[from] verl_nn::NnError),

    #[error(transparent)]
    Loss(#[from] verl_losses::LossError),

    /// Errors of the batching, optimizer and metric helpers shared with the FSDP backend.
    #[error(transparent)]
    Shared(Box<verl_backend_kit::BackendError>),

    /// A libtorch call failed; `message` is its first line (libtorch appends a C++ backtrace).
    #[error("libtorch: {context}: {message}")]
    Torch { context: String, message: String },

    #[error(transparent)]
    Api(#[from] ApiError),
}

pub type Result<T> = std::result::Result<T, MegatronError>;

impl MegatronError {
    pub fn config(
        key: impl Into<String>,
        expected: impl Into<String>,
        found: impl ToString,
    ) -> Self {
        verl_backend_kit::BackendError::config(key, expected, found).into()
    }

    pub fn checkpoint(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        verl_backend_kit::BackendError::Checkpoint {
            path: path.into(),
            message: message.into(),
        }
        .into()
    }

    /// True when this error only repeats another rank's failure.
    pub(crate) fn is_peer_failure(&self) -> bool {
        matches!(
            self,
            MegatronError::Comm { source, .. }
                if matches!(**source, verl_comm::CommError::PeerFailed { .. })
        ) || matches!(
            self,
            MegatronError::Shared(e) if matches!(
                **e,
                verl_backend_kit::BackendError::Comm {
                    source: verl_comm::CommError::PeerFailed { .. },
                    ..
                }
            )
        )
    }
}

impl From<verl_backend_kit::BackendError> for MegatronError {
    fn from(e: verl_backend_kit::BackendError) -> Self {
        MegatronError::Shared(Box::new(e))
    }
}

/// Adds a short description of the operation to tch errors.
pub(crate) trait TorchContext<T> {
    fn ctx(self, context: &str) -> Result<T>;
}

impl<T> TorchContext<T> for std::result::Result<T, tch::TchError> {
    fn ctx(self, context: &str) -> Result<T> {
        self.map_err(|source| MegatronError::Torch {
            context: context.to_string(),
            message: source
                .to_string()
                .lines()
                .next()
                .unwrap_or_default()
                .to_string(),
        })
    }
}

impl From<MegatronError> for ApiError {
    fn from(e: MegatronError) -> Self {
        match e {
            MegatronError::Api(inner) => inner,
            MegatronError::Shared(inner) => (*inner).into(),
            MegatronError::Unsupported { .. } => ApiError::not_implemented(e.to_string()),
            other => ApiError::failed(other.to_string()),
        }
    }
}

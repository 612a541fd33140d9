use std::path::PathBuf;

/// Every failure of this crate. Messages name the file / key / tensor involved, what was expected
/// and what was found, so a user can fix a checkpoint or config without reading our source.
#[derive(Debug, thiserror::Error)]
pub enum NnError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    #[error("{path}: unsupported model_type {found:?}; supported model types: {supported}")]
    UnsupportedModelType {
        path: PathBuf,
        found: String,
        supported: String,
    },

    #[error(
        "{path}: unsupported architecture {found:?} for model_type {model_type:?}; supported: {supported}"
    )]
    UnsupportedArchitecture {
        path: PathBuf,
        model_type: String,
        found: String,
        supported: String,
    },

    #[error("{path}: config key `{key}`: expected {expected}, found {found}")]
    InvalidConfig {
        path: PathBuf,
        key: String,
        expected: String,
        found: String,
    },

    #[error("{dir}: no checkpoint found (looked for {looked_for})")]
    NoCheckpoint { dir: PathBuf, looked_for: String },

    #[error("{path}: malformed safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },

    #[error("{dir}: checkpoint lacks tensor `{name}` (needed by this {arch} model)")]
    MissingTensor {
        dir: PathBuf,
        name: String,
        arch: String,
    },

    #[error("{path}: tensor `{name}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        path: PathBuf,
        name: String,
        expected: Vec<i64>,
        found: Vec<i64>,
    },

    #[error("{path}: tensor `{name}` has dtype {found}, expected one of F32, F16, BF16, F64")]
    UnsupportedDtype {
        path: PathBuf,
        name: String,
        found: String,
    },

    #[error(
        "{dir}: checkpoint has {count} tensor(s) this {arch} model does not use \
         (config/checkpoint mismatch?): {names:?}"
    )]
    UnexpectedTensors {
        dir: PathBuf,
        arch: String,
        count: usize,
        /// The first few offending names.
        names: Vec<String>,
    },

    #[error("invalid input `{what}`: expected {expected}, found {found}")]
    InvalidInput {
        what: String,
        expected: String,
        found: String,
    },

    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),

    /// A fused CUDA kernel of the torch extension (inference paths) failed.
    #[error("fused kernel: {0}")]
    Kernel(#[from] verl_torch_ext::TorchExtError),

    /// A [`crate::ParamGate`] could not materialise, free or take the gradients of a unit (the
    /// gate keeps the underlying cause for its owner).
    #[error("parameter gate, unit {unit}: {message}")]
    Gate { unit: String, message: String },
}

pub type Result<T, E = NnError> = std::result::Result<T, E>;

impl NnError {
    pub(crate) fn input(
        what: impl Into<String>,
        expected: impl Into<String>,
        found: impl Into<String>,
    ) -> Self {
        NnError::InvalidInput {
            what: what.into(),
            expected: expected.into(),
            found: found.into(),
        }
    }
}

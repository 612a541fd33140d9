use thiserror::Error;

/// Everything that can go wrong in this crate. Config errors name the verl key, what it accepts and what was
/// found; tensor errors name the argument, the expected and the found shape or dtype.
#[derive(Debug, Error)]
pub enum LossError {
    /// A fused CUDA kernel of the torch extension (the LM head's log-prob / entropy) failed.
    #[error("LM head kernel: {0}")]
    Kernel(#[from] verl_torch_ext::TorchExtError),

    /// A name-valued config key (`policy_loss.loss_mode`, `loss_agg_mode`, `kl_loss_type`) holds a name we do
    /// not know.
    #[error("config key `{key}`: unknown value {found:?}; valid values: {}{}", valid.join(", "), note.as_deref().map(|n| format!(" ({n})")).unwrap_or_default())]
    UnknownName {
        key: &'static str,
        found: String,
        valid: Vec<&'static str>,
        note: Option<String>,
    },

    /// A numeric config value is outside the range the algorithm is defined for.
    #[error("config key `{key}`: expected {expected}, found {found}")]
    InvalidValue {
        key: &'static str,
        expected: &'static str,
        found: f64,
    },

    /// A tensor argument does not have the shape the computation needs.
    #[error("{op}: argument `{arg}` has shape {found:?}, expected {expected}")]
    Shape {
        op: &'static str,
        arg: &'static str,
        expected: String,
        found: Vec<i64>,
    },

    /// A tensor argument has a dtype the computation cannot use.
    #[error("{op}: argument `{arg}` has dtype {found}, expected {expected}")]
    Dtype {
        op: &'static str,
        arg: &'static str,
        expected: &'static str,
        found: String,
    },

    /// The global normaliser handed in by the backend cannot produce a finite loss.
    #[error("{op}: global normaliser `{field}` is {found}, expected {expected} (the backend must all-reduce the mini-batch counts before the micro-batch loop)")]
    Normaliser {
        op: &'static str,
        field: &'static str,
        expected: &'static str,
        found: f64,
    },

    /// An input the configuration requires was not supplied by the caller.
    #[error("{op}: `{input}` is required because {reason}")]
    MissingInput {
        op: &'static str,
        input: &'static str,
        reason: &'static str,
    },

    /// libtorch raised an exception (caught through tch's fallible `f_*` API).
    #[error("{op}: libtorch error: {source}")]
    Torch {
        op: &'static str,
        #[source]
        source: tch::TchError,
    },
}

pub type Result<T, E = LossError> = std::result::Result<T, E>;

/// Attaches the operation name to a libtorch error, so a failure deep inside a loss says which loss it was.
pub(crate) trait TorchContext<T> {
    fn op(self, op: &'static str) -> Result<T>;
}

impl<T> TorchContext<T> for std::result::Result<T, tch::TchError> {
    fn op(self, op: &'static str) -> Result<T> {
        self.map_err(|source| LossError::Torch { op, source })
    }
}

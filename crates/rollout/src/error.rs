/// Every failure of the generation engine. Input errors name the argument or `SamplingParams`
/// field, what was expected and what was found.
#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    #[error("rollout input `{what}`: expected {expected}, found {found}")]
    Input {
        what: String,
        expected: String,
        found: String,
    },

    #[error("rollout model: {0}")]
    Model(#[from] verl_nn::NnError),

    #[error("rollout libtorch call failed: {0}")]
    Torch(#[from] tch::TchError),

    #[error("rollout CUDA extension (graphs, kernels): {0}")]
    Graph(#[from] verl_torch_ext::TorchExtError),

    /// A multi-turn caller's [`crate::TurnDriver`] failed; its own error, as it said it.
    #[error("{0}")]
    Driver(String),
}

impl RolloutError {
    pub(crate) fn input(
        what: impl Into<String>,
        expected: impl Into<String>,
        found: impl Into<String>,
    ) -> Self {
        RolloutError::Input {
            what: what.into(),
            expected: expected.into(),
            found: found.into(),
        }
    }
}

pub type Result<T, E = RolloutError> = std::result::Result<T, E>;

//! verl-losses: the RL training losses of verl 0.9 on tch, for the backends' update steps — policy losses
//! (`vanilla`, `gspo`, `sapo`, `gpg`, `cispo`, `geo_mean`, `dppo_tv`, `dppo_kl`), `agg_loss` with a global normaliser that keeps gradient
//! accumulation and data parallelism exact, KL and entropy terms, the clipped value loss, and a chunked
//! LM-head log-prob/entropy path. It computes on tensors it is handed: it owns no model, optimizer,
//! communicator or config file, never crosses the plugin ABI itself, and never panics (tch `f_*` calls only).
//!
//! The contract a backend must follow for exact micro-batch accumulation is documented in [`agg`].

pub mod agg;
pub mod config;
pub mod deferred;
pub mod error;
pub mod kl;
pub mod policy;
pub mod tokens;
pub mod value;

pub use agg::{
    agg_loss, masked_mean, masked_sum, seq_mean, AggSpec, LossAggMode, LossScale, MaskCounts,
    Normaliser,
};
pub use config::{
    ActorInputs, ActorLoss, ActorLossConfig, ActorOutput, CriticLoss, CriticLossConfig,
    PolicyLossSection,
};
pub use deferred::{fetch_scalars, DeferredMetrics};
pub use error::{LossError, Result};
pub use kl::{KlEstimator, KlPenalty};
pub use policy::{
    DppoDivergence, PolicyInputs, PolicyLoss, PolicyMetrics, PolicyOutput, POLICY_LOSS_MODES,
};
pub use tokens::{entropy_from_logits, logprobs_from_logits, ChunkedLmHead, TokenStats};
pub use value::{value_loss, ValueInputs, ValueMetrics, ValueOutput};

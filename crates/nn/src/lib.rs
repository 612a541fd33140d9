//! `verl-nn`: decoder-only transformer models on tch (libtorch) and HF safetensors checkpoint I/O.
//!
//! Owns: parsing HF `config.json` into a typed [`ModelConfig`]; the Llama / Mistral / Qwen2 / Qwen3 /
//! Mixtral / Qwen2-MoE / Qwen3-MoE decoder with an LM, value or sequence-classification head
//! ([`Transformer`]); the KV cache for incremental decoding ([`KvCache`]) and the
//! [`AttentionBackend`] hook through which a generation engine keeps its own (paged) one; activation
//! checkpointing ([`Transformer::forward_backward`]); the [`ParamGate`] hook through which a sharding
//! backend materialises each [`Unit`]'s parameters around its use; loading and saving HF safetensors
//! folders; one tensor-parallel rank's shard of a dense model for inference
//! ([`Transformer::tp_shard`], Megatron's layout, collectives through the caller's [`TpComm`]).
//!
//! Must not: own training loops, losses, optimizers, sampling policies or distributed sharding
//! itself (those belong to the losses crate, the backends and the generation engine); panic (every libtorch
//! call goes through tch's fallible `f_*` API and surfaces as [`NnError`]); download anything.
//! Code paths are device-generic: the same model runs on CPU and CUDA.

mod attention_backend;
pub mod checkpoint;
pub mod config;
pub mod error;
mod layers;
pub mod lora;
pub mod model;
pub mod profile;
pub mod tp;

pub use checkpoint::{Checkpoint, LoadReport, SaveOptions};
pub use config::{Arch, ModelConfig, MoeConfig, RopeScaling};
pub use error::{NnError, Result};
pub use layers::{
    accumulating_into_grad, apply_rope, causal_attention, repeat_kv, rms_norm, silu_mul,
    varlen_layout, AttentionRows, Rope, VarlenRows,
};
pub use lora::{LoraConfig, LoraReport, Modules as LoraModules};
pub use model::{
    linear_fp32, AttentionBackend, AttentionCall, FusedDecodeWeights, GemmTuning, HeadKind,
    KvCache, ModelOptions, ParamGate, Transformer, Unit,
};
pub use tp::TpComm;

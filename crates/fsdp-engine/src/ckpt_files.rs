//! A role's checkpoint folder (the files [`crate::train`] writes and [`crate::shard`] reads back at
//! any world size), and how much of an offloaded role's state visits the device at once.

/// The role's state: format, step, the sharding it was written with.
pub const STATE_FILE: &str = "state.json";
/// AdamW's moments (and step) of every parameter.
pub const OPTIM_FILE: &str = "optim.safetensors";
/// fp32 master weights, where the model folder holds a lower-precision copy.
pub const MASTER_FILE: &str = "master.safetensors";
/// The HF model folder.
pub const MODEL_DIR: &str = "model";
/// One rank with offloaded state: the master-dtype bytes of parameters stepped per host round trip
/// (their moments and, offloaded, their masters visit the device together).
pub const OFFLOAD_CHUNK_BYTES: usize = 256 << 20;
/// The PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`) of a LoRA model,
/// inside a checkpoint and an HF export.
pub const LORA_DIR: &str = "lora_adapter";

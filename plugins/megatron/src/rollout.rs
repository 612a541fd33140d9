//! The model generation runs on: the actor's tensor-parallel shards as they are (rollout TP =
//! actor TP: every rank of a tensor-parallel group runs the `verl_rollout` engine in lock-step on a
//! `verl_nn::Transformer` holding its own shard), or a TP=1 copy gathered from them on every rank
//! (rollout TP = 1; also pipeline-parallel and mixture-of-experts models, whatever was asked).
//!
//! `actor_rollout_ref.rollout.tensor_model_parallel_size` picks one; re-sharding to any other
//! rollout TP is not supported.

use std::sync::Arc;

use serde_json::Value;
use tch::{Device, Tensor};
use verl_comm::ReduceOp;
use verl_nn::{HeadKind, ModelConfig, ModelOptions, NnError, TpComm, Transformer};

use crate::error::{MegatronError, Result, TorchContext};
use crate::layout::Layout;
use crate::parallel::Group;
use crate::tp::TpModel;

/// The config key choosing the rollout tensor-parallel size.
pub const ROLLOUT_TP_KEY: &str = "actor_rollout_ref.rollout.tensor_model_parallel_size";

/// verl's default `rollout.tensor_model_parallel_size` (its `ppo_trainer.yaml`), which the host's
/// defaults fill in when a job does not set the key.
const VERL_DEFAULT_ROLLOUT_TP: u64 = 2;

/// How generation gets its model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RolloutTp {
    /// Every rank gathers the full weights into a TP=1 model (rollout TP = 1).
    Gathered,
    /// Every rank runs on its own tensor-parallel shard, collectives over the TP group (rollout
    /// TP = actor TP).
    Sharded,
}

/// Resolves `actor_rollout_ref.rollout.tensor_model_parallel_size` against the actor's layout:
///
/// * 1: the gathered TP=1 copy;
/// * the actor's `tensor_model_parallel_size`, or absent / null: the TP-sharded weights (the
///   gathered copy when the actor's TP is 1, or for a pipeline-parallel or MoE model, which this
///   backend does not generate from sharded: then the asked rollout TP is ignored with a warning,
///   since it changes speed only);
/// * verl's default 2 when the actor's TP is not 2: treated as unset (the host's defaults fill it
///   in for every job), with a warning when the actor's TP is above 1;
/// * anything else: refused (re-sharding to a different rollout TP is not supported).
pub fn resolve(cfg: &Value, layout: &Layout, model: &ModelConfig) -> Result<RolloutTp> {
    let tp = layout.tp as u64;
    let v = cfg.pointer("/actor_rollout_ref/rollout/tensor_model_parallel_size");
    let asked = match v {
        None | Some(Value::Null) => tp,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => n,
            _ => {
                return Err(MegatronError::config(
                    ROLLOUT_TP_KEY,
                    "a positive integer (or null: the actor's tensor_model_parallel_size)",
                    v,
                ))
            }
        },
    };
    let set = asked;
    // At actor TP = 1 verl's default 2 is every job that leaves the key alone: taken as unset.
    let default_as_unset = asked != 1 && asked != tp && asked == VERL_DEFAULT_ROLLOUT_TP;
    let asked = if default_as_unset { tp } else { asked };
    if asked != 1 && asked != tp {
        return Err(MegatronError::config(
            ROLLOUT_TP_KEY,
            format!(
                "1 (generation on a gathered TP=1 copy) or the actor's tensor_model_parallel_size={tp} \
                 (generation on the TP-sharded weights): re-sharding to a different rollout \
                 tensor-parallel size is not supported"
            ),
            asked,
        ));
    }
    let gathered_because = if asked == 1 || tp == 1 {
        None
    } else if layout.pp > 1 {
        Some("a pipeline-parallel actor")
    } else if model.moe.is_some() {
        Some("a mixture-of-experts model")
    } else {
        return {
            if default_as_unset {
                tracing::warn!(
                    "{ROLLOUT_TP_KEY}={set} (verl's default) differs from the actor's \
                     tensor_model_parallel_size={tp}: taken as unset, generation runs on the \
                     TP={tp} shards; set it to 1 or {tp} to silence this"
                );
            }
            Ok(RolloutTp::Sharded)
        };
    };
    // One message for what generation does, whatever the value asked.
    if let Some(why) = gathered_because {
        tracing::warn!(
            "{ROLLOUT_TP_KEY}={set} is ignored: {why} generates on a gathered TP=1 copy \
             (the same tokens; the rollout TP only changes speed); set it to 1 to silence this"
        );
    }
    Ok(RolloutTp::Gathered)
}

/// [`TpComm`] over the tensor-parallel [`Group`]: the all-reduce of the communicator (NCCL's
/// result, or the CPU communicator's, is the same on every member) and an all-gather joined along
/// the last dimension.
pub struct GroupComm(pub Arc<Group>);

fn comm_err(what: &str, e: MegatronError) -> NnError {
    NnError::InvalidInput {
        what: format!("tensor-parallel {what}"),
        expected: "a completed collective".into(),
        found: e.to_string(),
    }
}

impl TpComm for GroupComm {
    fn rank(&self) -> usize {
        self.0.rank
    }
    fn size(&self) -> usize {
        self.0.size
    }
    fn all_reduce_sum(&self, t: &Tensor) -> verl_nn::Result<Tensor> {
        let mut s = t.f_contiguous()?.f_detach_copy()?;
        self.0
            .all_reduce(&mut s, ReduceOp::Sum, "all_reduce (generation)")
            .map_err(|e| comm_err("all-reduce", e))?;
        Ok(s)
    }
    fn all_gather_last(&self, t: &Tensor) -> verl_nn::Result<Tensor> {
        let parts = self
            .0
            .all_gather(t, "all_gather (generation logits)")
            .map_err(|e| comm_err("all-gather", e))?;
        Ok(Tensor::f_cat(&parts, -1)?)
    }
}

/// This rank's shard of `model` as a `verl_nn::Transformer` for generation: the live
/// (compute-dtype) weights copied as they are, no communication.
pub fn shard_model(model: &TpModel, tp: &Arc<Group>, device: Device) -> Result<Transformer> {
    let out = Transformer::tp_shard(
        model.config().clone(),
        &ModelOptions {
            device,
            dtype: model.dtype(),
            head: HeadKind::CausalLm,
        },
        Arc::new(GroupComm(tp.clone())),
    )?;
    tch::no_grad(|| -> Result<()> {
        for (name, dst) in out.named_parameters() {
            let i = model.param_index(name).ok_or_else(|| {
                MegatronError::Api(verl_plugin_api::Error::failed(format!(
                    "internal: no tensor-parallel parameter `{name}` for the generation shard"
                )))
            })?;
            let src = &model.params[i].local;
            if src.size() != dst.size() {
                return Err(MegatronError::Api(verl_plugin_api::Error::failed(format!(
                    "internal: generation shard `{name}` is {:?}, the training shard {:?}",
                    dst.size(),
                    src.size()
                ))));
            }
            dst.shallow_clone()
                .f_copy_(&src.f_detach().ctx("live weight")?)
                .ctx("copy generation shard")?;
        }
        Ok(())
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn model(moe: bool) -> ModelConfig {
        let mut v = json!({
            "model_type": "qwen2", "vocab_size": 40, "hidden_size": 16, "intermediate_size": 40,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        });
        if moe {
            v = json!({
                "model_type": "mixtral", "vocab_size": 40, "hidden_size": 16,
                "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
            });
        }
        ModelConfig::from_value(v, "inline/config.json").unwrap()
    }

    fn layout(tp: usize, pp: usize) -> Layout {
        Layout {
            tp,
            pp,
            ..Layout::single()
        }
    }

    fn cfg(v: Value) -> Value {
        json!({"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": v}}})
    }

    #[test]
    fn rollout_tp_resolution() {
        let dense = model(false);
        let r = |v: Value, tp, pp| resolve(&cfg(v), &layout(tp, pp), &dense);
        assert_eq!(r(json!(2), 2, 1).unwrap(), RolloutTp::Sharded);
        assert_eq!(r(Value::Null, 2, 1).unwrap(), RolloutTp::Sharded);
        assert_eq!(
            resolve(&json!({}), &layout(4, 1), &dense).unwrap(),
            RolloutTp::Sharded
        );
        assert_eq!(r(json!(1), 2, 1).unwrap(), RolloutTp::Gathered);
        assert_eq!(r(json!(1), 1, 1).unwrap(), RolloutTp::Gathered);
        // verl's default 2 with another actor TP: taken as unset.
        assert_eq!(r(json!(2), 1, 1).unwrap(), RolloutTp::Gathered);
        assert_eq!(r(json!(2), 4, 1).unwrap(), RolloutTp::Sharded);
        // Pipeline-parallel and MoE actors generate on the gathered copy.
        assert_eq!(r(json!(2), 2, 2).unwrap(), RolloutTp::Gathered);
        assert_eq!(
            resolve(&cfg(json!(2)), &layout(2, 1), &model(true)).unwrap(),
            RolloutTp::Gathered
        );
        let e = r(json!(4), 2, 1).unwrap_err().to_string();
        assert!(e.contains(ROLLOUT_TP_KEY), "{e}");
        assert!(e.contains("found 4"), "{e}");
        assert!(e.contains("tensor_model_parallel_size=2"), "{e}");
        assert!(e.contains("re-sharding"), "{e}");
        let e = r(json!(0), 2, 1).unwrap_err().to_string();
        assert!(e.contains("positive integer"), "{e}");
    }
}

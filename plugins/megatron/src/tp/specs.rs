//! Which parameters a model has, how each is split over the tensor-parallel ranks, and which pipeline stage holds it.

use super::*;

/// The parameters of a model, in a fixed order, with their full shapes and splits.
pub(super) fn param_specs(
    cfg: &ModelConfig,
    head: HeadKind,
) -> Result<Vec<(String, Vec<i64>, Split)>> {
    if head == HeadKind::SequenceClassification {
        return Err(MegatronError::Unsupported {
            key: "reward_model".into(),
            what: "a sequence-classification head".into(),
        });
    }
    let (h, nh, nkv, hd, inter, v) = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    );
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![v, h],
        Split::Rows,
    )];
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let mut push = |n: String, s: Vec<i64>, sp: Split| out.push((n, s, sp));
        push(
            format!("{p}.input_layernorm.weight"),
            vec![h],
            Split::Replicated,
        );
        for (n, rows) in [
            ("q_proj", nh * hd),
            ("k_proj", nkv * hd),
            ("v_proj", nkv * hd),
        ] {
            push(
                format!("{p}.self_attn.{n}.weight"),
                vec![rows, h],
                Split::Rows,
            );
            if cfg.qkv_bias {
                push(format!("{p}.self_attn.{n}.bias"), vec![rows], Split::Rows);
            }
        }
        push(
            format!("{p}.self_attn.o_proj.weight"),
            vec![h, nh * hd],
            Split::Cols,
        );
        if cfg.o_bias {
            push(
                format!("{p}.self_attn.o_proj.bias"),
                vec![h],
                Split::Replicated,
            );
        }
        if cfg.qk_norm {
            push(
                format!("{p}.self_attn.q_norm.weight"),
                vec![hd],
                Split::Replicated,
            );
            push(
                format!("{p}.self_attn.k_norm.weight"),
                vec![hd],
                Split::Replicated,
            );
        }
        push(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            Split::Replicated,
        );
        if is_sparse(cfg, i as usize) {
            out.extend(moe_specs(cfg, i as usize)?);
            continue;
        }
        for n in ["gate_proj", "up_proj"] {
            push(format!("{p}.mlp.{n}.weight"), vec![inter, h], Split::Rows);
            if cfg.mlp_bias {
                push(format!("{p}.mlp.{n}.bias"), vec![inter], Split::Rows);
            }
        }
        push(
            format!("{p}.mlp.down_proj.weight"),
            vec![h, inter],
            Split::Cols,
        );
        if cfg.mlp_bias {
            push(
                format!("{p}.mlp.down_proj.bias"),
                vec![h],
                Split::Replicated,
            );
        }
    }
    out.push(("model.norm.weight".into(), vec![h], Split::Replicated));
    match head {
        HeadKind::CausalLm if cfg.tie_word_embeddings => {}
        HeadKind::CausalLm => out.push(("lm_head.weight".into(), vec![v, h], Split::Rows)),
        _ => {
            out.push(("score.weight".into(), vec![1, h], Split::Replicated));
            out.push(("score.bias".into(), vec![1], Split::Replicated));
        }
    }
    Ok(out)
}

/// Whether decoder layer `layer` of `cfg` is a sparse MoE layer.
pub(super) fn is_sparse(cfg: &ModelConfig, layer: usize) -> bool {
    cfg.moe
        .as_ref()
        .and_then(|m| m.sparse_layers.get(layer).copied())
        .unwrap_or(false)
}

/// The parameters of sparse layer `layer`'s MoE block (every expert), as [`EpMoe`] holds them:
/// the router and a shared expert replicated, each routed expert's gate/up split by rows and
/// down by columns over the (expert-)tensor-parallel group.
pub(super) fn moe_specs(cfg: &ModelConfig, layer: usize) -> Result<Vec<(String, Vec<i64>, Split)>> {
    let s = MoeSpec::new(cfg, layer, 0.0)?;
    let (p, e, h, inter) = (&s.prefix, s.num_experts, s.hidden, s.expert_intermediate);
    let [g, u, d] = s.names;
    let mut out = vec![(format!("{p}.gate.weight"), vec![e, h], Split::Replicated)];
    for x in 0..e {
        out.push((
            format!("{p}.experts.{x}.{g}.weight"),
            vec![inter, h],
            Split::Rows,
        ));
        out.push((
            format!("{p}.experts.{x}.{u}.weight"),
            vec![inter, h],
            Split::Rows,
        ));
        out.push((
            format!("{p}.experts.{x}.{d}.weight"),
            vec![h, inter],
            Split::Cols,
        ));
    }
    if let Some(si) = s.shared_intermediate {
        for (n, shape) in [
            ("gate_proj", vec![si, h]),
            ("up_proj", vec![si, h]),
            ("down_proj", vec![h, si]),
        ] {
            out.push((
                format!("{p}.shared_expert.{n}.weight"),
                shape,
                Split::Replicated,
            ));
        }
        out.push((
            format!("{p}.shared_expert_gate.weight"),
            vec![1, h],
            Split::Replicated,
        ));
    }
    Ok(out)
}

/// The MoE block prefix (`model.layers.<i>.block_sparse_moe` / `.mlp`) of a sparse layer's
/// parameter `name`, with the layer index.
pub(super) fn moe_layer_of(cfg: &ModelConfig, name: &str) -> Option<usize> {
    let i = layer_of(name)?;
    if !is_sparse(cfg, i) {
        return None;
    }
    let p = format!("model.layers.{i}.");
    let rest = name.strip_prefix(&p)?;
    (rest.starts_with("block_sparse_moe.") || rest.starts_with("mlp.")).then_some(i)
}

/// The global layer index of a parameter name (`model.layers.<i>.…`).
pub(super) fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// The parameters stage `stage` holds, in [`param_specs`] order. With tied embeddings the last
/// stage holds its own copy of the embedding as the LM head (Megatron's shared embedding): its
/// gradient is summed with the first stage's before every optimizer step, so both copies stay
/// equal.
pub fn stage_specs(
    cfg: &ModelConfig,
    head: HeadKind,
    stage: Stage,
) -> Result<Vec<(String, Vec<i64>, Split)>> {
    let layers = stage.layers(cfg.num_hidden_layers as usize);
    let tied_head = head == HeadKind::CausalLm && cfg.tie_word_embeddings;
    Ok(param_specs(cfg, head)?
        .into_iter()
        .filter(|(name, _, _)| match layer_of(name) {
            Some(i) => layers.contains(&i),
            None if name == EMBED => stage.is_first() || (stage.is_last() && tied_head),
            None => stage.is_last(),
        })
        .collect())
}

pub const EMBED: &str = "model.embed_tokens.weight";

/// Rank `rank`'s block of `full` (of `size` blocks) under `split`.
pub fn shard_of(full: &Tensor, split: Split, rank: usize, size: usize) -> Result<Tensor> {
    match split.dim() {
        None => Ok(full.shallow_clone()),
        Some(d) => {
            let n = full.size()[d as usize] / size as i64;
            full.f_narrow(d, rank as i64 * n, n)
                .ctx("tensor-parallel shard")
        }
    }
}

//! Building a rank's shard of the model: its parameters from a checkpoint (or a seeded init), its layers, its stage of the pipeline.

use super::*;

impl TpModel {
    /// Builds this rank's slices of the model described by `cfg`, reading full tensors from
    /// `source`. A value head the source lacks (a critic started from a policy checkpoint) is
    /// initialised like HF's `_init_weights`, from the global generator: seed it identically on
    /// every rank first.
    pub fn new(
        cfg: ModelConfig,
        head_kind: HeadKind,
        dtype: Kind,
        device: Device,
        tp: Arc<Group>,
        source: &mut dyn FullSource,
    ) -> Result<TpModel> {
        Self::new_stage(
            cfg,
            head_kind,
            dtype,
            device,
            tp,
            Stage::single(),
            ExpertSetup::single(),
            source,
        )
    }

    /// [`TpModel::new`] for pipeline stage `stage`: only that stage's parameters are read and held.
    /// The sparse MoE layers of a mixture-of-experts model hold this expert-parallel rank's
    /// experts (of `experts.ep`), each split over the expert-tensor-parallel group.
    #[allow(clippy::too_many_arguments)]
    pub fn new_stage(
        cfg: ModelConfig,
        head_kind: HeadKind,
        dtype: Kind,
        device: Device,
        tp: Arc<Group>,
        stage: Stage,
        experts: ExpertSetup,
        source: &mut dyn FullSource,
    ) -> Result<TpModel> {
        if cfg.moe.is_some() && tp.size > 1 && experts.seq.size != tp.size {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(format!(
                "internal: the MoE token group has {} ranks, the tensor-parallel group {}",
                experts.seq.size, tp.size
            ))));
        }
        let specs = stage_specs(&cfg, head_kind, stage)?;
        let (rank, size) = (tp.rank, tp.size);
        let mut params = Vec::with_capacity(specs.len());
        let mut moe_splits = std::collections::HashMap::new();
        for (name, shape, split) in specs {
            if moe_layer_of(&cfg, &name).is_some() {
                moe_splits.insert(name, split);
                continue;
            }
            let full = match source.full(&name)? {
                Some(t) => t,
                None if name.starts_with("score.") => {
                    let t = Tensor::f_zeros(shape.as_slice(), (dtype, device)).ctx("value head")?;
                    if name.ends_with(".weight") {
                        let mut t2 = t.shallow_clone();
                        let _ = tch::no_grad(|| t2.f_normal_(0.0, cfg.initializer_range))
                            .ctx("initialise value head")?;
                    }
                    tracing::warn!("{name} is not in the checkpoint: freshly initialised");
                    t
                }
                None => {
                    return Err(MegatronError::Model(verl_nn::NnError::MissingTensor {
                        dir: std::path::PathBuf::from("<model source>"),
                        name,
                        arch: cfg.arch.to_string(),
                    }))
                }
            };
            if full.size() != shape {
                return Err(MegatronError::Model(verl_nn::NnError::ShapeMismatch {
                    path: std::path::PathBuf::from("<model source>"),
                    name,
                    expected: shape,
                    found: full.size(),
                }));
            }
            let local = shard_of(&full, split, rank, size)?
                .f_to_kind(dtype)
                .and_then(|t| t.f_to_device(device))
                .and_then(|t| t.f_contiguous())
                .and_then(|t| t.f_detach_copy())
                .ctx(&format!("load `{name}`"))?;
            params.push(TpParam {
                name,
                full_shape: shape,
                split,
                local,
                expert: None,
            });
        }
        // The MoE blocks read their own parameters (this rank's experts); the model shares their
        // tensors, so the optimizer's writes reach the blocks.
        let mut blocks = std::collections::HashMap::new();
        for i in stage.layers(cfg.num_hidden_layers as usize) {
            if !is_sparse(&cfg, i) {
                continue;
            }
            let spec = MoeSpec::new(&cfg, i, experts.aux_loss_coeff)?;
            let mut block = EpMoe::new(
                spec,
                experts.ep.clone(),
                experts.etp.clone(),
                dtype,
                device,
                source,
            )?;
            block.set_tokens(
                experts.seq.clone(),
                moe_tokens(false, tp.size, experts.etp.size),
            );
            let per_rank = block.local_expert_range().end - block.local_expert_range().start;
            let mut index = Vec::with_capacity(block.params.len());
            for mp in &block.params {
                let split = moe_splits.get(&mp.name).copied().ok_or_else(|| {
                    MegatronError::Api(verl_plugin_api::Error::failed(format!(
                        "internal: MoE parameter `{}` has no spec",
                        mp.name
                    )))
                })?;
                index.push(params.len());
                params.push(TpParam {
                    name: mp.name.clone(),
                    full_shape: mp.full_shape.clone(),
                    split,
                    local: mp.local.shallow_clone(),
                    expert: match mp.placement {
                        crate::moe::Placement::Expert { expert, .. } => Some((expert, per_rank)),
                        crate::moe::Placement::Replicated => None,
                    },
                });
            }
            blocks.insert(i, (block, index));
        }
        let index = |n: &str| -> Option<usize> { params.iter().position(|p| p.name == n) };
        let need = |n: String| -> Result<usize> {
            index(&n).ok_or_else(|| {
                MegatronError::Api(verl_plugin_api::Error::failed(format!(
                    "internal: parameter `{n}` was not built"
                )))
            })
        };
        let lin = |p: String| -> Result<Lin> {
            Ok(Lin {
                w: need(format!("{p}.weight"))?,
                b: index(&format!("{p}.bias")),
            })
        };
        let mut layers = Vec::new();
        for i in stage.layers(cfg.num_hidden_layers as usize) {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                in_norm: need(format!("{p}.input_layernorm.weight"))?,
                q: lin(format!("{p}.self_attn.q_proj"))?,
                k: lin(format!("{p}.self_attn.k_proj"))?,
                v: lin(format!("{p}.self_attn.v_proj"))?,
                o: lin(format!("{p}.self_attn.o_proj"))?,
                q_norm: index(&format!("{p}.self_attn.q_norm.weight")),
                k_norm: index(&format!("{p}.self_attn.k_norm.weight")),
                post_norm: need(format!("{p}.post_attention_layernorm.weight"))?,
                ffn: match blocks.remove(&i) {
                    Some((block, index)) => Ffn::Moe {
                        block: Box::new(block),
                        index,
                        layer: i,
                    },
                    None => Ffn::Dense {
                        gate: lin(format!("{p}.mlp.gate_proj"))?,
                        up: lin(format!("{p}.mlp.up_proj"))?,
                        down: lin(format!("{p}.mlp.down_proj"))?,
                    },
                },
                window: cfg.layer_windows.get(i).copied().flatten(),
            });
        }
        let embed = match stage.is_first() {
            true => Some(need(EMBED.into())?),
            false => None,
        };
        let (norm, head) = match (stage.is_last(), head_kind) {
            (false, _) => (None, None),
            (true, HeadKind::CausalLm) => (
                Some(need("model.norm.weight".into())?),
                Some(Head::Lm(match index("lm_head.weight") {
                    Some(i) => i,
                    None => need(EMBED.into())?,
                })),
            ),
            (true, _) => (
                Some(need("model.norm.weight".into())?),
                Some(Head::Value {
                    w: need("score.weight".into())?,
                    b: need("score.bias".into())?,
                }),
            ),
        };
        let tp_size = size as i64;
        let vocab_local = cfg.vocab_size / tp_size;
        let vocab_start = rank as i64 * vocab_local;
        let padding_local = cfg
            .pad_token_id
            .filter(|&p| p >= vocab_start && p < vocab_start + vocab_local)
            .map(|p| p - vocab_start)
            .unwrap_or(-1);
        let rope = Rope::new(&cfg, device)?;
        let moe_load = std::sync::Mutex::new(fresh_load(&cfg));
        let mut seq_sharded = vec![false; params.len()];
        for l in &layers {
            seq_sharded[l.in_norm] = true;
            seq_sharded[l.post_norm] = true;
            for b in [l.o.b, l.ffn_down_bias()].into_iter().flatten() {
                seq_sharded[b] = true;
            }
        }
        if let Some(n) = norm {
            seq_sharded[n] = true;
        }
        Ok(TpModel {
            sp: false,
            recompute: Recompute::All,
            grad_into: Vec::new(),
            seq_sharded,
            experts,
            moe_load,
            heads_local: cfg.num_attention_heads / tp_size,
            kv_local: cfg.num_key_value_heads / tp_size,
            vocab_start,
            vocab_local,
            padding_local,
            norm,
            embed,
            layers,
            head,
            stage,
            head_kind,
            dtype,
            device,
            tp,
            rope,
            params,
            cfg,
        })
    }
}

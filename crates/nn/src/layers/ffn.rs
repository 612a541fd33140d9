//! The feed-forward blocks: the dense SwiGLU MLP and the mixture of experts.

use super::*;

impl Mlp {
    pub fn new(
        f: &mut ParamFactory,
        prefix: &str,
        names: [&str; 3],
        hidden: i64,
        inter: i64,
        bias: bool,
    ) -> Result<Self> {
        Ok(Mlp {
            gate: f.linear(&format!("{prefix}.{}", names[0]), hidden, inter, bias)?,
            up: f.linear(&format!("{prefix}.{}", names[1]), hidden, inter, bias)?,
            down: f.linear(&format!("{prefix}.{}", names[2]), inter, hidden, bias)?,
            fused_gate_up: Mutex::new(None),
            lora_gate_up: Mutex::new(None),
        })
    }

    /// Builds (`on`) or drops the fused gate/up projection; returns the bytes it holds.
    pub fn fuse(&self, on: bool) -> Result<usize> {
        let parts = [&self.gate, &self.up];
        let bytes = crate::lora::fuse_adapters(&parts, &self.lora_gate_up, on)?;
        if let Some(a) = &self.down.lora {
            a.fuse(on)?;
        }
        Ok(bytes + self.fuse_base(on)?)
    }

    fn fuse_base(&self, on: bool) -> Result<usize> {
        let mut slot = self.fused_gate_up.lock().unwrap_or_else(|e| e.into_inner());
        *slot = None;
        if !on || self.gate.bias.is_some() || self.up.bias.is_some() {
            return Ok(0);
        }
        let _guard = tch::no_grad_guard();
        let w = Tensor::f_cat(&[&self.gate.weight, &self.up.weight], 0)?;
        let bytes = w.numel() * w.kind().elt_size_in_bytes();
        *slot = Some(w);
        Ok(bytes)
    }

    /// The (weight, bias) of each GEMM a decode step runs here: the fused gate/up while it exists
    /// (else gate and up), and down.
    pub(super) fn decode_gemms(&self) -> Vec<(Tensor, Option<Tensor>)> {
        let fused = self
            .fused_gate_up
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(Tensor::shallow_clone);
        let mut out = match fused {
            Some(w) => vec![(w, None)],
            None => vec![self.gate.gemm(), self.up.gemm()],
        };
        out.push(self.down.gemm());
        out
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // The fused copy is detached: never on a path that needs gradients.
        let fused = (!x.requires_grad())
            .then(|| self.fused_gate_up.lock().unwrap_or_else(|e| e.into_inner()))
            .and_then(|g| g.as_ref().map(|w| decode_linear(x, w, None)))
            .transpose()?;
        if let Some(gu) = fused {
            // gate's and up's adapters accumulate into the fused output.
            let gu = crate::lora::add_fused(gu, x, &[&self.gate, &self.up], &self.lora_gate_up)?;
            if fused_swiglu(&gu) {
                return self.down.forward(&verl_torch_ext::swiglu(&gu)?);
            }
            let inter = self.gate.weight.size()[0];
            let g = gu.f_narrow(-1, 0, inter)?.f_silu()?;
            return self
                .down
                .forward(&g.f_mul(&gu.f_narrow(-1, inter, inter)?)?);
        }
        // Under gradient-accumulation fusion gate and up are one backward node: x's gradient is
        // a GEMM and an accumulating GEMM instead of two GEMMs and a separate add.
        if self.gate.weight.requires_grad()
            && self.up.weight.requires_grad()
            && accumulating_into_grad()
        {
            let (g, u) = verl_torch_ext::linear_pair_accumulating(
                x,
                &self.gate.weight,
                &self.up.weight,
                self.gate.bias.as_ref(),
                self.up.bias.as_ref(),
            )?;
            return self.down.forward(&silu_mul(&g, &u)?);
        }
        let g = self.gate.forward(x)?;
        self.down.forward(&silu_mul(&g, &self.up.forward(x)?)?)
    }

    /// One tensor-parallel shard's MLP (gate/up column-parallel, down row-parallel): the partial
    /// sums of `down` reduced over the group, then its bias added once.
    pub fn forward_tp(&self, x: &Tensor, tp: &TpShard) -> Result<Tensor> {
        match &self.down.bias {
            // Without a down bias the local MLP's output is exactly the partial sum.
            None => tp.reduce_with_bias(&self.forward(x)?, None),
            Some(bias) => {
                let g = self.gate.forward(x)?;
                let partial = silu_mul(&g, &self.up.forward(x)?)?
                    .f_linear(&self.down.weight, None::<&Tensor>)?;
                tp.reduce_with_bias(&partial, Some(bias))
            }
        }
    }
}

impl Moe {
    pub fn new(f: &mut ParamFactory, cfg: &ModelConfig, prefix: &str) -> Result<Self> {
        let moe = cfg
            .moe
            .as_ref()
            .ok_or_else(|| NnError::input("moe config", "present for an MoE family", "absent"))?;
        let h = cfg.hidden_size;
        // Mixtral names expert projections w1 (gate) / w3 (up) / w2 (down).
        let names = if cfg.arch == crate::config::Arch::Mixtral {
            ["w1", "w3", "w2"]
        } else {
            ["gate_proj", "up_proj", "down_proj"]
        };
        let router = f.linear(&format!("{prefix}.gate"), h, moe.num_experts, false)?;
        let experts = (0..moe.num_experts)
            .map(|e| {
                Mlp::new(
                    f,
                    &format!("{prefix}.experts.{e}"),
                    names,
                    h,
                    moe.expert_intermediate_size,
                    false,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let shared = match moe.shared_expert_intermediate_size {
            None => None,
            Some(inter) => Some((
                Mlp::new(
                    f,
                    &format!("{prefix}.shared_expert"),
                    ["gate_proj", "up_proj", "down_proj"],
                    h,
                    inter,
                    false,
                )?,
                f.linear(&format!("{prefix}.shared_expert_gate"), h, 1, false)?,
            )),
        };
        Ok(Moe {
            router,
            experts,
            top_k: moe.top_k,
            norm_topk_prob: moe.norm_topk_prob,
            shared,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let size = x.size();
        let h = *size.last().unwrap_or(&0);
        let xs = x.f_reshape([-1, h])?;
        let kind = xs.kind();
        let probs = self.router.forward(&xs)?.f_softmax(1, Kind::Float)?;
        let (mut weights, selected) = probs.f_topk(self.top_k, -1, true, true)?;
        if self.norm_topk_prob {
            weights = weights.f_div(&weights.f_sum_dim_intlist(
                [-1i64].as_slice(),
                true,
                None::<Kind>,
            )?)?;
        }
        let weights = weights.f_to_kind(kind)?.f_reshape([-1])?;
        // One host sync per layer: group (token, slot) pairs by expert on the CPU.
        let sel: Vec<i64> =
            Vec::<i64>::try_from(selected.f_reshape([-1])?.f_to_device(Device::Cpu)?)?;
        let mut per_expert: Vec<Vec<i64>> = vec![Vec::new(); self.experts.len()];
        for (flat, &e) in sel.iter().enumerate() {
            let slot = per_expert.get_mut(e as usize).ok_or_else(|| {
                NnError::input(
                    "router output",
                    format!("expert id < {}", self.experts.len()),
                    e.to_string(),
                )
            })?;
            slot.push(flat as i64);
        }
        let device = xs.device();
        let mut out = xs.f_zeros_like()?;
        for (expert, flats) in self.experts.iter().zip(per_expert.iter()) {
            if flats.is_empty() {
                continue;
            }
            let flat = Tensor::f_from_slice(flats)?.f_to_device(device)?;
            let tokens = flat.f_div_scalar_mode(self.top_k, "floor")?;
            let w = weights.f_index_select(0, &flat)?.f_unsqueeze(-1)?;
            let y = expert.forward(&xs.f_index_select(0, &tokens)?)?.f_mul(&w)?;
            out = out.f_index_add(0, &tokens, &y)?;
        }
        if let Some((mlp, gate)) = &self.shared {
            let s = mlp.forward(&xs)?.f_mul(&gate.forward(&xs)?.f_sigmoid()?)?;
            out = out.f_add(&s)?;
        }
        Ok(out.f_reshape(size.as_slice())?)
    }
}

//! What generation engines use: fused decode weights, tuned decode GEMMs, and a plain greedy decoder.

use super::*;

impl Transformer {
    /// Concatenates each layer's q/k/v weights (and a dense MLP's gate/up weights) into one
    /// projection for forwards that need no gradient, while the returned guard lives: a decode
    /// step then runs one GEMM where it ran three (two for the MLP). The copies take
    /// [`Transformer::decode_fusion_bytes`] of device memory and are dropped with the guard; they
    /// are taken now, so the weights must not change while it lives (a generation call).
    pub fn fuse_decode_weights(&self) -> Result<FusedDecodeWeights<'_>> {
        let mut guard = FusedDecodeWeights {
            model: self,
            bytes: 0,
        };
        for layer in &self.layers {
            guard.bytes += layer.fuse(true)?;
        }
        Ok(guard)
    }

    /// Tunes the GEMMs of a decode step of `rows` sequences (each distinct projection shape of
    /// the layers, and the LM head with fp32 logits) with [`verl_torch_ext::tune_linear`] (`wide`:
    /// over every configuration, not only the heuristic's), once per shape and process. Call it
    /// with the decode weights fused ([`Transformer::fuse_decode_weights`]) and outside a CUDA
    /// graph capture; it synchronises the device. Nothing happens off CUDA or without cuBLASLt.
    pub fn tune_decode_gemms(&self, rows: i64, wide: bool) -> Result<GemmTuning> {
        let mut sum = GemmTuning::default();
        if !self.device().is_cuda() || !verl_torch_ext::tuned_gemms_available() {
            return Ok(sum);
        }
        let _g = tch::no_grad_guard();
        let mut seen: Vec<(Vec<i64>, bool)> = Vec::new();
        let mut count = |t: verl_torch_ext::Tuned| {
            sum.shapes += 1;
            sum.chosen += usize::from(t.chosen);
            sum.timed += usize::from(t.fresh && !t.from_file);
            sum.from_file += usize::from(t.from_file);
        };
        for layer in &self.layers {
            for (w, b) in layer.decode_gemms() {
                let key = (w.size(), b.is_some());
                if seen.contains(&key) {
                    continue;
                }
                seen.push(key);
                count(verl_torch_ext::tune_linear(
                    rows,
                    &w,
                    b.as_ref(),
                    false,
                    wide,
                )?);
            }
        }
        if let Some(w) = self.lm_head_weight() {
            count(verl_torch_ext::tune_linear(rows, w, None, true, wide)?);
        }
        Ok(sum)
    }

    /// Device bytes [`Transformer::fuse_decode_weights`] takes (dense layers: q/k/v weights and
    /// biases, gate/up weights without biases).
    pub fn decode_fusion_bytes(&self) -> usize {
        let c = self.shard_config();
        let (h, hd) = (c.hidden_size, c.head_dim);
        let qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd;
        let dense_mlp = c.moe.is_none() && !c.mlp_bias;
        let per_layer = qkv * h
            + if c.qkv_bias { qkv } else { 0 }
            + if dense_mlp {
                2 * c.intermediate_size * h
            } else {
                0
            };
        per_layer as usize * c.num_hidden_layers as usize * self.dtype.elt_size_in_bytes()
    }

    /// Greedy decoding of exactly `max_new_tokens` tokens (no EOS stop: that policy belongs to the
    /// generation engine). Returns int64 `[B, max_new_tokens]`. `use_cache = false` recomputes the
    /// whole sequence every step (a reference for the cached path).
    pub fn generate_greedy(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        max_new_tokens: i64,
        use_cache: bool,
    ) -> Result<Tensor> {
        if self.head_kind != HeadKind::CausalLm {
            return Err(NnError::input(
                "generate_greedy head",
                "CausalLm",
                format!("{:?}", self.head_kind),
            ));
        }
        tch::no_grad(|| {
            let (b, t) = ids_shape(input_ids)?;
            let device = input_ids.device();
            let mask = match attention_mask {
                Some(m) => m.f_ne(0)?.f_to_kind(Kind::Int64)?,
                None => Tensor::f_ones([b, t], (Kind::Int64, device))?,
            };
            let ones = Tensor::f_ones([b, 1], (Kind::Int64, device))?;
            let mut out: Vec<Tensor> = Vec::new();
            let last_logits_argmax = |h: &Tensor| -> Result<Tensor> {
                let t = h.size()[1];
                let last = h.f_narrow(1, t - 1, 1)?;
                Ok(self.apply_head(&last, None)?.f_argmax(-1, false)?)
            };
            if use_cache {
                let mut cache = self.new_cache_with_capacity(t + max_new_tokens);
                let h = self.forward_hidden(input_ids, Some(&mask), None, Some(&mut cache))?;
                let mut next = last_logits_argmax(&h)?;
                for _ in 1..max_new_tokens {
                    out.push(next.shallow_clone());
                    let h = self.forward_hidden(&next, Some(&ones), None, Some(&mut cache))?;
                    next = last_logits_argmax(&h)?;
                }
                if max_new_tokens > 0 {
                    out.push(next);
                }
            } else {
                let mut ids = input_ids.shallow_clone();
                let mut mask = mask;
                for _ in 0..max_new_tokens {
                    let h = self.forward_hidden(&ids, Some(&mask), None, None)?;
                    let next = last_logits_argmax(&h)?;
                    ids = Tensor::f_cat(&[&ids, &next], 1)?;
                    mask = Tensor::f_cat(&[&mask, &ones], 1)?;
                    out.push(next);
                }
            }
            if out.is_empty() {
                return Ok(Tensor::f_zeros([b, 0], (Kind::Int64, device))?);
            }
            Ok(Tensor::f_cat(&out, 1)?)
        })
    }
}

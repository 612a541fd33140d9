//! Forward passes: hidden states (padded rows, shared-prompt rows, a generation engine's attention backend) and the heads on top of them.

use super::*;

impl Transformer {
    /// Embedding + decoder layers + final norm: hidden states `[B, T, H]` in the model dtype.
    ///
    /// * `input_ids`: int64 `[B, T]`.
    /// * `attention_mask`: `[B, T]` (any integer/bool kind, nonzero = real token) for the tokens in
    ///   `input_ids` only, left or right padding; `None` = all real.
    /// * `position_ids`: int64 `[B, T]`; `None` derives them like verl/HF: `cumsum(mask) - 1`
    ///   (clamped at 0) over cached + new tokens.
    /// * `cache`: when given, attention also covers the cached tokens, and the new keys/values and
    ///   mask are appended to it.
    pub fn forward_hidden(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        self.forward_hidden_in(input_ids, attention_mask, position_ids, cache, None)
    }

    /// [`Transformer::forward_hidden`] of a packed token stream: `input_ids` and `position_ids`
    /// int64 `[1, N]`, attention over `rows` (see [`AttentionRows`]); hidden states `[1, N, H]`.
    pub fn forward_hidden_rows(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        rows: &AttentionRows,
    ) -> Result<Tensor> {
        self.forward_hidden_in(input_ids, None, Some(position_ids), None, Some(rows))
    }

    pub(super) fn forward_hidden_in(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
        cache: Option<&mut KvCache>,
        rows: Option<&AttentionRows>,
    ) -> Result<Tensor> {
        let ctx = self.prepare(
            input_ids,
            attention_mask,
            position_ids,
            cache.as_deref(),
            rows,
        )?;
        // Without autograd, each residual add joins the next RMSNorm in one kernel (CUDA).
        let fuse = !verl_torch_ext::grad_enabled();
        let mut h = Residual::Done(self.embed(input_ids)?);
        match cache {
            None => {
                for layer in &self.layers {
                    h = layer.forward_res(h, &ctx.layer, None, fuse)?;
                }
            }
            Some(cache) => {
                if cache.layers.len() != self.layers.len() {
                    return Err(NnError::input(
                        "KvCache",
                        format!("{} layers", self.layers.len()),
                        format!("{} layers", cache.layers.len()),
                    ));
                }
                let past = cache.len();
                let t = input_ids.size()[1];
                if let Some(cap) = cache.capacity {
                    if past + t > cap {
                        return Err(NnError::input(
                            "KvCache capacity",
                            format!("room for {t} more tokens after {past}"),
                            format!("capacity {cap}"),
                        ));
                    }
                }
                let capacity = cache.capacity;
                for (layer, entry) in self.layers.iter().zip(cache.layers.iter_mut()) {
                    let slot = KvSlot {
                        entry,
                        past,
                        capacity,
                    };
                    h = layer.forward_res(h, &ctx.layer, Some(slot), fuse)?;
                }
                cache.key_mask = Some(ctx.full_mask);
            }
        }
        Ok(h.normed(&self.norm, fuse)?.1)
    }

    /// Embedding + decoder layers + final norm with every layer's attention delegated to
    /// `backend` (which owns the KV cache): hidden states `[B, T, H]` in the model dtype.
    ///
    /// * `input_ids`: int64 `[B, T]`; `position_ids`: int64 `[B, T]` (the RoPE positions; the
    ///   backend decides which keys each query sees, so padding is the backend's business).
    pub fn forward_hidden_with_backend(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        backend: &mut dyn AttentionBackend,
    ) -> Result<Tensor> {
        let (b, t) = ids_shape(input_ids)?;
        let device = input_ids.device();
        if device != self.device() {
            return Err(NnError::input(
                "input_ids device",
                format!("{:?} (the model's)", self.device()),
                format!("{device:?}"),
            ));
        }
        check_shape("position_ids", position_ids, &[b, t])?;
        let (cos, sin) = self
            .rope
            .cos_sin(&position_ids.f_to_device(device)?, self.dtype)?;
        let (cos, sin) = (cos.f_unsqueeze(1)?, sin.f_unsqueeze(1)?);
        let fuse = !verl_torch_ext::grad_enabled();
        let mut h = Residual::Done(self.embed(input_ids)?);
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward_with_backend(h, &cos, &sin, i, backend, fuse)?;
        }
        Ok(h.normed(&self.norm, fuse)?.1)
    }

    /// Applies the head to final hidden states `[B, T, H]`:
    /// `CausalLm` -> logits `[B, T, V]`; `Value` -> `[B, T]`; `SequenceClassification` ->
    /// `[B, num_labels]` at each row's last position whose `attention_mask` is nonzero
    /// (the last position when `attention_mask` is `None`). Output is in the model dtype.
    pub fn apply_head(&self, hidden: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        let hs = hidden.size();
        if hs.len() != 3 || hs[2] != self.config.hidden_size {
            return Err(NnError::input(
                "hidden states",
                format!("[B, T, {}]", self.config.hidden_size),
                format!("{hs:?}"),
            ));
        }
        match &self.head {
            Head::Lm(w) => self.gather_vocab(hidden.f_linear(w, None::<&Tensor>)?),
            Head::Value(lin) => Ok(lin.forward(hidden)?.f_squeeze_dim(-1)?),
            Head::Score(_) | Head::RewardMlp(..) => {
                let scores = match &self.head {
                    Head::RewardMlp(a, b) => b.forward(&a.forward(hidden)?.f_relu()?)?,
                    Head::Score(lin) => lin.forward(hidden)?,
                    _ => unreachable!("matched above"),
                };
                let (b, t) = (hidden.size()[0], hidden.size()[1]);
                let last = match attention_mask {
                    None => Tensor::f_full([b], t - 1, (Kind::Int64, hidden.device()))?,
                    Some(m) => {
                        check_shape("attention_mask", m, &[b, t])?;
                        let valid = m.f_ne(0)?.f_to_kind(Kind::Int64)?;
                        Tensor::f_arange(t, (Kind::Int64, hidden.device()))?
                            .f_mul(&valid)?
                            .f_argmax(-1, false)?
                    }
                };
                let rows = Tensor::f_arange(b, (Kind::Int64, hidden.device()))?;
                Ok(scores.f_index(&[Some(rows), Some(last)])?)
            }
        }
    }

    /// `apply_head(forward_hidden(..))`; see those two for shapes.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let h = self.forward_hidden(input_ids, attention_mask, position_ids, cache)?;
        self.apply_head(&h, attention_mask)
    }

    /// The LM head matrix `[V, H]` (the embedding matrix when tied), the same tensor the model
    /// uses; `None` for a value or score head. On a tensor-parallel shard this rank's rows
    /// `[V / tp, H]`: pass logits made from it through [`Transformer::gather_vocab`].
    pub fn lm_head_weight(&self) -> Option<&Tensor> {
        match &self.head {
            Head::Lm(w) => Some(w),
            _ => None,
        }
    }

    /// The final norm, then the head unless `output` asks for the hidden states.
    pub(super) fn output(
        &self,
        x: &Tensor,
        attention_mask: Option<&Tensor>,
        output: Output,
    ) -> Result<Tensor> {
        let h = self.norm.forward(x)?;
        match output {
            Output::Head => self.apply_head(&h, attention_mask),
            Output::Hidden => Ok(h),
        }
    }
}

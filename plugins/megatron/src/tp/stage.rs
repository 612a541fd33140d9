//! A stage's forward over its layers (whole, or one virtual-pipeline chunk), and the heads of the last stage.

use super::*;

impl TpModel {
    /// Final hidden states `[B, T, H]` (after the final norm), replicated on every tensor-parallel
    /// rank, of a model that is the whole pipeline (one stage). No autograd.
    pub fn forward_hidden(
        &self,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Tensor,
    ) -> Result<Tensor> {
        let acts = self.stage_forward(ids, mask, positions, None)?;
        self.final_hidden(&acts)
    }

    /// The final norm of the last stage's output `[B, T, H]`, replicated on every
    /// tensor-parallel rank (with SP, all-gathered from the sequence shards and unpadded). No
    /// autograd.
    pub fn final_hidden(&self, acts: &StageActs) -> Result<Tensor> {
        let _guard = tch::no_grad_guard();
        let h = self.rms(&acts.out, self.need_norm()?)?;
        if !self.sp {
            return Ok(h);
        }
        self.gather_seq(&h)?
            .f_narrow(1, 0, acts.ctx.t)
            .ctx("unpad sequence")
    }

    /// This stage's forward of one micro-batch without autograd: the first stage embeds `ids`,
    /// every other stage starts from `input` (the previous stage's output). Keeps each layer's
    /// input for the recomputing backward ([`TpModel::stage_backward`]); `out` is what goes to the
    /// next stage (the last stage's is before the final norm). A stage of several model chunks
    /// runs its chunk 0 ([`TpModel::chunk_forward`] runs the others).
    pub fn stage_forward(
        &self,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Tensor,
        input: Option<&Tensor>,
    ) -> Result<StageActs> {
        self.chunk_forward_impl(0, ids, mask, positions, input, false)
    }

    /// [`TpModel::stage_forward`] of a micro-batch whose backward follows
    /// ([`TpModel::stage_backward`]): it keeps the activations of the dense layers the backward
    /// does not recompute ([`TpModel::set_recompute`]).
    pub fn stage_forward_train(
        &self,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Tensor,
        input: Option<&Tensor>,
    ) -> Result<StageActs> {
        self.chunk_forward_impl(0, ids, mask, positions, input, true)
    }

    /// [`TpModel::chunk_forward`] of a micro-batch whose backward follows (see
    /// [`TpModel::stage_forward_train`]).
    pub fn chunk_forward_train(
        &self,
        chunk: usize,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Tensor,
        input: Option<&Tensor>,
    ) -> Result<StageActs> {
        self.chunk_forward_impl(chunk, ids, mask, positions, input, true)
    }

    /// The forward of this stage's model chunk `chunk` (virtual pipeline stage
    /// `chunk · stages + stage`): chunk 0 of the first stage embeds `ids`, every other chunk starts
    /// from `input` (the previous virtual stage's output).
    pub fn chunk_forward(
        &self,
        chunk: usize,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Tensor,
        input: Option<&Tensor>,
    ) -> Result<StageActs> {
        self.chunk_forward_impl(chunk, ids, mask, positions, input, false)
    }

    /// The forwards above; `train`: keep the autograd graphs of the dense layers the backward does
    /// not recompute (none with SP).
    pub(super) fn chunk_forward_impl(
        &self,
        chunk: usize,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Tensor,
        input: Option<&Tensor>,
        train: bool,
    ) -> Result<StageActs> {
        let _guard = tch::no_grad_guard();
        let layers = self.chunk_layer_slice(chunk)?;
        let ctx = self.prepare(ids, mask, positions)?;
        let embeds = self.stage.is_first() && chunk == 0;
        let mut h = match (embeds, input) {
            (true, _) => self.embed_input(&ctx.ids)?,
            (false, Some(x)) => x.shallow_clone(),
            (false, None) => {
                return Err(MegatronError::Api(verl_plugin_api::Error::failed(format!(
                    "internal: pipeline stage {} (model chunk {chunk}) got no activation from the previous stage",
                    self.stage.index
                ))))
            }
        };
        let want = self.local_len(ctx.t);
        if h.size().get(1) != Some(&want) {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(format!(
                "internal: pipeline stage {} got an activation of shape {:?}, expected {want} positions",
                self.stage.index,
                h.size()
            ))));
        }
        LAST_RESIDUAL.with(|c| c.set(Some((want, ctx.t))));
        let mut inputs = Vec::with_capacity(layers.len());
        let keep = |i: usize| train && self.keeps_layer(i);
        let any_kept = (0..layers.len()).any(keep);
        let mut kept = Vec::new();
        for (i, l) in layers.iter().enumerate() {
            if keep(i) && !self.sp && matches!(l.ffn, Ffn::Dense { .. }) {
                let hl = leaf_if(&h, true)?;
                let tr = tch::with_grad(|| self.layer(l, &hl, &ctx, true))?;
                let next = tr.out.f_detach().ctx("layer output")?;
                inputs.push(std::mem::replace(&mut h, next));
                kept.push(Some(Kept { h: hl, tr }));
                continue;
            }
            let next = self.layer_out(l, &h, &ctx)?;
            inputs.push(std::mem::replace(&mut h, next));
            if any_kept {
                kept.push(None);
            }
        }
        Ok(StageActs {
            chunk,
            ctx,
            inputs,
            kept,
            out: h,
        })
    }

    /// The decoder layers of model chunk `chunk` of this stage.
    pub(super) fn chunk_layer_slice(&self, chunk: usize) -> Result<&[Layer]> {
        let chunks = self.stage.chunks.max(1);
        if chunk >= chunks {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(format!(
                "internal: model chunk {chunk} of a stage with {chunks}"
            ))));
        }
        let per = self.layers.len() / chunks;
        Ok(&self.layers[chunk * per..(chunk + 1) * per])
    }

    /// The LM head matrix `[V, H]` when this rank holds all of it (tensor-parallel size 1, last
    /// stage): log-probs then go through [`verl_losses::ChunkedLmHead`], as in the FSDP backend (on
    /// CUDA fused kernels over fp32 logit chunks; no `[tokens, V]` logits kept for the backward).
    pub fn whole_lm_head(&self) -> Option<&Tensor> {
        match (self.tp.size, self.head) {
            (1, Some(Head::Lm(w))) => Some(self.p(w)),
            _ => None,
        }
    }

    /// Log-probabilities of `targets` (`[..]`) and optionally the entropy, from hidden states
    /// `[.., H]`: vocab-parallel, fp32, logits divided by `temperature`. Differentiable.
    pub fn token_stats(
        &self,
        hidden: &Tensor,
        targets: &Tensor,
        temperature: f64,
        with_entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let Head::Lm(w) = self.need_head()? else {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(
                "log-probabilities need an LM head; this model has a value head",
            )));
        };
        let logits = hidden
            .f_linear(self.p(w), None::<&Tensor>)
            .and_then(|l| l.f_to_kind(Kind::Float))
            .and_then(|l| l.f_div_scalar(temperature))
            .ctx("local logits")?;
        if self.tp.size == 1 {
            let lp = verl_losses::logprobs_from_logits(&logits, targets)?;
            let ent = match with_entropy {
                true => Some(verl_losses::entropy_from_logits(&logits)?),
                false => None,
            };
            return Ok((lp, ent));
        }
        // The maximum only stabilises the exponentials (log Z does not depend on it): no gradient.
        let mut m = logits
            .f_detach()
            .and_then(|l| l.f_amax([-1i64].as_slice(), true))
            .ctx("local max")?;
        self.tp
            .all_reduce(&mut m, ReduceOp::Max, "all_reduce (logit max)")?;
        let shifted = logits.f_sub(&m).ctx("shift logits")?;
        let sum_exp = shifted
            .f_exp()
            .and_then(|e| e.f_sum_dim_intlist([-1i64].as_slice(), false, None::<Kind>))
            .ctx("sum of exponentials")?;
        // log Z - m; the maximum cancels in every quantity below.
        let sum_total = self.reduce(sum_exp)?;
        let log_z = sum_total.f_log().ctx("log partition")?;
        let in_range = targets
            .f_ge(self.vocab_start)
            .and_then(|a| a.f_logical_and(&targets.f_lt(self.vocab_start + self.vocab_local)?))
            .ctx("target range")?;
        let local_t = targets
            .f_sub_scalar(self.vocab_start)
            .and_then(|x| x.f_mul(&in_range.f_to_kind(Kind::Int64)?))
            .and_then(|x| x.f_unsqueeze(-1))
            .ctx("local targets")?;
        let picked = shifted
            .f_gather(-1, &local_t, false)
            .and_then(|p| p.f_squeeze_dim(-1))
            .and_then(|p| p.f_mul(&in_range.f_to_kind(Kind::Float)?))
            .ctx("target logit")?;
        let lp = self.reduce(picked)?.f_sub(&log_z).ctx("log-prob")?;
        let ent = if with_entropy {
            // H = log S - W / S with W = Σ exp(l - m)·(l - m). Every all-reduced sum must be of
            // terms that depend on this rank's logits only: the identity backward of the reduction
            // drops the other ranks' dependence on ours (Σ p·(l - m) would depend on every rank's
            // logits through p's normaliser, and its gradient would come out wrong).
            let w = shifted
                .f_exp()
                .and_then(|e| e.f_mul(&shifted))
                .and_then(|x| x.f_sum_dim_intlist([-1i64].as_slice(), false, None::<Kind>))
                .ctx("expected logit")?;
            let w = self.reduce(w)?;
            let mean = w.f_div(&sum_total).ctx("entropy")?;
            Some(log_z.f_sub(&mean).ctx("entropy")?)
        } else {
            None
        };
        Ok((lp, ent))
    }

    /// Values `[..]` from hidden states `[.., H]` (value head; replicated). Differentiable.
    pub fn values(&self, hidden: &Tensor) -> Result<Tensor> {
        let Head::Value { w, b } = self.need_head()? else {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(
                "values need a value head; this model has an LM head",
            )));
        };
        hidden
            .f_linear(self.p(w), Some(self.p(b)))
            .and_then(|v| v.f_squeeze_dim(-1))
            .ctx("value head")
    }
}

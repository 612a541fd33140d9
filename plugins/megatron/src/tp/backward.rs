//! The backward pass of a stage: the head's, the layers' (with recompute and sequence parallelism) and the MoE layers'.

use super::*;

impl TpModel {
    /// The backward of [`TpModel::sp_attention_block`] from the gradient `g_x2` of the
    /// post-attention norm's output (shard) and `grad_res` of the residual stream `h2` (shard):
    /// the norm and residual segment, o_proj's output gradient all-gathered (the backward of the
    /// reduce-scatter), the attention segment, its input gradient reduce-scattered (the backward
    /// of the all-gather), and the input norm. Returns the gradient of the layer input `h`.
    pub(super) fn sp_attention_backward(
        &self,
        l: &Layer,
        h: &Tensor,
        a: &SpAttn,
        g_x2: &Tensor,
        grad_res: &Tensor,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Tensor> {
        let roots = [(&a.x2, g_x2), (&a.h2, grad_res)];
        let mut params = vec![l.post_norm];
        params.extend(l.o.b);
        let g = self.backward(&roots, &[&a.a_c, h], &params, true, sink)?;
        let g_a = self.gather_seq(&g[0])?;
        let through_residual = g[1].shallow_clone();
        let roots = [(&a.a_part, &g_a)];
        let g = self.backward(&roots, &[&a.x1c], &l.attention_inner_params(), false, sink)?;
        let g_x1 = self.scatter_seq(&g[0])?;
        let roots = [(&a.x1, &g_x1)];
        let g = self.backward(&roots, &[h], &[l.in_norm], false, sink)?;
        through_residual.f_add(&g[0]).ctx("input gradient")
    }

    /// [`TpModel::layer_backward`] with SP.
    pub(super) fn sp_layer_backward(
        &self,
        l: &Layer,
        saved: &Tensor,
        grad_out: &Tensor,
        ctx: &Ctx,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Tensor> {
        let Ffn::Dense { gate, up, down } = l.ffn else {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(
                "internal: a MoE layer chained as a dense one",
            )));
        };
        let h = leaf_if(saved, true)?;
        let tr = self.sp_layer(l, &h, ctx, true)?;
        // Residual add: the reduce-scattered MLP output and down's bias get `grad_out`.
        let roots = [(&tr.out, grad_out)];
        let bias: Vec<usize> = down.b.into_iter().collect();
        let g = self.backward(&roots, &[&tr.m_c], &bias, true, sink)?;
        let g_m = self.gather_seq(&g[0])?;
        let mut params = vec![];
        for lin in [gate, up] {
            params.push(lin.w);
            params.extend(lin.b);
        }
        params.push(down.w);
        let roots = [(&tr.m_part, &g_m)];
        let g = self.backward(&roots, &[&tr.x2c], &params, false, sink)?;
        let g_x2 = self.scatter_seq(&g[0])?;
        self.sp_attention_backward(l, &h, &tr.attn, &g_x2, grad_out, sink)
    }

    pub(super) fn head_params(&self) -> Vec<usize> {
        match self.head {
            Some(Head::Lm(w)) => vec![w],
            Some(Head::Value { w, b }) => vec![w, b],
            None => vec![],
        }
    }

    /// Differentiates the outputs `roots` (each with its gradient, `(y, dL/dy)`) w.r.t. `inputs`
    /// (leaves or graph tensors) and the parameters `params`, through `autograd::grad` (no
    /// surrogate `(y · g).sum()` to run and differentiate); hands each parameter gradient to
    /// `sink` and returns the inputs' gradients (zeros when unreachable).
    pub(super) fn backward(
        &self,
        roots: &[(&Tensor, &Tensor)],
        inputs: &[&Tensor],
        params: &[usize],
        keep_graph: bool,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Vec<Tensor>> {
        let mut wrt: Vec<&Tensor> = inputs.to_vec();
        wrt.extend(params.iter().map(|&i| self.p(i)));
        let grads = output_grads(roots, &wrt, keep_graph)?;
        let mut out = Vec::with_capacity(inputs.len());
        for (k, g) in grads.iter().enumerate() {
            if k < inputs.len() {
                out.push(match g {
                    Some(g) => g.shallow_clone(),
                    None => inputs[k].f_zeros_like().ctx("zero gradient")?,
                });
            } else if let Some(g) = g {
                let i = params[k - inputs.len()];
                if self.sp && self.seq_sharded[i] {
                    // A replicated parameter applied to this rank's sequence shard: its gradient
                    // is a partial sum over the tensor-parallel group.
                    let mut g = g
                        .f_contiguous()
                        .and_then(|g| g.f_detach_copy())
                        .ctx("gradient")?;
                    self.tp.all_reduce(
                        &mut g,
                        ReduceOp::Sum,
                        "all_reduce (sequence-parallel parameter gradient)",
                    )?;
                    sink(i, &g)?;
                } else {
                    sink(i, g)?;
                }
            }
        }
        Ok(out)
    }

    /// Forward, `loss_fn` on the final hidden states (a leaf: call [`TpModel::token_stats`] or
    /// [`TpModel::values`] on it), and the hand-chained backward, of a model that is the whole
    /// pipeline. Parameter gradients (this rank's slices, in the parameter dtype) go to
    /// `sink(param_index, grad)`; nothing accumulates in `.grad`. Returns the detached loss and the
    /// loss function's side values.
    pub fn forward_backward<T>(
        &self,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Tensor,
        moe: MoeMicro,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
        loss_fn: impl FnOnce(&Tensor) -> Result<(Tensor, T)>,
    ) -> Result<(Tensor, T)> {
        let acts = self.stage_forward_train(ids, mask, positions, None)?;
        let (grad, loss, side) = self.head_backward(&acts, sink, loss_fn)?;
        self.stage_backward(ids, acts, &grad, moe, sink)?;
        Ok((loss, side))
    }

    /// The last stage's head: the final norm of `out` (this stage's output), `loss_fn` on the
    /// normed hidden states (a leaf), and the backward to `out`. Returns the gradient of `out`, the
    /// detached loss and the loss function's side values.
    pub fn head_backward<T>(
        &self,
        acts: &StageActs,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
        loss_fn: impl FnOnce(&Tensor) -> Result<(Tensor, T)>,
    ) -> Result<(Tensor, Tensor, T)> {
        let (norm, head) = (self.need_norm()?, self.need_head()?);
        if acts.chunk + 1 != self.stage.chunks.max(1) {
            return Err(self.wrong_stage("the head", "the last chunk of the last"));
        }
        let leaf = |x: &Tensor| {
            x.f_detach()
                .and_then(|d| d.f_set_requires_grad(true))
                .ctx("leaf")
        };
        // The final norm's output is cut because a vocab-parallel head consumes it. With SP the
        // norm runs on this rank's sequence shard and its output is all-gathered (and unpadded)
        // before the head.
        let hl = leaf(&acts.out)?;
        let hf = self.rms(&hl, norm)?;
        let hc = match self.sp {
            true => leaf(
                &self
                    .gather_seq(&hf)?
                    .f_narrow(1, 0, acts.ctx.t)
                    .ctx("unpad sequence")?,
            )?,
            false => leaf(&hf)?,
        };
        let (loss, side) = loss_fn(&hc)?;
        if loss.numel() != 1 {
            return Err(MegatronError::config(
                "loss",
                "a scalar tensor",
                format!("shape {:?}", loss.size()),
            ));
        }
        let one = loss.f_ones_like().ctx("loss gradient")?;
        let g = self.backward(&[(&loss, &one)], &[&hc], &self.head_params(), false, sink)?;
        let ghc = match (head, self.sp) {
            (Head::Lm(_), false) => self.reduce_grad(g[0].shallow_clone())?,
            (Head::Value { .. }, false) => g[0].shallow_clone(),
            (head, true) => {
                let padded = g[0]
                    .f_constant_pad_nd([0, 0, 0, acts.ctx.t_pad - acts.ctx.t])
                    .ctx("pad gradient")?;
                match head {
                    // The vocab-parallel head's input gradients are partial sums: the backward
                    // of the all-gather is a reduce-scatter.
                    Head::Lm(_) => self.scatter_seq(&padded)?,
                    // A replicated head's are complete on every rank: take this rank's block.
                    Head::Value { .. } => self.shard_seq(&padded)?,
                }
            }
        };
        let roots = [(&hf, &ghc)];
        let grad = self.backward(&roots, &[&hl], &[norm], false, sink)?[0].shallow_clone();
        Ok((grad, loss.f_detach().ctx("loss")?, side))
    }

    /// This stage's backward of one micro-batch from the gradient of its output: the layers are
    /// recomputed from their saved inputs and chained in reverse. Returns the gradient of the
    /// stage input (for the previous stage), or `None` on the first stage, where it flows into
    /// the embedding. `moe` says how the MoE blocks treat this micro-batch (router loss scale,
    /// load metrics).
    pub fn stage_backward(
        &self,
        ids: &Tensor,
        acts: StageActs,
        grad_out: &Tensor,
        moe: MoeMicro,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Option<Tensor>> {
        let StageActs {
            chunk,
            ctx,
            inputs,
            mut kept,
            out,
        } = acts;
        drop(out);
        let layers = self.chunk_layer_slice(chunk)?;
        kept.resize_with(layers.len(), || None);
        let mut grad = grad_out.shallow_clone();
        for ((l, saved), kept) in layers.iter().zip(inputs).zip(kept).rev() {
            grad = match &l.ffn {
                Ffn::Dense { .. } if kept.is_some() => {
                    let k = kept.expect("checked");
                    self.layer_chain(l, &k.h, &k.tr, &grad, sink)?
                }
                Ffn::Dense { .. } if self.sp => {
                    self.sp_layer_backward(l, &saved, &grad, &ctx, sink)?
                }
                Ffn::Dense { .. } => self.layer_backward(l, &saved, &grad, &ctx, sink)?,
                Ffn::Moe { .. } => self.moe_layer_backward(l, &saved, &grad, &ctx, moe, sink)?,
            };
        }
        if !(self.stage.is_first() && chunk == 0) {
            return Ok(Some(grad));
        }
        // The ids as the forward embedded them (padded with SP) are kept in `ctx`.
        let _ = ids;
        let (e, grad) = match self.sp {
            // The backward of the embedding's reduce-scatter is an all-gather.
            true => (self.embed_partial(&ctx.ids)?, self.gather_seq(&grad)?),
            false => (self.embed(&ctx.ids)?, grad),
        };
        if e.requires_grad() {
            let roots = [(&e, &grad)];
            self.backward(&roots, &[], &[self.need_embed()?], false, sink)?;
        }
        Ok(None)
    }

    /// Recomputes layer `l` from its saved input and chains its backward in three segments: the
    /// MLP block (its input gradient all-reduced), the attention block plus the residual path, and
    /// the input norm (its output gradient all-reduced). Returns the gradient of the layer input.
    pub(super) fn layer_backward(
        &self,
        l: &Layer,
        saved: &Tensor,
        grad_out: &Tensor,
        ctx: &Ctx,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Tensor> {
        let h = saved
            .f_detach()
            .and_then(|d| d.f_set_requires_grad(true))
            .ctx("layer input")?;
        let tr = self.layer(l, &h, ctx, true)?;
        self.layer_chain(l, &h, &tr, grad_out, sink)
    }

    /// The backward of dense layer `l` from its traced forward (`h`: its input leaf), in the three
    /// segments of [`TpModel::layer_backward`]. Returns the gradient of the layer input.
    pub(super) fn layer_chain(
        &self,
        l: &Layer,
        h: &Tensor,
        tr: &Trace,
        grad_out: &Tensor,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Tensor> {
        let roots = [(&tr.out, grad_out)];
        let g = self.backward(&roots, &[&tr.x2c], &l.mlp_params(), true, sink)?;
        let gx2 = self.reduce_grad(g[0].shallow_clone())?;
        let roots = [(&tr.x2, &gx2), (&tr.h2, grad_out)];
        let mut params = vec![l.post_norm];
        params.extend(l.attention_params());
        let g = self.backward(&roots, &[&tr.x1c, h], &params, true, sink)?;
        let gx1 = self.reduce_grad(g[0].shallow_clone())?;
        let through_residual = g[1].shallow_clone();
        let roots = [(&tr.x1, &gx1)];
        let g = self.backward(&roots, &[h], &[l.in_norm], false, sink)?;
        through_residual.f_add(&g[0]).ctx("input gradient")
    }

    /// Recomputes MoE layer `l` from its saved input and chains its backward: the MoE block
    /// (forward and backward through the expert-parallel all-to-alls and the
    /// expert-tensor-parallel collectives; its input gradient is complete for the tokens it was
    /// given: the whole replicated sequence without SP, this rank's shard with SP), then the
    /// attention block plus the residual path and the input norm as in
    /// [`TpModel::layer_backward`] (or [`TpModel::sp_attention_backward`]).
    pub(super) fn moe_layer_backward(
        &self,
        l: &Layer,
        saved: &Tensor,
        grad_out: &Tensor,
        ctx: &Ctx,
        moe: MoeMicro,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Tensor> {
        let Ffn::Moe {
            block,
            index,
            layer,
        } = &l.ffn
        else {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(
                "internal: a dense layer chained as a MoE one",
            )));
        };
        let h = leaf_if(saved, true)?;
        // With SP the MoE block routes this rank's sequence shard (Megatron-core's dispatch: no
        // all-gather before the block, no reduce-scatter after it): the shard's output gradient
        // goes in, the shard's input gradient comes out; the block reduces its statistics, its
        // router loss and its replicated parameters' gradients over the tensor-parallel group.
        let (attn, x2d, gy, valid) = match self.sp {
            true => {
                let a = self.sp_attention_block(l, &h, ctx, true)?;
                let x2d = a.x2.f_detach().ctx("moe input")?;
                let valid = self.shard_seq(&ctx.valid)?;
                (Err(a), x2d, grad_out.shallow_clone(), valid)
            }
            false => {
                let t = self.attention_block(l, &h, ctx, true)?;
                let x2d = t.3.f_detach().ctx("moe input")?;
                (
                    Ok(t),
                    x2d,
                    grad_out.shallow_clone(),
                    ctx.valid.shallow_clone(),
                )
            }
        };
        let mut block_sink = |k: usize, g: &Tensor| -> Result<()> {
            let i = *index.get(k).ok_or_else(|| {
                MegatronError::Api(verl_plugin_api::Error::failed(format!(
                    "internal: MoE parameter {k} of layer {layer} has no model index"
                )))
            })?;
            sink(i, g)
        };
        let r = block.forward_backward(&x2d, Some(&valid), &gy, moe.aux_scale, &mut block_sink)?;
        if moe.record {
            self.moe_load
                .lock()
                .map_err(|_| {
                    MegatronError::Api(verl_plugin_api::Error::failed(
                        "internal: MoE load metrics lock poisoned",
                    ))
                })?
                .add(*layer, &r.stats)?;
        }
        let (x1, x1c, h2, x2) = match attn {
            Ok(t) => t,
            Err(a) => {
                return self.sp_attention_backward(l, &h, &a, &r.grad_x, grad_out, sink);
            }
        };
        let roots = [(&x2, &r.grad_x), (&h2, grad_out)];
        let mut params = vec![l.post_norm];
        params.extend(l.attention_params());
        let g = self.backward(&roots, &[&x1c, &h], &params, true, sink)?;
        let gx1 = self.reduce_grad(g[0].shallow_clone())?;
        let through_residual = g[1].shallow_clone();
        let roots = [(&x1, &gx1)];
        let g = self.backward(&roots, &[&h], &[l.in_norm], false, sink)?;
        through_residual.f_add(&g[0]).ctx("input gradient")
    }
}

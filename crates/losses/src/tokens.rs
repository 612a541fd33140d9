//! Per-token quantities from logits: log-probabilities of the taken tokens and the entropy of the
//! distribution; and a chunked LM-head path that never holds `[N, V]` fp32 logits for all tokens at once,
//! neither in the forward pass nor in the backward pass.

use tch::{Kind, Tensor};

use crate::error::{LossError, Result, TorchContext};

/// Entropy of `softmax(logits)` over the last dimension: `logsumexp(l) - Σ softmax(l)·l`, which never takes
/// the log of a probability, so underflowed probabilities cannot produce `0 · -inf`.
pub fn entropy_from_logits(logits: &Tensor) -> Result<Tensor> {
    const OP: &str = "entropy_from_logits";
    check_float(OP, "logits", logits)?;
    let lse = logits.f_logsumexp(-1, false).op(OP)?;
    let p = logits.f_softmax(-1, None::<Kind>).op(OP)?;
    let expected = p
        .f_mul(logits)
        .op(OP)?
        .f_sum_dim_intlist(-1, false, None::<Kind>)
        .op(OP)?;
    lse.f_sub(&expected).op(OP)
}

/// `log softmax(logits)[label]` over the last dimension; `labels` has the shape of `logits` without its last
/// dimension. Temperature is the caller's: divide the logits first, as verl does. Half-precision logits are
/// promoted to fp32 (verl computes them in bf16, which loses the log-prob's low bits).
pub fn logprobs_from_logits(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    const OP: &str = "logprobs_from_logits";
    check_float(OP, "logits", logits)?;
    check_labels(OP, labels, &logits.size())?;
    let logits = match logits.kind() {
        Kind::Float | Kind::Double => logits.shallow_clone(),
        _ => logits.f_to_kind(Kind::Float).op(OP)?,
    };
    let picked = logits
        .f_gather(-1, &labels.f_unsqueeze(-1).op(OP)?, false)
        .op(OP)?
        .f_squeeze_dim(-1)
        .op(OP)?;
    picked.f_sub(&logits.f_logsumexp(-1, false).op(OP)?).op(OP)
}

/// A chunk's per-token `(logsumexp, E_p[logits / T])` kept from the fused forward for the backward,
/// with the chunk's fp32 logits where the memory budget kept them (the backward then skips their
/// recomputation).
type ChunkConstants = (Tensor, Tensor, Option<Tensor>);

/// Options of the chunked LM-head computation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChunkedLmHead {
    /// Tokens per chunk; peak extra memory is about `3 · chunk_tokens · V` fp32 values.
    pub chunk_tokens: i64,
    /// Logits are divided by this before softmax (verl's rollout temperature); must be > 0.
    pub temperature: f64,
    /// Also compute the entropy of each token's distribution.
    pub with_entropy: bool,
    /// Bytes of fp32 logits the fused CUDA path may keep from the forward of
    /// [`ChunkedLmHead::loss_and_backward`] / [`ChunkedLmHead::loss_and_surrogate`] for their
    /// backward (chunk by chunk, in order, while they fit), instead of recomputing them with a
    /// GEMM. 0 (the default) keeps none.
    pub kept_logits_bytes: u64,
}

/// Per-token results: `[N]` fp32 (fp64 when the hidden states are fp64).
#[derive(Debug)]
pub struct TokenStats {
    pub log_probs: Tensor,
    pub entropy: Option<Tensor>,
}

impl ChunkedLmHead {
    pub fn new(chunk_tokens: i64, temperature: f64, with_entropy: bool) -> Self {
        ChunkedLmHead {
            chunk_tokens,
            temperature,
            with_entropy,
            kept_logits_bytes: 0,
        }
    }

    /// This head with a budget of `bytes` for fp32 logits kept between the forward and the
    /// backward (see [`ChunkedLmHead::kept_logits_bytes`]).
    pub fn with_kept_logits(mut self, bytes: u64) -> Self {
        self.kept_logits_bytes = bytes;
        self
    }

    /// Values only (no autograd graph is kept): for `compute_log_prob` / reference log-probs.
    /// `hidden` is `[N, H]`, `weight` the LM head `[V, H]`, `targets` `[N]` token ids.
    pub fn forward(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        targets: &Tensor,
    ) -> Result<TokenStats> {
        self.check(hidden, weight, targets)?;
        let _guard = tch::no_grad_guard();
        Ok(self.forward_kept(hidden, weight, targets, 0)?.0)
    }

    /// Whether the fused CUDA kernels compute the statistics (and their gradient): hidden states
    /// on a CUDA device in fp32/bf16/f16. The torch path (CPU, fp64) computes the same quantities
    /// with separate ops.
    fn fused(&self, hidden: &Tensor) -> bool {
        hidden.kind() != Kind::Double && verl_torch_ext::row_kernels_available(hidden.device())
    }

    /// fp32 logits of a chunk, no autograd (the GEMM writes fp32 straight from its accumulator).
    fn chunk_logits(hidden: &Tensor, weight: &Tensor) -> Result<Tensor> {
        const OP: &str = "ChunkedLmHead";
        let _guard = tch::no_grad_guard();
        if hidden.kind() == Kind::Float {
            hidden
                .f_linear(weight, None::<Tensor>)
                .op(OP)?
                .f_contiguous()
                .op(OP)
        } else {
            verl_nn::linear_fp32(hidden, weight)
                .op(OP)?
                .f_contiguous()
                .op(OP)
        }
    }

    /// [`ChunkedLmHead::forward`], plus each chunk's `(lse, mean)` when the fused kernels ran
    /// (the backward's per-token constants).
    fn forward_kept(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        targets: &Tensor,
        keep_budget: u64,
    ) -> Result<(TokenStats, Option<Vec<ChunkConstants>>)> {
        const OP: &str = "ChunkedLmHead";
        let mut budget = keep_budget;
        let _guard = tch::no_grad_guard();
        let n = hidden.size()[0];
        let fused = self.fused(hidden);
        let mut lps = Vec::new();
        let mut ents = Vec::new();
        let mut kept = Vec::new();
        // Where every chunk's logits will be kept anyway, one GEMM writes them all (the chunks are
        // row blocks of it): fewer, larger GEMMs run closer to the matmul peak (1.5B head, 8,192
        // tokens, H100: 5.8 against 6.4 ms in five chunks).
        let whole_bytes = (n.max(0) * weight.size()[0].max(0)) as u64 * 4;
        let whole = if fused && n > self.chunk_tokens && whole_bytes <= budget {
            Some(Self::chunk_logits(hidden, weight)?)
        } else {
            None
        };
        for (start, len) in chunks(n, self.chunk_tokens) {
            let h = hidden.f_narrow(0, start, len).op(OP)?;
            let t = targets.f_narrow(0, start, len).op(OP)?;
            if fused {
                let logits = match &whole {
                    Some(all) => all.f_narrow(0, start, len).op(OP)?,
                    None => Self::chunk_logits(&h, weight)?,
                };
                let t = t.f_contiguous().op(OP)?;
                let s =
                    verl_torch_ext::token_stats(&logits, &t, self.temperature, self.with_entropy)?;
                lps.push(s.log_probs);
                if let Some(e) = s.entropy {
                    ents.push(e);
                }
                let bytes = (logits.numel() * logits.kind().elt_size_in_bytes()) as u64;
                let keep = bytes <= budget;
                if keep {
                    budget -= bytes;
                }
                kept.push((s.lse, s.mean, keep.then_some(logits)));
            } else {
                let (lp, ent) = self.chunk_stats(&h, weight, &t, false)?;
                lps.push(lp);
                if let Some(e) = ent {
                    ents.push(e);
                }
            }
        }
        let stats = TokenStats {
            log_probs: cat(&lps, hidden)?,
            entropy: if self.with_entropy {
                Some(cat(&ents, hidden)?)
            } else {
                None
            },
        };
        Ok((stats, fused.then_some(kept)))
    }

    /// Forward, loss and backward in one call, with the logits recomputed chunk by chunk in the backward pass.
    ///
    /// 1. per-token log-probs (and entropy) are computed without a graph;
    /// 2. `loss_fn` builds the scalar loss from them (they are fresh leaves that require grad), and its
    ///    backward yields `∂loss/∂log_probs` and `∂loss/∂entropy`, both `[N]`;
    /// 3. each chunk's logits are recomputed with a graph, and its vector-Jacobian product accumulates
    ///    `∂loss/∂hidden` (`[N, H]`) and `∂loss/∂weight` (`[V, H]`);
    /// 4. those are pushed into the caller's graph with one backward of `Σ hidden·g_h + Σ weight·g_w`, so
    ///    gradients reach the model's parameters (and a tied embedding) exactly as a full-logits backward would.
    ///
    /// Returns the loss (detached) and the per-token values. Gradients are accumulated into `.grad` of the
    /// leaves `hidden` and `weight` depend on; nothing else is kept.
    pub fn loss_and_backward<F>(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        targets: &Tensor,
        loss_fn: F,
    ) -> Result<(Tensor, TokenStats)>
    where
        F: FnOnce(&Tensor, Option<&Tensor>) -> Result<Tensor>,
    {
        const OP: &str = "ChunkedLmHead::loss_and_backward";
        let (loss, stats, push) = self.loss_and_push(hidden, weight, targets, loss_fn)?;
        if let Some(push) = push {
            push.f_backward().op(OP)?;
        }
        Ok((loss, stats))
    }

    /// Steps 1–3 of [`ChunkedLmHead::loss_and_backward`], for a caller that runs the backward itself (a model
    /// whose backward goes unit by unit, a sharded model): returns a scalar *surrogate* whose value is the loss
    /// and whose gradients with respect to `hidden` and `weight` are exactly the loss's, while its graph holds
    /// no `[N, V]` tensor — only `hidden`, `weight` and the precomputed `[N, H]` / `[V, H]` gradients. Calling
    /// `backward()` on it (or differentiating it with `run_backward`) is the backward of the loss through the
    /// LM head. When neither `hidden` nor `weight` requires grad the surrogate is the detached loss.
    pub fn loss_and_surrogate<F>(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        targets: &Tensor,
        loss_fn: F,
    ) -> Result<(Tensor, TokenStats)>
    where
        F: FnOnce(&Tensor, Option<&Tensor>) -> Result<Tensor>,
    {
        const OP: &str = "ChunkedLmHead::loss_and_surrogate";
        let (loss, stats, push) = self.loss_and_push(hidden, weight, targets, loss_fn)?;
        let surrogate = match push {
            // `push - push.detach()` is exactly zero in value (for a finite push) and carries its gradient.
            Some(push) => {
                let zero = push.f_sub(&push.f_detach().op(OP)?).op(OP)?;
                loss.f_to_kind(zero.kind())
                    .op(OP)?
                    .f_add(&zero)
                    .op(OP)?
                    .f_to_kind(loss.kind())
                    .op(OP)?
            }
            None => loss,
        };
        Ok((surrogate, stats))
    }

    /// The detached loss, the per-token values, and `Σ hidden·g_h + Σ weight·g_w` (`None` when neither
    /// needs a gradient), whose gradient is the loss's.
    fn loss_and_push<F>(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        targets: &Tensor,
        loss_fn: F,
    ) -> Result<(Tensor, TokenStats, Option<Tensor>)>
    where
        F: FnOnce(&Tensor, Option<&Tensor>) -> Result<Tensor>,
    {
        const OP: &str = "ChunkedLmHead::loss_and_backward";
        self.check(hidden, weight, targets)?;
        let (stats, mut kept) =
            self.forward_kept(hidden, weight, targets, self.kept_logits_bytes)?;
        let lp_leaf = stats
            .log_probs
            .f_detach()
            .op(OP)?
            .f_set_requires_grad(true)
            .op(OP)?;
        let ent_leaf = match &stats.entropy {
            Some(e) => Some(e.f_detach().op(OP)?.f_set_requires_grad(true).op(OP)?),
            None => None,
        };
        let loss = loss_fn(&lp_leaf, ent_leaf.as_ref())?;
        if loss.numel() != 1 {
            return Err(LossError::Shape {
                op: OP,
                arg: "loss_fn(..) result",
                expected: "a scalar".into(),
                found: loss.size(),
            });
        }
        // autograd refuses inputs the loss does not use; a zero-weighted term makes every leaf "used", so a
        // loss that ignores the entropy just gets a zero gradient for it.
        let mut inputs = vec![&lp_leaf];
        if let Some(e) = &ent_leaf {
            inputs.push(e);
        }
        let mut rooted = loss.shallow_clone();
        for leaf in &inputs {
            let unused_guard = leaf.f_sum(leaf.kind()).op(OP)?.f_mul_scalar(0.0).op(OP)?;
            rooted = rooted.f_add(&unused_guard).op(OP)?;
        }
        let grads = Tensor::f_run_backward(&[&rooted], &inputs, false, false).op(OP)?;
        let g_lp = grads[0].shallow_clone();
        let g_ent = ent_leaf.as_ref().map(|_| grads[1].shallow_clone());

        let hidden_d = hidden.f_detach().op(OP)?;
        // Only the gradients someone will receive are computed: a frozen LM head gets no [V, H] gradient.
        let want_weight_grad = weight.requires_grad();
        let weight_leaf = weight
            .f_detach()
            .op(OP)?
            .f_set_requires_grad(want_weight_grad)
            .op(OP)?;
        let acc_kind = work_kind(weight);
        // Under the model's gradient-accumulation fusion the head's weight gradient goes
        // straight into its .grad, as the projections' do.
        let into_grad =
            verl_nn::accumulating_into_grad() && weight.requires_grad() && weight.is_leaf();
        if let Some(kept) = &mut kept {
            if into_grad && self.product_applies(hidden, weight, kept) {
                let push = self.push_product(
                    hidden,
                    &hidden_d,
                    weight,
                    targets,
                    kept,
                    &g_lp,
                    g_ent.as_ref(),
                )?;
                return Ok((loss.f_detach().op(OP)?, stats, Some(push)));
            }
        }
        let mut g_hidden = Vec::new();
        let mut g_weight: Option<Tensor> = None;
        for (ci, (start, len)) in chunks(hidden.size()[0], self.chunk_tokens).enumerate() {
            if let Some(kept) = &mut kept {
                // Fused: the logits' gradient from one kernel over recomputed fp32 logits, then
                // the head's two GEMMs by hand (no autograd graph over [C, V] tensors).
                let _guard = tch::no_grad_guard();
                let h = hidden_d.f_narrow(0, start, len).op(OP)?;
                let (t, g_lp_c, g_ent_c) =
                    chunk_grad_inputs(start, len, targets, &g_lp, g_ent.as_ref())?;
                let (lse, mean, kept_logits) = &mut kept[ci];
                let logits = match kept_logits.take() {
                    Some(l) => l,
                    None => Self::chunk_logits(&h, &weight_leaf)?,
                };
                let g_logits = verl_torch_ext::token_stats_grad(
                    &logits,
                    &t,
                    lse,
                    mean,
                    &g_lp_c,
                    g_ent_c.as_ref(),
                    self.temperature,
                    h.kind(),
                )?;
                drop(logits);
                let w = weight_leaf.f_detach().op(OP)?;
                g_hidden.push(g_logits.f_mm(&w.f_to_kind(h.kind()).op(OP)?).op(OP)?);
                if want_weight_grad {
                    let gt = g_logits.f_tr().op(OP)?;
                    g_weight = Some(if fp32_accumulating_gemm(&h, acc_kind) {
                        // One GEMM per chunk accumulating in fp32 (no bf16 rounding of each
                        // chunk's product, no conversion and add passes over [V, H]).
                        match g_weight {
                            None => gt.f_mm_dtype(&h, Kind::Float).op(OP)?,
                            Some(acc) => {
                                acc.f_addmm_dtype_out(&acc, &gt, &h, Kind::Float).op(OP)?
                            }
                        }
                    } else {
                        let gw = gt.f_mm(&h).op(OP)?.f_to_kind(acc_kind).op(OP)?;
                        match g_weight {
                            None => gw,
                            Some(acc) => acc.f_add(&gw).op(OP)?,
                        }
                    });
                }
                continue;
            }
            let h = hidden_d
                .f_narrow(0, start, len)
                .op(OP)?
                .f_set_requires_grad(true)
                .op(OP)?;
            let t = targets.f_narrow(0, start, len).op(OP)?;
            let (lp, ent) = self.chunk_stats(&h, &weight_leaf, &t, true)?;
            let mut surrogate = lp
                .f_mul(&g_lp.f_narrow(0, start, len).op(OP)?)
                .op(OP)?
                .f_sum(lp.kind())
                .op(OP)?;
            if let (Some(ent), Some(g)) = (ent, &g_ent) {
                let term = ent
                    .f_mul(&g.f_narrow(0, start, len).op(OP)?)
                    .op(OP)?
                    .f_sum(ent.kind())
                    .op(OP)?;
                surrogate = surrogate.f_add(&term).op(OP)?;
            }
            let wrt: Vec<&Tensor> = if want_weight_grad {
                vec![&h, &weight_leaf]
            } else {
                vec![&h]
            };
            let g = Tensor::f_run_backward(&[&surrogate], &wrt, false, false).op(OP)?;
            g_hidden.push(g[0].shallow_clone());
            if want_weight_grad {
                // Accumulated in fp32 at least: summing many bf16 chunk gradients would round each partial sum.
                let gw = g[1].f_to_kind(acc_kind).op(OP)?;
                g_weight = Some(match g_weight {
                    None => gw,
                    Some(acc) => acc.f_add(&gw).op(OP)?,
                });
            }
        }
        if kept.is_some()
            && hidden.requires_grad()
            && !g_hidden.is_empty()
            && matches!(hidden.device(), tch::Device::Cuda(_))
        {
            // The fused path on CUDA: the gradients handed straight to hidden and weight by one
            // autograd node (one pass each) instead of differentiating Σ hidden·g_h + Σ weight·g_w.
            let g_hidden = Tensor::f_cat(&g_hidden, 0).op(OP)?;
            let zero = Tensor::f_zeros([], (acc_kind, hidden.device())).op(OP)?;
            let push = verl_torch_ext::inject_grads(
                &zero,
                hidden,
                Some(&g_hidden),
                weight,
                g_weight.as_ref().filter(|_| weight.requires_grad()),
                into_grad,
            )?;
            return Ok((loss.f_detach().op(OP)?, stats, Some(push)));
        }
        let mut push: Option<Tensor> = None;
        if hidden.requires_grad() && !g_hidden.is_empty() {
            let g_hidden = Tensor::f_cat(&g_hidden, 0).op(OP)?;
            push = Some(hidden.f_mul(&g_hidden).op(OP)?.f_sum(acc_kind).op(OP)?);
        }
        if let Some(gw) = g_weight {
            let term = weight.f_mul(&gw).op(OP)?.f_sum(acc_kind).op(OP)?;
            push = Some(match push {
                None => term,
                Some(p) => p.f_add(&term).op(OP)?,
            });
        }
        if push.is_none() {
            // No tokens (an empty selection): the gradient is zero, but a caller that runs a backward through
            // `hidden` still needs a graph that reaches it.
            for t in [hidden, weight] {
                if t.requires_grad() {
                    let zero = t.f_sum(acc_kind).op(OP)?.f_mul_scalar(0.0).op(OP)?;
                    push = Some(match push {
                        None => zero,
                        Some(p) => p.f_add(&zero).op(OP)?,
                    });
                }
            }
        }
        Ok((loss.f_detach().op(OP)?, stats, push))
    }

    /// How many backwards in this process took the LM head's weight gradient as one product GEMM
    /// (see [`ChunkedLmHead::push_product`]): a diagnostic, e.g. for tests that a path ran.
    pub fn product_backwards() -> u64 {
        PRODUCT_BACKWARDS.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the backward can take the head's weight gradient as one product (see
    /// [`ChunkedLmHead::push_product`]): every chunk's logits were kept, `hidden` is a 16-bit CUDA
    /// tensor that needs a gradient, and the keep budget also covers the whole `[N, V]` logits
    /// gradient (in `hidden`'s dtype) on top of the kept logits.
    fn product_applies(&self, hidden: &Tensor, weight: &Tensor, kept: &[ChunkConstants]) -> bool {
        if !(hidden.requires_grad()
            && matches!(hidden.device(), tch::Device::Cuda(_))
            && matches!(hidden.kind(), Kind::BFloat16 | Kind::Half)
            && !kept.is_empty()
            && kept.iter().all(|(_, _, l)| l.is_some()))
        {
            return false;
        }
        let elems = |t: &Tensor| t.size().iter().product::<i64>().max(0) as u64;
        let kept_bytes: u64 = kept
            .iter()
            .filter_map(|(_, _, l)| l.as_ref())
            .map(|l| elems(l) * l.kind().elt_size_in_bytes() as u64)
            .sum();
        let product_bytes = (hidden.size()[0].max(0) * weight.size()[0].max(0)) as u64
            * hidden.kind().elt_size_in_bytes() as u64;
        kept_bytes + product_bytes <= self.kept_logits_bytes
    }

    /// The backward's inputs when every chunk's logits were kept and the head's weight gradient goes
    /// into its `.grad`: each chunk's logits gradient written into one `[N, V]` tensor `G` (in
    /// `hidden`'s dtype), `∂loss/∂hidden = G·W` as one GEMM, and `∂loss/∂W = Gᵀ·hidden` left to the
    /// backward as one GEMM accumulating into `W.grad` ([`verl_torch_ext::inject_grads_product`]),
    /// where the chunked path sums a GEMM per chunk into an fp32 `[V, H]` buffer and adds that into
    /// `.grad` in another pass. `G` lives until the backward's first node.
    #[allow(clippy::too_many_arguments)]
    fn push_product(
        &self,
        hidden: &Tensor,
        hidden_d: &Tensor,
        weight: &Tensor,
        targets: &Tensor,
        kept: &mut [ChunkConstants],
        g_lp: &Tensor,
        g_ent: Option<&Tensor>,
    ) -> Result<Tensor> {
        const OP: &str = "ChunkedLmHead::loss_and_backward";
        let guard = tch::no_grad_guard();
        let n = hidden.size()[0];
        let g_all =
            Tensor::f_empty([n, weight.size()[0]], (hidden.kind(), hidden.device())).op(OP)?;
        for (ci, (start, len)) in chunks(n, self.chunk_tokens).enumerate() {
            let (t, g_lp_c, g_ent_c) = chunk_grad_inputs(start, len, targets, g_lp, g_ent)?;
            let (lse, mean, kept_logits) = &mut kept[ci];
            let logits = kept_logits.take().ok_or_else(|| LossError::Shape {
                op: OP,
                arg: "kept logits",
                expected: "every chunk's logits kept".into(),
                found: vec![ci as i64],
            })?;
            verl_torch_ext::token_stats_grad_into(
                &g_all.f_narrow(0, start, len).op(OP)?,
                &logits,
                &t,
                lse,
                mean,
                &g_lp_c,
                g_ent_c.as_ref(),
                self.temperature,
            )?;
        }
        let w = weight.f_detach().op(OP)?.f_to_kind(hidden.kind()).op(OP)?;
        let g_hidden = g_all.f_mm(&w).op(OP)?;
        let zero = Tensor::f_zeros([], (work_kind(weight), hidden.device())).op(OP)?;
        let rhs = hidden_d.f_contiguous().op(OP)?;
        // The node that carries the gradients is recorded with autograd on.
        drop(guard);
        PRODUCT_BACKWARDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(verl_torch_ext::inject_grads_product(
            &zero,
            hidden,
            Some(&g_hidden),
            weight,
            &g_all,
            &rhs,
            true,
        )?)
    }

    /// Log-probs (and entropy) of one chunk (`hidden` `[C, H]`, `targets` `[C]`), computed in fp32 (fp64 for
    /// fp64 inputs).
    fn chunk_stats(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        targets: &Tensor,
        differentiable: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        const OP: &str = "ChunkedLmHead";
        // fp32 logits straight from the GEMM (no bf16 rounding), as the rollout engine samples
        // from: its log-probs and these then agree to bf16 noise in the hidden states only. That
        // GEMM has no derivative, so the recomputation under autograd (whose values are not
        // reported, only differentiated) keeps `linear`.
        let raw = if work_kind(hidden) == Kind::Float && !differentiable {
            verl_nn::linear_fp32(hidden, weight).op(OP)?
        } else {
            hidden
                .f_linear(weight, None::<Tensor>)
                .op(OP)?
                .f_to_kind(work_kind(hidden))
                .op(OP)?
        };
        let logits = raw.f_div_scalar(self.temperature).op(OP)?;
        let lse = logits.f_logsumexp(-1, false).op(OP)?;
        let lp = logits
            .f_gather(-1, &targets.f_unsqueeze(-1).op(OP)?, false)
            .op(OP)?
            .f_squeeze_dim(-1)
            .op(OP)?
            .f_sub(&lse)
            .op(OP)?;
        let ent = if self.with_entropy {
            let p = logits.f_softmax(-1, None::<Kind>).op(OP)?;
            let expected = p
                .f_mul(&logits)
                .op(OP)?
                .f_sum_dim_intlist(-1, false, None::<Kind>)
                .op(OP)?;
            Some(lse.f_sub(&expected).op(OP)?)
        } else {
            None
        };
        Ok((lp, ent))
    }

    fn check(&self, hidden: &Tensor, weight: &Tensor, targets: &Tensor) -> Result<()> {
        const OP: &str = "ChunkedLmHead";
        if self.chunk_tokens < 1 {
            return Err(LossError::InvalidValue {
                key: "chunk_tokens",
                expected: "an integer >= 1",
                found: self.chunk_tokens as f64,
            });
        }
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Err(LossError::InvalidValue {
                key: "temperature",
                expected: "a finite number > 0",
                found: self.temperature,
            });
        }
        check_float(OP, "hidden", hidden)?;
        check_float(OP, "weight", weight)?;
        if hidden.dim() != 2 {
            return Err(LossError::Shape {
                op: OP,
                arg: "hidden",
                expected: "[N, H]".into(),
                found: hidden.size(),
            });
        }
        let h = hidden.size()[1];
        if weight.dim() != 2 || weight.size()[1] != h {
            return Err(LossError::Shape {
                op: OP,
                arg: "weight",
                expected: format!("[V, {h}] (H taken from `hidden`)"),
                found: weight.size(),
            });
        }
        check_labels(OP, targets, &[hidden.size()[0], weight.size()[0]])
    }
}

/// A chunk's targets (contiguous) and its rows of the loss's gradients with respect to the
/// log-probs and the entropy (fp32, contiguous): the fused logits-gradient kernel's inputs.
fn chunk_grad_inputs(
    start: i64,
    len: i64,
    targets: &Tensor,
    g_lp: &Tensor,
    g_ent: Option<&Tensor>,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    const OP: &str = "ChunkedLmHead::loss_and_backward";
    let rows = |g: &Tensor, kind: Option<Kind>| -> Result<Tensor> {
        let g = g.f_narrow(0, start, len).op(OP)?;
        let g = match kind {
            Some(k) => g.f_to_kind(k).op(OP)?,
            None => g,
        };
        g.f_contiguous().op(OP)
    };
    let g_ent_c = match g_ent {
        Some(g) => Some(rows(g, Some(Kind::Float))?),
        None => None,
    };
    Ok((
        rows(targets, None)?,
        rows(g_lp, Some(Kind::Float))?,
        g_ent_c,
    ))
}

static PRODUCT_BACKWARDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn chunks(n: i64, size: i64) -> impl Iterator<Item = (i64, i64)> {
    (0..n)
        .step_by(size.max(1) as usize)
        .map(move |s| (s, size.min(n - s)))
}

/// fp64 stays fp64; everything else is computed in fp32.
/// Whether a `[V, C] x [C, H]` product of `h`'s dtype can accumulate straight into an fp32
/// tensor through cuBLAS (`addmm` with an fp32 output for bf16/fp16 operands on CUDA).
fn fp32_accumulating_gemm(h: &Tensor, acc_kind: Kind) -> bool {
    acc_kind == Kind::Float
        && matches!(h.kind(), Kind::BFloat16 | Kind::Half)
        && matches!(h.device(), tch::Device::Cuda(_))
}

fn work_kind(t: &Tensor) -> Kind {
    if t.kind() == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    }
}

fn cat(parts: &[Tensor], like: &Tensor) -> Result<Tensor> {
    if parts.is_empty() {
        return Tensor::f_zeros([0i64], (work_kind(like), like.device())).op("ChunkedLmHead");
    }
    Tensor::f_cat(parts, 0).op("ChunkedLmHead")
}

fn check_float(op: &'static str, arg: &'static str, t: &Tensor) -> Result<()> {
    if matches!(
        t.kind(),
        Kind::Float | Kind::Double | Kind::BFloat16 | Kind::Half
    ) {
        Ok(())
    } else {
        Err(LossError::Dtype {
            op,
            arg,
            expected: "a floating-point dtype",
            found: format!("{:?}", t.kind()),
        })
    }
}

/// `labels` must be integer ids with the shape of `logits_shape` minus its last dimension.
fn check_labels(op: &'static str, labels: &Tensor, logits_shape: &[i64]) -> Result<()> {
    if labels.kind() != Kind::Int64 {
        return Err(LossError::Dtype {
            op,
            arg: "labels",
            expected: "int64 token ids",
            found: format!("{:?}", labels.kind()),
        });
    }
    let expected = &logits_shape[..logits_shape.len().saturating_sub(1)];
    if labels.size() != expected {
        return Err(LossError::Shape {
            op,
            arg: "labels",
            expected: format!("{expected:?} (the logits' shape without the vocabulary dimension)"),
            found: labels.size(),
        });
    }
    Ok(())
}

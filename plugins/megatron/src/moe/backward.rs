//! The MoE layer's forward and backward through the dispatch, with the router's auxiliary load-balancing loss.

use super::*;

impl EpMoe {
    /// `coeff · E / (k · T²)`, the Switch loss's scale for `tokens` valid tokens.
    pub(super) fn aux_scale(&self, tokens: i64) -> f64 {
        let t = tokens as f64;
        let e = self.spec.num_experts as f64;
        let k = self.spec.top_k as f64;
        self.spec.aux_loss_coeff * e / (k * t * t)
    }

    /// Megatron-core's Switch load-balancing loss term of this rank, coefficient included:
    /// `p_sum` this rank's router probability sums, `stats` the counts (of the whole sequence
    /// when the tokens are partitioned over the tensor-parallel ranks).
    pub(super) fn aux_loss(
        &self,
        p_sum: Option<&Tensor>,
        stats: &LoadStats,
    ) -> Result<Option<Tensor>> {
        let Some(p_sum) = p_sum else {
            return Ok(None);
        };
        if stats.tokens == 0 {
            return Tensor::f_zeros([], (Kind::Float, p_sum.device()))
                .map(Some)
                .ctx("aux loss");
        }
        let counts: Vec<f32> = stats.tokens_per_expert.iter().map(|&c| c as f32).collect();
        let scale = self.aux_scale(stats.tokens);
        let f = || -> std::result::Result<Tensor, tch::TchError> {
            let counts = Tensor::f_from_slice(&counts)?.f_to_device(p_sum.device())?;
            p_sum
                .f_mul(&counts)?
                .f_sum(Kind::Float)?
                .f_mul_scalar(scale)
        };
        f().map(Some).ctx("aux loss")
    }

    /// The whole sequence's load-balancing loss from the probability sums `p_total` and the
    /// counts of `stats`, both summed over the tensor-parallel ranks.
    pub(super) fn aux_value(&self, p_total: &[f64], stats: &LoadStats) -> f64 {
        if stats.tokens == 0 {
            return 0.0;
        }
        let dot: f64 = p_total
            .iter()
            .zip(&stats.tokens_per_expert)
            .map(|(p, &n)| p * n as f64)
            .sum();
        dot * self.aux_scale(stats.tokens)
    }

    /// The block on `x` (`[.., H]`, this rank's tokens), without autograd. `valid` (`[..]`,
    /// nonzero = real token) restricts the load statistics and the aux loss; every token is
    /// still routed. Every member of the EP and ETP groups (and, with partitioned tokens, of the
    /// tensor-parallel group) must call this together.
    pub fn forward(&self, x: &Tensor, valid: Option<&Tensor>) -> Result<MoeOutput> {
        let _guard = tch::no_grad_guard();
        let f = self.run(x, valid, false)?;
        Ok(MoeOutput {
            y: self.full_rows(&f.y, x, "all_gather (moe output slices)")?,
            stats: f.plan.stats,
        })
    }

    /// Forward and backward of the block for the output gradient `grad_y` (shaped like `x`),
    /// plus `aux_scale ×` the gradient of the load-balancing loss (Megatron scales it like the
    /// main loss: pass the same factor the micro-batch's loss is scaled by). Parameter gradients
    /// (this rank's slices, in the parameter dtype) go to `sink(param_index, grad)` (not called
    /// for a parameter that got none, e.g. an expert without tokens); nothing accumulates in
    /// `.grad`. With tokens partitioned over the tensor-parallel ranks the replicated parameters'
    /// gradients are summed over them first (complete on every rank). Returns the output, the
    /// input gradient and the load statistics. Every member of the EP and ETP groups (and, with
    /// partitioned tokens, of the tensor-parallel group) must call this together.
    pub fn forward_backward(
        &self,
        x: &Tensor,
        valid: Option<&Tensor>,
        grad_y: &Tensor,
        aux_scale: f64,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<MoeGrad> {
        if grad_y.size() != x.size() {
            return Err(MegatronError::from(verl_backend_kit::BackendError::Input {
                call: "expert-parallel moe backward",
                column: "output gradient".into(),
                expected: format!("the input's shape {:?}", x.size()),
                found: format!("{:?}", grad_y.size()),
            }));
        }
        let f = self.run(x, valid, true)?;
        let gy = grad_y
            .f_reshape([-1, self.spec.hidden])
            .ctx("output gradient")?;
        let gy = match self.sliced() {
            true => self.slice_of(&gy)?,
            false => gy,
        };
        // Segment 1: combine, router, shared expert and aux loss, up to the combine cut.
        let aux_grad = match &f.aux {
            Some(a) => Some(
                Tensor::f_full(a.size(), aux_scale, (a.kind(), a.device()))
                    .ctx("aux loss gradient")?,
            ),
            None => None,
        };
        let mut roots: Vec<(&Tensor, &Tensor)> = vec![(&f.y, &gy)];
        if let (Some(a), Some(g)) = (&f.aux, &aux_grad) {
            roots.push((a, g));
        }
        let mut replicated = vec![self.router];
        if let Some((mlp, gate)) = self.shared {
            replicated.extend(mlp);
            replicated.push(gate);
        }
        let g = if self.partitioned() {
            // Partial over the tensor-parallel ranks' tokens: summed over them, in a fixed
            // order, whether or not this rank got a gradient.
            let mut got: Vec<Option<Tensor>> = (0..replicated.len()).map(|_| None).collect();
            let mut keep = |i: usize, g: &Tensor| -> Result<()> {
                if let Some(k) = replicated.iter().position(|&r| r == i) {
                    got[k] = Some(g.shallow_clone());
                }
                Ok(())
            };
            let g = self.backward(&roots, &[&f.xl, &f.ybl], &replicated, &mut keep)?;
            for (k, &i) in replicated.iter().enumerate() {
                if !self.p(i).requires_grad() {
                    continue;
                }
                let mut t = match got[k].take() {
                    Some(t) => t.f_contiguous().and_then(|t| t.f_detach_copy()),
                    None => self.p(i).f_detach().and_then(|p| p.f_zeros_like()),
                }
                .ctx("replicated moe gradient")?;
                self.seq.all_reduce_sum(
                    &mut t,
                    "all_reduce (router / shared expert gradient over the tensor-parallel ranks)",
                )?;
                sink(i, &t)?;
            }
            g
        } else {
            self.backward(&roots, &[&f.xl, &f.ybl], &replicated, sink)?
        };
        let (gx_direct, g_back) = (g[0].shallow_clone(), g[1].shallow_clone());
        drop(roots);
        // Reverse of the combine all-to-all: output gradients to the expert owners.
        let g_recv = self.ep.all_to_all_v(
            &g_back,
            &f.plan.send_splits,
            &f.plan.recv_splits,
            "all_to_all (expert output gradient)",
        )?;
        // The backward of the ETP reduce-scatter is an all-gather (of the all-reduce, the
        // identity).
        let g_gathered = match self.etp_gather() {
            true => self.etp.all_gather_rows(
                &g_recv,
                &f.plan.etp_rows,
                "all_gather (expert output gradient)",
            )?,
            false => g_recv,
        };
        let g_sorted = g_gathered
            .f_index_select(0, &f.plan.order)
            .ctx("sort gradient by local expert")?;
        // Segment 2: the local experts.
        let mut g_xs = match &f.ys {
            Some(ys) => {
                let params: Vec<usize> = self.experts.iter().flatten().copied().collect();
                self.backward(&[(ys, &g_sorted)], &[&f.xsl], &params, sink)?[0].shallow_clone()
            }
            None => f.xsl.f_zeros_like().ctx("expert input gradient")?,
        };
        // The experts' input gradients are partial sums over ETP: the backward of the all-gather
        // is a reduce-scatter (of identical inputs, an all-reduce).
        let g_recv_x = if self.etp_gather() {
            let g_g = g_xs
                .f_index_select(0, &f.plan.inverse)
                .ctx("unsort expert input gradient")?;
            self.etp.reduce_scatter_rows(
                &g_g,
                &f.plan.etp_rows,
                "reduce_scatter (expert input gradient)",
            )?
        } else {
            if self.etp.size > 1 && g_xs.numel() > 0 {
                g_xs = g_xs.f_contiguous().ctx("expert input gradient")?;
                self.etp
                    .all_reduce_sum(&mut g_xs, "all_reduce (expert input gradient)")?;
            }
            g_xs.f_index_select(0, &f.plan.inverse)
                .ctx("unsort expert input gradient")?
        };
        // Reverse of the dispatch all-to-all: input gradients back to the token owners.
        let g_xp = self.ep.all_to_all_v(
            &g_recv_x,
            &f.plan.recv_splits,
            &f.plan.send_splits,
            "all_to_all (token gradient)",
        )?;
        let grad_x = gx_direct
            .f_index_add(0, &f.plan.tokens, &g_xp)
            .ctx("input gradient")?;
        Ok(MoeGrad {
            y: self.full_rows(
                &f.y.f_detach().ctx("moe output")?,
                x,
                "all_gather (moe output slices)",
            )?,
            grad_x: self.full_rows(&grad_x, x, "all_gather (moe input gradient slices)")?,
            stats: f.plan.stats,
        })
    }

    /// Differentiates the outputs `roots` (each `(y, dL/dy)`, see [`crate::tp::output_grads`])
    /// w.r.t. `inputs` and the parameters `params`; hands each parameter gradient to `sink`,
    /// returns the inputs' gradients (zeros when unreachable).
    pub(super) fn backward(
        &self,
        roots: &[(&Tensor, &Tensor)],
        inputs: &[&Tensor],
        params: &[usize],
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Vec<Tensor>> {
        let mut wrt: Vec<&Tensor> = inputs.to_vec();
        let params: Vec<usize> = params
            .iter()
            .copied()
            .filter(|&i| self.p(i).requires_grad())
            .collect();
        wrt.extend(params.iter().map(|&i| self.p(i)));
        let grads = crate::tp::output_grads(roots, &wrt, false)?;
        let mut out = Vec::with_capacity(inputs.len());
        for (k, g) in grads.iter().enumerate() {
            if k < inputs.len() {
                out.push(match g {
                    Some(g) => g.shallow_clone(),
                    None => inputs[k].f_zeros_like().ctx("zero gradient")?,
                });
            } else if let Some(g) = g {
                sink(params[k - inputs.len()], g)?;
            }
        }
        Ok(out)
    }
}

//! Routing tokens to experts and running them: the router's choices, the dispatch plan over the expert-parallel ranks, the all-to-all exchanges and the expert MLPs.

use super::*;

impl EpMoe {
    /// Router: fp32 softmax probabilities `[N, E]`, top-k weights `[N, k]` (in the input dtype)
    /// and the selected experts (host).
    pub(super) fn route(&self, xs: &Tensor) -> Result<(Tensor, Tensor, Vec<i64>)> {
        let probs = xs
            .f_linear(self.p(self.router), None::<&Tensor>)
            .and_then(|l| l.f_softmax(1, Kind::Float))
            .ctx("router")?;
        let (mut w, sel) = probs
            .f_topk(self.spec.top_k, -1, true, true)
            .ctx("top-k routing")?;
        if self.spec.norm_topk_prob {
            w = w
                .f_sum_dim_intlist([-1i64].as_slice(), true, None::<Kind>)
                .and_then(|s| w.f_div(&s))
                .ctx("renormalise top-k")?;
        }
        let w = w.f_to_kind(xs.kind()).ctx("routing weights")?;
        let sel = sel
            .f_reshape([-1])
            .and_then(|s| s.f_to_device(Device::Cpu))
            .ctx("selected experts")?;
        let sel = Vec::<i64>::try_from(&sel).ctx("selected experts")?;
        Ok((probs, w, sel))
    }

    /// Groups the (token, slot) pairs by expert, exchanges the counts and derives the splits.
    pub(super) fn plan(&self, sel: &[i64], valid: &[bool], device: Device) -> Result<Plan> {
        let e = self.spec.num_experts as usize;
        let k = self.spec.top_k as usize;
        let mut per_expert: Vec<Vec<i64>> = vec![Vec::new(); e];
        let mut counts = vec![0i64; 2 * e];
        for (flat, &x) in sel.iter().enumerate() {
            let slot = per_expert.get_mut(x as usize).ok_or_else(|| {
                MegatronError::from(verl_backend_kit::BackendError::Input {
                    call: "expert-parallel moe",
                    column: "router output".into(),
                    expected: format!("expert ids below {e}"),
                    found: x.to_string(),
                })
            })?;
            slot.push(flat as i64);
            counts[x as usize] += 1;
            if valid[flat / k] {
                counts[e + x as usize] += 1;
            }
        }
        // One collective: every rank's routed pairs per expert (dispatch) and its valid pairs
        // per expert (metrics).
        let all = self
            .ep
            .all_gather_i64(&counts, device, "all_gather (tokens per expert)")?;
        let per_rank = self.local_experts as usize;
        let send_splits: Vec<usize> = (0..self.ep.size)
            .map(|r| counts[r * per_rank..(r + 1) * per_rank].iter().sum::<i64>() as usize)
            .collect();
        let first = self.first_expert as usize;
        let recv_splits: Vec<usize> = all
            .iter()
            .map(|c| c[first..first + per_rank].iter().sum::<i64>() as usize)
            .collect();
        // Received rows are [source][local expert]; gathered over ETP (members holding different
        // tokens) they are [member][source][local expert]; the experts want [local expert][member,
        // source].
        let mine: Vec<i64> = all
            .iter()
            .flat_map(|c| c[first..first + per_rank].iter().copied())
            .collect();
        let members = if self.etp_gather() {
            self.etp.all_gather_i64(
                &mine,
                device,
                "all_gather (expert-tensor-parallel row counts)",
            )?
        } else {
            vec![mine]
        };
        let etp_rows: Vec<usize> = members
            .iter()
            .map(|m| m.iter().sum::<i64>() as usize)
            .collect();
        // Start of each (member, source, local expert) block of rows.
        let mut starts = Vec::with_capacity(members.len());
        let mut start = 0i64;
        for m in &members {
            let mut row = Vec::with_capacity(m.len());
            for &n in m {
                row.push(start);
                start += n;
            }
            starts.push(row);
        }
        let sources = all.len();
        let mut order = Vec::with_capacity(start as usize);
        let mut expert_rows = vec![0i64; per_rank];
        for (j, rows) in expert_rows.iter_mut().enumerate() {
            for (m, counts) in members.iter().enumerate() {
                for s in 0..sources {
                    let b = s * per_rank + j;
                    order.extend(starts[m][b]..starts[m][b] + counts[b]);
                    *rows += counts[b];
                }
            }
        }
        let mut inverse = vec![0i64; order.len()];
        for (i, &o) in order.iter().enumerate() {
            inverse[o as usize] = i as i64;
        }
        let flat: Vec<i64> = per_expert.concat();
        let tokens: Vec<i64> = flat.iter().map(|f| f / k as i64).collect();
        let stats = LoadStats {
            tokens_per_expert: counts[e..].to_vec(),
            tokens: valid.iter().filter(|v| **v).count() as i64,
            aux_loss: None,
        };
        Ok(Plan {
            flat: index(&flat, device, "routing indices")?,
            tokens: index(&tokens, device, "routing indices")?,
            send_splits,
            recv_splits,
            etp_rows,
            order: index(&order, device, "expert order")?,
            inverse: index(&inverse, device, "expert order")?,
            expert_rows,
            stats,
        })
    }

    /// Whether this member routes its slice of a copy shared by the tensor-parallel ranks.
    pub(super) fn sliced(&self) -> bool {
        self.tokens == Tokens::Slice && self.seq.size > 1
    }

    /// With [`Tokens::Slice`]: this member's block of the rows of `xs` (`[N, ..]`), padded with
    /// zero rows to a multiple of the tensor-parallel size first. The flags of the rows come
    /// from [`EpMoe::slice_flags`].
    pub(super) fn slice_of(&self, xs: &Tensor) -> Result<Tensor> {
        let (n, size) = (xs.size()[0] as usize, self.seq.size);
        let per = n.div_ceil(size);
        let pad = per * size - n;
        let padded = match pad {
            0 => xs.shallow_clone(),
            _ => {
                let mut spec = vec![0i64; 2 * (xs.dim() - 1)];
                spec.extend([0, pad as i64]);
                xs.f_constant_pad_nd(spec.as_slice())
                    .ctx("pad token rows")?
            }
        };
        padded
            .f_narrow(0, (self.seq.rank * per) as i64, per as i64)
            .ctx("token slice")
    }

    /// The valid flags of this member's block of rows ([`EpMoe::slice_of`]); padding is invalid.
    pub(super) fn slice_flags(&self, flags: &[bool]) -> Vec<bool> {
        let per = flags.len().div_ceil(self.seq.size);
        let start = self.seq.rank * per;
        (start..start + per)
            .map(|i| flags.get(i).copied().unwrap_or(false))
            .collect()
    }

    /// This rank's rows `local` of a block input shaped like `x` back as the whole `x`'s: with
    /// [`Tokens::Slice`] every member's block all-gathered, joined and unpadded.
    pub(super) fn full_rows(
        &self,
        local: &Tensor,
        x: &Tensor,
        what: &'static str,
    ) -> Result<Tensor> {
        let full = if self.sliced() {
            let size = x.size();
            let n: i64 = size[..size.len() - 1].iter().product();
            let local = local.f_contiguous().ctx(what)?;
            let parts = self.seq.all_gather(&local, what)?;
            Tensor::f_cat(&parts, 0)
                .and_then(|t| t.f_narrow(0, 0, n))
                .ctx(what)?
        } else {
            local.shallow_clone()
        };
        full.f_reshape(x.size().as_slice()).ctx(what)
    }

    /// `Σ_t p[t, e]` over the valid tokens (`[E]`, fp32, in the graph of `probs`) when the
    /// load-balancing loss is on.
    pub(super) fn prob_sums(&self, probs: &Tensor, valid: &[bool]) -> Result<Option<Tensor>> {
        if self.spec.aux_loss_coeff == 0.0 {
            return Ok(None);
        }
        let mask: Vec<f32> = valid.iter().map(|&v| if v { 1.0 } else { 0.0 }).collect();
        let f = || -> std::result::Result<Tensor, tch::TchError> {
            let mask = Tensor::f_from_slice(&mask)?
                .f_to_device(probs.device())?
                .f_unsqueeze(-1)?;
            probs
                .f_mul(&mask)?
                .f_sum_dim_intlist([0i64].as_slice(), false, None::<Kind>)
        };
        f().map(Some).ctx("router probability sums")
    }

    /// With tokens partitioned over the tensor-parallel ranks: sums the valid (token, slot) pairs
    /// per expert, the valid tokens and (with the load-balancing loss) the router probability
    /// sums over them (Megatron-core's `sequence_partition_group`), so `stats` describe the
    /// whole sequence. Returns the summed probability sums.
    pub(super) fn reduce_stats(
        &self,
        stats: &mut LoadStats,
        p_sum: Option<&Tensor>,
        device: Device,
    ) -> Result<Option<Vec<f64>>> {
        if !self.partitioned() {
            return Ok(None);
        }
        let what = "all_reduce (moe load statistics over the tensor-parallel ranks)";
        let e = self.spec.num_experts as usize;
        let mut host: Vec<f64> = stats.tokens_per_expert.iter().map(|&c| c as f64).collect();
        host.push(stats.tokens as f64);
        let head = Tensor::f_from_slice(&host)
            .and_then(|t| t.f_to_device(device))
            .ctx(what)?;
        let mut buf = match p_sum {
            Some(p) => p
                .f_detach()
                .and_then(|p| p.f_to_kind(Kind::Double))
                .and_then(|p| Tensor::f_cat(&[&head, &p], 0))
                .ctx(what)?,
            None => head,
        };
        self.seq.all_reduce_sum(&mut buf, what)?;
        let v = Vec::<f64>::try_from(&buf.f_to_device(Device::Cpu).ctx(what)?).ctx(what)?;
        stats.tokens_per_expert = v[..e].iter().map(|&c| c.round() as i64).collect();
        stats.tokens = v[e].round() as i64;
        Ok(p_sum.map(|_| v[e + 1..].to_vec()))
    }

    /// The forward; with `grad` the differentiable pieces are built as graphs between the cuts.
    pub(super) fn run(&self, x: &Tensor, valid: Option<&Tensor>, grad: bool) -> Result<Fwd> {
        let (xs, flags) = self.check(x, valid)?;
        let input_rows = flags.len() as i64;
        let (xs, flags) = match self.sliced() {
            true => (self.slice_of(&xs)?, self.slice_flags(&flags)),
            false => (xs, flags),
        };
        LAST_ROUTED.with(|c| c.set(Some((self.tokens, flags.len() as i64, input_rows))));
        let device = xs.device();
        let xl = if grad {
            cut(&xs, "moe input")?
        } else {
            xs.shallow_clone()
        };
        let (probs, weights, sel) = self.route(&xl)?;
        let mut plan = self.plan(&sel, &flags, device)?;
        let p_sum = self.prob_sums(&probs, &flags)?;
        let p_total = self.reduce_stats(&mut plan.stats, p_sum.as_ref(), device)?;
        // Dispatch: rows of the (token, slot) pairs, expert-major, to the expert owners.
        let xp = xl
            .f_detach()
            .and_then(|x| x.f_index_select(0, &plan.tokens))
            .ctx("permute tokens")?;
        let recv = self.ep.all_to_all_v(
            &xp,
            &plan.send_splits,
            &plan.recv_splits,
            "all_to_all (dispatch tokens)",
        )?;
        drop(xp);
        let gathered = match self.etp_gather() {
            true => self.etp.all_gather_rows(
                &recv,
                &plan.etp_rows,
                "all_gather (expert-tensor-parallel token rows)",
            )?,
            false => recv,
        };
        let sorted = gathered
            .f_index_select(0, &plan.order)
            .ctx("sort by local expert")?;
        drop(gathered);
        let xsl = if grad {
            cut(&sorted, "expert input")?
        } else {
            sorted
        };
        let mut outs = Vec::with_capacity(self.experts.len());
        let mut start = 0;
        for (j, &rows) in plan.expert_rows.iter().enumerate() {
            if rows > 0 {
                let chunk = xsl.f_narrow(0, start, rows).ctx("expert rows")?;
                outs.push(self.mlp(&chunk, self.experts[j])?);
            }
            start += rows;
        }
        let ys = if outs.is_empty() {
            None
        } else {
            Some(Tensor::f_cat(&outs, 0).ctx("expert outputs")?)
        };
        drop(outs);
        let mut y_sorted = match &ys {
            Some(ys) => ys.f_detach_copy().ctx("expert outputs")?,
            None => xsl
                .f_detach()
                .and_then(|x| x.f_zeros_like())
                .ctx("expert outputs")?,
        };
        let y_recv = if self.etp_gather() {
            // Partial sums of every member's rows: each member keeps the sum of its own.
            let y_g = y_sorted
                .f_index_select(0, &plan.inverse)
                .ctx("unsort expert outputs")?;
            self.etp.reduce_scatter_rows(
                &y_g,
                &plan.etp_rows,
                "reduce_scatter (expert output partial sums)",
            )?
        } else {
            if self.etp.size > 1 && y_sorted.numel() > 0 {
                self.etp
                    .all_reduce_sum(&mut y_sorted, "all_reduce (expert output partial sums)")?;
            }
            y_sorted
                .f_index_select(0, &plan.inverse)
                .ctx("unsort expert outputs")?
        };
        let back = self.ep.all_to_all_v(
            &y_recv,
            &plan.recv_splits,
            &plan.send_splits,
            "all_to_all (combine expert outputs)",
        )?;
        let ybl = if grad {
            cut(&back, "expert outputs")?
        } else {
            back
        };
        // Combine: y[t] = Σ_k w[t, k] · expert_k(x[t]), in expert order per token as verl-nn.
        let w = weights
            .f_reshape([-1])
            .and_then(|w| w.f_index_select(0, &plan.flat))
            .and_then(|w| w.f_unsqueeze(-1))
            .ctx("routing weights")?;
        let mut y = xl
            .f_detach()
            .and_then(|x| x.f_zeros_like())
            .and_then(|z| z.f_index_add(0, &plan.tokens, &ybl.f_mul(&w)?))
            .ctx("combine expert outputs")?;
        if let Some((mlp, gate)) = self.shared {
            let s = self
                .mlp(&xl, mlp)?
                .f_mul(
                    &xl.f_linear(self.p(gate), None::<&Tensor>)
                        .and_then(|g| g.f_sigmoid())
                        .ctx("shared expert gate")?,
                )
                .ctx("shared expert")?;
            y = y.f_add(&s).ctx("shared expert")?;
        }
        let aux = self.aux_loss(p_sum.as_ref(), &plan.stats)?;
        plan.stats.aux_loss = match (&aux, &p_total) {
            (None, _) => None,
            // The loss of the whole sequence: Σ over the tensor-parallel ranks of their terms.
            (Some(_), Some(p)) => Some(self.aux_value(p, &plan.stats)),
            (Some(a), None) => Some(a.f_double_value(&[]).ctx("aux loss value")?),
        };
        Ok(Fwd {
            xl,
            xsl,
            ys,
            ybl,
            y,
            aux,
            plan,
        })
    }
}

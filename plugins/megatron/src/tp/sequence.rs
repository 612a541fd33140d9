//! Sequence parallelism: the residual stream split over the tensor-parallel ranks by position.

use super::*;

impl TpModel {
    /// The sequence length a micro-batch of `t` positions runs at: with SP, `t` padded up to a
    /// multiple of the tensor-parallel size (the padding is masked).
    pub fn padded_len(&self, t: i64) -> i64 {
        let n = self.tp.size as i64;
        match self.sp {
            true => (t + n - 1) / n * n,
            false => t,
        }
    }

    /// The positions of the residual stream this rank holds for a micro-batch of `t` positions.
    pub fn local_len(&self, t: i64) -> i64 {
        match self.sp {
            true => self.padded_len(t) / self.tp.size as i64,
            false => t,
        }
    }

    /// The shape of a stage's output (and of its gradient) for input ids `[B, T]`: what pipeline
    /// stages exchange, `[B, T / tp (padded), H]` with SP.
    pub fn activation_shape(&self, ids: &Tensor) -> [i64; 3] {
        let s = ids.size();
        [s[0], self.local_len(s[1]), self.cfg.hidden_size]
    }

    /// All-gathers sequence shards `[B, T / tp, ..]` into `[B, T, ..]` (no autograd).
    pub(super) fn gather_seq(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.f_detach().ctx("sequence gather input")?;
        let parts = self
            .tp
            .all_gather(&x, "all_gather (sequence-parallel activations)")?;
        Tensor::f_cat(&parts, 1).ctx("join sequence shards")
    }

    /// Reduce-scatters partial sums `[B, T, ..]` along the sequence: this rank's `[B, T / tp, ..]`
    /// block of the sum over the tensor-parallel group (no autograd).
    pub(super) fn scatter_seq(&self, x: &Tensor) -> Result<Tensor> {
        let s = x.size();
        let n = self.tp.size as i64;
        let tl = s[1] / n;
        let mut blocked = vec![s[0], n, tl];
        blocked.extend_from_slice(&s[2..]);
        let mut out_shape = vec![s[0], tl];
        out_shape.extend_from_slice(&s[2..]);
        let input = x
            .f_detach()
            .and_then(|x| x.f_reshape(blocked.as_slice()))
            .and_then(|x| x.f_transpose(0, 1))
            .and_then(|x| x.f_contiguous())
            .and_then(|x| x.f_reshape([-1]))
            .ctx("sequence scatter input")?;
        let numel: i64 = out_shape.iter().product();
        let mut out = Tensor::f_zeros([numel], (x.kind(), x.device())).ctx("scatter buffer")?;
        self.tp.reduce_scatter_sum(
            &mut out,
            &input,
            "reduce_scatter (sequence-parallel partial sums)",
        )?;
        out.f_reshape(out_shape.as_slice()).ctx("sequence shard")
    }

    /// This rank's sequence block `[B, T / tp, ..]` of a replicated `[B, T, ..]` tensor.
    pub(super) fn shard_seq(&self, x: &Tensor) -> Result<Tensor> {
        let tl = x.size()[1] / self.tp.size as i64;
        x.f_narrow(1, self.tp.rank as i64 * tl, tl)
            .ctx("sequence shard")
    }

    /// The attention half of a decoder layer with SP: `h` is this rank's sequence shard. The input
    /// norm `x1` (shard) is all-gathered (`x1c`, a leaf with `cut`) before the column-parallel
    /// QKV, the row-parallel o_proj's partial sums `a_part` are reduce-scattered (`a_c`, a leaf
    /// with `cut`) into the residual stream `h2` (shard) and its norm `x2` (shard).
    pub(super) fn sp_attention_block(
        &self,
        l: &Layer,
        h: &Tensor,
        ctx: &Ctx,
        cut: bool,
    ) -> Result<SpAttn> {
        let x1 = self.rms(h, l.in_norm)?;
        let x1c = leaf_if(&self.gather_seq(&x1)?, cut)?;
        let a_part = self.attention(l, &x1c, ctx)?;
        let a_c = leaf_if(&self.scatter_seq(&a_part)?, cut)?;
        let a = self.add_bias(a_c.shallow_clone(), l.o.b)?;
        let h2 = h.f_add(&a).ctx("residual")?;
        let x2 = self.rms(&h2, l.post_norm)?;
        Ok(SpAttn {
            x1,
            x1c,
            a_part,
            a_c,
            h2,
            x2,
        })
    }

    /// One decoder layer with a dense MLP and SP: [`TpModel::sp_attention_block`], then `x2`
    /// all-gathered (`x2c`) before gate/up and down's partial sums reduce-scattered (`m_c`).
    pub(super) fn sp_layer(&self, l: &Layer, h: &Tensor, ctx: &Ctx, cut: bool) -> Result<SpTrace> {
        let Ffn::Dense { gate, up, down } = l.ffn else {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(
                "internal: a MoE layer traced as a dense one",
            )));
        };
        let attn = self.sp_attention_block(l, h, ctx, cut)?;
        let x2c = leaf_if(&self.gather_seq(&attn.x2)?, cut)?;
        let m_part = self.mlp(gate, up, down, &x2c)?;
        let m_c = leaf_if(&self.scatter_seq(&m_part)?, cut)?;
        let m = self.add_bias(m_c.shallow_clone(), down.b)?;
        let out = attn.h2.f_add(&m).ctx("residual")?;
        Ok(SpTrace {
            attn,
            x2c,
            m_part,
            m_c,
            out,
        })
    }
}

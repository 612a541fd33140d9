//! Self-attention: q/k/v projections (fused on CUDA), rotary embedding, the attention kernels (dense, shared-prompt rows, varlen, a generation engine's backend) and the output projection.

use super::*;

impl Attention {
    pub fn new(
        f: &mut ParamFactory,
        cfg: &ModelConfig,
        prefix: &str,
        layer: usize,
    ) -> Result<Self> {
        let (h, nh, nkv, hd) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let (q_norm, k_norm) = if cfg.qk_norm {
            (
                Some(f.rms_norm(&format!("{prefix}.q_norm"), hd, cfg.rms_norm_eps)?),
                Some(f.rms_norm(&format!("{prefix}.k_norm"), hd, cfg.rms_norm_eps)?),
            )
        } else {
            (None, None)
        };
        Ok(Attention {
            q_proj: f.linear(&format!("{prefix}.q_proj"), h, nh * hd, cfg.qkv_bias)?,
            k_proj: f.linear(&format!("{prefix}.k_proj"), h, nkv * hd, cfg.qkv_bias)?,
            v_proj: f.linear(&format!("{prefix}.v_proj"), h, nkv * hd, cfg.qkv_bias)?,
            o_proj: f.linear(&format!("{prefix}.o_proj"), nh * hd, h, cfg.o_bias)?,
            q_norm,
            k_norm,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            window: cfg.layer_windows.get(layer).copied().flatten(),
            tp: None,
            fused_qkv: Mutex::new(None),
            lora_qkv: Mutex::new(None),
        })
    }

    /// Builds (`on`) or drops the fused q/k/v projection; returns the bytes it holds. Layers whose
    /// projections do not all have (or all lack) a bias stay unfused.
    pub fn fuse(&self, on: bool) -> Result<usize> {
        let (q, k, v) = (&self.q_proj, &self.k_proj, &self.v_proj);
        let bytes = crate::lora::fuse_adapters(&[q, k, v], &self.lora_qkv, on)?;
        if let Some(a) = &self.o_proj.lora {
            a.fuse(on)?;
        }
        Ok(bytes + self.fuse_base(on)?)
    }

    fn fuse_base(&self, on: bool) -> Result<usize> {
        let mut slot = self.fused_qkv.lock().unwrap_or_else(|e| e.into_inner());
        *slot = None;
        if !on {
            return Ok(0);
        }
        let _guard = tch::no_grad_guard();
        let (q, k, v) = (&self.q_proj, &self.k_proj, &self.v_proj);
        let bias = match (&q.bias, &k.bias, &v.bias) {
            (Some(a), Some(b), Some(c)) => Some(Tensor::f_cat(&[a, b, c], 0)?),
            (None, None, None) => None,
            _ => return Ok(0),
        };
        let w = Tensor::f_cat(&[&q.weight, &k.weight, &v.weight], 0)?;
        let bytes =
            (w.numel() + bias.as_ref().map_or(0, |b| b.numel())) * w.kind().elt_size_in_bytes();
        *slot = Some((w, bias));
        Ok(bytes)
    }

    /// The (weight, bias) of each GEMM a decode step runs here: the fused q/k/v while it exists
    /// (else q, k and v), and o_proj.
    pub(super) fn decode_gemms(&self) -> Vec<(Tensor, Option<Tensor>)> {
        let fused = self
            .fused_qkv
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|(w, b)| (w.shallow_clone(), b.as_ref().map(Tensor::shallow_clone)));
        let mut out = match fused {
            Some(g) => vec![g],
            None => vec![self.q_proj.gemm(), self.k_proj.gemm(), self.v_proj.gemm()],
        };
        if self.tp.is_none() {
            out.push(self.o_proj.gemm());
        }
        out
    }

    /// `x`: `[B, T, H]`. With `kv`, the new keys/values are appended to it and attention runs
    /// over the whole cached sequence.
    pub fn forward(&self, x: &Tensor, ctx: &LayerCtx, kv: Option<KvSlot<'_>>) -> Result<Tensor> {
        let (b, t) = (x.size()[0], x.size()[1]);
        let (q, k, v) = self.qkv(x, &ctx.cos, &ctx.sin)?;
        if let Some(rows) = &ctx.rows {
            return self.forward_rows(&q, &k, &v, ctx, rows, t);
        }
        let cached = kv.is_some();
        let (k, v) = match kv {
            None => (k, v),
            Some(slot) => slot.append(k, v)?,
        };
        if ctx.causal && !cached {
            if let Some(c) = &ctx.consistent {
                if self.window.is_none() && !q.requires_grad() {
                    let out = self.consistent_attention(&q, &k, &v, c, b, t)?;
                    return self.project_out(&out, b, t);
                }
            }
            let out = causal_attention(&q, &k, &v)?;
            return self.project_out(&out, b, t);
        }
        let groups = self.num_heads / self.num_kv_heads;
        let (k, v) = (repeat_kv(&k, groups)?, repeat_kv(&v, groups)?);
        let mask = ctx.mask(self.window)?;
        let out = Tensor::f_scaled_dot_product_attention(
            &q,
            &k,
            &v,
            Some(mask),
            0.0,
            false,
            None::<f64>,
            false,
        )?;
        self.project_out(&out, b, t)
    }

    /// Attention of a packed forward (`[1, heads, N, D]` stream queries/keys/values) over the
    /// rows of `rows`, then `o_proj`.
    pub(super) fn forward_rows(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        ctx: &LayerCtx,
        rows: &AttentionRows,
        n: i64,
    ) -> Result<Tensor> {
        let consistent = ctx
            .consistent
            .as_ref()
            .filter(|_| self.window.is_none() && !q.requires_grad());
        if let Some(vl) = rows.varlen.as_ref() {
            if consistent.is_none() && self.window.is_none() && varlen_applies(q, self.head_dim) {
                let kv = |x: &Tensor| -> Result<Tensor> {
                    let s = AttentionRows::stream(x)?;
                    if s.requires_grad() && verl_torch_ext::grad_enabled() {
                        return Ok(verl_torch_ext::gather_rows(
                            &s,
                            &vl.kv_gather,
                            &vl.kv_offsets,
                            &vl.kv_sources,
                        )?);
                    }
                    Ok(s.f_index_select(0, &vl.kv_gather)?)
                };
                let out = verl_torch_ext::varlen_causal_attention(
                    &AttentionRows::stream(q)?,
                    &kv(k)?,
                    &kv(v)?,
                    &vl.cu_q,
                    &vl.cu_k,
                    vl.max_q,
                    vl.max_k,
                )?;
                let out = out
                    .f_view([1, n, self.num_heads, self.head_dim])?
                    .f_transpose(1, 2)?;
                return self.project_out(&out, 1, n);
            }
        }
        let k = rows.assemble(&AttentionRows::stream(k)?)?;
        let v = rows.assemble(&AttentionRows::stream(v)?)?;
        if let Some(c) = consistent {
            // One query per stream token (no duplicated prompt queries), over its row.
            let q = AttentionRows::stream(q)?.f_contiguous()?;
            let out = c.attend(&q, &k, &v, self.head_dim)?;
            let out = out.f_transpose(0, 1)?.f_unsqueeze(0)?;
            return self.project_out(&out, 1, n);
        }
        let heads = |x: Tensor| x.f_transpose(1, 2);
        let q = heads(rows.assemble(&AttentionRows::stream(q)?)?)?;
        let out = causal_attention(&q, &heads(k)?, &heads(v)?)?;
        self.project_out(&rows.disperse(&out)?, 1, n)
    }

    /// Causal attention of `q` `[B, H, T, D]` over `k`, `v` `[B, n_kv, T, D]` through the paged
    /// decode kernel (see [`ConsistentAttention`]), as `[B, H, T, D]`.
    pub(super) fn consistent_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        c: &ConsistentAttention,
        b: i64,
        t: i64,
    ) -> Result<Tensor> {
        let (h, d) = (self.num_heads, self.head_dim);
        let rows = |x: &Tensor| x.f_transpose(1, 2).and_then(|x| x.f_contiguous());
        let q = rows(q)?.f_view([b * t, h, d])?;
        let out = c.attend(&q, &rows(k)?, &rows(v)?, d)?;
        Ok(out.f_view([b, t, h, d])?.f_transpose(1, 2)?)
    }

    /// Attention whose key/value storage and score computation belong to `backend` (a paged KV
    /// cache of a generation engine); `cos`/`sin` are `[B, 1, T, D]`.
    pub fn forward_with_backend(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        layer: usize,
        backend: &mut dyn AttentionBackend,
    ) -> Result<Tensor> {
        let (b, t) = (x.size()[0], x.size()[1]);
        let (q, k, v) = self.qkv_unrotated(x)?;
        if !x.requires_grad() && !cos.requires_grad() && !sin.requires_grad() {
            let call = AttentionCall {
                layer,
                window: self.window,
                q: &q,
                k: &k,
                v: &v,
            };
            if let Some(out) = backend.attend_unrotated(call, cos, sin)? {
                if out.size() != q.size() {
                    return Err(NnError::input(
                        format!("attention backend output (layer {layer})"),
                        format!("shape {:?} (the queries')", q.size()),
                        format!("shape {:?}", out.size()),
                    ));
                }
                return self.project_out(&out, b, t);
            }
        }
        let q = apply_rope(&q, cos, sin)?;
        let k = apply_rope(&k, cos, sin)?;
        let out = backend.attend(AttentionCall {
            layer,
            window: self.window,
            q: &q,
            k: &k,
            v: &v,
        })?;
        if out.size() != q.size() {
            return Err(NnError::input(
                format!("attention backend output (layer {layer})"),
                format!("shape {:?} (the queries')", q.size()),
                format!("shape {:?}", out.size()),
            ));
        }
        self.project_out(&out, b, t)
    }

    /// Queries `[B, heads, T, D]` and keys/values `[B, kv_heads, T, D]`, normed and rotated.
    pub(super) fn qkv(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (q, k, v) = self.qkv_unrotated(x)?;
        Ok((apply_rope(&q, cos, sin)?, apply_rope(&k, cos, sin)?, v))
    }

    /// [`Attention::qkv`] before RoPE.
    pub(super) fn qkv_unrotated(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t) = (x.size()[0], x.size()[1]);
        let heads = |y: Tensor, n: i64, norm: &Option<RmsNorm>| -> Result<Tensor> {
            let y = y.f_view([b, t, n, self.head_dim])?;
            let y = match norm {
                Some(nm) => nm.forward(&y)?,
                None => y,
            };
            Ok(y.f_transpose(1, 2)?)
        };
        let (nq, nkv) = (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        );
        // The fused copies are detached: never on a path that needs gradients.
        let fused = (!x.requires_grad())
            .then(|| self.fused_qkv.lock().unwrap_or_else(|e| e.into_inner()))
            .and_then(|g| {
                g.as_ref()
                    .map(|(w, bias)| decode_linear(x, w, bias.as_ref()))
            })
            .transpose()?;
        let concatenated = match fused {
            Some(_) => None,
            None => self.qkv_concatenated(x)?,
        };
        let (qy, ky, vy) = match (fused, concatenated) {
            (Some(y), _) => {
                let y = self.add_qkv_adapters(y, x)?;
                (
                    y.f_narrow(-1, 0, nq)?,
                    y.f_narrow(-1, nq, nkv)?,
                    y.f_narrow(-1, nq + nkv, nkv)?,
                )
            }
            // One split (its backward is one concatenation, where three narrows would each
            // scatter into a zero tensor of the full width).
            (None, Some(y)) => {
                let y = self.add_qkv_adapters(y, x)?;
                let mut parts = y.f_split_with_sizes([nq, nkv, nkv], -1)?.into_iter();
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(q), Some(k), Some(v)) => (q, k, v),
                    _ => return Err(NnError::input("q/k/v projection", "three parts", "fewer")),
                }
            }
            (None, None) => (
                self.q_proj.forward(x)?,
                self.k_proj.forward(x)?,
                self.v_proj.forward(x)?,
            ),
        };
        let q = heads(qy, self.num_heads, &self.q_norm)?;
        let k = heads(ky, self.num_kv_heads, &self.k_norm)?;
        let v = heads(vy, self.num_kv_heads, &None)?;
        Ok((q, k, v))
    }

    /// The q/k/v LoRA adapters added to the fused q/k/v output `y` (one GEMM for the three A's,
    /// one accumulating into `y`; the same in training and decoding).
    fn add_qkv_adapters(&self, y: Tensor, x: &Tensor) -> Result<Tensor> {
        let parts = [&self.q_proj, &self.k_proj, &self.v_proj];
        crate::lora::add_fused(y, x, &parts, &self.lora_qkv)
    }

    /// On CUDA, q/k/v as one GEMM over the concatenated weights (and biases), recorded by
    /// autograd where the weights need gradients: the same GEMM shape as a generation engine's
    /// fused projection, one launch instead of three forward and one input-gradient GEMM instead
    /// of three (and their sum) backward. `None` off CUDA or with mixed biases.
    pub(super) fn qkv_concatenated(&self, x: &Tensor) -> Result<Option<Tensor>> {
        if !matches!(x.device(), Device::Cuda(_)) {
            return Ok(None);
        }
        let (q, k, v) = (&self.q_proj, &self.k_proj, &self.v_proj);
        let biases = match (&q.bias, &k.bias, &v.bias) {
            (Some(a), Some(b), Some(c)) => Some([a, b, c]),
            (None, None, None) => None,
            _ => return Ok(None),
        };
        let bias = match biases {
            Some(b) => Some(Tensor::f_cat(&b, 0)?),
            None => None,
        };
        let w = Tensor::f_cat(&[&q.weight, &k.weight, &v.weight], 0)?;
        Ok(Some(x.f_linear(&w, bias.as_ref())?))
    }

    /// `[B, heads, T, D]` attention output -> `o_proj` over `[B, T, heads * D]`.
    pub(super) fn project_out(&self, out: &Tensor, b: i64, t: i64) -> Result<Tensor> {
        let out = out.f_transpose(1, 2)?.f_contiguous()?.f_view([
            b,
            t,
            self.num_heads * self.head_dim,
        ])?;
        match &self.tp {
            None => self.o_proj.forward(&out),
            // Row-parallel: the local heads' partial sum, reduced, then the bias once.
            Some(tp) => tp.reduce_with_bias(
                &out.f_linear(&self.o_proj.weight, None::<&Tensor>)?,
                self.o_proj.bias.as_ref(),
            ),
        }
    }
}

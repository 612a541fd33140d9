//! Shared-prompt attention rows: uploading a layout built on the host, and gathering a stream's keys and values into each row.

use super::*;

impl AttentionRows {
    /// Uploads a layout built on the host and adds its [`VarlenRows`] form when the stream's
    /// outputs are row segments in row order: the tokens taking their outputs from row `a` come
    /// after those of every earlier row, as consecutive columns ending at the row's last real
    /// column. (A shared-prompt stream is like that: each group's prompt, then each member's
    /// response, the group's first row giving the prompt's outputs.)
    pub fn from_host(
        gather: &[i64],
        scatter: &[i64],
        rows: i64,
        len: i64,
        device: Device,
    ) -> Result<AttentionRows> {
        let up = |v: &[i64], kind: Kind| -> Result<Tensor> {
            Ok(verl_torch_ext::upload_nonblocking(
                Tensor::from_slice(v),
                device,
                kind,
            )?)
        };
        let mut out = AttentionRows::new(
            up(gather, Kind::Int64)?,
            up(scatter, Kind::Int64)?,
            rows,
            len,
        )?;
        if let Some((kv, cu_q, cu_k)) = varlen_layout(gather, scatter, rows, len) {
            let longest = |cu: &[i64]| cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
            let (offsets, sources) = verl_torch_ext::gather_rows_inverse(&kv, scatter.len())
                .ok_or_else(|| {
                    NnError::input(
                        "attention rows gather index",
                        format!("stream indices below {}", scatter.len()),
                        "an index out of range",
                    )
                })?;
            out.varlen = Some(VarlenRows {
                max_q: longest(&cu_q),
                max_k: longest(&cu_k),
                kv_offsets: up(&offsets, Kind::Int64)?,
                kv_sources: up(&sources, Kind::Int64)?,
                kv_gather: up(&kv, Kind::Int64)?,
                cu_q: up(&cu_q, Kind::Int)?,
                cu_k: up(&cu_k, Kind::Int)?,
            });
        }
        Ok(out)
    }

    /// Checks the shapes and kinds (not the index values: an index out of range fails in the
    /// forward's gather).
    pub fn new(gather: Tensor, scatter: Tensor, rows: i64, len: i64) -> Result<AttentionRows> {
        let flat = |t: &Tensor, what: &str, n: Option<i64>| -> Result<()> {
            let s = t.size();
            let ok = t.kind() == Kind::Int64 && s.len() == 1 && n.is_none_or(|n| s[0] == n);
            if ok {
                return Ok(());
            }
            Err(NnError::input(
                what,
                match n {
                    Some(n) => format!("int64 [{n}]"),
                    None => "int64 [N]".into(),
                },
                format!("{:?} {s:?}", t.kind()),
            ))
        };
        if rows < 1 || len < 1 {
            return Err(NnError::input(
                "attention rows",
                "at least one row of at least one column",
                format!("{rows} rows of {len}"),
            ));
        }
        flat(&gather, "attention rows gather index", Some(rows * len))?;
        flat(&scatter, "attention rows scatter index", None)?;
        Ok(AttentionRows {
            gather,
            scatter,
            rows,
            len,
            varlen: None,
        })
    }

    /// Stream tokens `N`.
    pub fn tokens(&self) -> i64 {
        self.scatter.size()[0]
    }

    pub(crate) fn shallow_clone(&self) -> AttentionRows {
        AttentionRows {
            gather: self.gather.shallow_clone(),
            scatter: self.scatter.shallow_clone(),
            rows: self.rows,
            len: self.len,
            varlen: self.varlen.as_ref().map(|v| VarlenRows {
                kv_gather: v.kv_gather.shallow_clone(),
                cu_q: v.cu_q.shallow_clone(),
                cu_k: v.cu_k.shallow_clone(),
                max_q: v.max_q,
                max_k: v.max_k,
                kv_offsets: v.kv_offsets.shallow_clone(),
                kv_sources: v.kv_sources.shallow_clone(),
            }),
        }
    }

    /// `[1, heads, N, D]` stream keys/queries/values -> `[N, heads, D]`.
    pub(super) fn stream(x: &Tensor) -> Result<Tensor> {
        let s = x.size();
        Ok(x.f_squeeze_dim(0)?
            .f_transpose(0, 1)?
            .f_reshape([s[2], s[1], s[3]])?)
    }

    /// `[N, heads, D]` -> `[rows, len, heads, D]`.
    pub(super) fn assemble(&self, x: &Tensor) -> Result<Tensor> {
        let s = x.size();
        Ok(x.f_index_select(0, &self.gather)?
            .f_view([self.rows, self.len, s[1], s[2]])?)
    }

    /// `[rows, heads, len, D]` attention output -> the stream's `[1, heads, N, D]`.
    pub(super) fn disperse(&self, out: &Tensor) -> Result<Tensor> {
        let s = out.size();
        Ok(out
            .f_transpose(1, 2)?
            .f_reshape([self.rows * self.len, s[1], s[3]])?
            .f_index_select(0, &self.scatter)?
            .f_transpose(0, 1)?
            .f_unsqueeze(0)?)
    }
}

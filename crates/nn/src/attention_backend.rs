//! The seam between the model and a generation engine's key/value storage: the model hands each
//! layer's queries, keys and values to an [`AttentionBackend`] and takes back the attention output.

use tch::Tensor;

use crate::error::Result;

/// One layer's attention inputs handed to an [`AttentionBackend`].
#[derive(Debug)]
pub struct AttentionCall<'a> {
    /// Decoder layer index.
    pub layer: usize,
    /// Sliding-window size of this layer (`None` = full causal attention): key `j` may be seen by
    /// a query at position `p` only when `p - window < j <= p`.
    pub window: Option<i64>,
    /// `[B, num_attention_heads, T, head_dim]`, after q-norm and RoPE.
    pub q: &'a Tensor,
    /// `[B, num_key_value_heads, T, head_dim]`, after k-norm and RoPE, not expanded for GQA
    /// (query head `h` reads kv head `h / (num_attention_heads / num_key_value_heads)`).
    pub k: &'a Tensor,
    pub v: &'a Tensor,
}

/// Key/value storage and attention of [`crate::Transformer::forward_hidden_with_backend`]: lets a
/// generation engine keep its own cache layout (a paged block pool) while the model owns the
/// projections, norms, RoPE and MLPs.
pub trait AttentionBackend {
    /// Stores this forward's keys/values and returns the attention output for the queries,
    /// `[B, num_attention_heads, T, head_dim]` (softmax scale `1 / sqrt(head_dim)`), in the
    /// queries' dtype.
    fn attend(&mut self, call: AttentionCall<'_>) -> Result<Tensor>;

    /// [`AttentionBackend::attend`] on queries and keys before RoPE (after q/k-norm), with the
    /// rotation's `cos`/`sin` `[B, 1, T, head_dim]`: a backend that rotates them itself while it
    /// stores the keys (one fused kernel) returns the output; `None` (the default) makes the
    /// caller rotate and call [`AttentionBackend::attend`]. Only offered where nothing needs a
    /// gradient.
    fn attend_unrotated(
        &mut self,
        call: AttentionCall<'_>,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<Option<Tensor>> {
        let _ = (call, cos, sin);
        Ok(None)
    }
}

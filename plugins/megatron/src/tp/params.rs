//! A rank's parameters against the full model's: gathering shards into full tensors, slicing full tensors into shards.

use super::*;

impl TpModel {
    /// Whether this stage holds the last stage's copy of a tied embedding (its LM head).
    pub fn holds_tied_head_copy(&self) -> bool {
        !self.stage.is_first()
            && matches!(self.head, Some(Head::Lm(w)) if self.params[w].name == EMBED)
    }

    /// The index of parameter `name` on this stage.
    pub fn param_index(&self, name: &str) -> Option<usize> {
        self.params.iter().position(|p| p.name == name)
    }

    pub fn set_requires_grad(&mut self, on: bool) -> Result<()> {
        for p in &self.params {
            let _ = p.local.f_set_requires_grad(on).ctx("requires_grad")?;
        }
        Ok(())
    }

    /// The global indices of the model's sparse (MoE) layers (every stage's).
    pub fn sparse_layers(&self) -> Vec<usize> {
        (0..self.cfg.num_hidden_layers as usize)
            .filter(|&i| is_sparse(&self.cfg, i))
            .collect()
    }

    /// The routing counts and load-balancing losses recorded by the training backwards since the
    /// last call (every sparse layer of the model listed, so stages reduce together), and a fresh
    /// accumulator in their place.
    pub fn take_moe_load(&self) -> Result<MoeLoadMetrics> {
        let mut guard = self.moe_load.lock().map_err(|_| {
            MegatronError::Api(verl_plugin_api::Error::failed(
                "internal: MoE load metrics lock poisoned",
            ))
        })?;
        Ok(std::mem::replace(&mut *guard, fresh_load(&self.cfg)))
    }

    /// Whole tensors of parameter `i`, by HF name, from this rank's slice `local` (the parameter
    /// itself or e.g. an optimizer moment): one for an ordinary parameter; for a routed expert's,
    /// one per expert-parallel rank (the same projection of the expert at the same local position
    /// on each). Every rank of the tensor- and expert-parallel groups must call this together, in
    /// the same parameter order.
    pub fn gather_named(&self, i: usize, local: &Tensor) -> Result<Vec<(String, Tensor)>> {
        let full = self.gather_full(i, local)?;
        let p = &self.params[i];
        let Some((expert, per_rank)) = p.expert else {
            return Ok(vec![(p.name.clone(), full)]);
        };
        let ep = &self.experts.ep;
        let parts = ep.all_gather(&full, "all_gather (expert weights)")?;
        let me = ep.rank as i64;
        let own = format!(".experts.{expert}.");
        Ok(parts
            .into_iter()
            .enumerate()
            .map(|(r, t)| {
                let other = expert + (r as i64 - me) * per_rank;
                (p.name.replacen(&own, &format!(".experts.{other}."), 1), t)
            })
            .collect())
    }

    /// Whether parameter `i` is a routed expert's (held by one expert-parallel rank; its gradient
    /// covers every token of the expert-parallel group).
    pub fn is_expert(&self, i: usize) -> bool {
        self.params[i].expert.is_some()
    }

    /// The full tensor of parameter `i` from this rank's slice `local` (which may be the slice of
    /// another tensor of the same layout, e.g. an optimizer moment). Every rank of the
    /// tensor-parallel group (of the expert-tensor-parallel group, for a routed expert's
    /// parameter) must call this together.
    pub fn gather_full(&self, i: usize, local: &Tensor) -> Result<Tensor> {
        let p = &self.params[i];
        let Some(d) = p.split.dim() else {
            return Ok(local.shallow_clone());
        };
        let parts = match p.expert {
            // A routed expert is split over the expert-tensor-parallel group.
            Some(_) => self
                .experts
                .etp
                .all_gather(local, "all_gather (expert-tensor-parallel slices)")?,
            None => self.tp.all_gather(local, "all_gather (full parameter)")?,
        };
        Tensor::f_cat(&parts, d).ctx("join tensor-parallel shards")
    }

    /// This rank's slice of a full tensor shaped like parameter `i`.
    pub fn local_of(&self, i: usize, full: &Tensor) -> Result<Tensor> {
        let p = &self.params[i];
        if full.size() != p.full_shape {
            return Err(MegatronError::Model(verl_nn::NnError::ShapeMismatch {
                path: std::path::PathBuf::from("<full tensor>"),
                name: p.name.clone(),
                expected: p.full_shape.clone(),
                found: full.size(),
            }));
        }
        match p.expert {
            Some(_) => shard_of(full, p.split, self.experts.etp.rank, self.experts.etp.size),
            None => shard_of(full, p.split, self.tp.rank, self.tp.size),
        }
    }

    /// Whether parameter `i` is divided over the tensor-parallel ranks (its gradient norm is then
    /// summed over them; a replicated one counts once).
    pub fn is_split(&self, i: usize) -> bool {
        self.params[i].split != Split::Replicated
    }
}

//! Training passes: a forward and its backward into the parameters' gradients, whole or unit by unit (the FSDP backend's gated gathers).

use super::*;

impl Transformer {
    /// Forward, `loss_fn` on the head output, backward; returns the (detached) loss.
    /// Gradients accumulate into the parameters' `.grad` exactly as `loss.backward()` would.
    ///
    /// With activation checkpointing on, tch has no `torch.utils.checkpoint` and no custom
    /// autograd functions, so recomputation is driven by hand: the layers first run under
    /// `no_grad` keeping only each layer's input; the head + `loss_fn` are differentiated from the
    /// last hidden state; then, from the last layer to the first, the layer is re-run with grad on
    /// its saved input and back-propagated with the incoming gradient (`(y * g).sum().backward()`,
    /// whose gradient w.r.t. `y` is exactly `g`), yielding parameter gradients and the gradient for
    /// the layer below. Peak activation memory is one layer's graph plus the `[B, T, H]` inputs.
    /// The result equals the plain backward up to floating-point reassociation; the forward runs
    /// twice per layer. Deterministic layers are required (no dropout here; MoE top-k re-selects the
    /// same experts on identical inputs).
    pub fn forward_backward<F>(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
        loss_fn: F,
    ) -> Result<Tensor>
    where
        F: FnOnce(&Tensor) -> Result<Tensor>,
    {
        self.forward_backward_to(
            Output::Head,
            input_ids,
            attention_mask,
            position_ids,
            None,
            loss_fn,
        )
    }

    /// [`Transformer::forward_backward`] with `loss_fn` on the final hidden states `[B, T, H]`
    /// (after the final norm) instead of the head output: for a caller that applies the head
    /// itself, e.g. chunk by chunk over the positions it needs (see [`Transformer::lm_head_weight`]).
    /// The returned loss must depend on the hidden states (and may depend on the head weight).
    pub fn forward_backward_hidden<F>(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
        loss_fn: F,
    ) -> Result<Tensor>
    where
        F: FnOnce(&Tensor) -> Result<Tensor>,
    {
        self.forward_backward_to(
            Output::Hidden,
            input_ids,
            attention_mask,
            position_ids,
            None,
            loss_fn,
        )
    }

    /// [`Transformer::forward_backward_hidden`] of a packed token stream (see
    /// [`Transformer::forward_hidden_rows`]): `loss_fn` gets the hidden states `[1, N, H]`.
    pub fn forward_backward_hidden_rows<F>(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        rows: &AttentionRows,
        loss_fn: F,
    ) -> Result<Tensor>
    where
        F: FnOnce(&Tensor) -> Result<Tensor>,
    {
        self.forward_backward_to(
            Output::Hidden,
            input_ids,
            None,
            Some(position_ids),
            Some(rows),
            loss_fn,
        )
    }

    pub(super) fn forward_backward_to<F>(
        &self,
        output: Output,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
        rows: Option<&AttentionRows>,
        loss_fn: F,
    ) -> Result<Tensor>
    where
        F: FnOnce(&Tensor) -> Result<Tensor>,
    {
        self.check_trainable()?;
        let _accumulate = AccumulateIntoGrad::set(self.grad_accumulation_fusion);
        if !self.checkpointing {
            let mut timer = crate::profile::start(self.device());
            let h = self.forward_hidden_in(input_ids, attention_mask, position_ids, None, rows)?;
            let out = match output {
                Output::Head => self.apply_head(&h, attention_mask)?,
                Output::Hidden => h,
            };
            crate::profile::lap(&mut timer, "train/forward");
            let loss = loss_fn(&out)?;
            check_scalar(&loss)?;
            crate::profile::lap(&mut timer, "train/loss_fn");
            loss.f_backward()?;
            crate::profile::lap(&mut timer, "train/backward");
            return Ok(loss.f_detach()?);
        }
        let ctx = self.prepare(input_ids, attention_mask, position_ids, None, rows)?;
        // Inputs of every layer, kept without autograd history.
        let mut inputs: Vec<Tensor> = Vec::with_capacity(self.layers.len());
        let mut h = tch::no_grad(|| self.embed(input_ids))?;
        for layer in &self.layers {
            let next = tch::no_grad(|| layer.forward(&h, &ctx.layer, None))?;
            inputs.push(std::mem::replace(&mut h, next));
        }
        let x = h.f_detach()?.f_set_requires_grad(true)?;
        let out = self.output(&x, attention_mask, output)?;
        let loss = loss_fn(&out)?;
        check_scalar(&loss)?;
        loss.f_backward()?;
        drop(out);
        let mut grad = x.f_grad()?;
        for (layer, saved) in self.layers.iter().zip(inputs).rev() {
            let x = saved.f_detach()?.f_set_requires_grad(true)?;
            let y = layer.forward(&x, &ctx.layer, None)?;
            backward_with_grad(&y, &grad)?;
            grad = x.f_grad()?;
        }
        let e = self.embed(input_ids)?;
        if e.requires_grad() {
            backward_with_grad(&e, &grad)?;
        }
        Ok(loss.f_detach()?)
    }

    /// [`Transformer::forward_backward`] for a sharded model: every unit's parameters are
    /// acquired from `gate` right before the unit runs and released right after, and each unit's
    /// parameter gradients go to [`ParamGate::gradients`] as soon as its backward is done (they
    /// never accumulate in `.grad`). Returns the (detached) loss.
    ///
    /// This always recomputes each layer in the backward (activation checkpointing), whatever
    /// [`Transformer::set_activation_checkpointing`] says: a layer graph kept from the forward
    /// would hold `weight.t()` views of the gathered parameters, and tch cannot shrink a storage
    /// in place (PyTorch FSDP's `untyped_storage().resize_(0)`), so the gathered weights could not
    /// be freed between forward and backward. Units are entered in the order embedding, layers,
    /// head (forward), then head, layers in reverse, embedding (backward).
    pub fn forward_backward_gated<F>(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
        gate: &mut dyn ParamGate,
        loss_fn: F,
    ) -> Result<Tensor>
    where
        F: FnOnce(&Tensor) -> Result<Tensor>,
    {
        self.forward_backward_gated_to(
            Output::Head,
            input_ids,
            attention_mask,
            position_ids,
            None,
            gate,
            loss_fn,
        )
    }

    /// [`Transformer::forward_backward_gated`] with `loss_fn` on the final hidden states, as in
    /// [`Transformer::forward_backward_hidden`]. The head unit stays acquired while `loss_fn`
    /// runs, so [`Transformer::lm_head_weight`] holds its full values there.
    pub fn forward_backward_gated_hidden<F>(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
        gate: &mut dyn ParamGate,
        loss_fn: F,
    ) -> Result<Tensor>
    where
        F: FnOnce(&Tensor) -> Result<Tensor>,
    {
        self.forward_backward_gated_to(
            Output::Hidden,
            input_ids,
            attention_mask,
            position_ids,
            None,
            gate,
            loss_fn,
        )
    }

    /// [`Transformer::forward_backward_gated_hidden`] of a packed token stream (see
    /// [`Transformer::forward_hidden_rows`]).
    pub fn forward_backward_gated_hidden_rows<F>(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        rows: &AttentionRows,
        gate: &mut dyn ParamGate,
        loss_fn: F,
    ) -> Result<Tensor>
    where
        F: FnOnce(&Tensor) -> Result<Tensor>,
    {
        self.forward_backward_gated_to(
            Output::Hidden,
            input_ids,
            None,
            Some(position_ids),
            Some(rows),
            gate,
            loss_fn,
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_backward_gated_to<F>(
        &self,
        output: Output,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
        rows: Option<&AttentionRows>,
        gate: &mut dyn ParamGate,
        loss_fn: F,
    ) -> Result<Tensor>
    where
        F: FnOnce(&Tensor) -> Result<Tensor>,
    {
        self.check_trainable()?;
        let ctx = self.prepare(input_ids, attention_mask, position_ids, None, rows)?;
        let mut inputs: Vec<Tensor> = Vec::with_capacity(self.layers.len());
        let mut h = gated(gate, Unit::Embedding, |_| {
            tch::no_grad(|| self.embed(input_ids))
        })?;
        for (i, layer) in self.layers.iter().enumerate() {
            let next = gated(gate, Unit::Layer(i), |_| {
                tch::no_grad(|| layer.forward(&h, &ctx.layer, None))
            })?;
            inputs.push(std::mem::replace(&mut h, next));
        }
        let (loss, mut grad) = gated(gate, Unit::Head, |gate| -> Result<(Tensor, Tensor)> {
            let x = h.f_detach()?.f_set_requires_grad(true)?;
            let out = self.output(&x, attention_mask, output)?;
            let loss = loss_fn(&out)?;
            check_scalar(&loss)?;
            let grads = self.unit_backward(Unit::Head, &loss, Some(&x), gate)?;
            Ok((loss.f_detach()?, input_grad(grads)?))
        })?;
        drop(h);
        for (i, (layer, saved)) in self.layers.iter().zip(inputs).enumerate().rev() {
            grad = gated(gate, Unit::Layer(i), |gate| -> Result<Tensor> {
                let x = saved.f_detach()?.f_set_requires_grad(true)?;
                let y = layer.forward(&x, &ctx.layer, None)?;
                let surrogate = y.f_mul(&grad)?.f_sum(None::<Kind>)?;
                let g = self.unit_backward(Unit::Layer(i), &surrogate, Some(&x), gate)?;
                input_grad(g)
            })?;
        }
        gated(gate, Unit::Embedding, |gate| -> Result<()> {
            let e = self.embed(input_ids)?;
            if e.requires_grad() {
                let surrogate = e.f_mul(&grad)?.f_sum(None::<Kind>)?;
                self.unit_backward(Unit::Embedding, &surrogate, None, gate)?;
            }
            Ok(())
        })?;
        Ok(loss)
    }

    /// Differentiates `root` w.r.t. `unit`'s parameters (those that require grad) and `input`;
    /// hands the parameter gradients to `gate` and returns the input's.
    pub(super) fn unit_backward(
        &self,
        unit: Unit,
        root: &Tensor,
        input: Option<&Tensor>,
        gate: &mut dyn ParamGate,
    ) -> Result<Option<Tensor>> {
        let idx = self.unit_parameters(unit);
        let trainable: Vec<usize> = (0..idx.len())
            .filter(|&k| self.params[idx[k]].1.requires_grad())
            .collect();
        let mut wrt: Vec<&Tensor> = input.into_iter().collect();
        wrt.extend(trainable.iter().map(|&k| &self.params[idx[k]].1));
        if wrt.is_empty() {
            return Ok(None);
        }
        let mut grads = Tensor::f_run_backward(&[root], &wrt, false, false)?.into_iter();
        let input_grad = match input {
            Some(x) => {
                let g = grads.next().filter(|g| g.defined());
                Some(match g {
                    Some(g) => g,
                    None => x.f_zeros_like()?,
                })
            }
            None => None,
        };
        let mut per_param: Vec<Option<Tensor>> = (0..idx.len()).map(|_| None).collect();
        for (k, g) in trainable.into_iter().zip(grads) {
            per_param[k] = g.defined().then_some(g);
        }
        // Called even when no parameter got a gradient: a sharding gate runs one collective per
        // call, and every rank must make the same calls whatever its tokens were routed to.
        if !per_param.is_empty() {
            gate.gradients(unit, per_param)?;
        }
        Ok(input_grad)
    }
}

//! A tensor-parallel model (one pipeline stage of it) being trained: fp32 gradient accumulators, fp32
//! master weights and their AdamW state, the micro-batches through the pipeline schedule,
//! data-parallel gradient reduction, clipping with the norm of the whole (unsplit, every stage)
//! model, the LR schedule.
//!
//! This rank's parameter slices are laid out in flat fp32 vectors: the tensor-parallel-split
//! parameters, the replicated ones (their squared gradients count once across the
//! tensor-parallel group, not once per rank) and, on the last of several stages with tied
//! embeddings, its copy of the embedding (counted by the first stage only). Each stage's squares
//! add up over the pipeline group. Gradients are summed over the data-parallel ranks
//! (never averaged: the loss uses verl-losses' global normaliser over the whole mini-batch, so the
//! per-rank shares add up to the one-rank loss). A mixture-of-experts model's routed experts are a
//! flat of their own: each expert-parallel rank holds other experts whose gradients already cover
//! the tokens of its whole expert-tensor × expert-parallel group, so they are summed over the
//! expert-data-parallel group only (Megatron-core's expert grid; and their squares over the
//! expert-parallel and expert-tensor-parallel groups: every parameter counts once in the norm). With `use_distributed_optimizer` the flats are
//! padded to a multiple of their group's size, gradients are reduce-scattered, and each rank
//! keeps and steps only its block of the masters and AdamW moments (ZeRO-1, Megatron's distributed
//! optimizer), then all-gathers the updated masters; without it every rank all-reduces and steps
//! everything.

use std::collections::HashMap;

use tch::{Kind, Tensor};
use verl_backend_kit::config::OptimSection;
use verl_backend_kit::optim::{AdamW, LrSchedule};
use verl_backend_kit::update::StepAt;
use verl_comm::ReduceOp;

use crate::error::{MegatronError, Result, TorchContext};
use crate::offload::{
    move_all, move_params, prefetch_all, Contents, HostHomes, Need, Offload, Place,
};
use crate::parallel::{Group, Parallel};
use crate::pipeline::{gather_stages, train_1f1b, MicroInput};
use crate::tp::TpModel;

/// How a flat's squared gradients enter the global norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Share {
    /// Tensor-parallel slices: summed over the tensor-parallel group.
    Split,
    /// Replicated over the tensor-parallel group: counted once.
    Replicated,
    /// The last pipeline stage's copy of a tied embedding: the first stage counts it.
    Mirror,
    /// Routed experts' slices (expert-tensor-parallel split, different experts on each
    /// expert-parallel rank): reduced over the expert-data-parallel group, squares summed over
    /// the expert-parallel and expert-tensor-parallel groups.
    Expert,
}

/// One flat vector of parameter slices.
#[derive(Debug, Clone)]
struct Flat {
    share: Share,
    params: Vec<usize>,
    offsets: Vec<usize>,
    numels: Vec<usize>,
    numel: usize,
    /// `numel` rounded up to a multiple of the group size (distributed optimizer).
    padded: usize,
    /// This rank's index in, and the size of, the group the flat's gradients are reduced over
    /// (data-parallel; expert-data-parallel for experts).
    rank: usize,
    size: usize,
    /// Sharded over that group (the distributed optimizer with more than one member).
    sharded: bool,
}

impl Flat {
    /// The group this flat's gradients are reduced (and its optimizer state sharded) over.
    fn group<'a>(&self, par: &'a Parallel) -> &'a Group {
        match self.share {
            Share::Expert => par.expert_dp(),
            _ => &par.dp,
        }
    }
}

pub use verl_backend_kit::optim::What;

pub struct TpTrainer {
    pub model: TpModel,
    flats: Vec<Flat>,
    /// Per parameter: (flat, offset, numel).
    slot: Vec<(usize, usize, usize)>,
    /// Per flat: fp32 gradient accumulator `[padded]`.
    grads: Vec<Tensor>,
    /// Per flat: fp32 masters, this rank's block `[padded / dp]` or everything `[numel]`.
    masters: Vec<Tensor>,
    optim: AdamW,
    distributed: bool,
    optim_cfg: OptimSection,
    optim_key: String,
    schedule: Option<LrSchedule>,
    /// `update` calls completed (the scheduler's step).
    pub updates: u64,
    pub grad_clip: f64,
    /// Host homes of the offloaded parameters and state ([`crate::offload`]).
    homes: HostHomes,
    /// Optimizer state on its way to the device for an update (`optimizer_offload`): joined
    /// before the step (or before it goes back), so the copies overlap the forward and backward.
    uploads: Option<verl_torch_ext::SideCopies>,
}

impl TpTrainer {
    /// Every rank of the data-parallel group must build the same model (same checkpoint).
    pub fn new(
        mut model: TpModel,
        optim_cfg: OptimSection,
        optim_key: &str,
        grad_clip: f64,
        par: &Parallel,
    ) -> Result<TpTrainer> {
        model.set_requires_grad(true)?;
        let distributed = par.layout.distributed_optimizer && par.dp.size > 1;
        let mut flats = Vec::new();
        let mut slot = vec![(0, 0, 0); model.params.len()];
        let mirror = model
            .holds_tied_head_copy()
            .then(|| model.param_index(crate::tp::EMBED))
            .flatten();
        let share_of = |i: usize| {
            if Some(i) == mirror {
                Share::Mirror
            } else if model.is_expert(i) {
                Share::Expert
            } else if model.is_split(i) {
                Share::Split
            } else {
                Share::Replicated
            }
        };
        let mut shares = vec![Share::Split, Share::Replicated];
        if mirror.is_some() {
            shares.push(Share::Mirror);
        }
        if (0..model.params.len()).any(|i| model.is_expert(i)) {
            shares.push(Share::Expert);
        }
        for share in shares {
            let group = match share {
                Share::Expert => par.expert_dp(),
                _ => &par.dp,
            };
            let mut f = Flat {
                share,
                params: vec![],
                offsets: vec![],
                numels: vec![],
                numel: 0,
                padded: 0,
                rank: group.rank,
                size: group.size,
                sharded: par.layout.distributed_optimizer && group.size > 1,
            };
            for (i, p) in model.params.iter().enumerate() {
                if share_of(i) != share {
                    continue;
                }
                let n = p.local.numel();
                slot[i] = (flats.len(), f.numel, n);
                f.params.push(i);
                f.offsets.push(f.numel);
                f.numels.push(n);
                f.numel += n;
            }
            f.padded = if f.sharded {
                f.numel.div_ceil(f.size).max(1) * f.size
            } else {
                f.numel
            };
            flats.push(f);
        }
        let device = model.device();
        let mut grads = Vec::new();
        let mut masters = Vec::new();
        for f in &flats {
            grads.push(
                Tensor::f_zeros([f.padded as i64], (Kind::Float, device))
                    .ctx("gradient accumulator")?,
            );
            let full = flatten(&model, f)?;
            masters.push(if f.sharded {
                block(&full, f, f.rank, f.size)?
            } else {
                full
            });
        }
        let optim = AdamW::new(&optim_cfg, optim_key, &masters)?;
        Ok(TpTrainer {
            model,
            flats,
            slot,
            grads,
            masters,
            optim,
            distributed,
            optim_cfg,
            optim_key: optim_key.to_string(),
            schedule: None,
            updates: 0,
            grad_clip,
            homes: HostHomes::default(),
            uploads: None,
        })
    }

    pub fn distributed(&self) -> bool {
        self.distributed
    }

    /// The LR schedule, built on first use so the host can pass the total step count with the first
    /// update (`UpdateOptions.extra.total_training_steps`).
    pub fn lr(&mut self, fallback_total: Option<i64>) -> Result<f64> {
        Ok(verl_backend_kit::optim::scheduled_lr(
            &mut self.schedule,
            &self.optim_cfg,
            &self.optim_key,
            fallback_total,
            self.updates,
        )?)
    }

    pub fn zero_grad(&mut self) -> Result<()> {
        for g in &mut self.grads {
            let _ = g.f_zero_().ctx("zero gradients")?;
        }
        Ok(())
    }

    /// Adds a parameter gradient (this rank's slice of parameter `i`) into the fp32 accumulator.
    fn accumulate(
        grads: &[Tensor],
        slot: &[(usize, usize, usize)],
        i: usize,
        g: &Tensor,
    ) -> Result<()> {
        let (f, off, n) = slot[i];
        // One kernel: the in-place add reads the gradient in its dtype and sums in fp32.
        let g = g.f_reshape([-1]).ctx("flatten gradient")?;
        let _ = grads[f]
            .f_narrow(0, off as i64, n as i64)
            .and_then(|mut dst| dst.f_add_(&g))
            .ctx("accumulate gradient")?;
        Ok(())
    }

    /// Forward and backward of every micro-batch of a mini-batch through the pipeline (the 1F1B
    /// schedule; with one stage, one micro-batch after the other). `loss_fn(i, model, hidden)`
    /// runs on the last stage only, on micro-batch `i`'s normed final hidden states; its results
    /// come back there (`None` on the other stages).
    pub fn forward_backward_pipelined<T>(
        &mut self,
        par: &Parallel,
        micro: &[MicroInput],
        mut loss_fn: impl FnMut(usize, &TpModel, &Tensor) -> Result<(Tensor, T)>,
    ) -> Result<Vec<Option<(Tensor, T)>>> {
        // The projection weights' gradients go straight into their accumulator slices.
        let targets = self.grad_targets()?;
        self.model.set_grad_targets(Some(targets));
        let (grads, slot) = (&self.grads, &self.slot);
        let mut sink = |i: usize, g: &Tensor| Self::accumulate(grads, slot, i, g);
        let model = &self.model;
        let mut loss = |i: usize, h: &Tensor| loss_fn(i, model, h);
        let out = train_1f1b(model, &par.pp, micro, &mut sink, &mut loss);
        self.model.set_grad_targets(None);
        out
    }

    /// Per parameter, its fp32 accumulator slice in the parameter's local shape, for the matrices
    /// (the decoder layers' projection weights take it; see [`TpModel::set_grad_targets`]).
    fn grad_targets(&self) -> Result<Vec<Option<Tensor>>> {
        let mut out = Vec::with_capacity(self.slot.len());
        for (i, &(f, off, n)) in self.slot.iter().enumerate() {
            let shape = self.model.params[i].local.size();
            if shape.len() != 2 || self.grads[f].device() != self.model.device() {
                out.push(None);
                continue;
            }
            out.push(Some(
                self.grads[f]
                    .f_narrow(0, off as i64, n as i64)
                    .and_then(|t| t.f_view(shape.as_slice()))
                    .ctx("gradient accumulator slice")?,
            ));
        }
        Ok(out)
    }

    /// The end of a mini-batch: gradients summed over the data-parallel ranks, the global norm
    /// (of the whole model), clipping, and — if the norm is finite — the AdamW step and the new
    /// weights published into the model. A non-finite norm clears the gradients, leaves the weights
    /// untouched and fails naming `role`, step, epoch, mini-batch and `<role>/grad_norm`.
    pub fn finish_mini_batch(&mut self, par: &Parallel, lr: f64, at: StepAt) -> Result<f64> {
        self.sum_tied_embedding_gradients(par)?;
        let mut reduced = Vec::with_capacity(self.grads.len());
        for (f, g) in self.flats.iter().zip(&self.grads) {
            let group = f.group(par);
            if f.sharded {
                let mut out =
                    Tensor::f_zeros([(f.padded / f.size) as i64], (Kind::Float, g.device()))
                        .ctx("gradient shard")?;
                group.reduce_scatter_sum(&mut out, g, "reduce_scatter (gradients)")?;
                reduced.push(out);
            } else {
                let mut g = g.shallow_clone();
                group.all_reduce(&mut g, ReduceOp::Sum, "all_reduce (gradients)")?;
                reduced.push(g);
            }
        }
        // [split, replicated] squared sums of this stage's dense flats, and of its experts; a
        // mirror copy is counted by the first stage.
        let mut sq = [0.0f64; 2];
        let mut expert_sq = [0.0f64];
        for (f, g) in self.flats.iter().zip(&reduced) {
            match f.share {
                Share::Split => sq[0] += sum_sq(g)?,
                Share::Replicated => sq[1] += sum_sq(g)?,
                Share::Expert => expert_sq[0] += sum_sq(g)?,
                Share::Mirror => {}
            }
        }
        if self.distributed {
            par.dp
                .all_reduce_f64(&mut sq, ReduceOp::Sum, "all_reduce (gradient norm)")?;
        }
        if let Some(f) = self.flats.iter().find(|f| f.share == Share::Expert) {
            // Each expert-data-parallel rank holds a block of the experts' gradients, each
            // expert-parallel rank other experts.
            if f.sharded {
                f.group(par).all_reduce_f64(
                    &mut expert_sq,
                    ReduceOp::Sum,
                    "all_reduce (expert gradient norm)",
                )?;
            }
            par.ep_all_reduce_f64(&mut expert_sq, "all_reduce (expert gradient norm)")?;
            // Expert slices are split over the expert-tensor-parallel group.
            par.etp_all_reduce_f64(&mut expert_sq, "all_reduce (expert gradient norm)")?;
        }
        let mut split = [sq[0]];
        par.tp
            .all_reduce_f64(&mut split, ReduceOp::Sum, "all_reduce (gradient norm)")?;
        // Each stage holds other parameters: their squares add up over the pipeline (the expert
        // squares are already the stage's whole).
        let mut stage = [split[0] + sq[1] + expert_sq[0]];
        par.pp
            .all_reduce_f64(&mut stage, ReduceOp::Sum, "all_reduce (gradient norm)")?;
        let norm = stage[0].sqrt();
        if !norm.is_finite() {
            self.zero_grad()?;
            return Err(at.non_finite_grad_norm(norm).into());
        }
        if self.grad_clip > 0.0 {
            let coef = self.grad_clip / (norm + 1e-6);
            if coef < 1.0 {
                for g in &mut reduced {
                    let _ = g.f_mul_scalar_(coef).ctx("clip gradients")?;
                }
            }
        }
        self.join_uploads()?;
        self.optim.step(&self.masters, &reduced, lr)?;
        self.publish(par)?;
        Ok(norm)
    }

    /// Megatron's embedding group: with tied embeddings split over several stages, the first
    /// stage's input embedding and the last stage's LM head are one parameter, so each adds the
    /// other's gradient (before the data-parallel reduction; `a + b` is the same on both ends,
    /// and both then take the same optimizer step).
    fn sum_tied_embedding_gradients(&mut self, par: &Parallel) -> Result<()> {
        let stage = self.model.stage();
        let tied = self.model.config().tie_word_embeddings
            && self.model.head_kind() == verl_nn::HeadKind::CausalLm;
        if stage.count == 1 || !tied || !(stage.is_first() || stage.is_last()) {
            return Ok(());
        }
        let i = self.model.param_index(crate::tp::EMBED).ok_or_else(|| {
            MegatronError::Api(verl_plugin_api::Error::failed(
                "internal: tied embedding missing on a pipeline end stage",
            ))
        })?;
        let (f, off, n) = self.slot[i];
        let mut mine = self.grads[f]
            .f_narrow(0, off as i64, n as i64)
            .ctx("tied embedding gradient")?;
        let peer = if stage.is_first() { stage.count - 1 } else { 0 };
        let mut theirs = mine.f_zeros_like().ctx("tied embedding gradient")?;
        let out = mine.f_contiguous().ctx("tied embedding gradient")?;
        par.pp.exchange(
            &out,
            &mut theirs,
            peer,
            "send_recv (tied embedding gradient)",
        )?;
        let _ = mine.f_add_(&theirs).ctx("tied embedding gradient")?;
        Ok(())
    }

    /// Copies the masters (gathered over the data-parallel ranks when sharded) into the model.
    fn publish(&mut self, par: &Parallel) -> Result<()> {
        for fi in 0..self.flats.len() {
            let full = self.full_flat(par, fi, What::Master)?;
            self.write_flat(fi, &full)?;
        }
        Ok(())
    }

    fn write_flat(&self, fi: usize, full: &Tensor) -> Result<()> {
        let f = &self.flats[fi];
        tch::no_grad(|| -> Result<()> {
            for (k, &i) in f.params.iter().enumerate() {
                let p = &self.model.params[i].local;
                let src = full
                    .f_narrow(0, f.offsets[k] as i64, f.numels[k] as i64)
                    .and_then(|x| x.f_view(p.size().as_slice()))
                    .ctx("master slice")?;
                p.shallow_clone().f_copy_(&src).ctx("masters → model")?;
            }
            Ok(())
        })
    }

    fn state(&self, what: What, fi: usize) -> &Tensor {
        match what {
            What::Master => &self.masters[fi],
            What::ExpAvg => &self.optim.exp_avg[fi],
            What::ExpAvgSq => &self.optim.exp_avg_sq[fi],
        }
    }

    /// This rank's whole flat `[numel]` of `what` (gathered over data-parallel ranks when sharded).
    /// Every data-parallel rank must call it together.
    fn full_flat(&self, par: &Parallel, fi: usize, what: What) -> Result<Tensor> {
        let f = &self.flats[fi];
        let t = self.state(what, fi);
        if !f.sharded {
            return Ok(t.shallow_clone());
        }
        let mut out =
            Tensor::f_zeros([f.padded as i64], (Kind::Float, t.device())).ctx("gather buffer")?;
        f.group(par)
            .all_gather_into(&mut out, t, "all_gather (optimizer shards)")?;
        out.f_narrow(0, 0, f.numel as i64).ctx("unpad")
    }

    /// The full (unsplit, fp32) tensor of every parameter of the whole model (every pipeline stage)
    /// for `what`, by HF name. Every rank takes part; the tensors are complete on every rank.
    pub fn gather_state(&self, par: &Parallel, what: What) -> Result<HashMap<String, Tensor>> {
        let mine = self.gather_stage_state(par, what)?;
        let m = &self.model;
        gather_stages(
            m.config(),
            m.head_kind(),
            &par.pp,
            m.stage().chunks,
            mine,
            Kind::Float,
            1,
        )
    }

    /// [`TpTrainer::gather_state`] of this stage's parameters only.
    fn gather_stage_state(&self, par: &Parallel, what: What) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        for fi in 0..self.flats.len() {
            let full = self.full_flat(par, fi, what)?;
            let f = &self.flats[fi];
            for (k, &i) in f.params.iter().enumerate() {
                let p = &self.model.params[i];
                let local = full
                    .f_narrow(0, f.offsets[k] as i64, f.numels[k] as i64)
                    .and_then(|x| x.f_view(p.local.size().as_slice()))
                    .ctx("state slice")?;
                out.extend(self.model.gather_named(i, &local)?);
            }
        }
        Ok(out)
    }

    /// Restores `what` from full tensors by HF name (any tensor-parallel or data-parallel size
    /// wrote them); masters are then published into the model.
    pub fn restore_state(
        &mut self,
        par: &Parallel,
        what: What,
        full: &HashMap<String, Tensor>,
        file: &std::path::Path,
    ) -> Result<()> {
        for fi in 0..self.flats.len() {
            let f = self.flats[fi].clone();
            let device = self.masters[fi].device();
            let flat =
                Tensor::f_zeros([f.padded as i64], (Kind::Float, device)).ctx("restore buffer")?;
            for (k, &i) in f.params.iter().enumerate() {
                let name = &self.model.params[i].name;
                let t = full.get(name).ok_or_else(|| {
                    MegatronError::checkpoint(file, format!("tensor `{name}` missing"))
                })?;
                let local = self
                    .model
                    .local_of(i, t)?
                    .f_to_kind(Kind::Float)
                    .and_then(|x| x.f_to_device(device))
                    .and_then(|x| x.f_reshape([-1]))
                    .ctx("restore slice")?;
                flat.f_narrow(0, f.offsets[k] as i64, f.numels[k] as i64)
                    .and_then(|mut d| d.f_copy_(&local))
                    .ctx("restore slice")?;
            }
            let src = if f.sharded {
                block(&flat, &f, f.rank, f.size)?
            } else {
                flat
            };
            let dst = match what {
                What::Master => &self.masters[fi],
                What::ExpAvg => &self.optim.exp_avg[fi],
                What::ExpAvgSq => &self.optim.exp_avg_sq[fi],
            };
            tch::no_grad(|| dst.shallow_clone().f_copy_(&src)).ctx("restore state")?;
        }
        if what == What::Master {
            self.publish(par)?;
        }
        Ok(())
    }

    pub fn optimizer_step(&self) -> u64 {
        self.optim.step
    }

    pub fn set_counters(&mut self, optimizer_step: u64, updates: u64) {
        self.optim.step = optimizer_step;
        self.updates = updates;
    }

    /// Moves the fp32 gradient accumulators (one per flat) to `place` (`grad_offload`); returns
    /// their labels (`grad/<flat>`).
    pub fn move_grads(&mut self, place: Place) -> Result<Vec<String>> {
        let device = self.model.device();
        move_all(
            self.grads
                .iter_mut()
                .enumerate()
                .map(|(fi, t)| (format!("grad/{fi}"), t)),
            place,
            device,
            &mut self.homes,
            // Zeroed at the end of every update: nothing to carry between calls.
            Contents::Zeros,
        )
    }

    /// Moves this rank's fp32 masters and AdamW moments (its shards with the distributed
    /// optimizer) to `place` (`optimizer_offload`); returns their labels (`master/<flat>`,
    /// `exp_avg/<flat>`, `exp_avg_sq/<flat>`).
    pub fn move_optimizer(&mut self, place: Place) -> Result<Vec<String>> {
        self.move_optimizer_as(place, false)
    }

    /// [`TpTrainer::move_optimizer`]; with `prefetch` (to the device) the copies run on a side
    /// stream, joined by the step ([`TpTrainer::join_uploads`]).
    fn move_optimizer_as(&mut self, place: Place, prefetch: bool) -> Result<Vec<String>> {
        // Copies still on their way in must land before anything reads or moves these tensors.
        self.join_uploads()?;
        let device = self.model.device();
        let label = |what: &'static str| move |(fi, t)| (format!("{what}/{fi}"), t);
        let tensors = self
            .masters
            .iter_mut()
            .enumerate()
            .map(label("master"))
            .chain(
                self.optim
                    .exp_avg
                    .iter_mut()
                    .enumerate()
                    .map(label("exp_avg")),
            )
            .chain(
                self.optim
                    .exp_avg_sq
                    .iter_mut()
                    .enumerate()
                    .map(label("exp_avg_sq")),
            );
        if prefetch && place == Place::Device {
            let (seen, copies) = prefetch_all(tensors, device, &mut self.homes)?;
            self.uploads = Some(copies);
            return Ok(seen);
        }
        move_all(tensors, place, device, &mut self.homes, Contents::Changed)
    }

    /// Makes the current stream wait for the optimizer state [`TpTrainer::move_offloaded`] sent
    /// to the device for an update (a no-op when nothing is on its way).
    pub fn join_uploads(&mut self) -> Result<()> {
        if let Some(mut up) = self.uploads.take() {
            up.join()?;
        }
        Ok(())
    }

    /// Moves what `offload` offloads of what a call needing `need` uses to `place`: the
    /// parameters, and for an update the gradient buffers and for an update or a checkpoint the
    /// optimizer state. Returns the labels of the tensors moved.
    pub fn move_offloaded(
        &mut self,
        offload: Offload,
        need: Need,
        place: Place,
    ) -> Result<Vec<String>> {
        let mut seen = Vec::new();
        if offload.params {
            seen.extend(move_params(
                &mut self.model,
                place,
                &mut self.homes,
                need.param_contents(),
            )?);
        }
        if offload.grads && need.grads() {
            seen.extend(self.move_grads(place)?);
        }
        if offload.optimizer && need.optimizer() {
            // An update reads the state only at its step: the copies overlap the micro-batches.
            seen.extend(self.move_optimizer_as(place, need == Need::Train)?);
        }
        Ok(seen)
    }

    /// The flats (gradient buffers, master / moment tensors per kind) of this rank.
    pub fn flat_count(&self) -> usize {
        self.flats.len()
    }

    /// The devices of the gradient buffers, then of masters and moments (tests).
    pub fn state_devices(&self) -> (Vec<tch::Device>, Vec<tch::Device>) {
        let grads = self.grads.iter().map(|t| t.device()).collect();
        let optim = self
            .masters
            .iter()
            .chain(&self.optim.exp_avg)
            .chain(&self.optim.exp_avg_sq)
            .map(|t| t.device())
            .collect();
        (grads, optim)
    }

    /// Bytes held in masters, gradient accumulators and optimizer state on this rank.
    pub fn memory_bytes(&self) -> usize {
        let b = |t: &Tensor| t.numel() * t.kind().elt_size_in_bytes();
        self.masters.iter().map(b).sum::<usize>()
            + self.grads.iter().map(b).sum::<usize>()
            + self
                .optim
                .exp_avg
                .iter()
                .chain(&self.optim.exp_avg_sq)
                .map(b)
                .sum::<usize>()
    }
}

/// The fp32 values of the model's slices of `f`, flat `[padded]`.
fn flatten(model: &TpModel, f: &Flat) -> Result<Tensor> {
    let out =
        Tensor::f_zeros([f.padded as i64], (Kind::Float, model.device())).ctx("flat masters")?;
    tch::no_grad(|| -> Result<()> {
        for (k, &i) in f.params.iter().enumerate() {
            let src = model.params[i]
                .local
                .f_detach()
                .and_then(|x| x.f_to_kind(Kind::Float))
                .and_then(|x| x.f_reshape([-1]))
                .ctx("flatten")?;
            out.f_narrow(0, f.offsets[k] as i64, f.numels[k] as i64)
                .and_then(|mut d| d.f_copy_(&src))
                .ctx("flatten")?;
        }
        Ok(())
    })?;
    Ok(out)
}

/// Block `rank` of `size` of a padded flat vector (a copy).
fn block(flat: &Tensor, f: &Flat, rank: usize, size: usize) -> Result<Tensor> {
    let n = (f.padded / size) as i64;
    flat.f_narrow(0, rank as i64 * n, n)
        .and_then(|x| x.f_detach_copy())
        .ctx("optimizer shard")
}

fn sum_sq(t: &Tensor) -> Result<f64> {
    t.f_to_kind(Kind::Double)
        .and_then(|x| x.f_square())
        .and_then(|x| x.f_sum(Kind::Double))
        .and_then(|x| x.f_double_value(&[]))
        .ctx("gradient norm")
}

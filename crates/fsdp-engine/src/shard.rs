//! ZeRO-3 state of a model trained on several data-parallel ranks.
//!
//! The parameters are grouped per [`Unit`] (embedding, each decoder layer, final norm + head) into
//! one flat fp32 vector per group, padded to a multiple of the world size; rank `r` owns block `r`
//! of every group: the master weights, the gradient accumulator and the AdamW moments of that
//! block, nothing else. The live compute-dtype model keeps its parameter tensors (autograd leaves
//! the layers hold), but their data is an empty tensor except while a unit runs: the [`Gate`]
//! all-gathers the unit's groups into them (`Tensor::set_data`) right before, and empties them
//! right after. Each unit's gradients are reduce-scattered (sum) into the accumulators as soon as
//! its backward is done, so a full gradient exists for one unit at a time.
//!
//! A tied LM head reads the embedding group: the head unit gathers both groups and its embedding
//! gradient is reduce-scattered into the embedding group's accumulator (summed with the one from
//! the embedding unit).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};
use verl_nn::{Checkpoint, NnError, ParamGate, Transformer, Unit};

use verl_backend_kit::dp::Dp;
use verl_backend_kit::error::{BackendError, Result, TorchContext};
use verl_backend_kit::host_params::Fill;
use verl_backend_kit::optim::AdamW;
use verl_comm::Pending;

/// One flat group: the parameters of a unit (those no earlier unit owns), in model order.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    pub name: String,
    /// Indices into `Transformer::named_parameters`.
    pub params: Vec<usize>,
    pub names: Vec<String>,
    pub shapes: Vec<Vec<i64>>,
    pub offsets: Vec<usize>,
    pub numels: Vec<usize>,
    /// Elements before padding.
    pub numel: usize,
}

impl Group {
    /// Elements each rank owns (the padded length divided by `world`).
    pub fn shard_len(&self, world: usize) -> usize {
        self.numel.div_ceil(world).max(1)
    }
}

/// How a model's parameters are grouped, and which groups and slots each unit reads.
#[derive(Debug, Clone)]
pub struct Layout {
    pub groups: Vec<Group>,
    /// For each unit, per entry of `Transformer::unit_parameters(unit)`: (group, index in group);
    /// `None` for a frozen parameter (LoRA's base), which stays whole on every rank.
    slots: BTreeMap<Unit, Vec<Option<(usize, usize)>>>,
    /// Groups a unit reads, in gather order.
    unit_groups: BTreeMap<Unit, Vec<usize>>,
}

fn group_name(unit: Unit) -> String {
    match unit {
        Unit::Embedding => "embedding".into(),
        Unit::Layer(i) => format!("layers.{i}"),
        Unit::Head => "head".into(),
    }
}

impl Layout {
    /// Decoder layers (units `Layer(0..n)`).
    pub fn layers(&self) -> usize {
        self.slots
            .keys()
            .filter(|u| matches!(u, Unit::Layer(_)))
            .count()
    }

    /// The layout of `model`'s trainable parameters (all of them, or a LoRA model's adapters:
    /// frozen parameters are not sharded, every rank keeps them whole).
    pub fn of(model: &Transformer) -> Layout {
        let named = model.named_parameters();
        let mut owner: Vec<Option<(usize, usize)>> = vec![None; named.len()];
        let mut groups: Vec<Group> = Vec::new();
        let mut slots = BTreeMap::new();
        let mut unit_groups = BTreeMap::new();
        for unit in model.units() {
            let idx = model.unit_parameters(unit);
            let mut g = Group {
                name: group_name(unit),
                params: vec![],
                names: vec![],
                shapes: vec![],
                offsets: vec![],
                numels: vec![],
                numel: 0,
            };
            for &i in &idx {
                if owner[i].is_some() || !named[i].1.requires_grad() {
                    continue;
                }
                owner[i] = Some((groups.len(), g.params.len()));
                let (name, p) = &named[i];
                g.params.push(i);
                g.names.push(name.clone());
                g.shapes.push(p.size());
                g.offsets.push(g.numel);
                g.numels.push(p.numel());
                g.numel += p.numel();
            }
            if !g.params.is_empty() {
                groups.push(g);
            }
            let s: Vec<Option<(usize, usize)>> = idx.iter().map(|&i| owner[i]).collect();
            let mut gs: Vec<usize> = Vec::new();
            for (g, _) in s.iter().flatten() {
                if !gs.contains(g) {
                    gs.push(*g);
                }
            }
            slots.insert(unit, s);
            unit_groups.insert(unit, gs);
        }
        Layout {
            groups,
            slots,
            unit_groups,
        }
    }

    pub fn unit_groups(&self, unit: Unit) -> Vec<usize> {
        self.unit_groups.get(&unit).cloned().unwrap_or_default()
    }

    /// The layout as written into a sharded checkpoint's index.
    pub fn to_json(&self, world: usize) -> serde_json::Value {
        let groups: Vec<serde_json::Value> = self
            .groups
            .iter()
            .map(|g| {
                serde_json::json!({
                    "name": g.name,
                    "numel": g.numel,
                    "shard_numel": g.shard_len(world),
                    "params": g.names.iter().zip(&g.shapes).zip(&g.offsets)
                        .map(|((n, s), o)| serde_json::json!({"name": n, "shape": s, "offset": o}))
                        .collect::<Vec<_>>(),
                })
            })
            .collect();
        serde_json::json!(groups)
    }
}

/// Where the rank's shards live between optimizer steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Offload {
    /// Master weights on the CPU.
    pub params: bool,
    /// AdamW moments on the CPU.
    pub optimizer: bool,
}

/// Bytes held by a rank's training tensors, counted from the tensors themselves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryStats {
    /// Parameters: master weights plus whatever compute-dtype parameters are materialised now.
    pub params: usize,
    /// Gradients (accumulators and `.grad` buffers).
    pub grads: usize,
    /// Optimizer state.
    pub optimizer: usize,
    /// The most bytes of gathered (full) parameters held at once since the last reset.
    pub peak_gathered: usize,
}

impl MemoryStats {
    pub fn total(&self) -> usize {
        self.params + self.grads + self.optimizer
    }
}

pub(crate) use verl_backend_kit::host_params::bytes;
pub use verl_backend_kit::optim::What;

/// One rank's block of `flat` (`[numel]`) after padding to `world * shard` elements.
fn slice_shard(flat: &Tensor, numel: usize, shard: usize, rank: usize) -> Result<Tensor> {
    let start = rank * shard;
    let out = Tensor::f_zeros([shard as i64], (flat.kind(), flat.device())).ctx("shard")?;
    if start < numel {
        let len = shard.min(numel - start);
        out.f_narrow(0, 0, len as i64)
            .and_then(|mut o| o.f_copy_(&flat.f_narrow(0, start as i64, len as i64)?))
            .ctx("shard")?;
    }
    Ok(out)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GroupState {
    Freed,
    Gathered,
}

pub struct ShardState {
    pub layout: Layout,
    rank: usize,
    world: usize,
    /// The model's parameter tensors (shared with its layers).
    live: Vec<Tensor>,
    compute: Kind,
    device: Device,
    empty: Tensor,
    /// Per group, this rank's fp32 master block `[shard]`.
    pub masters: Vec<Tensor>,
    /// Per group, this rank's fp32 gradient accumulator block `[shard]` (on the device).
    pub accum: Vec<Tensor>,
    refs: Vec<usize>,
    state: Vec<GroupState>,
    grads_seen: Vec<bool>,
    pub offload: Offload,
    reshard_after_forward: bool,
    /// The dtype gradients are reduce-scattered in (added into the fp32 accumulators).
    reduce: Kind,
    gathered_bytes: usize,
    peak_gathered: usize,
    /// Per group, a gather started ahead of its acquire ([`ShardState::prefetch`]): the full
    /// buffer and the collective filling it.
    prefetched: Vec<Option<(Tensor, Pending)>>,
    /// Reduce-scatters that may still be running: (group, this rank's summed block, the
    /// collective); added into the accumulators in order (see [`ShardState::reduce_gradients`]).
    reductions: Vec<(usize, Tensor, Pending)>,
}

impl ShardState {
    /// Shards `model` (every rank holds the same full model: rank 0's weights are broadcast
    /// first, like FSDP's `sync_module_states`) and frees the model's parameters.
    pub fn new(
        model: &Transformer,
        dp: &Dp,
        master: Kind,
        offload: Offload,
        reshard_after_forward: bool,
        reduce: Kind,
    ) -> Result<ShardState> {
        let layout = Layout::of(model);
        let device = model.device();
        let compute = model.dtype();
        let live: Vec<Tensor> = model
            .named_parameters()
            .iter()
            .map(|(_, p)| p.shallow_clone())
            .collect();
        let (world, rank) = (dp.size, dp.rank);
        let master_device = if offload.params { Device::Cpu } else { device };
        let mut masters = Vec::with_capacity(layout.groups.len());
        let mut accum = Vec::with_capacity(layout.groups.len());
        tch::no_grad(|| -> Result<()> {
            for g in &layout.groups {
                let mut flat = Tensor::f_cat(
                    &g.params
                        .iter()
                        .map(|&i| live[i].f_detach()?.f_reshape([-1]))
                        .collect::<std::result::Result<Vec<_>, _>>()
                        .ctx("flatten parameters")?,
                    0,
                )
                .ctx("flatten parameters")?;
                dp.broadcast(&mut flat, 0)?;
                let flat = flat.f_to_kind(master).ctx("master weights")?;
                let shard = g.shard_len(world);
                masters.push(
                    slice_shard(&flat, g.numel, shard, rank)?
                        .f_to_device(master_device)
                        .ctx("master shard")?,
                );
                accum.push(
                    Tensor::f_zeros([shard as i64], (Kind::Float, device))
                        .ctx("gradient accumulator")?,
                );
            }
            Ok(())
        })?;
        if offload.params && device.is_cuda() {
            // Page-locked (one flat buffer) for the copies of every optimizer step.
            let refs: Vec<&Tensor> = masters.iter().collect();
            masters = verl_backend_kit::host_params::host_buffers(&refs, None, Fill::Copy, device)?;
        }
        let empty = Tensor::f_empty([0], (compute, device)).ctx("empty parameter")?;
        let n = layout.groups.len();
        let mut s = ShardState {
            layout,
            rank,
            world,
            live,
            compute,
            device,
            empty,
            masters,
            accum,
            refs: vec![0; n],
            state: vec![GroupState::Gathered; n],
            grads_seen: vec![false; n],
            offload,
            reshard_after_forward,
            reduce,
            gathered_bytes: 0,
            peak_gathered: 0,
            prefetched: (0..n).map(|_| None).collect(),
            reductions: Vec::new(),
        };
        s.gathered_bytes = s.live.iter().map(bytes).sum();
        for g in 0..n {
            s.free(g)?;
        }
        s.peak_gathered = 0;
        Ok(s)
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Starts the all-gather of group `g`'s master blocks (in the compute dtype) into a new full
    /// buffer; the collective may still be running when this returns.
    fn start_gather(&self, dp: &Dp, g: usize) -> Result<(Tensor, Pending)> {
        let group = &self.layout.groups[g];
        let shard = group.shard_len(self.world);
        let input = self.masters[g]
            .f_to_device(self.device)
            .and_then(|m| m.f_to_kind(self.compute))
            .ctx("master shard to compute dtype")?;
        let full = Tensor::f_empty([(shard * self.world) as i64], (self.compute, self.device))
            .ctx("gather buffer")?;
        let pending = dp.all_gather_into_async(&full, &input)?;
        Ok((full, pending))
    }

    /// Starts gathering group `g` ahead of its [`ShardState::acquire`] (a no-op where it is
    /// gathered or already on its way), so that the collective runs while the device computes
    /// what was queued before it. Costs one group's full parameters until it is acquired.
    pub fn prefetch(&mut self, dp: &Dp, g: usize) -> Result<()> {
        if self.state[g] == GroupState::Freed && self.prefetched[g].is_none() {
            self.prefetched[g] = Some(self.start_gather(dp, g)?);
        }
        Ok(())
    }

    /// Makes group `g`'s parameters hold their full values (all-gather of the master blocks in
    /// the compute dtype, or the one [`ShardState::prefetch`] started), counting references.
    pub fn acquire(&mut self, dp: &Dp, g: usize) -> Result<()> {
        if self.state[g] == GroupState::Freed {
            let (full, pending) = match self.prefetched[g].take() {
                Some(started) => started,
                None => self.start_gather(dp, g)?,
            };
            pending.wait().map_err(|source| BackendError::Comm {
                op: "all_gather (parameters)",
                source,
            })?;
            let group = &self.layout.groups[g];
            for (k, &i) in group.params.iter().enumerate() {
                let view = full
                    .f_narrow(0, group.offsets[k] as i64, group.numels[k] as i64)
                    .and_then(|v| v.f_view(group.shapes[k].as_slice()))
                    .ctx("gathered parameter")?;
                self.live[i]
                    .shallow_clone()
                    .f_set_data(&view)
                    .ctx("publish gathered parameter")?;
            }
            self.state[g] = GroupState::Gathered;
            self.gathered_bytes += bytes(&full);
            self.peak_gathered = self.peak_gathered.max(self.gathered_bytes);
        }
        self.refs[g] += 1;
        Ok(())
    }

    /// Drops a reference to group `g`; frees it when none is left (with
    /// `reshard_after_forward: false`, only once its gradients went through).
    pub fn release(&mut self, g: usize) -> Result<()> {
        self.refs[g] = self.refs[g].saturating_sub(1);
        if self.refs[g] == 0 && (self.reshard_after_forward || self.grads_seen[g]) {
            self.free(g)?;
        }
        Ok(())
    }

    fn free(&mut self, g: usize) -> Result<()> {
        if self.state[g] == GroupState::Freed {
            return Ok(());
        }
        let group = &self.layout.groups[g];
        let mut freed = 0;
        for &i in &group.params {
            freed += bytes(&self.live[i]);
            self.live[i]
                .shallow_clone()
                .f_set_data(&self.empty)
                .ctx("free gathered parameter")?;
        }
        self.gathered_bytes = self.gathered_bytes.saturating_sub(freed);
        self.state[g] = GroupState::Freed;
        self.grads_seen[g] = false;
        Ok(())
    }

    /// Gathers every group (for a call that runs the whole model several times: generation,
    /// log-probs, values, saving the HF folder).
    pub fn acquire_all(&mut self, dp: &Dp) -> Result<()> {
        for g in 0..self.layout.groups.len() {
            self.acquire(dp, g)?;
        }
        Ok(())
    }

    /// Frees every group, whatever its reference count, after the gradient reductions still
    /// running were added up; gathers started ahead and never acquired are dropped.
    pub fn release_all(&mut self) -> Result<()> {
        let reduced = self.finish_reductions();
        for p in &mut self.prefetched {
            *p = None;
        }
        reduced?;
        for g in 0..self.layout.groups.len() {
            self.refs[g] = 0;
            self.free(g)?;
        }
        Ok(())
    }

    /// Reduce-scatters (sum) the gradients of one backward through `unit` into the accumulators.
    /// Every rank calls this for the same units in the same order; a parameter without gradient
    /// contributes zeros, so the collectives match even when ranks route tokens differently.
    ///
    /// The reduce-scatters may still be running when this returns (the communicator's own
    /// stream): the previous unit's are added into the accumulators here, after this unit's are
    /// queued, so each unit's reduction overlaps the next unit's backward; the rest are added by
    /// [`ShardState::finish_reductions`] (every reader of the accumulators calls it). The adds
    /// happen in the order the reductions were issued, as without overlap.
    pub fn reduce_gradients(
        &mut self,
        dp: &Dp,
        unit: Unit,
        grads: Vec<Option<Tensor>>,
    ) -> Result<()> {
        let earlier = std::mem::take(&mut self.reductions);
        let slots = self.layout.slots.get(&unit).cloned().unwrap_or_default();
        for g in self.layout.unit_groups(unit) {
            let group = &self.layout.groups[g];
            let shard = group.shard_len(self.world);
            let flat = Tensor::f_zeros([(shard * self.world) as i64], (self.reduce, self.device))
                .ctx("gradient buffer")?;
            for (slot, grad) in slots.iter().zip(&grads) {
                let Some((gg, k)) = slot else { continue };
                if *gg != g {
                    continue;
                }
                if let Some(grad) = grad {
                    flat.f_narrow(0, group.offsets[*k] as i64, group.numels[*k] as i64)
                        .and_then(|mut dst| dst.f_copy_(&grad.f_reshape([-1])?))
                        .ctx("flatten gradient")?;
                }
            }
            let out = Tensor::f_zeros([shard as i64], (self.reduce, self.device))
                .ctx("gradient shard")?;
            // The collective keeps `flat` alive until it has run.
            let pending = dp.reduce_scatter_sum_async(&out, &flat)?;
            self.reductions.push((g, out, pending));
            self.grads_seen[g] = true;
        }
        self.add_reductions(earlier)
    }

    /// Adds every reduce-scatter still pending into its accumulator (the default stream waits
    /// for each collective on the device; the host does not).
    pub fn finish_reductions(&mut self) -> Result<()> {
        let pending = std::mem::take(&mut self.reductions);
        self.add_reductions(pending)
    }

    /// Adds `reductions` into their accumulators, in order, once each collective has run.
    fn add_reductions(&mut self, reductions: Vec<(usize, Tensor, Pending)>) -> Result<()> {
        for (g, out, pending) in reductions {
            pending.wait().map_err(|source| BackendError::Comm {
                op: "reduce_scatter (gradients)",
                source,
            })?;
            let _ = self.accum[g]
                .f_add_(&out)
                .ctx("accumulate gradient shard")?;
        }
        Ok(())
    }

    pub fn zero_grad(&mut self) -> Result<()> {
        self.finish_reductions()?;
        for a in &mut self.accum {
            let _ = a.f_zero_().ctx("zero gradient shards")?;
        }
        Ok(())
    }

    /// Σ of the squared gradient-shard elements on this rank (fp64).
    pub fn local_grad_sq(&mut self) -> Result<f64> {
        self.finish_reductions()?;
        let mut sq = 0.0;
        for a in &self.accum {
            sq += a
                .f_to_kind(Kind::Double)
                .and_then(|x| x.f_square())
                .and_then(|x| x.f_sum(Kind::Double))
                .and_then(|x| x.f_double_value(&[]))
                .ctx("gradient norm")?;
        }
        Ok(sq)
    }

    pub fn scale_grads(&mut self, coef: f64) -> Result<()> {
        self.finish_reductions()?;
        for a in &mut self.accum {
            let _ = a.f_mul_scalar_(coef).ctx("clip gradient shards")?;
        }
        Ok(())
    }

    /// One AdamW step on this rank's blocks (libtorch's fused kernel on a GPU); offloaded blocks
    /// visit the device for it, about [`crate::ckpt_files::OFFLOAD_CHUNK_BYTES`] of masters at a time.
    pub fn step(&mut self, optim: &mut AdamW, lr: f64) -> Result<()> {
        self.finish_reductions()?;
        let c = optim.begin_step(lr);
        let host = (self.offload.params, self.offload.optimizer);
        let chunk = if host.0 || host.1 {
            crate::ckpt_files::OFFLOAD_CHUNK_BYTES
        } else {
            usize::MAX
        };
        optim.step_visiting(
            &c,
            self.device,
            &self.masters,
            &self.accum,
            host,
            chunk,
            |_, _| Ok(()),
        )
    }

    /// The device optimizer state should live on.
    pub fn optimizer_device(&self) -> Device {
        if self.offload.optimizer {
            Device::Cpu
        } else {
            self.device
        }
    }

    pub fn memory(&self, optim: &AdamW) -> MemoryStats {
        MemoryStats {
            params: self.masters.iter().map(bytes).sum::<usize>() + self.gathered_bytes,
            grads: self.accum.iter().map(bytes).sum(),
            optimizer: optim
                .exp_avg
                .iter()
                .chain(&optim.exp_avg_sq)
                .map(bytes)
                .sum(),
            peak_gathered: self.peak_gathered,
        }
    }

    pub fn reset_peak(&mut self) {
        self.peak_gathered = self.gathered_bytes;
    }

    /// File names of rank `rank`'s shards in a checkpoint of `world` ranks.
    pub fn shard_files(rank: usize, world: usize) -> (String, String) {
        (
            format!("master.rank{rank}-of-{world}.safetensors"),
            format!("optim.rank{rank}-of-{world}.safetensors"),
        )
    }

    /// Writes this rank's master and optimizer blocks into `dir`.
    pub fn save_shards(&self, dir: &Path, optim: &AdamW) -> Result<()> {
        let (mf, of) = Self::shard_files(self.rank, self.world);
        let host = |t: &Tensor| t.f_to_device(Device::Cpu).ctx("shard to host");
        let masters: Vec<(String, Tensor)> = self
            .layout
            .groups
            .iter()
            .zip(&self.masters)
            .map(|(g, t)| Ok((g.name.clone(), host(t)?)))
            .collect::<Result<_>>()?;
        Tensor::write_safetensors(&masters, dir.join(&mf)).ctx("write master shard")?;
        let mut state: Vec<(String, Tensor)> = Vec::new();
        for (i, g) in self.layout.groups.iter().enumerate() {
            state.push((format!("exp_avg.{}", g.name), host(&optim.exp_avg[i])?));
            state.push((
                format!("exp_avg_sq.{}", g.name),
                host(&optim.exp_avg_sq[i])?,
            ));
        }
        Tensor::write_safetensors(&state, dir.join(&of)).ctx("write optimizer shard")
    }

    /// Restores this rank's blocks from a checkpoint written at any world size.
    pub fn load_from(&mut self, src: &mut Source, optim: &mut AdamW) -> Result<()> {
        let groups = self.layout.groups.clone();
        tch::no_grad(|| -> Result<()> {
            for (g, group) in groups.iter().enumerate() {
                let shard = group.shard_len(self.world);
                for (what, dst) in [
                    (What::Master, &mut self.masters[g]),
                    (What::ExpAvg, &mut optim.exp_avg[g]),
                    (What::ExpAvgSq, &mut optim.exp_avg_sq[g]),
                ] {
                    let flat = src.group_flat(group, what)?;
                    let block = slice_shard(&flat, group.numel, shard, self.rank)?;
                    dst.f_copy_(&block).ctx("restore shard")?;
                }
            }
            Ok(())
        })
    }
}

/// A checkpoint being restored, read as one flat fp32 vector per group whatever the world size it
/// was written at.
pub enum Source {
    /// A one-rank checkpoint: full tensors by parameter name.
    Full {
        dir: PathBuf,
        /// `master.safetensors` (mixed precision), else the HF folder holds the masters.
        masters: Option<HashMap<String, Tensor>>,
        model: Checkpoint,
        optim: HashMap<String, Tensor>,
        optim_path: PathBuf,
    },
    /// Shards of `world` ranks, each file read on first use.
    Sharded {
        dir: PathBuf,
        world: usize,
        /// Group name → (elements, shard elements) as saved.
        groups: HashMap<String, (usize, usize)>,
        files: HashMap<String, HashMap<String, Tensor>>,
    },
}

pub(crate) fn read_named(path: &Path) -> Result<HashMap<String, Tensor>> {
    if !path.is_file() {
        return Err(BackendError::Checkpoint {
            path: path.to_path_buf(),
            message: "file missing".into(),
        });
    }
    Ok(Tensor::read_safetensors(path)
        .ctx(&format!("read {}", path.display()))?
        .into_iter()
        .collect())
}

impl Source {
    /// `state` is the checkpoint's parsed `state.json`.
    pub fn open(dir: &Path, state: &serde_json::Value) -> Result<Source> {
        let world = state
            .get("world_size")
            .and_then(|v| v.as_u64())
            .unwrap_or(1) as usize;
        if world <= 1 {
            let mp = dir.join(crate::ckpt_files::MASTER_FILE);
            let masters = if mp.is_file() {
                Some(read_named(&mp)?)
            } else {
                None
            };
            let optim_path = dir.join(crate::ckpt_files::OPTIM_FILE);
            return Ok(Source::Full {
                dir: dir.to_path_buf(),
                masters,
                model: Checkpoint::open(dir.join(crate::ckpt_files::MODEL_DIR))?,
                optim: read_named(&optim_path)?,
                optim_path,
            });
        }
        let bad = |message: String| BackendError::Checkpoint {
            path: dir.join(crate::ckpt_files::STATE_FILE),
            message,
        };
        let layout = state
            .get("layout")
            .and_then(|v| v.as_array())
            .ok_or_else(|| {
                bad(format!(
                    "`layout` should list the flat groups of a {world}-rank checkpoint, found {}",
                    state.get("layout").cloned().unwrap_or_default()
                ))
            })?;
        let mut groups = HashMap::new();
        for g in layout {
            let name = g.get("name").and_then(|v| v.as_str());
            let numel = g.get("numel").and_then(|v| v.as_u64());
            let shard = g.get("shard_numel").and_then(|v| v.as_u64());
            match (name, numel, shard) {
                (Some(n), Some(e), Some(s)) => {
                    groups.insert(n.to_string(), (e as usize, s as usize));
                }
                _ => {
                    return Err(bad(format!(
                        "layout entry should have name, numel and shard_numel, found {g}"
                    )))
                }
            }
        }
        Ok(Source::Sharded {
            dir: dir.to_path_buf(),
            world,
            groups,
            files: HashMap::new(),
        })
    }

    /// The group's full flat contents (`[group.numel]`, fp32, CPU).
    pub fn group_flat(&mut self, group: &Group, what: What) -> Result<Tensor> {
        match self {
            Source::Full {
                dir,
                masters,
                model,
                optim,
                optim_path,
            } => {
                let mut parts = Vec::with_capacity(group.params.len());
                for (name, shape) in group.names.iter().zip(&group.shapes) {
                    let (t, path) = match what {
                        What::Master => match masters {
                            Some(m) => (
                                m.get(name).map(|t| t.shallow_clone()),
                                dir.join(crate::ckpt_files::MASTER_FILE),
                            ),
                            None => (
                                Some(model.tensor(name)?),
                                model.file_of(name)?.to_path_buf(),
                            ),
                        },
                        _ => (
                            optim
                                .get(&format!("{}{name}", what.prefix()))
                                .map(|t| t.shallow_clone()),
                            optim_path.clone(),
                        ),
                    };
                    let key = format!("{}{name}", what.prefix());
                    let t = t.ok_or_else(|| BackendError::Checkpoint {
                        path: path.clone(),
                        message: format!("tensor `{key}` missing"),
                    })?;
                    if &t.size() != shape {
                        return Err(BackendError::Checkpoint {
                            path,
                            message: format!(
                                "tensor `{key}` has shape {:?}, expected {shape:?}",
                                t.size()
                            ),
                        });
                    }
                    parts.push(
                        t.f_reshape([-1])
                            .and_then(|x| x.f_to_kind(Kind::Float))
                            .ctx("checkpoint tensor")?,
                    );
                }
                Tensor::f_cat(&parts, 0).ctx("flatten checkpoint group")
            }
            Source::Sharded {
                dir,
                world,
                groups,
                files,
            } => {
                let state_path = dir.join(crate::ckpt_files::STATE_FILE);
                let &(numel, shard) =
                    groups
                        .get(&group.name)
                        .ok_or_else(|| BackendError::Checkpoint {
                            path: state_path.clone(),
                            message: format!("layout lacks group `{}`", group.name),
                        })?;
                if numel != group.numel {
                    return Err(BackendError::Checkpoint {
                        path: state_path,
                        message: format!(
                            "group `{}` holds {numel} elements, this model's {} (a different model?)",
                            group.name, group.numel
                        ),
                    });
                }
                let mut parts = Vec::with_capacity(*world);
                for r in 0..*world {
                    let (mf, of) = ShardState::shard_files(r, *world);
                    let file = if what == What::Master { mf } else { of };
                    if !files.contains_key(&file) {
                        let named = read_named(&dir.join(&file))?;
                        files.insert(file.clone(), named);
                    }
                    let key = format!("{}{}", what.prefix(), group.name);
                    let t = files[&file]
                        .get(&key)
                        .ok_or_else(|| BackendError::Checkpoint {
                            path: dir.join(&file),
                            message: format!("tensor `{key}` missing"),
                        })?;
                    if t.size() != [shard as i64] {
                        return Err(BackendError::Checkpoint {
                            path: dir.join(&file),
                            message: format!(
                                "tensor `{key}` has shape {:?}, expected [{shard}]",
                                t.size()
                            ),
                        });
                    }
                    parts.push(t.f_to_kind(Kind::Float).ctx("checkpoint shard")?);
                }
                Tensor::f_cat(&parts, 0)
                    .and_then(|t| t.f_narrow(0, 0, numel as i64))
                    .ctx("join checkpoint shards")
            }
        }
    }
}

/// The [`ParamGate`] of one sharded forward-backward: gathers, frees and reduce-scatters through
/// `dp`. The first error is kept in `error` (the model only sees [`NnError::Gate`]).
pub struct Gate<'a> {
    pub state: &'a mut ShardState,
    pub dp: &'a Dp,
    pub error: Option<BackendError>,
    /// Past the head: units are entered in reverse from here on.
    backward: bool,
}

/// The unit [`Transformer::forward_backward_gated`] enters after `unit` (`backward`: past the
/// head), if any.
fn next_unit(unit: Unit, backward: bool, layers: usize) -> Option<Unit> {
    let last_layer = || layers.checked_sub(1).map(Unit::Layer);
    match (unit, backward) {
        (Unit::Embedding, false) => Some(if layers > 0 {
            Unit::Layer(0)
        } else {
            Unit::Head
        }),
        (Unit::Layer(i), false) if i + 1 < layers => Some(Unit::Layer(i + 1)),
        (Unit::Layer(_), false) => Some(Unit::Head),
        (Unit::Head, _) => last_layer().or(Some(Unit::Embedding)),
        (Unit::Layer(0), true) => Some(Unit::Embedding),
        (Unit::Layer(i), true) => Some(Unit::Layer(i - 1)),
        (Unit::Embedding, true) => None,
    }
}

impl<'a> Gate<'a> {
    /// The gate of one forward-backward through the units of `state`.
    pub fn new(state: &'a mut ShardState, dp: &'a Dp) -> Gate<'a> {
        Gate {
            state,
            dp,
            error: None,
            backward: false,
        }
    }
}

impl Gate<'_> {
    fn keep(&mut self, unit: Unit, e: BackendError) -> NnError {
        let message = e.to_string();
        if self.error.is_none() {
            self.error = Some(e);
        }
        NnError::Gate {
            unit: unit.to_string(),
            message,
        }
    }
}

impl ParamGate for Gate<'_> {
    fn acquire(&mut self, unit: Unit) -> verl_nn::Result<()> {
        for g in self.state.layout.unit_groups(unit) {
            if let Err(e) = self.state.acquire(self.dp, g) {
                return Err(self.keep(unit, e));
            }
        }
        // The unit entered next (forward: embedding, layers, head; then backward: layers in
        // reverse, embedding) starts gathering now, behind this unit's compute.
        if unit == Unit::Head {
            self.backward = true;
        }
        let layers = self.state.layout.layers();
        if let Some(next) = next_unit(unit, self.backward, layers) {
            for g in self.state.layout.unit_groups(next) {
                if let Err(e) = self.state.prefetch(self.dp, g) {
                    return Err(self.keep(next, e));
                }
            }
        }
        Ok(())
    }
    fn release(&mut self, unit: Unit) -> verl_nn::Result<()> {
        for g in self.state.layout.unit_groups(unit) {
            if let Err(e) = self.state.release(g) {
                return Err(self.keep(unit, e));
            }
        }
        Ok(())
    }
    fn gradients(&mut self, unit: Unit, grads: Vec<Option<Tensor>>) -> verl_nn::Result<()> {
        match self.state.reduce_gradients(self.dp, unit, grads) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.keep(unit, e)),
        }
    }
}

/// A run of a group's flat vector that a tensor-parallel shard needs: `len` elements from
/// `start`, or (a column-split matrix) `w` columns from `col0` of `rows` consecutive rows of width
/// `c` beginning at flat index `start`.
#[derive(Debug, Clone, Copy)]
enum Seg {
    Range {
        start: usize,
        len: usize,
    },
    Cols {
        start: usize,
        rows: usize,
        c: usize,
        col0: usize,
        w: usize,
    },
}

impl Seg {
    fn len(&self) -> usize {
        match *self {
            Seg::Range { len, .. } => len,
            Seg::Cols { rows, w, .. } => rows * w,
        }
    }

    /// The segment's elements out of `block`, which holds flat indices from `b0`.
    fn take(&self, block: &Tensor, b0: usize) -> Result<Tensor> {
        let t = match *self {
            Seg::Range { start, len } => block.f_narrow(0, (start - b0) as i64, len as i64),
            Seg::Cols {
                start,
                rows,
                c,
                col0,
                w,
            } => block
                .f_narrow(0, (start - b0) as i64, (rows * c) as i64)
                .and_then(|m| m.f_view([rows as i64, c as i64]))
                .and_then(|m| m.f_narrow(1, col0 as i64, w as i64))
                .and_then(|m| m.f_reshape([-1])),
        };
        t.ctx("rollout shard piece")
    }
}

/// The segments of flat indices `b0..b1` of `group` that shard `t` of `size` of its parameters
/// needs, in ascending order (see [`verl_nn::tp::split_dim`]).
fn shard_segments(group: &Group, b0: usize, b1: usize, t: usize, size: usize) -> Vec<Seg> {
    let mut out = Vec::new();
    let range = |s: usize, e: usize, out: &mut Vec<Seg>| {
        let (s, e) = (s.max(b0), e.min(b1));
        if s < e {
            out.push(Seg::Range {
                start: s,
                len: e - s,
            });
        }
    };
    for k in 0..group.params.len() {
        let (off, n, shape) = (group.offsets[k], group.numels[k], &group.shapes[k]);
        if off + n <= b0 || off >= b1 {
            continue;
        }
        match verl_nn::tp::split_dim(&group.names[k]) {
            None => range(off, off + n, &mut out),
            Some(0) => {
                let per = n / size;
                range(off + t * per, off + (t + 1) * per, &mut out);
            }
            Some(_) => {
                // Rows of width c; shard t needs columns col0..col0 + w of each. The rows inside
                // the block: a cut first / last row as plain ranges, whole ones as one segment.
                let c = shape[1] as usize;
                let w = c / size;
                let col0 = t * w;
                let (s, e) = (off.max(b0), (off + n).min(b1));
                let (first, last) = ((s - off) / c, (e - off - 1) / c);
                let row = |r: usize, out: &mut Vec<Seg>| {
                    let r0 = off + r * c;
                    let (a, b) = ((r0 + col0).max(s), (r0 + col0 + w).min(e));
                    if a < b {
                        out.push(Seg::Range {
                            start: a,
                            len: b - a,
                        });
                    }
                };
                if first == last {
                    row(first, &mut out);
                    continue;
                }
                let mut whole = first..last + 1;
                if (s - off) % c != 0 {
                    row(first, &mut out);
                    whole.start += 1;
                }
                let cut_last = (e - off) % c != 0;
                if cut_last {
                    whole.end -= 1;
                }
                if !whole.is_empty() {
                    out.push(Seg::Cols {
                        start: off + whole.start * c,
                        rows: whole.len(),
                        c,
                        col0,
                        w,
                    });
                }
                if cut_last {
                    row(last, &mut out);
                }
            }
        }
    }
    out
}

impl ShardState {
    /// Every parameter of group `g` as shard `t` of `size` of the tensor-parallel layout
    /// ([`verl_nn::tp::split_dim`]), in the compute dtype, built with one all-to-all: each rank
    /// sends every other exactly the elements of its master block that the other's shard needs,
    /// so a rank receives its shard and nothing else. Ranks `r` hold shard `shard_of(r)`. Every
    /// rank calls it together. Returns `(model parameter index, shard)` pairs and the bytes this
    /// rank received from others.
    pub fn tensor_parallel_shards(
        &self,
        dp: &Dp,
        g: usize,
        size: usize,
        shard_of: impl Fn(usize) -> usize,
    ) -> Result<(Vec<(usize, Tensor)>, f64)> {
        let group = &self.layout.groups[g];
        let len = group.shard_len(self.world);
        let (b0, b1) = (self.rank * len, (self.rank + 1) * len);
        let block = self.masters[g]
            .f_to_device(self.device)
            .and_then(|m| m.f_to_kind(self.compute))
            .ctx("master shard to compute dtype")?;
        // What this rank's block holds of each shard, sent to every rank of that shard.
        let pieces: Vec<Tensor> = (0..size)
            .map(|t| -> Result<Tensor> {
                let parts = shard_segments(group, b0, b1, t, size)
                    .iter()
                    .map(|s| s.take(&block, b0))
                    .collect::<Result<Vec<_>>>()?;
                match parts.is_empty() {
                    true => Tensor::f_empty([0], (self.compute, self.device)).ctx("empty piece"),
                    false => Tensor::f_cat(&parts, 0).ctx("rollout shard pieces"),
                }
            })
            .collect::<Result<_>>()?;
        let mut input = Vec::with_capacity(self.world);
        let mut input_splits = Vec::with_capacity(self.world);
        for q in 0..self.world {
            let piece = &pieces[shard_of(q)];
            input_splits.push(piece.size()[0] as usize);
            input.push(piece.shallow_clone());
        }
        let input = Tensor::f_cat(&input, 0).ctx("rollout shard pieces")?;
        let me = shard_of(self.rank);
        let output_splits: Vec<usize> = (0..self.world)
            .map(|r| {
                shard_segments(group, r * len, (r + 1) * len, me, size)
                    .iter()
                    .map(Seg::len)
                    .sum()
            })
            .collect();
        let received: usize = output_splits
            .iter()
            .enumerate()
            .filter(|&(r, _)| r != self.rank)
            .map(|(_, n)| n)
            .sum();
        let flat = dp.all_to_all_v(
            &input,
            &input_splits,
            &output_splits,
            "all_to_all (rollout reshard)",
        )?;
        // The shard's elements arrive in ascending flat order: parameter by parameter, row-major.
        let mut out = Vec::with_capacity(group.params.len());
        let mut at = 0i64;
        for k in 0..group.params.len() {
            let mut shape = group.shapes[k].clone();
            if let Some(d) = verl_nn::tp::split_dim(&group.names[k]) {
                shape[d as usize] /= size as i64;
            }
            let n: i64 = shape.iter().product();
            let t = flat
                .f_narrow(0, at, n)
                .and_then(|t| t.f_view(shape.as_slice()))
                .ctx("rollout shard")?;
            at += n;
            out.push((group.params[k], t));
        }
        Ok((out, (received * self.compute.elt_size_in_bytes()) as f64))
    }
}

/// Bytes of tensors, for the one-rank [`MemoryStats`].
pub(crate) fn sum_bytes<'a>(ts: impl IntoIterator<Item = &'a Tensor>) -> usize {
    ts.into_iter().map(bytes).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// For every world size and shard, the segments of every rank's block, taken in rank order,
    /// are exactly the shard's tensors flattened in parameter order: blocks that cut a matrix
    /// inside a row, at both ends of one row, or hold no element of it.
    #[test]
    fn shard_segments_of_all_blocks_make_each_shard() {
        let specs: [(&str, [i64; 2]); 4] = [
            ("a.q_proj.weight", [8, 6]),
            ("a.o_proj.weight", [6, 8]),
            ("a.input_layernorm.weight", [5, 1]),
            ("a.mlp.down_proj.weight", [3, 12]),
        ];
        let mut group = Group {
            name: "g".into(),
            params: vec![],
            names: vec![],
            shapes: vec![],
            offsets: vec![],
            numels: vec![],
            numel: 0,
        };
        for (k, (name, shape)) in specs.iter().enumerate() {
            let shape = if shape[1] == 1 {
                vec![shape[0]]
            } else {
                shape.to_vec()
            };
            let n = shape.iter().product::<i64>() as usize;
            group.params.push(k);
            group.names.push(name.to_string());
            group.shapes.push(shape);
            group.offsets.push(group.numel);
            group.numels.push(n);
            group.numel += n;
        }
        for world in 1..=7 {
            let len = group.shard_len(world);
            let flat = Tensor::arange((len * world) as i64, (Kind::Float, Device::Cpu));
            for size in [1, 2, 4] {
                for t in 0..size {
                    let want: Vec<Tensor> = (0..group.params.len())
                        .map(|k| {
                            let v = flat
                                .narrow(0, group.offsets[k] as i64, group.numels[k] as i64)
                                .view(group.shapes[k].as_slice());
                            verl_nn::tp::shard_of(&v, &group.names[k], t, size)
                                .unwrap()
                                .reshape([-1])
                        })
                        .collect();
                    let mut got = Vec::new();
                    for r in 0..world {
                        let block = flat.narrow(0, (r * len) as i64, len as i64);
                        for seg in shard_segments(&group, r * len, (r + 1) * len, t, size) {
                            got.push(seg.take(&block, r * len).unwrap());
                        }
                    }
                    let (want, got) = (Tensor::cat(&want, 0), Tensor::cat(&got, 0));
                    assert!(
                        want.equal(&got),
                        "world {world}, shard {t} of {size}: {want:?} != {got:?}"
                    );
                }
            }
        }
    }

    /// The units `forward_backward_gated` enters, in order, for `layers` layers.
    fn visiting_order(layers: usize) -> Vec<Unit> {
        let mut v = vec![Unit::Embedding];
        v.extend((0..layers).map(Unit::Layer));
        v.push(Unit::Head);
        v.extend((0..layers).rev().map(Unit::Layer));
        v.push(Unit::Embedding);
        v
    }

    /// The gate prefetches exactly the unit entered next, in both directions, and nothing after
    /// the last one.
    #[test]
    fn the_next_unit_is_the_one_entered_next() {
        for layers in [0, 1, 2, 5] {
            let order = visiting_order(layers);
            let mut backward = false;
            for (k, &unit) in order.iter().enumerate() {
                if unit == Unit::Head {
                    backward = true;
                }
                assert_eq!(
                    next_unit(unit, backward, layers),
                    order.get(k + 1).copied(),
                    "{layers} layers, after {unit} (entry {k})"
                );
            }
        }
    }
}

//! AdamW on fp32 master weights, gradient clipping and verl's LR schedules.
//!
//! The optimizer is written out on tensors rather than taken from `tch::nn::Optimizer` because the
//! backend needs what that wrapper hides: the state tensors (for checkpoints that resume bit-exactly,
//! and later for sharding them per rank), and the master/compute split of mixed precision.

use tch::{Device, Kind, Tensor};

use crate::config::OptimSection;
use crate::error::{BackendError, Result, TorchContext};

/// `torch.optim.AdamW` (no amsgrad), step for step.
pub struct AdamW {
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    /// Optimizer steps taken.
    pub step: u64,
    pub exp_avg: Vec<Tensor>,
    pub exp_avg_sq: Vec<Tensor>,
    /// Whether [`AdamW::step`] uses libtorch's fused multi-tensor kernel
    /// (`torch.optim.AdamW(fused=True)`): on by default for CUDA parameters (one kernel per
    /// step instead of ~10 per parameter), off for CPU ones so CPU runs keep the step-for-step
    /// written-out update.
    pub fused: bool,
}

impl AdamW {
    pub fn new(cfg: &OptimSection, prefix: &str, params: &[Tensor]) -> Result<AdamW> {
        let on_cuda = params.first().is_some_and(|p| p.device().is_cuda());
        let mut optim = Self::without_state(cfg, prefix, on_cuda)?;
        let zeros = |p: &Tensor| p.f_zeros_like().ctx("optimizer state");
        optim.exp_avg = params.iter().map(zeros).collect::<Result<_>>()?;
        optim.exp_avg_sq = params.iter().map(zeros).collect::<Result<_>>()?;
        Ok(optim)
    }

    /// An AdamW whose state the caller provides (`exp_avg`, `exp_avg_sq`: zeros shaped like the
    /// parameters, wherever the caller keeps them); `cuda_params`: whether the steps run on a GPU
    /// (which picks the fused kernel, see [`AdamW::fused`]).
    pub fn without_state(cfg: &OptimSection, prefix: &str, cuda_params: bool) -> Result<AdamW> {
        if !cfg.optimizer.eq_ignore_ascii_case("adamw") {
            return Err(BackendError::config(
                format!("{prefix}.optimizer"),
                "AdamW (the optimizer this backend implements)",
                format!("{:?}", cfg.optimizer),
            ));
        }
        if cfg.betas.len() != 2 {
            return Err(BackendError::config(
                format!("{prefix}.betas"),
                "two numbers [beta1, beta2]",
                format!("{:?}", cfg.betas),
            ));
        }
        let fused = cuda_params;
        Ok(AdamW {
            betas: (cfg.betas[0], cfg.betas[1]),
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
            step: 0,
            exp_avg: Vec::new(),
            exp_avg_sq: Vec::new(),
            fused,
        })
    }

    /// One step on `params` with `grads` (both fp32, same order as at creation).
    pub fn step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) -> Result<()> {
        let c = self.begin_step(lr);
        self.step_tensors(&c, params, grads, &self.exp_avg, &self.exp_avg_sq)
    }

    /// The step [`AdamW::begin_step`] counted, on a list of parameters with their gradients and
    /// state (all on one device; any subset of the model, e.g. a chunk of offloaded state brought
    /// to the device: the update is elementwise, so a step taken chunk by chunk equals one step
    /// over all of them).
    pub fn step_tensors(
        &self,
        c: &StepCoefficients,
        params: &[Tensor],
        grads: &[Tensor],
        exp_avg: &[Tensor],
        exp_avg_sq: &[Tensor],
    ) -> Result<()> {
        if params.is_empty() {
            return Ok(());
        }
        if !self.fused {
            for (i, (p, g)) in params.iter().zip(grads).enumerate() {
                self.update(c, p, g, &exp_avg[i], &exp_avg_sq[i])?;
            }
            return Ok(());
        }
        let device = params[0].device();
        let step = Tensor::f_full([], self.step as f64, (Kind::Float, device)).ctx("AdamW step")?;
        let steps: Vec<Tensor> = params.iter().map(|_| step.shallow_clone()).collect();
        tch::no_grad(|| {
            verl_torch_ext::fused_adamw(
                params,
                grads,
                exp_avg,
                exp_avg_sq,
                &steps,
                c.lr,
                self.betas,
                self.weight_decay,
                self.eps,
            )
        })?;
        Ok(())
    }

    /// The step [`AdamW::begin_step`] counted, over parameters whose masters (`params`) and/or
    /// moments may live in host memory (`host.0`: the masters, `host.1`: the moments): chunks of
    /// about `chunk_bytes` of masters (at least one tensor each) are copied to `device`, stepped
    /// with [`AdamW::step_tensors`] and copied back; `after(i, p)` then sees parameter `i`'s new
    /// value on the device (e.g. to refresh a compute-dtype copy). Tensors not on the host are
    /// stepped in place. Bit for bit the step taken with everything on the device.
    ///
    /// The copies back run on a side stream ([`verl_torch_ext::SideCopies`]) while the next chunk
    /// comes to the device and steps, so on a GPU the two directions of PCIe overlap; at most one
    /// chunk's copies back are in flight when the next chunk is brought over (two chunks of device
    /// memory), and all of them have finished when this returns.
    #[allow(clippy::too_many_arguments)]
    pub fn step_visiting(
        &self,
        c: &StepCoefficients,
        device: Device,
        params: &[Tensor],
        grads: &[Tensor],
        host: (bool, bool),
        chunk_bytes: usize,
        mut after: impl FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<()> {
        let n = params.len();
        let size = |t: &Tensor| t.numel() * t.kind().elt_size_in_bytes();
        let visit = |ts: &[Tensor], on_host: bool, what: &'static str| -> Result<Vec<Tensor>> {
            ts.iter()
                .map(|t| {
                    if on_host {
                        // A copy even where host and device are one (the CPU tests of this path).
                        t.f_to_device_(device, t.kind(), true, true).ctx(what)
                    } else {
                        Ok(t.shallow_clone())
                    }
                })
                .collect()
        };
        let mut back = if host.0 || host.1 {
            Some(verl_torch_ext::SideCopies::new(device)?)
        } else {
            None
        };
        let mut start = 0;
        while start < n {
            let mut end = start;
            let mut chunk = 0usize;
            while end < n && (end == start || chunk + size(&params[end]) <= chunk_bytes) {
                chunk += size(&params[end]);
                end += 1;
            }
            let r = start..end;
            if let Some(b) = back.as_mut() {
                // The chunk before last has gone back: its device memory can serve this one.
                b.wait_all_but(1)?;
            }
            let p = visit(&params[r.clone()], host.0, "master weights to the device")?;
            let m = visit(
                &self.exp_avg[r.clone()],
                host.1,
                "optimizer state to the device",
            )?;
            let v = visit(
                &self.exp_avg_sq[r.clone()],
                host.1,
                "optimizer state to the device",
            )?;
            self.step_tensors(c, &p, &grads[r.clone()], &m, &v)?;
            tch::no_grad(|| -> Result<()> {
                for (k, i) in r.clone().enumerate() {
                    after(i, &p[k])?;
                }
                Ok(())
            })?;
            if let Some(b) = back.as_mut() {
                b.fence()?;
                for (k, i) in r.enumerate() {
                    if host.0 {
                        b.copy(&params[i], &p[k])?;
                    }
                    if host.1 {
                        b.copy(&self.exp_avg[i], &m[k])?;
                        b.copy(&self.exp_avg_sq[i], &v[k])?;
                    }
                }
                b.close_batch()?;
            }
            start = end;
        }
        if let Some(mut b) = back {
            b.finish()?;
        }
        Ok(())
    }

    /// Counts a step and returns its coefficients, for callers that update tensor by tensor
    /// ([`AdamW::update`]), e.g. moving offloaded state to the device one tensor at a time.
    pub fn begin_step(&mut self, lr: f64) -> StepCoefficients {
        self.step += 1;
        let (b1, b2) = self.betas;
        let bc1 = 1.0 - b1.powi(self.step as i32);
        let bc2 = 1.0 - b2.powi(self.step as i32);
        StepCoefficients {
            lr,
            step_size: lr / bc1,
            bc2_sqrt: bc2.sqrt(),
        }
    }

    /// Updates one parameter `p` in place with gradient `g` and its state `m`, `v` (all on one
    /// device, same shape).
    pub fn update(
        &self,
        c: &StepCoefficients,
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let (b1, b2) = self.betas;
        tch::no_grad(|| -> Result<()> {
            let mut p = p.shallow_clone();
            let (mut m, mut v) = (m.shallow_clone(), v.shallow_clone());
            let _ = p
                .f_mul_scalar_(1.0 - c.lr * self.weight_decay)
                .ctx("AdamW decay")?;
            let _ = m.f_lerp_(g, 1.0 - b1).ctx("AdamW exp_avg")?;
            let g2 = g
                .f_square()
                .and_then(|x| x.f_mul_scalar(1.0 - b2))
                .ctx("AdamW grad²")?;
            let _ = v
                .f_mul_scalar_(b2)
                .and_then(|mut v| v.f_add_(&g2))
                .ctx("AdamW exp_avg_sq")?;
            let denom = v
                .f_sqrt()
                .and_then(|d| d.f_div_scalar(c.bc2_sqrt))
                .and_then(|d| d.f_add_scalar(self.eps))
                .ctx("AdamW denom")?;
            let update = m.f_div(&denom).ctx("AdamW update")?;
            let _ = p
                .f_sub_(&update.f_mul_scalar(c.step_size).ctx("AdamW update")?)
                .ctx("AdamW apply")?;
            Ok(())
        })
    }
}

/// The per-step scalars of one AdamW step.
#[derive(Debug, Clone, Copy)]
pub struct StepCoefficients {
    lr: f64,
    step_size: f64,
    bc2_sqrt: f64,
}

/// `torch.nn.utils.clip_grad_norm_`: the total 2-norm of all gradients (before clipping); the
/// gradients are scaled by `max_norm / (norm + 1e-6)` when that is below 1. Non-finite norms leave the
/// gradients as they are (the caller refuses the step).
pub fn clip_grad_norm(grads: &[Tensor], max_norm: f64) -> Result<f64> {
    // Summed on the device, in order, in fp64: one host sync for the whole model instead of one
    // per parameter.
    let mut sq: Option<Tensor> = None;
    for g in grads {
        let n = g
            .f_to_kind(Kind::Double)
            .and_then(|x| x.f_square())
            .and_then(|x| x.f_sum(Kind::Double))
            .ctx("gradient norm")?;
        sq = Some(match sq {
            None => n,
            Some(acc) => acc.f_add(&n).ctx("gradient norm")?,
        });
    }
    let sq = match sq {
        Some(t) => t.f_double_value(&[]).ctx("gradient norm")?,
        None => 0.0,
    };
    let norm = sq.sqrt();
    if norm.is_finite() && max_norm > 0.0 {
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            tch::no_grad(|| -> Result<()> {
                for g in grads {
                    let _ = g
                        .shallow_clone()
                        .f_mul_scalar_(coef)
                        .ctx("clip gradients")?;
                }
                Ok(())
            })?;
        }
    }
    Ok(norm)
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScheduleKind {
    Constant,
    Cosine,
}

/// The learning rate after `updates` optimizer updates, the schedule built on first use from `cfg`
/// (at `key`) so the host can pass the run's total step count with the first update
/// (`UpdateOptions.extra.total_training_steps`, else `fallback_total`).
pub fn scheduled_lr(
    schedule: &mut Option<LrSchedule>,
    cfg: &OptimSection,
    key: &str,
    fallback_total: Option<i64>,
    updates: u64,
) -> Result<f64> {
    if schedule.is_none() {
        *schedule = Some(LrSchedule::from_config(cfg, key, fallback_total)?);
    }
    Ok(schedule.as_ref().map_or(0.0, |s| s.lr(updates)))
}

/// verl's `get_constant_schedule_with_warmup` / `get_cosine_schedule_with_warmup`, stepped once per
/// `update` call (verl's worker steps its scheduler after each `update_policy`).
#[derive(Debug, Clone, PartialEq)]
pub struct LrSchedule {
    pub kind: ScheduleKind,
    pub base_lr: f64,
    pub warmup_steps: u64,
    pub total_steps: u64,
    pub min_lr_ratio: f64,
    pub num_cycles: f64,
}

impl LrSchedule {
    /// `total_steps`: `optim.total_training_steps` when set (> 0), else `trainer.total_training_steps`
    /// or the host's `UpdateOptions.extra.total_training_steps` (given as `fallback_total`).
    pub fn from_config(
        cfg: &OptimSection,
        prefix: &str,
        fallback_total: Option<i64>,
    ) -> Result<LrSchedule> {
        let name = cfg
            .warmup_style
            .clone()
            .unwrap_or_else(|| cfg.lr_scheduler_type.clone());
        let kind = match name.as_str() {
            "constant" => ScheduleKind::Constant,
            "cosine" => ScheduleKind::Cosine,
            other => {
                return Err(BackendError::config(
                    format!("{prefix}.lr_scheduler_type"),
                    "\"constant\" or \"cosine\"",
                    format!("{other:?}"),
                ))
            }
        };
        if !(0.0..=1.0).contains(&cfg.min_lr_ratio) {
            return Err(BackendError::config(
                format!("{prefix}.min_lr_ratio"),
                "a number in [0, 1]",
                cfg.min_lr_ratio,
            ));
        }
        let total = if cfg.total_training_steps > 0 {
            cfg.total_training_steps
        } else {
            fallback_total.unwrap_or(-1)
        };
        let needs_total = kind == ScheduleKind::Cosine
            || (cfg.lr_warmup_steps < 0 && cfg.lr_warmup_steps_ratio > 0.0);
        if needs_total && total <= 0 {
            return Err(BackendError::config(
                format!("{prefix}.total_training_steps"),
                format!("the number of training steps (> 0), which the {name} schedule / warmup ratio needs; set it or trainer.total_training_steps"),
                total,
            ));
        }
        let warmup = if cfg.lr_warmup_steps >= 0 {
            cfg.lr_warmup_steps as u64
        } else {
            (cfg.lr_warmup_steps_ratio * total.max(0) as f64) as u64
        };
        Ok(LrSchedule {
            kind,
            base_lr: cfg.lr,
            warmup_steps: warmup,
            total_steps: total.max(0) as u64,
            min_lr_ratio: cfg.min_lr_ratio,
            num_cycles: cfg.num_cycles,
        })
    }

    /// The learning rate used by the update with index `step` (0-based).
    pub fn lr(&self, step: u64) -> f64 {
        let s = step as f64;
        let w = self.warmup_steps as f64;
        if step < self.warmup_steps {
            return self.base_lr * s / w.max(1.0);
        }
        let factor = match self.kind {
            ScheduleKind::Constant => 1.0,
            ScheduleKind::Cosine => {
                let span = (self.total_steps as f64 - w).max(1.0);
                let progress = (s - w) / span;
                let x = (std::f64::consts::PI * self.num_cycles * 2.0 * progress).cos();
                let coef = (1.0 - self.min_lr_ratio) * 0.5;
                let intercept = (1.0 + self.min_lr_ratio) * 0.5;
                (x * coef + intercept).max(self.min_lr_ratio)
            }
        };
        self.base_lr * factor
    }
}

/// What a checkpoint tensor holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum What {
    Master,
    ExpAvg,
    ExpAvgSq,
}

impl What {
    pub const ALL: [What; 3] = [What::Master, What::ExpAvg, What::ExpAvgSq];

    /// The prefix of this tensor's names in an optimizer checkpoint file.
    pub fn prefix(self) -> &'static str {
        match self {
            What::Master => "",
            What::ExpAvg => "exp_avg.",
            What::ExpAvgSq => "exp_avg_sq.",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn optim(extra: serde_json::Value) -> OptimSection {
        let mut v = serde_json::json!({"lr": 1.0});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    /// Values without the global RNG (the tests run in parallel threads).
    fn filled(shape: &[i64], salt: f64, device: Device) -> Tensor {
        let n: i64 = shape.iter().product();
        (Tensor::arange(n, (Kind::Float, device)) * 0.37 + salt)
            .sin()
            .reshape(shape)
    }

    #[test]
    fn offloaded_steps_equal_device_steps_bit_for_bit() {
        offloaded_steps_case(Device::Cpu);
    }

    #[test]
    #[ignore = "needs CUDA"]
    fn offloaded_steps_equal_device_steps_bit_for_bit_on_cuda() {
        offloaded_steps_case(verl_test_support::cuda::cuda_device());
    }

    fn offloaded_steps_case(device: Device) {
        // step_visiting with masters and/or moments in host memory (pinned on a GPU, where the
        // copies back run on a side stream overlapping the next chunk): three steps equal the
        // steps taken with everything on the device, for chunks of one tensor, a few, and all;
        // `after` sees each parameter's new value once per step.
        let shapes: [&[i64]; 5] = [&[64, 33], &[7], &[128, 64], &[3, 5, 2], &[1000]];
        let cfg = optim(serde_json::json!({"lr": 1e-2, "weight_decay": 0.01}));
        {
            let host_zeros = |shape: &[i64]| {
                let t = Tensor::zeros(shape, (Kind::Float, Device::Cpu));
                if device.is_cuda() {
                    t.pin_memory(device)
                } else {
                    t
                }
            };
            let grads = |step: usize| -> Vec<Tensor> {
                shapes
                    .iter()
                    .enumerate()
                    .map(|(i, s)| filled(s, (10 * step + i) as f64, device) * 0.1)
                    .collect()
            };
            let run = |host: (bool, bool), chunk: usize| {
                let params: Vec<Tensor> = shapes
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        let p = filled(s, i as f64 + 0.5, device);
                        if host.0 {
                            let h = host_zeros(s);
                            h.shallow_clone().copy_(&p);
                            h
                        } else {
                            p
                        }
                    })
                    .collect();
                let mut opt = AdamW::without_state(&cfg, "t", device.is_cuda()).unwrap();
                let state = |s: &&[i64]| {
                    if host.1 {
                        host_zeros(s)
                    } else {
                        Tensor::zeros(*s, (Kind::Float, device))
                    }
                };
                opt.exp_avg = shapes.iter().map(state).collect();
                opt.exp_avg_sq = shapes.iter().map(state).collect();
                for step in 0..3 {
                    let c = opt.begin_step(1e-2);
                    let mut seen: Vec<Vec<Tensor>> =
                        (0..shapes.len()).map(|_| Vec::new()).collect();
                    opt.step_visiting(&c, device, &params, &grads(step), host, chunk, |i, p| {
                        assert_eq!(p.device(), device);
                        seen[i].push(p.to_device(Device::Cpu));
                        Ok(())
                    })
                    .unwrap();
                    for (i, v) in seen.iter().enumerate() {
                        assert_eq!(v.len(), 1, "{device:?} {host:?} chunk {chunk}: after({i})");
                        assert!(v[0].equal(&params[i].to_device(Device::Cpu)));
                    }
                }
                let cpu = |ts: &[Tensor]| -> Vec<Tensor> {
                    ts.iter().map(|t| t.to_device(Device::Cpu)).collect()
                };
                assert_eq!(
                    params[0].device() == Device::Cpu,
                    host.0 || device == Device::Cpu
                );
                (cpu(&params), cpu(&opt.exp_avg), cpu(&opt.exp_avg_sq))
            };
            let want = run((false, false), usize::MAX);
            for (host, chunk) in [
                ((true, true), 1),
                ((true, true), 64 * 33 * 4 + 7 * 4),
                ((true, true), usize::MAX),
                ((false, true), 1),
                ((true, false), 4096),
            ] {
                let got = run(host, chunk);
                for (what, a, b) in [
                    ("params", &want.0, &got.0),
                    ("exp_avg", &want.1, &got.1),
                    ("exp_avg_sq", &want.2, &got.2),
                ] {
                    for (i, (x, y)) in a.iter().zip(b).enumerate() {
                        assert!(
                            x.equal(y),
                            "{device:?} {host:?} chunk {chunk}: {what}[{i}] differs"
                        );
                    }
                }
            }
            // The steps moved the parameters.
            assert!(!want.0[0].equal(&filled(shapes[0], 0.5, Device::Cpu)));
        }
    }

    #[test]
    fn constant_with_warmup_ratio() {
        let s = LrSchedule::from_config(
            &optim(serde_json::json!({"lr_warmup_steps_ratio": 0.2})),
            "actor.optim",
            Some(10),
        )
        .unwrap();
        assert_eq!(s.warmup_steps, 2);
        assert_eq!([s.lr(0), s.lr(1), s.lr(2), s.lr(9)], [0.0, 0.5, 1.0, 1.0]);
    }

    #[test]
    fn cosine_decays_to_min_ratio() {
        let s = LrSchedule::from_config(
            &optim(
                serde_json::json!({"lr_scheduler_type": "cosine", "lr_warmup_steps": 2,
                                      "min_lr_ratio": 0.1, "total_training_steps": 12}),
            ),
            "actor.optim",
            None,
        )
        .unwrap();
        assert_eq!(s.lr(1), 0.5);
        assert!((s.lr(2) - 1.0).abs() < 1e-12);
        // Half-way through the decay: (1 + 0.1) / 2.
        assert!((s.lr(7) - 0.55).abs() < 1e-12, "{}", s.lr(7));
        assert!((s.lr(12) - 0.1).abs() < 1e-12);
        let e = LrSchedule::from_config(
            &optim(serde_json::json!({"lr_scheduler_type": "cosine"})),
            "actor_rollout_ref.actor.optim",
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("total_training_steps"), "{e}");
    }

    #[test]
    fn adamw_matches_the_closed_form_first_step() {
        // First AdamW step: p ← p·(1 − lr·wd) − lr · g / (|g| + eps).
        let p = Tensor::from_slice(&[1.0f32, -2.0, 0.5]);
        let g = Tensor::from_slice(&[0.3f32, -0.1, 0.0]);
        let cfg = optim(serde_json::json!({"lr": 0.1, "weight_decay": 0.01}));
        let mut opt = AdamW::new(&cfg, "x", &[p.shallow_clone()]).unwrap();
        opt.step(&[p.shallow_clone()], &[g], 0.1).unwrap();
        let got = Vec::<f32>::try_from(&p).unwrap();
        let want = [
            1.0 * (1.0 - 0.001) - 0.1,
            -2.0 * (1.0 - 0.001) + 0.1,
            0.5 * (1.0 - 0.001),
        ];
        for (a, b) in got.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn fused_and_written_out_steps_agree() {
        tch::manual_seed(11);
        let cfg = optim(serde_json::json!({"lr": 0.05, "weight_decay": 0.1, "betas": [0.9, 0.95]}));
        let shapes: [&[i64]; 2] = [&[4, 6], &[9]];
        let params: Vec<Tensor> = shapes
            .iter()
            .map(|s| Tensor::randn(*s, tch::kind::FLOAT_CPU))
            .collect();
        let copy = |ps: &[Tensor]| ps.iter().map(|p| p.copy()).collect::<Vec<_>>();
        let (a, b) = (copy(&params), copy(&params));
        let mut plain = AdamW::new(&cfg, "x", &a).unwrap();
        let mut fused = AdamW::new(&cfg, "x", &b).unwrap();
        plain.fused = false;
        fused.fused = true;
        for _ in 0..4 {
            let grads: Vec<Tensor> = shapes
                .iter()
                .map(|s| Tensor::randn(*s, tch::kind::FLOAT_CPU))
                .collect();
            plain.step(&a, &grads, 0.05).unwrap();
            fused.step(&b, &grads, 0.05).unwrap();
        }
        assert_eq!(fused.step, 4);
        for ((x, y), p0) in a.iter().zip(&b).zip(&params) {
            let d = (x - y).abs().max().double_value(&[]);
            assert!(d < 1e-6, "fused and written-out AdamW differ by {d}");
            assert!(
                (x - p0).abs().max().double_value(&[]) > 1e-2,
                "parameters did not move"
            );
        }
        for (m, n) in plain.exp_avg_sq.iter().zip(&fused.exp_avg_sq) {
            assert!((m - n).abs().max().double_value(&[]) < 1e-7);
        }
    }
}

//! LoRA adapters on a model's linear projections, in PEFT's layout.
//!
//! An adapted projection computes `y = x Wᵀ (+ b) + s · (x Aᵀ) Bᵀ` with `A` `[r, in]`, `B`
//! `[out, r]` and `s = alpha / r` (`alpha / √r` with rsLoRA), the second term one GEMM that adds
//! into the first. The adapter matrices are ordinary parameters of the model (its dtype, its device)
//! named `<module>.lora_A.weight` / `<module>.lora_B.weight`, appended after the base parameters;
//! [`Transformer::add_lora`] freezes the base. Switching the adapters off
//! ([`Transformer::set_adapters_enabled`]) gives the base model back exactly (the reference policy,
//! PEFT's `disable_adapter`).
//!
//! Files: [`Transformer::save_adapter`] writes `adapter_config.json` and `adapter_model.safetensors`
//! with PEFT's key names (`base_model.model.<module>.lora_A.weight`), which
//! `peft.PeftModel.from_pretrained` loads; [`Transformer::load_adapter`] reads such a folder.
//!
//! Dense decoder projections only (`q/k/v/o_proj`, `gate/up/down_proj`); MoE blocks, heads and
//! tensor-parallel shards are refused. No LoRA dropout, no DoRA, no per-module rank patterns.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::Value;
use tch::{Kind, Tensor};

use crate::error::{NnError, Result};
use crate::layers::Linear;
use crate::model::Transformer;

/// PEFT's prefix of a causal LM's adapter keys.
pub const PEFT_PREFIX: &str = "base_model.model.";
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// Which linear modules get adapters (PEFT's `target_modules` / `exclude_modules`).
#[derive(Debug, Clone, PartialEq)]
pub enum Modules {
    /// PEFT's `"all-linear"`: every linear projection except the output layer.
    AllLinear,
    /// Module names: one matches a module whose full name equals it or ends with `.<name>`.
    Names(Vec<String>),
    /// A regular expression matched against the whole module name (PEFT's string form).
    Regex(String),
}

impl Modules {
    /// verl's / PEFT's value: `"all-linear"`, another string (a regular expression), or a list.
    pub fn from_json(what: &str, v: &Value) -> Result<Option<Modules>> {
        match v {
            Value::Null => Ok(None),
            Value::String(s) if s == "all-linear" => Ok(Some(Modules::AllLinear)),
            Value::String(s) => Ok(Some(Modules::Regex(s.clone()))),
            Value::Array(items) => items
                .iter()
                .map(|i| {
                    i.as_str().map(str::to_string).ok_or_else(|| {
                        NnError::input(what, "module names (strings)", i.to_string())
                    })
                })
                .collect::<Result<Vec<_>>>()
                .map(|v| Some(Modules::Names(v))),
            other => Err(NnError::input(
                what,
                "\"all-linear\", a regular expression or a list of module names",
                other.to_string(),
            )),
        }
    }

    fn to_json(&self) -> Value {
        match self {
            Modules::AllLinear => Value::from("all-linear"),
            Modules::Names(v) => Value::from(v.clone()),
            Modules::Regex(r) => Value::from(r.clone()),
        }
    }

    fn matches(&self, module: &str) -> Result<bool> {
        Ok(match self {
            Modules::AllLinear => true,
            Modules::Names(names) => names
                .iter()
                .any(|n| module == n || module.ends_with(&format!(".{n}"))),
            Modules::Regex(r) => regex::Regex::new(&format!("^(?:{r})$"))
                .map_err(|e| {
                    NnError::input("LoRA target_modules regex", "a valid regex", e.to_string())
                })?
                .is_match(module),
        })
    }
}

/// The adapters to add (PEFT's `LoraConfig` fields that change the model).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    pub rank: i64,
    pub alpha: f64,
    pub target_modules: Modules,
    pub exclude_modules: Option<Modules>,
    /// rsLoRA: scale `alpha / √r` instead of `alpha / r`.
    pub use_rslora: bool,
    /// Modules trained in full beside the adapters (PEFT's `modules_to_save`): a value or score
    /// head's `score` only.
    pub modules_to_save: Vec<String>,
}

impl LoraConfig {
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    /// Reads a PEFT `adapter_config.json`, refusing what this implementation does not do.
    pub fn from_adapter_dir(dir: &Path) -> Result<LoraConfig> {
        let path = dir.join(ADAPTER_CONFIG);
        let text = std::fs::read_to_string(&path).map_err(|source| NnError::Io {
            path: path.clone(),
            source,
        })?;
        let v: Value = serde_json::from_str(&text).map_err(|source| NnError::Json {
            path: path.clone(),
            source,
        })?;
        let bad = |key: &str, expected: &str| NnError::InvalidConfig {
            path: path.clone(),
            key: key.into(),
            expected: expected.into(),
            found: v[key].to_string(),
        };
        if v["peft_type"].as_str() != Some("LORA") {
            return Err(bad("peft_type", "\"LORA\""));
        }
        let rank = v["r"]
            .as_i64()
            .filter(|&r| r > 0)
            .ok_or_else(|| bad("r", "a positive integer"))?;
        let alpha = v["lora_alpha"]
            .as_f64()
            .ok_or_else(|| bad("lora_alpha", "a number"))?;
        let off = |key: &str| -> bool {
            match &v[key] {
                Value::Null | Value::Bool(false) => true,
                Value::Number(n) => n.as_f64() == Some(0.0),
                Value::Object(o) => o.is_empty(),
                Value::Array(a) => a.is_empty(),
                Value::String(s) => s == "none",
                _ => false,
            }
        };
        for (key, what) in [
            (
                "lora_dropout",
                "0 (LoRA dropout is not implemented; verl's own LoRA config has none)",
            ),
            ("use_dora", "false (DoRA is not implemented)"),
            (
                "rank_pattern",
                "empty (per-module ranks are not implemented)",
            ),
            (
                "alpha_pattern",
                "empty (per-module alphas are not implemented)",
            ),
            (
                "layers_to_transform",
                "null (layer selection is not implemented)",
            ),
            ("bias", "\"none\" (trained biases are not implemented)"),
            ("fan_in_fan_out", "false"),
        ] {
            if !off(key) {
                return Err(bad(key, what));
            }
        }
        let target_modules = Modules::from_json("target_modules", &v["target_modules"])?
            .ok_or_else(|| bad("target_modules", "a module list or regex"))?;
        let modules_to_save = match &v["modules_to_save"] {
            Value::Null => Vec::new(),
            Value::Array(items) => items
                .iter()
                .map(|i| i.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("modules_to_save", "null or module names"))?,
            _ => return Err(bad("modules_to_save", "null or module names")),
        };
        Ok(LoraConfig {
            modules_to_save,
            rank,
            alpha,
            target_modules,
            exclude_modules: Modules::from_json("exclude_modules", &v["exclude_modules"])?,
            use_rslora: v["use_rslora"].as_bool().unwrap_or(false),
        })
    }
}

/// One projection's adapter.
#[derive(Debug)]
pub(crate) struct Adapter {
    /// `[r, in]`.
    pub a: Tensor,
    /// `[out, r]`.
    pub b: Tensor,
    pub scale: f64,
    /// The model's switch (shared by all its adapters).
    pub enabled: Arc<AtomicBool>,
    /// `s·A` kept while a generation engine decodes ([`Adapter::fuse`]).
    scaled: Mutex<Option<Tensor>>,
}

impl Adapter {
    pub fn new(a: Tensor, b: Tensor, scale: f64, enabled: Arc<AtomicBool>) -> Adapter {
        Adapter {
            a,
            b,
            scale,
            enabled,
            scaled: Mutex::new(None),
        }
    }

    pub fn on(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// `s·A` in the model dtype: the scale goes into the small matrix, so the output side is one
    /// accumulating GEMM. Computed the same way whether kept for decoding or not.
    fn scaled_a(&self, cached: bool) -> Result<Tensor> {
        if cached {
            if let Some(t) = self
                .scaled
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
            {
                return Ok(t.shallow_clone());
            }
        }
        Ok(self.a.f_mul_scalar(self.scale)?)
    }

    /// Keeps (`on`) or drops `s·A` for decoding (no autograd there).
    pub fn fuse(&self, on: bool) -> Result<()> {
        let mut slot = self.scaled.lock().unwrap_or_else(|e| e.into_inner());
        *slot = None;
        if on {
            let _guard = tch::no_grad_guard();
            *slot = Some(self.a.f_mul_scalar(self.scale)?);
        }
        Ok(())
    }

    /// `base + (x·(s·A)ᵀ)·Bᵀ` when the adapters are on, else `base`. `base` must be this
    /// projection's own output (not a view of another tensor): the second GEMM accumulates into it
    /// in place, so no copy of the output is made.
    pub fn add(&self, base: Tensor, x: &Tensor) -> Result<Tensor> {
        if !self.on() {
            return Ok(base);
        }
        // The kept s·A has no autograd history: only where nothing is recorded.
        let xa = x.f_linear(
            &self.scaled_a(!verl_torch_ext::grad_enabled())?,
            None::<&Tensor>,
        )?;
        accumulate(base, &xa, &self.b)
    }
}

/// `y += xa · bᵀ` in place over the rows of `y` (`[.., out]`, its own storage), `xa` `[.., r]`.
fn accumulate(y: Tensor, xa: &Tensor, b: &Tensor) -> Result<Tensor> {
    let y = if y.is_contiguous() {
        y
    } else {
        y.f_contiguous()?
    };
    let out = *y.size().last().unwrap_or(&0);
    let r = *xa.size().last().unwrap_or(&0);
    let mut rows = y.f_view([-1, out])?;
    let _ = rows.f_addmm_(&xa.f_reshape([-1, r])?, &b.f_tr()?)?;
    Ok(y)
}

/// The adapters of projections whose outputs are consecutive column blocks of one fused output
/// (q/k/v, gate/up): their `s·A` stacked `[Σr, in]` and their `B` as one block-diagonal
/// `[Σout, Σr]` (a projection without adapter: a block of zero width). `None` when no part has
/// an adapter or the adapters are off.
pub(crate) fn fused_adapters(parts: &[&Linear], cached: bool) -> Result<Option<(Tensor, Tensor)>> {
    let adapters: Vec<Option<&Adapter>> = parts.iter().map(|l| l.lora.as_ref()).collect();
    let Some(first) = adapters.iter().flatten().next() else {
        return Ok(None);
    };
    if !first.on() {
        return Ok(None);
    }
    let mut a = Vec::new();
    let mut b = Vec::new();
    for (lin, ad) in parts.iter().zip(&adapters) {
        match ad {
            Some(ad) => {
                a.push(ad.scaled_a(cached)?);
                b.push(ad.b.shallow_clone());
            }
            None => {
                let out = lin.weight.size()[0];
                b.push(Tensor::f_zeros(
                    [out, 0],
                    (lin.weight.kind(), lin.weight.device()),
                )?);
            }
        }
    }
    Ok(Some((Tensor::f_cat(&a, 0)?, Tensor::f_block_diag(&b)?)))
}

/// Adds the adapters of `parts` to their fused output `y` (`[.., Σout]`, its own storage): one
/// GEMM for the stacked `s·A`, one accumulating GEMM with the block-diagonal `B`. `kept`: the pair
/// [`fused_adapters`] made for decoding, if any.
pub(crate) fn add_fused(
    y: Tensor,
    x: &Tensor,
    parts: &[&Linear],
    kept: &Mutex<Option<(Tensor, Tensor)>>,
) -> Result<Tensor> {
    // The kept pair has no autograd history: only where nothing is recorded.
    let decoding = !verl_torch_ext::grad_enabled();
    let kept = if decoding {
        kept.lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|(a, b)| (a.shallow_clone(), b.shallow_clone()))
    } else {
        None
    };
    let pair = match kept {
        Some(p)
            if parts
                .iter()
                .any(|l| l.lora.as_ref().is_some_and(Adapter::on)) =>
        {
            Some(p)
        }
        Some(_) => None,
        None => fused_adapters(parts, decoding)?,
    };
    let Some((a, b)) = pair else { return Ok(y) };
    let xa = x.f_linear(&a, None::<&Tensor>)?;
    accumulate(y, &xa, &b)
}

/// Keeps (`on`) or drops the [`fused_adapters`] pair of `parts` in `slot` (and each part's `s·A`).
pub(crate) fn fuse_adapters(
    parts: &[&Linear],
    slot: &Mutex<Option<(Tensor, Tensor)>>,
    on: bool,
) -> Result<usize> {
    let mut s = slot.lock().unwrap_or_else(|e| e.into_inner());
    *s = None;
    for l in parts {
        if let Some(a) = &l.lora {
            a.fuse(on)?;
        }
    }
    if !on {
        return Ok(0);
    }
    let _guard = tch::no_grad_guard();
    // Built while the adapters are on, whatever the switch says now.
    let pair = match parts.iter().find_map(|l| l.lora.as_ref()) {
        None => None,
        Some(first) => {
            let was = first.on();
            first.enabled.store(true, Ordering::Relaxed);
            let p = fused_adapters(parts, true);
            first.enabled.store(was, Ordering::Relaxed);
            p?
        }
    };
    let bytes = pair.as_ref().map_or(0, |(a, b)| {
        (a.numel() + b.numel()) * a.kind().elt_size_in_bytes()
    });
    *s = pair;
    Ok(bytes)
}

/// A fresh `A` `[rank, d_in]` (fp32, CPU): uniform in ±1/√d_in (PEFT's `kaiming_uniform_` with
/// `a=√5`), from a splitmix64 stream seeded by `seed` and the module name.
fn init_a(module: &str, seed: u64, rank: i64, d_in: i64) -> Result<Tensor> {
    let mut state = module.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let bound = 1.0 / (d_in as f64).sqrt();
    let values: Vec<f32> = (0..rank * d_in)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            let u = ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64;
            ((2.0 * u - 1.0) * bound) as f32
        })
        .collect();
    Ok(Tensor::f_from_slice(&values)?.f_reshape([rank, d_in])?)
}

/// The model-level LoRA state.
#[derive(Debug)]
pub(crate) struct LoraState {
    pub config: LoraConfig,
    /// Parameters before this index are the base model's; the rest are adapters.
    pub first_adapter: usize,
    /// Adapted module names, in parameter order.
    pub modules: Vec<String>,
    /// Indices of the base parameters trained in full (`modules_to_save`).
    pub saved: Vec<usize>,
    pub enabled: Arc<AtomicBool>,
}

/// Indices of the parameters an adapter folder holds: the fully trained head's, then the
/// adapters (all parameters from `first_adapter` to `len`).
fn file_params(l: &LoraState, len: usize) -> impl Iterator<Item = usize> + '_ {
    l.saved.iter().copied().chain(l.first_adapter..len)
}

/// What [`Transformer::add_lora`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraReport {
    pub modules: usize,
    pub trainable_params: usize,
}

impl Transformer {
    /// Adds LoRA adapters to the projections `config` selects (A: PEFT's default init, uniform in
    /// ±1/√in, drawn from `seed` and the module's name, so every rank and every thread draws the
    /// same; B: zeros, so the model's output is unchanged) and freezes every base parameter.
    /// Fails if no projection matches, for MoE models and tensor-parallel shards, and if the model
    /// has adapters already.
    pub fn add_lora(&mut self, config: &LoraConfig, seed: u64) -> Result<LoraReport> {
        if self.lora.is_some() {
            return Err(NnError::input(
                "add_lora",
                "a model without adapters",
                "one with adapters",
            ));
        }
        if config.rank <= 0 {
            return Err(NnError::input(
                "LoRA rank",
                "a positive integer",
                config.rank.to_string(),
            ));
        }
        if self.config().moe.is_some() {
            return Err(NnError::input(
                "LoRA model",
                "a dense model (LoRA on MoE blocks is not implemented)",
                format!("{} with experts", self.config().arch),
            ));
        }
        if self.tp.is_some() {
            return Err(NnError::input(
                "LoRA model",
                "a whole model",
                "a tensor-parallel shard",
            ));
        }
        let enabled = Arc::new(AtomicBool::new(true));
        let first_adapter = self.params.len();
        let scale = config.scale();
        let device = self.device();
        let kind = self.dtype();
        let mut modules = Vec::new();
        let mut new_params: Vec<(usize, String, Tensor)> = Vec::new();
        for (i, layer) in self.layers.iter_mut().enumerate() {
            for (name, lin) in layer.projections_mut(i) {
                let selected = config.target_modules.matches(&name)?
                    && !match &config.exclude_modules {
                        Some(ex) => ex.matches(&name)?,
                        None => false,
                    };
                if !selected {
                    continue;
                }
                let w = lin.weight.size();
                let (d_out, d_in) = (w[0], w[1]);
                let a = tch::no_grad(|| -> Result<Tensor> {
                    Ok(init_a(&name, seed, config.rank, d_in)?
                        .f_to_device(device)?
                        .f_to_kind(kind)?)
                })?
                .f_set_requires_grad(true)?;
                let b = Tensor::f_zeros([d_out, config.rank], (kind, device))?
                    .f_set_requires_grad(true)?;
                new_params.push((i, format!("{name}.lora_A.weight"), a.shallow_clone()));
                new_params.push((i, format!("{name}.lora_B.weight"), b.shallow_clone()));
                lin.lora = Some(Adapter::new(a, b, scale, enabled.clone()));
                modules.push(name);
            }
        }
        if modules.is_empty() {
            return Err(NnError::input(
                "LoRA target_modules",
                "a selection matching at least one projection (q/k/v/o_proj, gate/up/down_proj)",
                format!(
                    "{:?} (exclude {:?})",
                    config.target_modules, config.exclude_modules
                ),
            ));
        }
        for (_, p) in &self.params {
            let _ = p.f_set_requires_grad(false)?;
        }
        // modules_to_save: the head's own parameters, trained in full.
        let mut saved = Vec::new();
        for m in &config.modules_to_save {
            let found: Vec<usize> = (0..self.params.len())
                .filter(|&i| {
                    let n = &self.params[i].0;
                    self.head_parameter_names().contains(n)
                        && n.rsplit_once('.').map(|(module, _)| module) == Some(m.as_str())
                })
                .collect();
            if found.is_empty() && m != "classifier" {
                return Err(NnError::input(
                    "LoRA modules_to_save",
                    format!(
                        "the model's head ({:?}); other fully trained modules are not implemented",
                        self.head_parameter_names()
                    ),
                    m.clone(),
                ));
            }
            saved.extend(found);
        }
        let mut trainable = 0;
        for &i in &saved {
            let _ = self.params[i].1.f_set_requires_grad(true)?;
            trainable += self.params[i].1.numel();
        }
        for (layer, name, t) in new_params {
            trainable += t.numel();
            self.layer_adapters.resize(self.layers.len(), Vec::new());
            self.layer_adapters[layer].push(self.params.len());
            self.params.push((name, t));
        }
        for layer in &self.layers {
            layer.fuse(false)?;
        }
        let report = LoraReport {
            modules: modules.len(),
            trainable_params: trainable,
        };
        self.lora = Some(LoraState {
            config: config.clone(),
            first_adapter,
            modules,
            saved,
            enabled,
        });
        Ok(report)
    }

    /// The adapters' settings, `None` without adapters.
    pub fn lora_config(&self) -> Option<&LoraConfig> {
        self.lora.as_ref().map(|l| &l.config)
    }

    /// The base model's parameters (all of them without adapters).
    pub fn base_parameters(&self) -> &[(String, Tensor)] {
        match &self.lora {
            Some(l) => &self.params[..l.first_adapter],
            None => &self.params,
        }
    }

    /// Indices into [`Transformer::named_parameters`] of the parameters that require gradients.
    pub fn trainable_parameters(&self) -> Vec<usize> {
        (0..self.params.len())
            .filter(|&i| self.params[i].1.requires_grad())
            .collect()
    }

    /// Turns the adapters on or off (off: exactly the base model). No-op without adapters.
    pub fn set_adapters_enabled(&self, on: bool) {
        if let Some(l) = &self.lora {
            l.enabled.store(on, Ordering::Relaxed);
        }
    }

    pub fn adapters_enabled(&self) -> bool {
        self.lora
            .as_ref()
            .map(|l| l.enabled.load(Ordering::Relaxed))
            .unwrap_or(false)
    }

    /// Runs `f` with the adapters off (the base model), turning them back on afterwards.
    pub fn without_adapters<T>(&self, f: impl FnOnce(&Transformer) -> T) -> T {
        let was = self.adapters_enabled();
        self.set_adapters_enabled(false);
        let out = f(self);
        self.set_adapters_enabled(was);
        out
    }

    /// `W + s·B·A` for the base parameter `name` when it is an adapted projection's weight
    /// (computed in fp32, returned in `kind`); `None` otherwise.
    pub(crate) fn merged_weight(
        &self,
        name: &str,
        w: &Tensor,
        kind: Kind,
    ) -> Result<Option<Tensor>> {
        let Some(l) = &self.lora else { return Ok(None) };
        let Some(module) = name.strip_suffix(".weight") else {
            return Ok(None);
        };
        if !l.modules.iter().any(|m| m == module) {
            return Ok(None);
        }
        let find = |suffix: &str| -> Result<Tensor> {
            let key = format!("{module}.{suffix}");
            self.params[l.first_adapter..]
                .iter()
                .find(|(n, _)| *n == key)
                .map(|(_, t)| t.shallow_clone())
                .ok_or_else(|| NnError::input("LoRA merge", format!("tensor {key}"), "missing"))
        };
        let (a, b) = (find("lora_A.weight")?, find("lora_B.weight")?);
        let merged = tch::no_grad(|| -> Result<Tensor> {
            let delta = b.f_to_kind(Kind::Float)?.f_mm(&a.f_to_kind(Kind::Float)?)?;
            Ok(w.f_to_kind(Kind::Float)?
                .f_add(&delta.f_mul_scalar(l.config.scale())?)?
                .f_to_kind(kind)?)
        })?;
        Ok(Some(merged))
    }

    /// Writes the adapters as a PEFT folder: `adapter_config.json` and `adapter_model.safetensors`
    /// (keys `base_model.model.<module>.lora_{A,B}.weight`, fp32), which
    /// `peft.PeftModel.from_pretrained(base, dir)` loads. `base_model` is recorded as
    /// `base_model_name_or_path`.
    pub fn save_adapter(&self, dir: &Path, base_model: &str) -> Result<()> {
        let l = self
            .lora
            .as_ref()
            .ok_or_else(|| NnError::input("save_adapter", "a model with LoRA adapters", "none"))?;
        std::fs::create_dir_all(dir).map_err(|source| NnError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let tensors: Vec<(String, Tensor)> = tch::no_grad(|| {
            file_params(l, self.params.len())
                .map(|i| &self.params[i])
                .map(|(n, t)| {
                    Ok((
                        format!("{PEFT_PREFIX}{n}"),
                        t.f_detach()?
                            .f_to_kind(Kind::Float)?
                            .f_to_device(tch::Device::Cpu)?
                            .f_contiguous()?,
                    ))
                })
                .collect::<Result<Vec<_>>>()
        })?;
        let path = dir.join(ADAPTER_WEIGHTS);
        let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        Tensor::write_safetensors(&named, &path).map_err(|e| NnError::Safetensors {
            path: path.clone(),
            message: format!("writing: {e}"),
        })?;
        let c = &l.config;
        let json = serde_json::json!({
            "peft_type": "LORA",
            "task_type": match self.head_kind() {
                crate::HeadKind::Value => "TOKEN_CLS",
                crate::HeadKind::SequenceClassification | crate::HeadKind::RewardModel => "SEQ_CLS",
                crate::HeadKind::CausalLm => "CAUSAL_LM",
            },
            "base_model_name_or_path": base_model,
            "r": c.rank,
            "lora_alpha": c.alpha,
            "lora_dropout": 0.0,
            "target_modules": c.target_modules.to_json(),
            "exclude_modules": c.exclude_modules.as_ref().map(Modules::to_json),
            "use_rslora": c.use_rslora,
            "use_dora": false,
            "bias": "none",
            "fan_in_fan_out": false,
            "init_lora_weights": true,
            "inference_mode": true,
            "modules_to_save": if c.modules_to_save.is_empty() {
                Value::Null
            } else {
                Value::from(c.modules_to_save.clone())
            },
            "rank_pattern": {},
            "alpha_pattern": {},
        });
        let cfg_path = dir.join(ADAPTER_CONFIG);
        std::fs::write(
            &cfg_path,
            serde_json::to_string_pretty(&json).expect("json") + "\n",
        )
        .map_err(|source| NnError::Io {
            path: cfg_path,
            source,
        })
    }

    /// Copies a PEFT adapter folder's weights into this model's adapters (added with the folder's
    /// config, see [`LoraConfig::from_adapter_dir`]). Every adapter must be in the file with its
    /// shape, and every file tensor must belong to an adapter.
    pub fn load_adapter(&mut self, dir: &Path) -> Result<()> {
        let l = self
            .lora
            .as_ref()
            .ok_or_else(|| NnError::input("load_adapter", "a model with LoRA adapters", "none"))?;
        let path = dir.join(ADAPTER_WEIGHTS);
        let saved: HashMap<String, Tensor> = Tensor::read_safetensors(&path)
            .map_err(|e| NnError::Safetensors {
                path: path.clone(),
                message: format!("reading: {e}"),
            })?
            .into_iter()
            .map(|(k, t)| (k.replace(".default.weight", ".weight"), t))
            .collect();
        let mut used = 0;
        let ours: Vec<usize> = file_params(l, self.params.len()).collect();
        tch::no_grad(|| -> Result<()> {
            for (name, dst) in ours.iter().map(|&i| &self.params[i]) {
                let key = format!("{PEFT_PREFIX}{name}");
                let src = saved.get(&key).ok_or_else(|| NnError::MissingTensor {
                    dir: dir.to_path_buf(),
                    name: key.clone(),
                    arch: "LoRA adapter".into(),
                })?;
                if src.size() != dst.size() {
                    return Err(NnError::ShapeMismatch {
                        path: path.clone(),
                        name: key,
                        expected: dst.size(),
                        found: src.size(),
                    });
                }
                dst.shallow_clone().f_copy_(src)?;
                used += 1;
            }
            Ok(())
        })?;
        if used != saved.len() {
            let ours: std::collections::HashSet<String> = ours
                .iter()
                .map(|&i| format!("{PEFT_PREFIX}{}", self.params[i].0))
                .collect();
            let extra: Vec<String> = saved
                .keys()
                .filter(|k| !ours.contains(*k))
                .take(8)
                .cloned()
                .collect();
            return Err(NnError::UnexpectedTensors {
                dir: dir.to_path_buf(),
                arch: "LoRA adapter".into(),
                count: saved.len() - used,
                names: extra,
            });
        }
        Ok(())
    }
}

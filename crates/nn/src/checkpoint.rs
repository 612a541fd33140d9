//! HF safetensors checkpoints: load into a [`Transformer`], save back in the layout
//! `transformers.AutoModel*.from_pretrained` reads.
//!
//! Loading policy:
//! * every backbone tensor must be present with the exact shape (error names the tensor);
//! * an untied `lm_head.weight` must be present; a `Value` / `SequenceClassification` head that the
//!   checkpoint lacks (a critic or reward model started from a policy checkpoint) is freshly
//!   initialised, and reported in [`LoadReport::initialized`];
//! * extra tensors that belong to another head (`lm_head.weight`, `score.*`) or are RoPE buffers
//!   (`*.rotary_emb.inv_freq`) are skipped and reported in [`LoadReport::ignored`]; any other extra
//!   tensor is an error, because it means the config and the checkpoint disagree (wrong layer count,
//!   wrong family) and silently dropping weights would give a wrong model.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorInfo, View};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

use crate::config::ModelConfig;
use crate::error::{NnError, Result};
use crate::layers::InitMode;
use crate::model::{HeadKind, ModelOptions, Transformer};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// transformers' default `max_shard_size` ("5GB").
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// What a load did besides copying tensors.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadReport {
    pub loaded: usize,
    /// Head parameters absent from the checkpoint, left freshly initialised.
    pub initialized: Vec<String>,
    /// Checkpoint tensors skipped on purpose (another head's weights, RoPE buffers).
    pub ignored: Vec<String>,
}

/// Options for [`Transformer::save_pretrained`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaveOptions {
    /// Shards are cut so that each holds at most this many bytes (a single larger tensor gets a
    /// shard of its own). One shard is written as `model.safetensors`, more as
    /// `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`.
    pub max_shard_bytes: u64,
    /// Dtype of the written tensors; `None` keeps the model dtype.
    pub dtype: Option<Kind>,
    /// With LoRA adapters: write each adapted projection's weight merged (`W + s·B·A`, an HF
    /// export); otherwise the base weights are written and the adapters are not (they are saved
    /// apart with [`Transformer::save_adapter`]).
    pub merge_lora: bool,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            dtype: None,
            merge_lora: false,
        }
    }
}

/// The safetensors files of a model folder, memory-mapped, with a name -> file map.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    /// (path, mapping, offset of the data section)
    files: Vec<(PathBuf, memmap2::Mmap, usize)>,
    /// tensor name -> (index into `files`, header entry)
    index: BTreeMap<String, (usize, TensorInfo)>,
}

impl Checkpoint {
    /// Opens `<dir>/model.safetensors.index.json` (sharded) or `<dir>/model.safetensors`.
    pub fn open(dir: impl AsRef<Path>) -> Result<Checkpoint> {
        let dir = dir.as_ref().to_path_buf();
        let index_path = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        let shard_names: Vec<String> = if index_path.is_file() {
            let text = std::fs::read_to_string(&index_path).map_err(|source| NnError::Io {
                path: index_path.clone(),
                source,
            })?;
            let v: Value = serde_json::from_str(&text).map_err(|source| NnError::Json {
                path: index_path.clone(),
                source,
            })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| NnError::InvalidConfig {
                    path: index_path.clone(),
                    key: "weight_map".into(),
                    expected: "an object mapping tensor names to shard files".into(),
                    found: "missing or not an object".into(),
                })?;
            let mut names: Vec<String> = Vec::new();
            for (tensor, file) in map {
                let file = file.as_str().ok_or_else(|| NnError::InvalidConfig {
                    path: index_path.clone(),
                    key: format!("weight_map.{tensor}"),
                    expected: "a file name".into(),
                    found: file.to_string(),
                })?;
                if !names.iter().any(|n| n == file) {
                    names.push(file.to_string());
                }
            }
            names.sort();
            names
        } else if single.is_file() {
            vec![SINGLE_FILE.to_string()]
        } else {
            return Err(NnError::NoCheckpoint {
                dir,
                looked_for: format!(
                    "{INDEX_FILE} or {SINGLE_FILE}; .bin checkpoints are not supported"
                ),
            });
        };

        let mut files = Vec::with_capacity(shard_names.len());
        let mut index = BTreeMap::new();
        for (i, name) in shard_names.iter().enumerate() {
            let path = dir.join(name);
            let file = File::open(&path).map_err(|source| NnError::Io {
                path: path.clone(),
                source,
            })?;
            // SAFETY: the file is opened read-only; a concurrent writer truncating it could fault,
            // which is the standard caveat of every mmap-based safetensors reader.
            let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| NnError::Io {
                path: path.clone(),
                source,
            })?;
            // read_metadata validates that every tensor's byte range lies inside the file.
            let (header_len, meta) =
                SafeTensors::read_metadata(&mmap).map_err(|e| NnError::Safetensors {
                    path: path.clone(),
                    message: format!("{e:?}"),
                })?;
            for (tensor_name, info) in meta.tensors() {
                index.insert(tensor_name, (i, info.clone()));
            }
            files.push((path, mmap, 8 + header_len));
        }
        Ok(Checkpoint { dir, files, index })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(|s| s.as_str())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Reads one tensor onto the CPU in its stored dtype.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let (path, info, data) = self.entry(name)?;
        let kind = dtype_to_kind(info.dtype).ok_or_else(|| NnError::UnsupportedDtype {
            path: path.to_path_buf(),
            name: name.to_string(),
            found: format!("{:?}", info.dtype),
        })?;
        let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
        Ok(Tensor::f_from_data_size(data, &shape, kind)?)
    }

    /// Shape of one tensor.
    pub fn shape(&self, name: &str) -> Result<Vec<i64>> {
        let (_, info, _) = self.entry(name)?;
        Ok(info.shape.iter().map(|&d| d as i64).collect())
    }

    /// The file holding a tensor.
    pub fn file_of(&self, name: &str) -> Result<&Path> {
        Ok(self.entry(name)?.0)
    }

    fn entry(&self, name: &str) -> Result<(&Path, &TensorInfo, &[u8])> {
        let (i, info) = self.index.get(name).ok_or_else(|| NnError::MissingTensor {
            dir: self.dir.clone(),
            name: name.to_string(),
            arch: "requested".into(),
        })?;
        let (path, mmap, start) = &self.files[*i];
        let (a, b) = info.data_offsets;
        let data = mmap
            .get(start + a..start + b)
            .ok_or_else(|| NnError::Safetensors {
                path: path.clone(),
                message: format!("tensor `{name}` byte range {a}..{b} lies outside the file"),
            })?;
        Ok((path.as_path(), info, data))
    }
}

fn dtype_to_kind(d: Dtype) -> Option<Kind> {
    match d {
        Dtype::F32 => Some(Kind::Float),
        Dtype::F16 => Some(Kind::Half),
        Dtype::BF16 => Some(Kind::BFloat16),
        Dtype::F64 => Some(Kind::Double),
        _ => None,
    }
}

fn kind_to_dtype(k: Kind) -> Option<(Dtype, &'static str)> {
    match k {
        Kind::Float => Some((Dtype::F32, "float32")),
        Kind::Half => Some((Dtype::F16, "float16")),
        Kind::BFloat16 => Some((Dtype::BF16, "bfloat16")),
        Kind::Double => Some((Dtype::F64, "float64")),
        _ => None,
    }
}

fn is_benign_extra(name: &str) -> bool {
    name == "lm_head.weight" || name.starts_with("score.") || name.ends_with("rotary_emb.inv_freq")
}

impl Transformer {
    /// Builds the model described by `<dir>/config.json` and loads its safetensors weights,
    /// converting them to `opts.dtype` on `opts.device`. See the module docs for the policy on
    /// missing and extra tensors; skipped/initialised names are logged with `tracing::warn!`.
    pub fn from_pretrained(dir: impl AsRef<Path>, opts: &ModelOptions) -> Result<Transformer> {
        let dir = dir.as_ref();
        let (model, report) = Self::from_pretrained_with_report(dir, opts)?;
        if !report.initialized.is_empty() {
            tracing::warn!(
                dir = %dir.display(),
                "head parameters not in the checkpoint, freshly initialised: {:?}",
                report.initialized
            );
        }
        if !report.ignored.is_empty() {
            tracing::warn!(
                dir = %dir.display(),
                "checkpoint tensors not used by this head, skipped: {:?}",
                report.ignored
            );
        }
        Ok(model)
    }

    /// [`Transformer::from_pretrained`] without its warnings, returning what the load
    /// initialised or skipped instead (a caller that must not run on a fresh head checks
    /// [`LoadReport::initialized`]).
    pub fn from_pretrained_with_report(
        dir: impl AsRef<Path>,
        opts: &ModelOptions,
    ) -> Result<(Transformer, LoadReport)> {
        let dir = dir.as_ref();
        let config = ModelConfig::from_dir(dir)?;
        let checkpoint = Checkpoint::open(dir)?;
        // Everything is overwritten from the checkpoint (missing head parameters are initialised
        // in `load_checkpoint`), so skip the cost of random init.
        let mut model = Transformer::build(config, opts, InitMode::Zeros)?;
        let report = model.load_checkpoint(&checkpoint)?;
        Ok((model, report))
    }

    /// Copies weights from an opened checkpoint into this model (no grad).
    pub fn load_checkpoint(&mut self, ckpt: &Checkpoint) -> Result<LoadReport> {
        let mut report = LoadReport::default();
        let mut used: HashSet<&str> = HashSet::new();
        let arch = self.config().arch.to_string();
        let head_names: HashSet<String> = self.head_parameter_names().iter().cloned().collect();
        let optional_head = self.head_kind() != HeadKind::CausalLm;
        // Adapters are not in a base checkpoint (see `load_adapter`).
        for (name, dst) in self.base_parameters() {
            if !ckpt.contains(name) {
                if optional_head && head_names.contains(name) {
                    // HF `_init_weights` for a new Linear head: normal(0, initializer_range), zero bias.
                    let mut p = dst.shallow_clone();
                    let std = self.config().initializer_range;
                    tch::no_grad(|| -> Result<()> {
                        if name.ends_with(".bias") {
                            let _ = p.f_zero_()?;
                        } else {
                            let _ = p.f_normal_(0.0, std)?;
                        }
                        Ok(())
                    })?;
                    report.initialized.push(name.clone());
                    continue;
                }
                return Err(NnError::MissingTensor {
                    dir: ckpt.dir().to_path_buf(),
                    name: name.clone(),
                    arch: arch.clone(),
                });
            }
            let found = ckpt.shape(name)?;
            if found != dst.size() {
                return Err(NnError::ShapeMismatch {
                    path: ckpt.file_of(name)?.to_path_buf(),
                    name: name.clone(),
                    expected: dst.size(),
                    found,
                });
            }
            let src = ckpt.tensor(name)?;
            let mut dst = dst.shallow_clone();
            tch::no_grad(|| dst.f_copy_(&src))?;
            used.insert(name.as_str());
            report.loaded += 1;
        }
        let mut unexpected = Vec::new();
        for name in ckpt.names() {
            if used.contains(name) {
                continue;
            }
            if is_benign_extra(name) {
                report.ignored.push(name.to_string());
            } else {
                unexpected.push(name.to_string());
            }
        }
        if !unexpected.is_empty() {
            return Err(NnError::UnexpectedTensors {
                dir: ckpt.dir().to_path_buf(),
                arch,
                count: unexpected.len(),
                names: unexpected.into_iter().take(8).collect(),
            });
        }
        Ok(report)
    }

    /// Writes `config.json` and the weights in HF layout to `dir` (created if needed). Existing
    /// `model*.safetensors` / index files there are removed first so a reader never mixes old
    /// shards with new ones. A tied LM head is not written (HF re-ties it on load).
    pub fn save_pretrained(&self, dir: impl AsRef<Path>, opts: &SaveOptions) -> Result<()> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|source| NnError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let kind = opts.dtype.unwrap_or(self.dtype());
        let (dtype, dtype_name) = kind_to_dtype(kind).ok_or_else(|| {
            NnError::input(
                "SaveOptions.dtype",
                "Float, Half, BFloat16 or Double",
                format!("{kind:?}"),
            )
        })?;
        remove_old_weights(dir)?;

        // Plan shards by byte size, in parameter order.
        let elt = kind.elt_size_in_bytes() as u64;
        let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
        let mut current = 0u64;
        let mut total = 0u64;
        let params = self.base_parameters();
        for (i, (_, t)) in params.iter().enumerate() {
            let bytes = t.numel() as u64 * elt;
            total += bytes;
            let last = shards.len() - 1;
            if !shards[last].is_empty() && current + bytes > opts.max_shard_bytes {
                shards.push(Vec::new());
                current = 0;
            }
            let last = shards.len() - 1;
            shards[last].push(i);
            current += bytes;
        }
        let n = shards.len();
        let mut weight_map = BTreeMap::new();
        for (s, members) in shards.iter().enumerate() {
            let file_name = if n == 1 {
                SINGLE_FILE.to_string()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", s + 1, n)
            };
            let path = dir.join(&file_name);
            let mut views: Vec<(String, OwnedView)> = Vec::with_capacity(members.len());
            for &i in members {
                let (name, t) = &params[i];
                let merged = if opts.merge_lora {
                    self.merged_weight(name, t, kind)?
                } else {
                    None
                };
                views.push((
                    name.clone(),
                    OwnedView::from_tensor(merged.as_ref().unwrap_or(t), kind, dtype)?,
                ));
                weight_map.insert(name.clone(), Value::from(file_name.clone()));
            }
            let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
            safetensors::serialize_to_file(views, &Some(meta), &path).map_err(|e| {
                NnError::Safetensors {
                    path: path.clone(),
                    message: format!("writing: {e:?}"),
                }
            })?;
        }
        if n > 1 {
            let index = serde_json::json!({
                "metadata": {"total_size": total},
                "weight_map": weight_map,
            });
            write_json(&dir.join(INDEX_FILE), &index)?;
        }
        write_json(&dir.join("config.json"), &self.config_json(dtype_name))?;
        Ok(())
    }

    /// The config to save: the loaded JSON with `architectures`, dtype and head fields updated.
    fn config_json(&self, dtype_name: &str) -> Value {
        let cfg = self.config();
        let mut raw = cfg.raw.clone();
        if let Some(obj) = raw.as_object_mut() {
            let class = format!(
                "{}{}",
                cfg.arch.class_prefix(),
                self.head_kind().class_suffix()
            );
            obj.insert("architectures".into(), Value::from(vec![class]));
            // transformers >= 4.56 writes `dtype`, older versions `torch_dtype`; update whichever
            // the config uses so both generations read it without a deprecation warning.
            let key = if obj.contains_key("dtype") {
                "dtype"
            } else {
                "torch_dtype"
            };
            obj.insert(key.into(), Value::from(dtype_name));
            let labels = match self.head_kind() {
                HeadKind::CausalLm => None,
                HeadKind::Value | HeadKind::RewardModel => Some(1),
                HeadKind::SequenceClassification => Some(cfg.num_labels),
            };
            if let Some(n) = labels {
                let id2label: serde_json::Map<String, Value> = (0..n)
                    .map(|i| (i.to_string(), Value::from(format!("LABEL_{i}"))))
                    .collect();
                let label2id: serde_json::Map<String, Value> = (0..n)
                    .map(|i| (format!("LABEL_{i}"), Value::from(i)))
                    .collect();
                let keep = obj
                    .get("id2label")
                    .and_then(|v| v.as_object())
                    .map(|m| m.len() as i64 == n)
                    .unwrap_or(false);
                if !keep {
                    obj.insert("id2label".into(), Value::Object(id2label));
                    obj.insert("label2id".into(), Value::Object(label2id));
                }
                obj.remove("num_labels");
            }
        }
        raw
    }
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(|source| NnError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    std::fs::write(path, text + "\n").map_err(|source| NnError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn remove_old_weights(dir: &Path) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|source| NnError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let is_weights =
            name == INDEX_FILE || (name.starts_with("model") && name.ends_with(".safetensors"));
        if is_weights {
            std::fs::remove_file(entry.path()).map_err(|source| NnError::Io {
                path: entry.path(),
                source,
            })?;
        }
    }
    Ok(())
}

/// Tensor bytes copied to the host in the target dtype, for the safetensors writer.
struct OwnedView {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl OwnedView {
    fn from_tensor(t: &Tensor, kind: Kind, dtype: Dtype) -> Result<OwnedView> {
        let host = t
            .f_detach()?
            .f_to_device(Device::Cpu)?
            .f_to_kind(kind)?
            .f_contiguous()?;
        let numel = host.numel();
        let mut data = vec![0u8; numel * kind.elt_size_in_bytes()];
        host.f_copy_data_u8(&mut data, numel)?;
        Ok(OwnedView {
            dtype,
            shape: host.size().iter().map(|&d| d as usize).collect(),
            data,
        })
    }
}

impl View for OwnedView {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

//! Checkpoints that do not depend on the parallel layout they were written at.
//!
//! Every parameter is saved whole (gathered over the tensor-parallel ranks, the pipeline stages,
//! the expert-tensor- and expert-parallel ranks (every routed expert under its HF name) and, for
//! the distributed optimizer, the (expert-)data-parallel ranks): `model/` is an HF folder in the compute dtype,
//! `master.safetensors` holds the fp32 master weights and `optim.safetensors` the AdamW moments
//! (`exp_avg.<name>`, `exp_avg_sq.<name>`), all under HF parameter names; `state.json` records the
//! format, the role, the layout it was written at and the counters. Loading at any
//! tensor-/pipeline-/virtual-pipeline-/data-parallel size slices each rank's part out of the whole
//! tensors (a stage reads only its own layers, those of each of its model chunks), so 2→1 and 1→2
//! resharding is the ordinary path, not a special case. Rank 0 writes; every rank takes part in
//! the gathers.

use std::collections::HashMap;
use std::path::Path;

use tch::{Device, Tensor};
use verl_nn::SaveOptions;

use crate::common::assemble;
use crate::error::{MegatronError, Result, TorchContext};
use crate::parallel::Parallel;
use crate::train::{TpTrainer, What};

pub const FORMAT: &str = "verl-megatron/1";
pub const STATE_FILE: &str = "state.json";
pub const MASTER_FILE: &str = "master.safetensors";
pub const OPTIM_FILE: &str = "optim.safetensors";
pub const MODEL_DIR: &str = "model";

fn io(path: &Path) -> impl Fn(std::io::Error) -> MegatronError + '_ {
    move |source| {
        MegatronError::from(verl_backend_kit::BackendError::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

fn sorted(map: &HashMap<String, Tensor>, prefix: &str) -> Result<Vec<(String, Tensor)>> {
    let mut v: Vec<(String, Tensor)> = map
        .iter()
        .map(|(n, t)| {
            Ok((
                format!("{prefix}{n}"),
                t.f_to_device(Device::Cpu)
                    .ctx("checkpoint tensor to host")?,
            ))
        })
        .collect::<Result<_>>()?;
    v.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(v)
}

/// Writes `tr` (every rank calls this; rank 0 writes the files).
pub fn save(
    tr: &TpTrainer,
    par: &Parallel,
    dir: &Path,
    role: &str,
    extra: serde_json::Value,
) -> Result<()> {
    let masters = tr.gather_state(par, What::Master)?;
    let exp_avg = tr.gather_state(par, What::ExpAvg)?;
    let exp_avg_sq = tr.gather_state(par, What::ExpAvgSq)?;
    if par.is_first() {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let m = &tr.model;
        let full = assemble(m.config(), m.head_kind(), m.dtype(), Device::Cpu, &masters)?;
        full.save_pretrained(
            dir.join(MODEL_DIR),
            &SaveOptions {
                dtype: Some(m.dtype()),
                ..SaveOptions::default()
            },
        )?;
        Tensor::write_safetensors(&sorted(&masters, "")?, dir.join(MASTER_FILE))
            .ctx("write master weights")?;
        let mut optim = sorted(&exp_avg, "exp_avg.")?;
        optim.extend(sorted(&exp_avg_sq, "exp_avg_sq.")?);
        Tensor::write_safetensors(&optim, dir.join(OPTIM_FILE)).ctx("write optimizer state")?;
        let state = serde_json::json!({
            "format": FORMAT,
            "role": role,
            "layout": par.layout.to_json(),
            "optimizer_step": tr.optimizer_step(),
            "updates": tr.updates,
            "compute_dtype": format!("{:?}", m.dtype()),
            "extra": extra,
        });
        let path = dir.join(STATE_FILE);
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&state).unwrap_or_default() + "\n",
        )
        .map_err(io(&path))?;
    }
    par.barrier("checkpoint barrier")
}

fn read_named(path: &Path) -> Result<HashMap<String, Tensor>> {
    if !path.is_file() {
        return Err(MegatronError::checkpoint(path, "file missing"));
    }
    Ok(Tensor::read_safetensors(path)
        .ctx(&format!("read {}", path.display()))?
        .into_iter()
        .collect())
}

/// Restores what [`save`] wrote, at whatever layout this role runs; returns the `extra` object.
pub fn load(
    tr: &mut TpTrainer,
    par: &Parallel,
    dir: &Path,
    role: &str,
) -> Result<serde_json::Value> {
    let path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    let state: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| MegatronError::checkpoint(&path, format!("invalid JSON: {e}")))?;
    let field = |k: &str| state.get(k).cloned().unwrap_or(serde_json::Value::Null);
    if field("format").as_str() != Some(FORMAT) || field("role").as_str() != Some(role) {
        return Err(MegatronError::checkpoint(
            &path,
            format!(
                "expected format {FORMAT:?} for role {role:?}, found format {} role {}",
                field("format"),
                field("role")
            ),
        ));
    }
    let saved = |k: &str| field("layout").get(k).and_then(|v| v.as_u64()).unwrap_or(1) as usize;
    let (saved_tp, saved_pp, saved_vpp, saved_ep, saved_etp) = (
        saved("tensor_model_parallel_size"),
        saved("pipeline_model_parallel_size"),
        saved("virtual_pipeline_model_parallel_size"),
        saved("expert_model_parallel_size"),
        saved("expert_tensor_parallel_size"),
    );
    let l = &par.layout;
    if (saved_tp, saved_pp, saved_vpp, saved_ep, saved_etp) != (l.tp, l.pp, l.vpp, l.ep, l.etp) {
        tracing::info!(
            "{}: written at tensor_model_parallel_size={saved_tp} pipeline_model_parallel_size={saved_pp} virtual_pipeline_model_parallel_size={saved_vpp} expert_model_parallel_size={saved_ep} expert_tensor_parallel_size={saved_etp}, resharded for {} × {} × {} × {} × {}",
            dir.display(),
            l.tp,
            l.pp,
            l.vpp,
            l.ep,
            l.etp
        );
    }
    let count = |k: &str| -> Result<u64> {
        field(k).as_u64().ok_or_else(|| {
            MegatronError::checkpoint(
                &path,
                format!("`{k}` should be a non-negative integer, found {}", field(k)),
            )
        })
    };
    let (step, updates) = (count("optimizer_step")?, count("updates")?);
    let masters_path = dir.join(MASTER_FILE);
    let masters = read_named(&masters_path)?;
    tr.restore_state(par, What::Master, &masters, &masters_path)?;
    let optim_path = dir.join(OPTIM_FILE);
    let optim = read_named(&optim_path)?;
    for (what, prefix) in [(What::ExpAvg, "exp_avg."), (What::ExpAvgSq, "exp_avg_sq.")] {
        let part: HashMap<String, Tensor> = optim
            .iter()
            .filter_map(|(k, t)| {
                k.strip_prefix(prefix)
                    .map(|n| (n.to_string(), t.shallow_clone()))
            })
            .collect();
        tr.restore_state(par, what, &part, &optim_path)?;
    }
    tr.set_counters(step, updates);
    tr.zero_grad()?;
    Ok(field("extra"))
}

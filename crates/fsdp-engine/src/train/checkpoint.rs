//! A trainable model's checkpoint: state, optimizer moments and masters written by rank 0 (gathered) or per shard, and read back at any world size.

use super::*;

impl TrainableModel {
    pub(super) fn state_json(&self, role: &str, extra: serde_json::Value) -> serde_json::Value {
        serde_json::json!({
            "format": FORMAT,
            "role": role,
            "optimizer_step": self.optim.step,
            "updates": self.updates,
            "master_dtype": format!("{:?}", self.precision.master),
            "compute_dtype": format!("{:?}", self.model.dtype()),
            "extra": extra,
        })
    }

    /// Model (HF folder), master weights when they differ from the model, optimizer state, counters.
    ///
    /// Sharded: every rank calls this; rank 0 writes the HF folder (parameters gathered) and
    /// `state.json` (with `world_size` and the flat `layout`), every rank writes its
    /// `master.rank<r>-of-<w>` and `optim.rank<r>-of-<w>` files; returns once all ranks are done.
    pub fn save_on(
        &mut self,
        dp: &Dp,
        dir: &Path,
        role: &str,
        extra: serde_json::Value,
    ) -> Result<()> {
        if self.shard.is_none() {
            return self.save(dir, role, extra);
        }
        std::fs::create_dir_all(dir).map_err(|source| BackendError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let rank0 = dp.rank == 0;
        self.with_full(dp, |model| {
            if rank0 {
                save_model(model, dir)?;
            }
            Ok(())
        })?;
        let shard = self.shard.as_ref().expect("checked above");
        shard.save_shards(dir, &self.optim)?;
        if rank0 {
            let mut json = self.state_json(role, extra);
            json["world_size"] = serde_json::json!(dp.size);
            json["layout"] = shard.layout.to_json(dp.size);
            write_json(&dir.join(STATE_FILE), &json)?;
        }
        dp.barrier("checkpoint barrier")
    }

    /// The one-rank checkpoint (see [`TrainableModel::save_on`] for several ranks).
    pub fn save(&self, dir: &Path, role: &str, extra: serde_json::Value) -> Result<()> {
        if self.shard.is_some() {
            return Err(BackendError::Api(verl_plugin_api::Error::failed(
                "a sharded model is saved with save_on (every rank takes part)",
            )));
        }
        std::fs::create_dir_all(dir).map_err(|source| BackendError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        save_model(&self.model, dir)?;
        if self.mixed() {
            let named: Vec<(&str, &Tensor)> = self
                .names
                .iter()
                .map(String::as_str)
                .zip(self.masters.iter())
                .collect();
            Tensor::write_safetensors(&named, dir.join(MASTER_FILE)).ctx("write master weights")?;
        }
        let mut state: Vec<(String, &Tensor)> = Vec::new();
        for (i, n) in self.names.iter().enumerate() {
            state.push((format!("exp_avg.{n}"), &self.optim.exp_avg[i]));
            state.push((format!("exp_avg_sq.{n}"), &self.optim.exp_avg_sq[i]));
        }
        Tensor::write_safetensors(&state, dir.join(OPTIM_FILE)).ctx("write optimizer state")?;
        write_json(&dir.join(STATE_FILE), &self.state_json(role, extra))
    }

    /// Restores what [`TrainableModel::save`] or [`TrainableModel::save_on`] wrote, at any world
    /// size (a checkpoint of `w` ranks is resharded for this one's); returns its `extra` object.
    pub fn load(&mut self, dir: &Path, role: &str) -> Result<serde_json::Value> {
        let path = dir.join(STATE_FILE);
        let text = std::fs::read_to_string(&path).map_err(|source| BackendError::Io {
            path: path.clone(),
            source,
        })?;
        let state: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| BackendError::Checkpoint {
                path: path.clone(),
                message: format!("invalid JSON: {e}"),
            })?;
        let field = |k: &str| state.get(k).cloned().unwrap_or(serde_json::Value::Null);
        if field("format").as_str() != Some(FORMAT) || field("role").as_str() != Some(role) {
            return Err(BackendError::Checkpoint {
                path,
                message: format!(
                    "expected format {FORMAT:?} for role {role:?}, found format {} role {}",
                    field("format"),
                    field("role")
                ),
            });
        }
        let saved_world = field("world_size").as_u64().unwrap_or(1);
        if let Some(shard) = self.shard.as_mut() {
            let mut src = Source::open(dir, &state)?;
            shard.load_from(&mut src, &mut self.optim)?;
        } else if saved_world > 1 {
            load_model(&mut self.model, dir)?;
            let mut src = Source::open(dir, &state)?;
            self.restore_unsharded(&mut src)?;
        } else {
            self.load_unsharded(dir)?;
        }
        let count = |k: &str| -> Result<u64> {
            field(k).as_u64().ok_or_else(|| BackendError::Checkpoint {
                path: dir.join(STATE_FILE),
                message: format!("`{k}` should be a non-negative integer, found {}", field(k)),
            })
        };
        self.optim.step = count("optimizer_step")?;
        self.updates = count("updates")?;
        self.zero_grad()?;
        Ok(field("extra"))
    }

    /// One rank from a sharded checkpoint: masters and optimizer state rebuilt from the shards.
    pub(super) fn restore_unsharded(&mut self, src: &mut Source) -> Result<()> {
        let layout = Layout::of(&self.model);
        tch::no_grad(|| -> Result<()> {
            for group in &layout.groups {
                for what in [What::Master, What::ExpAvg, What::ExpAvgSq] {
                    let flat = src.group_flat(group, what)?;
                    for (k, &param) in group.params.iter().enumerate() {
                        let i = self.trained_slot(param)?;
                        let piece = flat
                            .f_narrow(0, group.offsets[k] as i64, group.numels[k] as i64)
                            .and_then(|x| x.f_view(group.shapes[k].as_slice()))
                            .ctx("split checkpoint group")?;
                        let dst = match what {
                            What::Master => &self.masters[i],
                            What::ExpAvg => &self.optim.exp_avg[i],
                            What::ExpAvgSq => &self.optim.exp_avg_sq[i],
                        };
                        dst.shallow_clone().f_copy_(&piece).ctx("restore tensor")?;
                    }
                }
            }
            Ok(())
        })?;
        if self.mixed() {
            tch::no_grad(|| -> Result<()> {
                for (p, m) in self.trained_parameters().into_iter().zip(&self.masters) {
                    p.shallow_clone().f_copy_(m).ctx("masters → live model")?;
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    pub(super) fn load_unsharded(&mut self, dir: &Path) -> Result<()> {
        load_model(&mut self.model, dir)?;
        let masters_path = dir.join(MASTER_FILE);
        if self.mixed() {
            let saved = read_named(&masters_path)?;
            copy_named(&masters_path, &saved, "", &self.names, &self.masters)?;
        }
        let optim_path = dir.join(OPTIM_FILE);
        let saved = read_named(&optim_path)?;
        copy_named(
            &optim_path,
            &saved,
            "exp_avg.",
            &self.names,
            &self.optim.exp_avg,
        )?;
        copy_named(
            &optim_path,
            &saved,
            "exp_avg_sq.",
            &self.names,
            &self.optim.exp_avg_sq,
        )?;
        Ok(())
    }
}

/// The checkpoint's model folder: the (base) weights in the compute dtype and, with LoRA, the
/// adapters in PEFT's format beside them ([`LORA_DIR`]).
fn save_model(model: &Transformer, dir: &Path) -> Result<()> {
    let folder = dir.join(MODEL_DIR);
    model.save_pretrained(
        &folder,
        &SaveOptions {
            dtype: Some(model.dtype()),
            ..SaveOptions::default()
        },
    )?;
    if model.lora_config().is_some() {
        model.save_adapter(&dir.join(LORA_DIR), &folder.display().to_string())?;
    }
    Ok(())
}

/// Reads what [`save_model`] wrote into `model` (which has the same adapters, if any).
fn load_model(model: &mut Transformer, dir: &Path) -> Result<()> {
    model.load_checkpoint(&Checkpoint::open(dir.join(MODEL_DIR))?)?;
    if model.lora_config().is_some() {
        model.load_adapter(&dir.join(LORA_DIR))?;
    }
    Ok(())
}

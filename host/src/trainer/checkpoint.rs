//! verl's `_save_checkpoint` and `_load_checkpoint`: the roles' state in `actor/` and `critic/`,
//! the data loader's position and the loop's own state beside them, and resuming from there.

use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use verl_algos::KlController;
use verl_checkpoint::{
    CheckpointManager, KeepPolicy, ResumeDecision, ResumeMode, Role as CkptRole, RoleWriter,
    WriterError, DATA_STATE_FILE, TRAINER_STATE_FILE,
};
use verl_config::Config;
use verl_data::DataLoaderState;
use verl_plugin_api::client::ActorClient;

use super::error::TrainerError;
use super::reduce::Ranks;
use super::workers::Workers;
use crate::dist::HostGroup;

/// Loop state that a checkpoint must restore beyond the roles and the data loader.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TrainerState {
    global_step: u64,
    epoch: u64,
    kl_coef: f64,
    /// `kl_coef`'s bits: JSON text does not always parse back to the same float, and a resumed
    /// run must continue bit for bit.
    kl_coef_bits: u64,
}

/// Where an `hf_model` checkpoint puts the policy's HF export, inside the actor's folder (as verl).
const HF_EXPORT_DIR: &str = "huggingface";

/// The job's checkpoints: `trainer.default_local_dir`, what is kept, what is saved.
pub(super) struct Checkpoints {
    manager: CheckpointManager,
    /// verl's `hf_model` in `actor.checkpoint.save_contents`: an HF export beside the actor's state.
    hf: bool,
}

/// Where a run starts: the step it resumed at (0 when fresh) and the data loader's position.
pub(super) struct Resumed {
    pub(super) global_step: u64,
    pub(super) from: Option<u64>,
    pub(super) loader: Option<DataLoaderState>,
}

impl Checkpoints {
    pub(super) fn new(cfg: &Config, world: u32) -> Self {
        let t = &cfg.trainer;
        let mut manager = CheckpointManager::new(
            &t.default_local_dir,
            KeepPolicy::from_verl(
                t.max_actor_ckpt_to_keep.map(|v| v as i64),
                t.max_critic_ckpt_to_keep.map(|v| v as i64),
            ),
        );
        if world > 1 {
            // Every rank writes its shard into the same pending folder, so they must agree on
            // its name; a non-numeric tag also lets the next run clean up after a crashed one.
            manager = manager.with_temp_tag("spmd");
        }
        let hf = cfg
            .actor_rollout_ref
            .actor
            .checkpoint
            .save_contents
            .iter()
            .any(|c| c == "hf_model");
        Checkpoints { manager, hf }
    }

    /// verl's `_load_checkpoint` (`trainer.resume_mode`, `trainer.resume_from_path`): restores
    /// the roles and the KL controller's coefficient, and says where the data loader resumes.
    pub(super) fn resume(
        &self,
        cfg: &Config,
        workers: &mut Workers,
        kl_ctrl: &mut KlController,
    ) -> anyhow::Result<Resumed> {
        let t = &cfg.trainer;
        let mode = ResumeMode::from_verl(&t.resume_mode, t.resume_from_path.as_deref())?;
        let point = match self.manager.resolve_resume(&mode)? {
            ResumeDecision::Fresh { note } => {
                if let Some(note) = note {
                    tracing::warn!("{note}");
                }
                return Ok(Resumed {
                    global_step: 0,
                    from: None,
                    loader: None,
                });
            }
            ResumeDecision::Resume(point) => point,
        };
        let actor_dir = point.require_role(CkptRole::Actor)?;
        workers
            .actor
            .load(&actor_dir)
            .with_context(|| format!("restoring the actor from {}", actor_dir.display()))?;
        if let Some(critic) = workers.critic.as_mut() {
            let dir = point.require_role(CkptRole::Critic)?;
            critic
                .load(&dir)
                .with_context(|| format!("restoring the critic from {}", dir.display()))?;
        }
        let mut loader = None;
        if let Some(state) = &point.data_state {
            loader = Some(serde_json::from_value(state.clone()).map_err(|e| {
                TrainerError::Checkpoint {
                    path: point.dir.clone(),
                    message: format!("data.json is not a data-loader state: {e}"),
                }
            })?);
        }
        if let Some(state) = &point.trainer_state {
            let st: TrainerState =
                serde_json::from_value(state.clone()).map_err(|e| TrainerError::Checkpoint {
                    path: point.dir.clone(),
                    message: format!("trainer_state.json is not a trainer state: {e}"),
                })?;
            let coef = f64::from_bits(st.kl_coef_bits);
            *kl_ctrl = match *kl_ctrl {
                KlController::Fixed { .. } => KlController::fixed(coef),
                KlController::Adaptive {
                    target, horizon, ..
                } => KlController::adaptive(coef, target, horizon as i64)?,
            };
        }
        tracing::info!(step = point.global_step, dir = %point.dir.display(), "resumed from checkpoint");
        Ok(Resumed {
            global_step: point.global_step,
            from: Some(point.global_step),
            loader,
        })
    }

    /// verl's `_save_checkpoint` of step `step` (of `epoch`, with the KL controller at
    /// `kl_coef`): the roles fill `actor/` and `critic/`, then the loader position and the loop
    /// state, then the tracker file (atomically, by the checkpoint crate).
    pub(super) fn save(
        &self,
        workers: &mut Workers,
        step: u64,
        epoch: u64,
        kl_coef: f64,
        loader: &DataLoaderState,
        ranks: Ranks<'_>,
    ) -> anyhow::Result<()> {
        let state = TrainerState {
            global_step: step,
            epoch,
            kl_coef,
            kl_coef_bits: kl_coef.to_bits(),
        };
        match ranks.group() {
            None => save_local(self, workers, step, loader, &state),
            Some(g) => save_spmd(self, workers, step, loader, &state, g),
        }
    }
}

/// The actor's part of a checkpoint: its state, and with `hf` (verl's `hf_model` in
/// `checkpoint.save_contents`) an HF export of the policy in `huggingface/` beside it.
fn save_actor(actor: &mut ActorClient, dir: &Path, hf: bool) -> Result<(), WriterError> {
    actor.save(dir).map_err(|e| Box::new(e) as WriterError)?;
    if hf {
        actor
            .export_hf(&dir.join(HF_EXPORT_DIR))
            .map_err(|e| Box::new(e) as WriterError)?;
    }
    Ok(())
}

/// One rank: the roles write their folders, then the host state and the tracker follow.
fn save_local(
    ckpt: &Checkpoints,
    workers: &mut Workers,
    step: u64,
    loader: &DataLoaderState,
    state: &TrainerState,
) -> anyhow::Result<()> {
    let (actor, hf) = (&mut workers.actor, ckpt.hf);
    let mut writers: Vec<(CkptRole, RoleWriter<'_>)> = vec![(
        CkptRole::Actor,
        Box::new(move |dir: &Path| save_actor(actor, dir, hf)),
    )];
    if let Some(critic) = workers.critic.as_mut() {
        writers.push((
            CkptRole::Critic,
            Box::new(move |dir: &Path| critic.save(dir).map_err(|e| Box::new(e) as WriterError)),
        ));
    }
    let data = serde_json::to_value(loader)?;
    let st = serde_json::to_value(state)?;
    let saved = ckpt
        .manager
        .save(step, writers, Some(&data), Some(&st))
        .with_context(|| format!("saving the checkpoint of step {step}"))?;
    tracing::info!(step, dir = %saved.dir.display(), "checkpoint saved");
    Ok(())
}

/// A multi-rank job: rank 0 opens the pending step folder, every rank's roles write their
/// shards into it, then rank 0 alone writes the host state and commits (the atomic rename and
/// tracker update) once every shard is written. No rank goes on before the commit, so a later
/// failure never finds a half-published step.
fn save_spmd(
    ckpt: &Checkpoints,
    workers: &mut Workers,
    step: u64,
    loader: &DataLoaderState,
    state: &TrainerState,
    group: &HostGroup,
) -> anyhow::Result<()> {
    let context = || format!("saving the checkpoint of step {step}");
    let hf = ckpt.hf;
    let mut role_dirs = vec![CkptRole::Actor];
    if workers.critic.is_some() {
        role_dirs.push(CkptRole::Critic);
    }
    if group.rank() == 0 {
        let mut pending = ckpt.manager.begin(step).with_context(context)?;
        for role in &role_dirs {
            let dir = pending.role_dir(*role);
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        group.barrier("checkpoint-begin")?;
        let actor = &mut workers.actor;
        pending
            .write_role(CkptRole::Actor, |dir: &Path| save_actor(actor, dir, hf))
            .with_context(context)?;
        if let Some(critic) = workers.critic.as_mut() {
            pending
                .write_role(CkptRole::Critic, |dir: &Path| {
                    critic.save(dir).map_err(|e| Box::new(e) as WriterError)
                })
                .with_context(context)?;
        }
        group.barrier("checkpoint-written")?;
        pending
            .write_json(DATA_STATE_FILE, &serde_json::to_value(loader)?)
            .with_context(context)?;
        pending
            .write_json(TRAINER_STATE_FILE, &serde_json::to_value(state)?)
            .with_context(context)?;
        let saved = pending.commit().with_context(context)?;
        tracing::info!(step, dir = %saved.dir.display(), "checkpoint saved");
        group.barrier("checkpoint-committed")?;
    } else {
        group.barrier("checkpoint-begin")?;
        let tmp = ckpt.manager.temp_dir(step);
        let dir = tmp.join(CkptRole::Actor.dir_name());
        save_actor(&mut workers.actor, &dir, hf)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .with_context(|| format!("saving the actor's shard into {}", dir.display()))?;
        if let Some(critic) = workers.critic.as_mut() {
            let dir = tmp.join(CkptRole::Critic.dir_name());
            critic
                .save(&dir)
                .with_context(|| format!("saving the critic's shard into {}", dir.display()))?;
        }
        group.barrier("checkpoint-written")?;
        group.barrier("checkpoint-committed")?;
    }
    Ok(())
}

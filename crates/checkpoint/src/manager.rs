//! Saving: the pending (temporary) step folder, its commit protocol, leftover cleanup and keep-N pruning.

use std::collections::BTreeSet;
use std::fs;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{io, CheckpointError, Result, WriterError};
use crate::fsutil::{fsync_dir, fsync_tree, remove_tree, write_atomic, write_file_synced};
use crate::layout::{
    aside_dir_name, parse_leftover_tag, parse_step_dir_name, step_dir_name, temp_dir_name, Role,
    DATA_STATE_FILE, TRACKER_FILE, TRAINER_STATE_FILE,
};

/// A backend's writer for one role: it fills the folder it is given (which already exists).
pub type RoleWriter<'a> = Box<dyn FnOnce(&Path) -> Result<(), WriterError> + 'a>;

/// How many step folders keep each role's subfolder (`trainer.max_actor_ckpt_to_keep`,
/// `trainer.max_critic_ckpt_to_keep`); `None` keeps all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeepPolicy {
    /// Newest step folders that keep `actor/`.
    pub max_actor: Option<usize>,
    /// Newest step folders that keep `critic/`.
    pub max_critic: Option<usize>,
}

impl KeepPolicy {
    /// verl's reading of the two config values: unset, `-1` or `0` keep everything.
    pub fn from_verl(
        max_actor_ckpt_to_keep: Option<i64>,
        max_critic_ckpt_to_keep: Option<i64>,
    ) -> Self {
        let limit = |v: Option<i64>| v.filter(|&n| n > 0).map(|n| n as usize);
        KeepPolicy {
            max_actor: limit(max_actor_ckpt_to_keep),
            max_critic: limit(max_critic_ckpt_to_keep),
        }
    }

    fn for_role(&self, role: Role) -> Option<usize> {
        match role {
            Role::Actor => self.max_actor,
            Role::Critic => self.max_critic,
        }
    }
}

/// What a successful save left on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedCheckpoint {
    /// The step now named by the tracker file.
    pub global_step: u64,
    /// `default_local_dir/global_step_N`.
    pub dir: PathBuf,
    /// Role subfolders or whole step folders removed by the keep policy, oldest first.
    pub pruned: Vec<PathBuf>,
}

/// Owns `trainer.default_local_dir`: saves step folders atomically and finds what to resume from.
#[derive(Debug, Clone)]
pub struct CheckpointManager {
    root: PathBuf,
    keep: KeepPolicy,
    tag: String,
}

impl CheckpointManager {
    /// A manager for `root` (`trainer.default_local_dir`; created on first save). Temp folders are tagged with
    /// this process's id.
    pub fn new(root: impl Into<PathBuf>, keep: KeepPolicy) -> Self {
        CheckpointManager {
            root: root.into(),
            keep,
            tag: std::process::id().to_string(),
        }
    }

    /// Use `tag` instead of the pid in temp folder names, so that several ranks writing shards into one pending
    /// folder agree on its name (one of them must still be the only one to [`PendingCheckpoint::commit`]).
    pub fn with_temp_tag(mut self, tag: impl Into<String>) -> Self {
        self.tag = tag.into();
        self
    }

    /// The checkpoint root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The keep policy.
    pub fn keep_policy(&self) -> KeepPolicy {
        self.keep
    }

    /// `root/global_step_{step}`.
    pub fn step_dir(&self, step: u64) -> PathBuf {
        self.root.join(step_dir_name(step))
    }

    /// The pending folder [`CheckpointManager::begin`] creates for `step` (with this manager's temp
    /// tag): where the other ranks of a job write their shards while one rank owns the save.
    pub fn temp_dir(&self, step: u64) -> PathBuf {
        self.root.join(temp_dir_name(step, &self.tag))
    }

    /// `root/latest_checkpointed_iteration.txt`.
    pub fn tracker_path(&self) -> PathBuf {
        self.root.join(TRACKER_FILE)
    }

    /// Save a whole step in one call: each role's writer fills `role/`, then `data.json` and
    /// `trainer_state.json` are written, then the folder is committed (see [`PendingCheckpoint::commit`]).
    /// On any error or writer panic nothing that resume would pick is left behind.
    pub fn save(
        &self,
        global_step: u64,
        writers: Vec<(Role, RoleWriter<'_>)>,
        data_state: Option<&Value>,
        trainer_state: Option<&Value>,
    ) -> Result<SavedCheckpoint> {
        let mut pending = self.begin(global_step)?;
        for (role, writer) in writers {
            pending.write_role(role, writer)?;
        }
        if let Some(state) = data_state {
            pending.write_json(DATA_STATE_FILE, state)?;
        }
        if let Some(state) = trainer_state {
            pending.write_json(TRAINER_STATE_FILE, state)?;
        }
        pending.commit()
    }

    /// Start saving `global_step` into a fresh temp folder `.global_step_N.tmp-<tag>` beside the final one,
    /// after removing leftovers of earlier crashed saves.
    pub fn begin(&self, global_step: u64) -> Result<PendingCheckpoint<'_>> {
        fs::create_dir_all(&self.root).map_err(io("create checkpoint root", &self.root))?;
        self.clean_leftovers()?;
        let dir = self.root.join(temp_dir_name(global_step, &self.tag));
        remove_tree(&dir)?;
        fs::create_dir(&dir).map_err(io("create", &dir))?;
        Ok(PendingCheckpoint {
            manager: self,
            step: global_step,
            dir,
            written: BTreeSet::new(),
            discarded: None,
            committed: false,
        })
    }

    /// Remove temp and set-aside folders (and tracker temp files) left by saves that never finished. Those tagged
    /// with the pid of another live process are left alone: that process may still be saving.
    pub fn clean_leftovers(&self) -> Result<Vec<PathBuf>> {
        let mut removed = Vec::new();
        let entries = match fs::read_dir(&self.root) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
            Err(e) => return Err(io("list", &self.root)(e)),
        };
        for entry in entries {
            let entry = entry.map_err(io("list", &self.root))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(tag) = parse_leftover_tag(&name) else {
                continue;
            };
            if tag != self.tag && pid_is_alive(tag) {
                continue;
            }
            let path = entry.path();
            remove_tree(&path)?;
            removed.push(path);
        }
        Ok(removed)
    }

    /// Complete step folders under the root, by step ascending.
    pub fn list_steps(&self) -> Result<Vec<(u64, PathBuf)>> {
        let entries = match fs::read_dir(&self.root) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io("list", &self.root)(e)),
        };
        let mut steps = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io("list", &self.root))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(step) = parse_step_dir_name(&name) {
                if entry.path().is_dir() {
                    steps.push((step, entry.path()));
                }
            }
        }
        steps.sort();
        Ok(steps)
    }

    /// Apply the keep policy after `current` was committed. Only folders of earlier steps are touched (folders of
    /// later steps belong to a timeline abandoned by `resume_path` and are left for the user). Like verl, each
    /// role's subfolder is pruned on its own; a step folder left with no role subfolder is removed whole, since
    /// resume could not use it.
    fn prune(&self, current: u64) -> Result<Vec<PathBuf>> {
        let steps: Vec<(u64, PathBuf)> = self
            .list_steps()?
            .into_iter()
            .filter(|(s, _)| *s <= current)
            .collect();
        let mut pruned = Vec::new();
        let mut emptied = BTreeSet::new();
        for role in Role::ALL {
            let Some(keep) = self.keep.for_role(role) else {
                continue;
            };
            let holders: Vec<&(u64, PathBuf)> = steps
                .iter()
                .filter(|(_, dir)| dir.join(role.dir_name()).is_dir())
                .collect();
            let excess = holders.len().saturating_sub(keep);
            for (step, dir) in holders.into_iter().take(excess) {
                if *step == current {
                    continue;
                }
                let sub = dir.join(role.dir_name());
                remove_tree(&sub)?;
                pruned.push(sub);
                emptied.insert(*step);
            }
        }
        for (step, dir) in &steps {
            let has_role = Role::ALL.iter().any(|r| dir.join(r.dir_name()).is_dir());
            if emptied.contains(step) && !has_role {
                remove_tree(dir)?;
                pruned.retain(|p| !p.starts_with(dir));
                pruned.push(dir.clone());
            }
        }
        if !pruned.is_empty() {
            fsync_dir(&self.root)?;
        }
        Ok(pruned)
    }
}

/// A step being saved into its temp folder. Dropping it without [`commit`](Self::commit) removes the folder.
#[derive(Debug)]
pub struct PendingCheckpoint<'m> {
    manager: &'m CheckpointManager,
    step: u64,
    dir: PathBuf,
    written: BTreeSet<String>,
    discarded: Option<String>,
    committed: bool,
}

impl PendingCheckpoint<'_> {
    /// The step being saved.
    pub fn global_step(&self) -> u64 {
        self.step
    }

    /// The temp folder everything is written into.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where `role`'s files go inside the temp folder.
    pub fn role_dir(&self, role: Role) -> PathBuf {
        self.dir.join(role.dir_name())
    }

    /// Create `role/` and let `writer` fill it. A writer error or panic discards the pending checkpoint: its
    /// folder is removed at once and a later `commit` fails.
    pub fn write_role<F>(&mut self, role: Role, writer: F) -> Result<()>
    where
        F: FnOnce(&Path) -> Result<(), WriterError>,
    {
        self.check_usable()?;
        self.claim(role.dir_name())?;
        let dir = self.role_dir(role);
        // Other ranks of a job may have created it already, to write their shards beside ours.
        fs::create_dir_all(&dir).map_err(io("create", &dir))?;
        let outcome = catch_unwind(AssertUnwindSafe(|| writer(&dir)));
        let err = match outcome {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(source)) => CheckpointError::WriterFailed {
                role: role.to_string(),
                step: self.step,
                dir,
                source,
            },
            Err(payload) => CheckpointError::WriterPanicked {
                role: role.to_string(),
                step: self.step,
                dir,
                message: panic_message(payload.as_ref()),
            },
        };
        self.discard(err.to_string());
        Err(err)
    }

    /// Write `value` as pretty JSON to `name` inside the temp folder (`data.json`, `trainer_state.json`, or a
    /// file of the caller's own).
    pub fn write_json(&mut self, name: &str, value: &Value) -> Result<()> {
        self.check_usable()?;
        self.claim(name)?;
        let path = self.dir.join(name);
        let bytes = serde_json::to_vec_pretty(value).map_err(|source| CheckpointError::Json {
            path: path.clone(),
            what: "a serialisable state",
            source,
        })?;
        write_file_synced(&path, &bytes)
    }

    /// Publish the step: fsync everything under the temp folder, rename it to `global_step_N` (setting aside
    /// and then deleting an older folder of the same step), fsync the root, atomically point the tracker file
    /// at the step, then prune by the keep policy. A crash before the rename leaves only a temp folder that
    /// resume ignores; a crash after it but before the tracker update leaves the tracker on the previous
    /// complete step.
    pub fn commit(mut self) -> Result<SavedCheckpoint> {
        self.check_usable()?;
        let manager = self.manager;
        let root = manager.root.as_path();
        fsync_tree(&self.dir)?;
        let final_dir = manager.step_dir(self.step);
        let aside = root.join(aside_dir_name(self.step, &manager.tag));
        let had_old = final_dir.exists();
        if had_old {
            remove_tree(&aside)?;
            fs::rename(&final_dir, &aside).map_err(io("set aside the older", &final_dir))?;
        }
        fs::rename(&self.dir, &final_dir)
            .map_err(io("rename the finished checkpoint to", &final_dir))?;
        self.committed = true;
        fsync_dir(root)?;
        if had_old {
            remove_tree(&aside)?;
        }
        write_atomic(
            &manager.tracker_path(),
            self.step.to_string().as_bytes(),
            &manager.tag,
        )?;
        let pruned = manager.prune(self.step)?;
        Ok(SavedCheckpoint {
            global_step: self.step,
            dir: final_dir,
            pruned,
        })
    }

    fn check_usable(&self) -> Result<()> {
        match &self.discarded {
            Some(reason) => Err(CheckpointError::Discarded {
                step: self.step,
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    fn claim(&mut self, name: &str) -> Result<()> {
        if !self.written.insert(name.to_string()) {
            return Err(CheckpointError::DuplicateEntry {
                step: self.step,
                name: name.to_string(),
            });
        }
        Ok(())
    }

    fn discard(&mut self, reason: String) {
        let _ = remove_tree(&self.dir);
        self.discarded = Some(reason);
    }
}

impl Drop for PendingCheckpoint<'_> {
    fn drop(&mut self) {
        if !self.committed {
            let _ = remove_tree(&self.dir);
        }
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Only numeric tags can name a live process; `/proc` answers on Linux, elsewhere every tag counts as dead.
fn pid_is_alive(tag: &str) -> bool {
    match tag.parse::<u32>() {
        Ok(pid) => Path::new("/proc").join(pid.to_string()).exists(),
        Err(_) => false,
    }
}

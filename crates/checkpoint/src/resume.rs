//! Resuming: verl's `find_latest_ckpt_path` and `trainer.resume_mode`.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{io, CheckpointError, Result};
use crate::layout::{parse_step_dir_name, Role, DATA_STATE_FILE, TRAINER_STATE_FILE};
use crate::manager::CheckpointManager;

/// `trainer.resume_mode`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResumeMode {
    /// Resume from the step the tracker file names, else start fresh.
    Auto,
    /// Always start fresh.
    Disable,
    /// Resume from `trainer.resume_from_path`, which must be a `global_step_N` folder.
    ResumePath(PathBuf),
}

impl ResumeMode {
    /// Read verl's `trainer.resume_mode` and `trainer.resume_from_path`. A relative path is taken from the
    /// current directory, as verl does.
    pub fn from_verl(resume_mode: &str, resume_from_path: Option<&str>) -> Result<Self> {
        match resume_mode {
            "auto" => Ok(ResumeMode::Auto),
            "disable" => Ok(ResumeMode::Disable),
            "resume_path" => match resume_from_path {
                Some(p) if !p.is_empty() => Ok(ResumeMode::ResumePath(PathBuf::from(p))),
                _ => Err(CheckpointError::ResumePathUnset),
            },
            other => Err(CheckpointError::UnknownResumeMode {
                found: other.to_string(),
            }),
        }
    }
}

/// What the tracker file says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Latest {
    /// No tracker file: nothing was ever committed here.
    NoTracker,
    /// The tracker names a step whose folder is gone (deleted by hand).
    Missing {
        /// The step the tracker names.
        global_step: u64,
        /// The folder that does not exist.
        dir: PathBuf,
    },
    /// The tracker names an existing step folder.
    Found {
        /// The step the tracker names.
        global_step: u64,
        /// Its folder.
        dir: PathBuf,
    },
}

/// A checkpoint to restore, with its state files already read.
#[derive(Debug, Clone, PartialEq)]
pub struct ResumePoint {
    /// The step to continue after (verl sets `global_steps` to it).
    pub global_step: u64,
    /// The `global_step_N` folder.
    pub dir: PathBuf,
    /// `data.json`, when the step has one (verl warns and restarts the dataloader when it has none).
    pub data_state: Option<Value>,
    /// `trainer_state.json`, when the step has one.
    pub trainer_state: Option<Value>,
}

impl ResumePoint {
    /// `role`'s folder, if this step still has it.
    pub fn role_dir(&self, role: Role) -> Option<PathBuf> {
        let dir = self.dir.join(role.dir_name());
        dir.is_dir().then_some(dir)
    }

    /// `role`'s folder, or an error naming the step folder when it was pruned or never saved.
    pub fn require_role(&self, role: Role) -> Result<PathBuf> {
        self.role_dir(role)
            .ok_or_else(|| CheckpointError::MissingRole {
                role: role.to_string(),
                dir: self.dir.clone(),
            })
    }
}

/// The outcome of applying `trainer.resume_mode`.
#[derive(Debug, Clone, PartialEq)]
pub enum ResumeDecision {
    /// Train from step 0. `note` says why when a checkpoint was expected but unusable, for the host to print.
    Fresh {
        /// Why no checkpoint was used, when that deserves a warning.
        note: Option<String>,
    },
    /// Restore this checkpoint.
    Resume(ResumePoint),
}

impl CheckpointManager {
    /// verl's `find_latest_ckpt_path`: only the tracker file decides; step folders it does not name (newer
    /// ones from a crash before the tracker update, temp folders) are never picked.
    pub fn find_latest(&self) -> Result<Latest> {
        let tracker = self.tracker_path();
        let text = match fs::read_to_string(&tracker) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Latest::NoTracker),
            Err(e) => return Err(io("read", &tracker)(e)),
        };
        let global_step: u64 = text
            .trim()
            .parse()
            .map_err(|_| CheckpointError::BadTracker {
                path: tracker.clone(),
                found: text.clone(),
            })?;
        let dir = self.step_dir(global_step);
        if dir.is_dir() {
            Ok(Latest::Found { global_step, dir })
        } else {
            Ok(Latest::Missing { global_step, dir })
        }
    }

    /// Apply `trainer.resume_mode`. A tracker naming a missing folder starts fresh as in verl (whose
    /// `find_latest_ckpt_path` returns `None` then), with a note the host should print; `resume_path` to
    /// anything but an existing `global_step_N` folder is an error.
    pub fn resolve_resume(&self, mode: &ResumeMode) -> Result<ResumeDecision> {
        match mode {
            ResumeMode::Disable => Ok(ResumeDecision::Fresh { note: None }),
            ResumeMode::Auto => match self.find_latest()? {
                Latest::NoTracker => Ok(ResumeDecision::Fresh { note: None }),
                Latest::Missing { global_step, dir } => Ok(ResumeDecision::Fresh {
                    note: Some(format!(
                        "`{}` names global_step_{global_step}, but `{}` does not exist; training from scratch",
                        self.tracker_path().display(),
                        dir.display()
                    )),
                }),
                Latest::Found { global_step, dir } => Ok(ResumeDecision::Resume(load_point(global_step, dir)?)),
            },
            ResumeMode::ResumePath(path) => {
                let path = if path.is_absolute() {
                    path.clone()
                } else {
                    std::env::current_dir()
                        .map_err(io("read the current directory for", path))?
                        .join(path)
                };
                let global_step = validate_step_dir(&path)?;
                Ok(ResumeDecision::Resume(load_point(global_step, path)?))
            }
        }
    }
}

fn validate_step_dir(path: &Path) -> Result<u64> {
    let invalid = |found: String| CheckpointError::ResumePathInvalid {
        path: path.to_path_buf(),
        found,
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let step = parse_step_dir_name(&name).ok_or_else(|| {
        invalid(format!(
            "a final path component `{name}` that is not `global_step_N`"
        ))
    })?;
    match fs::metadata(path) {
        Ok(m) if m.is_dir() => Ok(step),
        Ok(_) => Err(invalid("a file, not a directory".to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(invalid("nothing there".to_string()))
        }
        Err(e) => Err(io("stat", path)(e)),
    }
}

fn load_point(global_step: u64, dir: PathBuf) -> Result<ResumePoint> {
    let data_state = read_optional_json(&dir.join(DATA_STATE_FILE), "the dataloader state")?;
    let trainer_state = read_optional_json(&dir.join(TRAINER_STATE_FILE), "the trainer state")?;
    Ok(ResumePoint {
        global_step,
        dir,
        data_state,
        trainer_state,
    })
}

fn read_optional_json(path: &Path, what: &'static str) -> Result<Option<Value>> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io("read", path)(e)),
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|source| CheckpointError::Json {
            path: path.to_path_buf(),
            what,
            source,
        })
}

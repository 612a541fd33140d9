//! `verl-checkpoint`: verl's checkpoint layout under `trainer.default_local_dir` and its resume rules
//! (`ray_trainer.py` `_save_checkpoint`/`_load_checkpoint`, `checkpoint_manager.py` `find_latest_ckpt_path`).
//!
//! It owns the folder protocol only: `global_step_N/{actor,critic}/` (filled by backends through callbacks),
//! `data.json`, `trainer_state.json`, `latest_checkpointed_iteration.txt`, atomic commit, leftover cleanup and
//! keep-N pruning. It must not know what a backend writes inside its role folder, and never links libtorch.
//!
//! Crash safety: a step is written into `.global_step_N.tmp-<pid>`, fsynced, renamed to `global_step_N`, and
//! only then is the tracker file replaced (write a temp file, rename). Resume trusts only the tracker, so a
//! crash at any point leaves resume on the last complete step; leftovers are removed by the next save.
//!
//! ```
//! use verl_checkpoint::{CheckpointManager, KeepPolicy, ResumeDecision, ResumeMode, Role, RoleWriter};
//!
//! let root = tempfile::tempdir().unwrap();
//! let ckpt = CheckpointManager::new(root.path(), KeepPolicy::from_verl(Some(2), None));
//! let actor: RoleWriter = Box::new(|dir| Ok(std::fs::write(dir.join("model.bin"), b"weights")?));
//! let data_state = serde_json::json!({"epoch": 0, "cursor": 64});
//! ckpt.save(5, vec![(Role::Actor, actor)], Some(&data_state), None)?;
//!
//! let ResumeDecision::Resume(point) = ckpt.resolve_resume(&ResumeMode::from_verl("auto", None)?)? else {
//!     panic!("expected a checkpoint");
//! };
//! assert_eq!(point.global_step, 5);
//! assert_eq!(point.data_state, Some(data_state));
//! assert!(point.require_role(Role::Actor)?.join("model.bin").is_file());
//! # Ok::<(), verl_checkpoint::CheckpointError>(())
//! ```

#![warn(missing_docs)]

mod error;
mod fsutil;
mod layout;
mod manager;
mod resume;

pub use error::{CheckpointError, Result, WriterError};
pub use layout::{
    parse_step_dir_name, step_dir_name, Role, DATA_STATE_FILE, TRACKER_FILE, TRAINER_STATE_FILE,
};
pub use manager::{CheckpointManager, KeepPolicy, PendingCheckpoint, RoleWriter, SavedCheckpoint};
pub use resume::{Latest, ResumeDecision, ResumeMode, ResumePoint};

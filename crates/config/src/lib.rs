//! `verl-config` owns verl's configuration: the schema with verl's key names and defaults
//! (`defaults.yaml`), loading job YAML with Hydra-style overrides and OmegaConf interpolation,
//! precise errors (file:line:column, dotted keys, suggestions), and the batch-size arithmetic
//! that must hold before a run starts. It must not load plugins, touch devices or read data:
//! it turns text into a checked [`Config`] and numbers into a [`BatchPlan`], nothing more.
//!
//! ```no_run
//! use verl_config::{validate_batches, Config, Layout};
//! let cfg = Config::load("job.yaml", &["actor_rollout_ref.actor.optim.lr=1e-6"])?;
//! let plan = validate_batches(&cfg, Layout::from_config(&cfg)?)?;
//! println!("{} optimizer steps per step", plan.actor.optimizer_steps_per_step);
//! let actor_section = cfg.section_yaml("actor_rollout_ref")?;
//! # Ok::<(), verl_config::ConfigError>(())
//! ```

mod aliases;
mod batch;
mod compose;
mod defaults;
mod error;
mod interp;
mod keys;
mod load;
mod multi_turn;
mod overrides;
mod rule;
mod rules;
mod schema;
pub mod surface;
mod tree;
mod value;

pub use aliases::{canonical, ALIASES};
pub use batch::{validate_batches, BatchPlan, ForwardPlan, Layout, UpdatePlan, ValidationPlan};
pub use compose::engine_of_config_name;
pub use defaults::defaults_tree;
pub use error::{ConfigError, Result, SetKey};
pub use load::ADV_ESTIMATORS;
pub use multi_turn::MultiTurn;
pub use overrides::{Override, OverrideKind};
pub use rules::IMPLEMENTED_ESTIMATORS;
pub use schema::*;
pub use value::parse_value;

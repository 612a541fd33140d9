//! Dev-only helpers shared by the workspace's tests (never a dependency of a shipped crate):
//!
//! - [`shared`]: the shared reference data beside the checkout (`../shared`), skipped when absent
//!   unless `VERL_REQUIRE_SHARED=1` (CI), which makes its absence a failure;
//! - [`rng::Lcg`]: the seeded LCG the tests draw their data from;
//! - [`json::merge`]: patching a test config;
//! - [`cuda`] (feature `torch`): the device of the `#[ignore = "needs CUDA"]` tests, a clear
//!   failure where there is none;
//! - [`model`] (feature `nn`): tiny random qwen2 model folders.
//! - [`tiny`] (feature `nn`): one tiny random qwen2 model in memory, and saved as an HF folder.
//! - [`ranks`] (feature `ranks`): a multi-rank job's ranks as threads of the test.

pub mod json;
pub mod rng;
pub mod shared;

#[cfg(feature = "torch")]
pub mod cuda;
#[cfg(feature = "nn")]
pub mod model;
#[cfg(feature = "ranks")]
pub mod ranks;
#[cfg(feature = "nn")]
pub mod tiny;

pub use json::merge;
pub use rng::Lcg;
pub use shared::{shared_dir, shared_path};

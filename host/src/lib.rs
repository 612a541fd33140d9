//! verl-host: the `verl` command's library — plugin loading (with libtorch preloading), the
//! environment doctor, and the command implementations. It must never link libtorch: tensors
//! live in plugins, the host sees token ids, masks and per-token floats in `Batch`es.

pub mod checks;
pub mod commands;
pub mod dist;
pub mod isolated_reward;
pub mod launch;
pub mod loader;
pub mod models;
pub mod paths;
pub mod python_reward;
pub mod tools;
pub mod torchlib;
pub mod trainer;

pub use loader::{LoadError, LoadedPlugin, Loader};

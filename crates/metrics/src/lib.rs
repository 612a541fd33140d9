//! `verl-metrics`: verl's training metrics as users know them — the names and arithmetic of `metric_utils.py`
//! (`critic/score/mean`, `response_length/clip_ratio`, `timing_s/gen`, `perf/throughput`, `val-core/...`),
//! `reduce_metrics`, the loggers of `tracking.py` (console table, JSONL file, native TensorBoard event files, and
//! wandb/mlflow/swanlab through their own Python clients in a sidecar process), the validation samples verl logs
//! to them (`trainer.log_val_generations`) and `verl plot` charts of a finished run.
//!
//! It computes on plain Rust slices and writes files only through the sinks and plots it is asked for; it must
//! not know tensors, plugins or the training loop, and never links libtorch or Python (the Python clients run
//! in child processes fed over a pipe).
//!
//! ```
//! use verl_metrics::{compute_data_metrics, StepData};
//!
//! // Two responses of width 3; the second is one token long.
//! let mask = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0];
//! let data = StepData {
//!     max_response_length: 3,
//!     max_prompt_length: 8,
//!     sequence_scores: &[1.0, 0.0],
//!     token_level_rewards: &[0.0, 0.0, 1.0, 0.0, 0.0, 0.0],
//!     advantages: &[0.5, 0.5, 0.5, -0.5, 0.0, 0.0],
//!     returns: &[0.5, 0.5, 0.5, -0.5, 0.0, 0.0],
//!     values: None,
//!     response_mask: &mask,
//!     prompt_lengths: &[8, 5],
//!     response_lengths: &[3, 1],
//!     num_turns: None,
//!     tool_call_counts: None,
//! };
//! let metrics = compute_data_metrics(&data)?;
//! let get = |k: &str| metrics.iter().find(|(n, _)| n == k).unwrap().1;
//! assert_eq!(get("critic/score/mean"), 0.5);
//! assert_eq!(get("response_length/clip_ratio"), 0.5);
//! assert_eq!(get("prompt_length/clip_ratio"), 0.5);
//! # Ok::<(), verl_metrics::MetricsError>(())
//! ```

#![warn(missing_docs)]

mod compute;
mod error;
mod generations;
mod logger;
pub mod numpy_random;
pub mod plot;
mod sink;
pub mod tfevents;
mod tracking;
mod validation;

pub use compute::{
    compute_data_metrics, compute_throughput_metrics, compute_timing_metrics, reduce_metrics,
    MetricLists, Metrics, StepData, StepSummary, Timings, TokenCounts,
};
pub use error::{MetricsError, Result};
pub use generations::{
    select_val_generations, ValGeneration, VAL_GENERATIONS_KEY, VAL_GENERATIONS_SEED,
};
pub use logger::{
    check_loggers, default_columns, jsonl_line, Column, ConsoleSink, JsonlSink, LoggerOptions,
    MetricsLogger, TensorboardSink,
};
pub use plot::{plot_run, RunHistory};
pub use sink::Sink;
pub use tracking::{check_tracking, TrackingOptions, TrackingSink, SIDECAR_LOGGERS};
pub use validation::{
    process_validation_metrics, validation_metrics, InfoColumn, ValidationTable, BOOTSTRAP_SEED,
};

//! The trait every metrics destination implements: the logger's own sinks and the tracking
//! sidecars ([`crate::tracking`]).

use crate::error::Result;
use crate::generations::ValGeneration;

/// A destination for per-step metrics.
pub trait Sink: Send {
    /// verl's backend name (`console`, `file`, `tensorboard`, `wandb`, ...) or the caller's own.
    fn name(&self) -> &str;
    /// Record `metrics` at `step`; durable (flushed) before returning, except for the Python-client loggers,
    /// which are durable after `finish`.
    fn log(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()>;
    /// Record the validation samples of `step` (`trainer.log_val_generations`), as verl's backend of the same
    /// name does; backends verl logs none to (console, file) keep the default, which does nothing.
    fn log_generations(&mut self, step: u64, samples: &[ValGeneration]) -> Result<()> {
        let _ = (step, samples);
        Ok(())
    }
    /// Flush and close what is open.
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

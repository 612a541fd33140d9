//! Where a model's full (unsplit) parameter values come from: a checkpoint, or tensors in memory.

use tch::Tensor;
use verl_nn::Checkpoint;

use crate::error::Result;

/// Where full (unsplit) parameter values come from when a model is built or reloaded.
pub trait FullSource {
    /// The full tensor `name`, or `None` when the source lacks it.
    fn full(&mut self, name: &str) -> Result<Option<Tensor>>;
}

impl FullSource for Checkpoint {
    fn full(&mut self, name: &str) -> Result<Option<Tensor>> {
        if !self.contains(name) {
            return Ok(None);
        }
        Ok(Some(self.tensor(name)?))
    }
}

impl FullSource for std::collections::HashMap<String, Tensor> {
    fn full(&mut self, name: &str) -> Result<Option<Tensor>> {
        Ok(self.get(name).map(|t| t.shallow_clone()))
    }
}

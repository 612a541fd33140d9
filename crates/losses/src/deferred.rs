//! Scalar metrics left on the device until the caller wants them: a loss's metrics as 0-d
//! tensors, fetched with one device-to-host copy for as many of them (and as many micro-batches)
//! as the caller gathers. Fetching each with `double_value` would make the host wait for the
//! device once per metric, in the middle of every micro-batch.

use std::collections::BTreeMap;

use tch::{Device, Kind, Tensor};

use crate::error::{Result, TorchContext};

/// Named scalar metrics, some still device tensors (in push order), some host values.
#[derive(Debug, Default)]
pub struct DeferredMetrics {
    device: Vec<(String, Tensor)>,
    host: Vec<(String, f64)>,
}

impl DeferredMetrics {
    /// A scalar (any shape of one element) kept as a detached fp64 0-d tensor.
    pub fn push(&mut self, name: impl Into<String>, value: &Tensor) -> Result<()> {
        const OP: &str = "DeferredMetrics::push";
        let v = value
            .f_detach()
            .op(OP)?
            .f_reshape(Vec::<i64>::new())
            .op(OP)?
            .f_to_kind(Kind::Double)
            .op(OP)?;
        self.device.push((name.into(), v));
        Ok(())
    }

    /// A value already on the host.
    pub fn push_host(&mut self, name: impl Into<String>, value: f64) {
        self.host.push((name.into(), value));
    }

    /// The device values in push order (for a caller fetching several sets at once with
    /// [`fetch_scalars`], then [`DeferredMetrics::with_values`]).
    pub fn device_values(&self) -> impl Iterator<Item = &Tensor> {
        self.device.iter().map(|(_, t)| t)
    }

    /// How many values [`DeferredMetrics::with_values`] takes.
    pub fn device_len(&self) -> usize {
        self.device.len()
    }

    /// The metrics, given the fetched device values in push order (`values.len()` must be
    /// [`DeferredMetrics::device_len`]; extra values are ignored, missing ones leave names out).
    pub fn with_values(self, values: &[f64]) -> BTreeMap<String, f64> {
        let mut out: BTreeMap<String, f64> = self.host.into_iter().collect();
        for ((name, _), v) in self.device.into_iter().zip(values) {
            out.insert(name, *v);
        }
        out
    }

    /// Fetches the device values (one copy) and returns every metric.
    pub fn resolve(self) -> Result<BTreeMap<String, f64>> {
        let values = fetch_scalars(&self.device_values().collect::<Vec<_>>())?;
        Ok(self.with_values(&values))
    }
}

/// The values of 0-d (or one-element) tensors as f64, with one device-to-host copy per device
/// they live on (the host waits once instead of once per tensor).
pub fn fetch_scalars(values: &[&Tensor]) -> Result<Vec<f64>> {
    const OP: &str = "fetch_scalars";
    if values.is_empty() {
        return Ok(Vec::new());
    }
    let flat = values
        .iter()
        .map(|t| t.f_detach()?.f_reshape([1])?.f_to_kind(Kind::Double))
        .collect::<std::result::Result<Vec<_>, _>>()
        .op(OP)?;
    // One cat per device (they normally share one).
    let mut out = vec![0.0; values.len()];
    let mut devices: Vec<Device> = Vec::new();
    for t in &flat {
        if !devices.contains(&t.device()) {
            devices.push(t.device());
        }
    }
    for d in devices {
        let idx: Vec<usize> = (0..flat.len()).filter(|&i| flat[i].device() == d).collect();
        let parts: Vec<&Tensor> = idx.iter().map(|&i| &flat[i]).collect();
        let host = Tensor::f_cat(&parts, 0)
            .op(OP)?
            .f_to_device(Device::Cpu)
            .op(OP)?;
        let v = Vec::<f64>::try_from(&host).op(OP)?;
        for (i, x) in idx.into_iter().zip(v) {
            out[i] = x;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fetched_values_keep_their_names_and_precision() {
        let mut m = DeferredMetrics::default();
        let x = Tensor::from_slice(&[0.1f32, 0.2, 0.7]);
        m.push("a/sum", &x.sum(Kind::Float)).unwrap();
        m.push("a/one", &Tensor::from_slice(&[1.5f64])).unwrap();
        m.push_host("a/coef", 0.25);
        assert_eq!(m.device_len(), 2);
        let want_sum = x.sum(Kind::Float).double_value(&[]);
        let got = m.resolve().unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(got["a/sum"], want_sum, "fp32 widened exactly");
        assert_eq!(got["a/one"], 1.5);
        assert_eq!(got["a/coef"], 0.25);
        assert!(fetch_scalars(&[]).unwrap().is_empty());
        let e = fetch_scalars(&[&Tensor::zeros([2], (Kind::Float, Device::Cpu))]);
        assert!(e.is_err(), "a two-element tensor is not a scalar");
    }
}

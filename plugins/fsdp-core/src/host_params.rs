//! A frozen model's parameters kept in host memory between calls
//! (`actor_rollout_ref.ref.fsdp_config.param_offload`, verl's offloaded reference policy).
//!
//! The parameters are copied once into one flat host buffer per dtype (page-locked when the
//! model runs on a GPU: one pinned block per dtype, so libtorch's pinned allocator rounds the
//! total up once rather than every tensor); every parameter then views its slice of the buffer.
//! [`HostParams::load`] gives each parameter a device copy of its slice (`Tensor::set_data`, so the
//! model's layers, which share the parameter tensors, compute on the device copies), and
//! [`HostParams::unload`] points the parameters back at the host views and drops the device
//! copies. The weights never change, so nothing is copied back.

use tch::{Device, Kind, Tensor};
use verl_nn::Transformer;

use crate::error::{Result, TorchContext};

pub struct HostParams {
    /// Per parameter (in `named_parameters` order), its view of the host buffer.
    host: Vec<Tensor>,
    device: Device,
    on_device: bool,
}

impl HostParams {
    /// Moves `model`'s parameters (on `device`) into host memory; the model stays usable only
    /// between [`HostParams::load`] and [`HostParams::unload`] on a GPU (on the CPU it computes
    /// on the host views as well).
    pub fn offload(model: &Transformer, device: Device) -> Result<HostParams> {
        let params = model.named_parameters();
        let mut host: Vec<Option<Tensor>> = (0..params.len()).map(|_| None).collect();
        let mut kinds: Vec<Kind> = Vec::new();
        for (_, p) in params {
            if !kinds.contains(&p.kind()) {
                kinds.push(p.kind());
            }
        }
        tch::no_grad(|| -> Result<()> {
            for kind in kinds {
                let members: Vec<usize> = (0..params.len())
                    .filter(|&i| params[i].1.kind() == kind)
                    .collect();
                let total: i64 = members.iter().map(|&i| params[i].1.numel() as i64).sum();
                let flat = Tensor::f_empty([total], (kind, Device::Cpu)).ctx("host parameters")?;
                let mut offset = 0;
                for &i in &members {
                    let p = &params[i].1;
                    let n = p.numel() as i64;
                    flat.f_narrow(0, offset, n)
                        .and_then(|s| s.f_view(p.size().as_slice()))
                        .and_then(|mut s| s.f_copy_(p))
                        .ctx("parameters to host")?;
                    offset += n;
                }
                // Page-locked for the uploads of every call (fallback: ordinary memory, slower
                // uploads, same values).
                let flat = if device.is_cuda() {
                    flat.f_internal_pin_memory(device).unwrap_or(flat)
                } else {
                    flat
                };
                let mut offset = 0;
                for &i in &members {
                    let p = &params[i].1;
                    let n = p.numel() as i64;
                    host[i] = Some(
                        flat.f_narrow(0, offset, n)
                            .and_then(|s| s.f_view(p.size().as_slice()))
                            .ctx("host parameter view")?,
                    );
                    offset += n;
                }
            }
            Ok(())
        })?;
        let mut s = HostParams {
            host: host
                .into_iter()
                .map(|t| t.expect("every parameter has a kind"))
                .collect(),
            device,
            on_device: true,
        };
        s.unload(model)?;
        Ok(s)
    }

    /// Whether the parameters are on the device now.
    pub fn on_device(&self) -> bool {
        self.on_device
    }

    /// Bytes of the host buffers.
    pub fn host_bytes(&self) -> usize {
        self.host.iter().map(crate::shard::bytes).sum()
    }

    /// Gives every parameter a device copy of its host slice (a copy even on the CPU).
    pub fn load(&mut self, model: &Transformer) -> Result<()> {
        if self.on_device {
            return Ok(());
        }
        tch::no_grad(|| -> Result<()> {
            for ((_, p), h) in model.named_parameters().iter().zip(&self.host) {
                let d = h
                    .f_to_device_(self.device, h.kind(), true, true)
                    .ctx("reference parameters to the device")?;
                p.shallow_clone()
                    .f_set_data(&d)
                    .ctx("reference parameters to the device")?;
            }
            Ok(())
        })?;
        self.on_device = true;
        Ok(())
    }

    /// Points every parameter back at its host slice; the device copies are freed.
    pub fn unload(&mut self, model: &Transformer) -> Result<()> {
        if !self.on_device {
            return Ok(());
        }
        tch::no_grad(|| -> Result<()> {
            for ((_, p), h) in model.named_parameters().iter().zip(&self.host) {
                p.shallow_clone()
                    .f_set_data(h)
                    .ctx("reference parameters to host")?;
            }
            Ok(())
        })?;
        self.on_device = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use verl_nn::{ModelConfig, ModelOptions};

    fn tiny() -> Transformer {
        tch::manual_seed(3);
        let cfg = ModelConfig::from_value(
            serde_json::json!({
                "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                "vocab_size": 40, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
                "tie_word_embeddings": false, "initializer_range": 0.2,
            }),
            "inline/config.json",
        )
        .unwrap();
        Transformer::new(
            cfg,
            &ModelOptions {
                dtype: Kind::BFloat16,
                ..ModelOptions::default()
            },
        )
        .unwrap()
    }

    fn logits(m: &Transformer) -> Tensor {
        let ids = Tensor::from_slice(&[3i64, 9, 4, 17, 2, 30]).reshape([1, 6]);
        tch::no_grad(|| m.forward(&ids, None, None, None).unwrap())
    }

    fn ptrs(m: &Transformer) -> Vec<usize> {
        m.named_parameters()
            .iter()
            .map(|(_, p)| p.data_ptr() as usize)
            .collect()
    }

    #[test]
    fn offloaded_parameters_compute_the_same_and_swap_storage() {
        let m = tiny();
        let want = logits(&m);
        let before: Vec<Tensor> = m.named_parameters().iter().map(|(_, p)| p.copy()).collect();
        let mut hp = HostParams::offload(&m, Device::Cpu).unwrap();
        assert!(!hp.on_device());
        let bytes: usize = before.iter().map(crate::shard::bytes).sum();
        assert_eq!(hp.host_bytes(), bytes);
        // Unloaded: the parameters view one flat buffer, in order.
        let host = ptrs(&m);
        let mut expect = host[0];
        for ((_, p), &ptr) in m.named_parameters().iter().zip(&host) {
            assert_eq!(
                ptr, expect,
                "parameters should be consecutive slices of one buffer"
            );
            expect += crate::shard::bytes(p);
        }
        for ((_, p), b) in m.named_parameters().iter().zip(&before) {
            assert!(p.equal(b));
        }
        // Loaded: every parameter has its own copy (not the host slice), same values.
        hp.load(&m).unwrap();
        assert!(hp.on_device());
        let loaded = ptrs(&m);
        assert!(loaded.iter().zip(&host).all(|(a, b)| a != b));
        assert!(logits(&m).equal(&want));
        hp.load(&m).unwrap();
        assert_eq!(ptrs(&m), loaded, "a second load is a no-op");
        hp.unload(&m).unwrap();
        assert_eq!(ptrs(&m), host);
        assert!(logits(&m).equal(&want));
    }
}

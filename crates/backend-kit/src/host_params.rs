//! A frozen model's parameters kept in host memory between calls
//! (`actor_rollout_ref.ref.fsdp_config.param_offload`, verl's offloaded reference policy).
//!
//! The parameters are copied once into one flat host buffer per dtype ([`host_buffers`], also
//! used for one rank's offloaded training state); every parameter then views its slice of it.
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
        let params: Vec<&Tensor> = model.named_parameters().iter().map(|(_, p)| p).collect();
        let host = host_buffers(&params, None, Fill::Copy, device)?;
        let mut s = HostParams {
            host,
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
        self.host.iter().map(bytes).sum()
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

/// What [`host_buffers`] puts into the host tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// The values of the given tensors (cast to the requested dtype).
    Copy,
    Zeros,
}

/// Host tensors shaped like `tensors`, of dtype `kind` (each tensor's own when `None`), holding
/// their values or zeros: views of one flat buffer per dtype, page-locked when `device` is a GPU
/// (libtorch's pinned allocator rounds each block up to a power of two, so one block per dtype
/// rounds once instead of per tensor). Should pinning fail the buffer stays in ordinary memory:
/// the same values, slower copies.
pub fn host_buffers(
    tensors: &[&Tensor],
    kind: Option<Kind>,
    fill: Fill,
    device: Device,
) -> Result<Vec<Tensor>> {
    let kind_of = |t: &Tensor| kind.unwrap_or_else(|| t.kind());
    let mut kinds: Vec<Kind> = Vec::new();
    for t in tensors {
        if !kinds.contains(&kind_of(t)) {
            kinds.push(kind_of(t));
        }
    }
    let mut out: Vec<Option<Tensor>> = (0..tensors.len()).map(|_| None).collect();
    tch::no_grad(|| -> Result<()> {
        for k in kinds {
            let members: Vec<usize> = (0..tensors.len())
                .filter(|&i| kind_of(tensors[i]) == k)
                .collect();
            let total: i64 = members.iter().map(|&i| tensors[i].numel() as i64).sum();
            let views = |flat: &Tensor| -> Result<Vec<Tensor>> {
                let mut offset = 0;
                let mut v = Vec::with_capacity(members.len());
                for &i in &members {
                    let n = tensors[i].numel() as i64;
                    v.push(
                        flat.f_narrow(0, offset, n)
                            .and_then(|x| x.f_view(tensors[i].size().as_slice()))
                            .ctx("host buffer view")?,
                    );
                    offset += n;
                }
                Ok(v)
            };
            let flat = match fill {
                Fill::Zeros => Tensor::f_zeros([total], (k, Device::Cpu)),
                Fill::Copy => Tensor::f_empty([total], (k, Device::Cpu)),
            }
            .ctx("host buffer")?;
            if fill == Fill::Copy {
                for (view, &i) in views(&flat)?.iter().zip(&members) {
                    view.shallow_clone()
                        .f_copy_(tensors[i])
                        .ctx("copy to host")?;
                }
            }
            let flat = if device.is_cuda() {
                flat.f_internal_pin_memory(device).unwrap_or(flat)
            } else {
                flat
            };
            for (view, &i) in views(&flat)?.into_iter().zip(&members) {
                out[i] = Some(view);
            }
        }
        Ok(())
    })?;
    Ok(out
        .into_iter()
        .map(|t| t.expect("every tensor has a dtype"))
        .collect())
}

/// Bytes a tensor's elements take (0 for an undefined tensor).
pub fn bytes(t: &Tensor) -> usize {
    if !t.defined() {
        return 0;
    }
    t.numel() * t.kind().elt_size_in_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Transformer {
        verl_test_support::tiny::tiny_transformer(Kind::BFloat16, 3)
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
        let total: usize = before.iter().map(bytes).sum();
        assert_eq!(hp.host_bytes(), total);
        // Unloaded: the parameters view one flat buffer, in order.
        let host = ptrs(&m);
        let mut expect = host[0];
        for ((_, p), &ptr) in m.named_parameters().iter().zip(&host) {
            assert_eq!(
                ptr, expect,
                "parameters should be consecutive slices of one buffer"
            );
            expect += bytes(p);
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

    #[test]
    fn host_buffers_group_by_dtype_and_cast_or_zero() {
        let a = Tensor::arange(6, (Kind::BFloat16, Device::Cpu)).reshape([2, 3]);
        let b = Tensor::ones([4], (Kind::Float, Device::Cpu));
        let c = Tensor::arange(5, (Kind::BFloat16, Device::Cpu)) * 0.5;
        // Each tensor's own dtype: two buffers (bf16: a then c, fp32: b).
        let h = host_buffers(&[&a, &b, &c], None, Fill::Copy, Device::Cpu).unwrap();
        assert!(h[0].equal(&a) && h[1].equal(&b) && h[2].equal(&c));
        assert_eq!(
            h[2].data_ptr() as usize,
            h[0].data_ptr() as usize + 6 * 2,
            "a and c share one bf16 buffer"
        );
        // Copies, not aliases.
        assert_ne!(h[0].data_ptr(), a.data_ptr());
        // Cast to fp32: one buffer, exact widening.
        let f = host_buffers(&[&a, &b, &c], Some(Kind::Float), Fill::Copy, Device::Cpu).unwrap();
        for (x, y) in f.iter().zip([&a, &b, &c]) {
            assert_eq!(x.kind(), Kind::Float);
            assert!(x.equal(&y.to_kind(Kind::Float)));
        }
        assert_eq!(f[1].data_ptr() as usize, f[0].data_ptr() as usize + 6 * 4);
        assert_eq!(f[2].data_ptr() as usize, f[1].data_ptr() as usize + 4 * 4);
        let z = host_buffers(&[&a, &b], None, Fill::Zeros, Device::Cpu).unwrap();
        assert_eq!(z[0].size(), vec![2, 3]);
        assert_eq!(z[0].kind(), Kind::BFloat16);
        assert_eq!(z[1].abs().sum(Kind::Float).double_value(&[]), 0.0);
        assert_eq!(z[0].abs().sum(Kind::Float).double_value(&[]), 0.0);
    }
}

//! verl's Megatron-worker offloading: `*.megatron.param_offload`, `grad_offload` and
//! `optimizer_offload`.
//!
//! * `param_offload`: the model's (compute-dtype) parameters live in host memory between API calls;
//!   every call that computes with them (generate, log-probs / values, update, save, load, export)
//!   brings them to the device first and sends them back at its end. A generation copy built from
//!   them (the TP shard copy or the gathered TP=1 copy) is dropped at the end of the call.
//! * `grad_offload`: the fp32 gradient accumulators stay on the host between updates.
//! * `optimizer_offload`: the fp32 master weights and AdamW moments (this rank's shards with the
//!   distributed optimizer) stay on the host between updates, visiting the device for the update
//!   (and for checkpoint save / load).
//!
//! Moves replace a tensor's storage in place (`Tensor::set_data`), so every alias of it (the MoE
//! blocks share their parameters with the model) follows; host copies are pinned where libtorch
//! can pin them (a CUDA build on a GPU), pageable otherwise. On the CPU the device is the host and
//! every move is a no-op, but the same code runs. Moves are exact copies: results are
//! bit-identical with and without offloading.

use tch::{Device, Tensor};

use crate::error::{Result, TorchContext};
use crate::layout::MegatronSection;
use crate::tp::TpModel;

/// The device offloaded tensors live on.
pub const HOST: Device = Device::Cpu;

/// Which parts of a role's state are offloaded between calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Offload {
    pub params: bool,
    pub grads: bool,
    pub optimizer: bool,
}

impl Offload {
    pub fn of(sec: &MegatronSection) -> Offload {
        Offload {
            params: sec.param_offload,
            grads: sec.grad_offload,
            optimizer: sec.optimizer_offload,
        }
    }

    pub fn any(&self) -> bool {
        self.params || self.grads || self.optimizer
    }
}

/// What an API call needs on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// The parameters only (generate, log-probs, values, export).
    Params,
    /// Parameters, gradient buffers and optimizer state (update).
    Train,
    /// Parameters and optimizer state (checkpoint save / load).
    State,
}

impl Need {
    pub fn grads(self) -> bool {
        self == Need::Train
    }
    pub fn optimizer(self) -> bool {
        matches!(self, Need::Train | Need::State)
    }
}

/// Where a move sends tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Host,
    Device,
}

impl Place {
    /// The concrete device of this place for a role computing on `device`.
    pub fn device(self, device: Device) -> Device {
        match self {
            Place::Host => HOST,
            Place::Device => device,
        }
    }
}

/// A copy of `t` in host memory: pinned when `device` is an accelerator libtorch can pin for,
/// pageable otherwise (and `t` itself when it already is on the host).
pub fn host_copy(t: &Tensor, device: Device) -> Result<Tensor> {
    let t = t.f_detach().ctx("offload to host")?;
    if t.device() == HOST {
        return Ok(t);
    }
    let host = t.f_to_device(HOST).ctx("offload to host")?;
    if device.is_cuda() {
        if let Ok(pinned) = host.f_internal_pin_memory(device) {
            return Ok(pinned);
        }
    }
    Ok(host)
}

/// Moves `t`'s storage to `place` (for a role computing on `device`) in place: every alias of the
/// tensor sees the new storage; `requires_grad` is kept. Returns whether the data had to move.
pub fn move_tensor(t: &mut Tensor, place: Place, device: Device) -> Result<bool> {
    let to = place.device(device);
    let moved = t.device() != to;
    let new = match place {
        Place::Host => host_copy(t, device)?,
        Place::Device => t
            .f_detach()
            .and_then(|x| x.f_to_device(to))
            .ctx("load to device")?,
    };
    tch::no_grad(|| t.f_set_data(&new)).ctx("offload: set_data")?;
    Ok(moved)
}

/// [`move_tensor`] over `tensors` (labelled); returns the labels of the tensors visited, in order
/// (the bookkeeping the tests check).
pub fn move_all<'a>(
    tensors: impl IntoIterator<Item = (String, &'a mut Tensor)>,
    place: Place,
    device: Device,
) -> Result<Vec<String>> {
    let mut seen = Vec::new();
    for (label, t) in tensors {
        move_tensor(t, place, device)?;
        seen.push(label);
    }
    if place == Place::Host && matches!(device, Device::Cuda(_)) && !seen.is_empty() {
        // The freed device blocks go back to the driver, as verl's offload does with
        // torch.cuda.empty_cache(): otherwise the caching allocator keeps them.
        verl_torch_ext::cuda_empty_cache()?;
    }
    Ok(seen)
}

/// Moves the model's parameters (this rank's slices, compute dtype) to `place`
/// (`param_offload`); returns their names.
pub fn move_params(model: &mut TpModel, place: Place) -> Result<Vec<String>> {
    let device = model.device();
    move_all(
        model
            .params
            .iter_mut()
            .map(|p| (p.name.clone(), &mut p.local)),
        place,
        device,
    )
}

/// Runs `f` with what `offload` offloads of what a call needing `need` uses on the device:
/// `enter(Place::Device)` first, `enter(Place::Host)` afterwards, also when `f` failed (its error
/// wins).
pub fn on_device<S, T>(
    state: &mut S,
    offload: Offload,
    mut enter: impl FnMut(&mut S, Place) -> Result<()>,
    f: impl FnOnce(&mut S) -> Result<T>,
) -> Result<T> {
    if !offload.any() {
        return f(state);
    }
    enter(state, Place::Device)?;
    let r = f(state);
    let back = enter(state, Place::Host);
    let out = r?;
    back?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    #[test]
    fn move_keeps_values_aliases_and_requires_grad() {
        let mut t = Tensor::arange(6, (Kind::Float, Device::Cpu))
            .reshape([2, 3])
            .set_requires_grad(true);
        let alias = t.shallow_clone();
        let before = Vec::<f32>::try_from(t.detach().reshape([-1])).unwrap();
        for place in [Place::Host, Place::Device, Place::Host] {
            move_tensor(&mut t, place, Device::Cpu).unwrap();
            assert_eq!(t.device(), place.device(Device::Cpu));
            assert_eq!(alias.device(), t.device());
            assert!(t.requires_grad());
            assert_eq!(t.size(), vec![2, 3]);
            let now = Vec::<f32>::try_from(alias.detach().reshape([-1])).unwrap();
            assert_eq!(now, before);
        }
    }

    #[test]
    fn move_all_reports_every_tensor_and_puts_them_on_the_host() {
        let mut a = Tensor::zeros([3], (Kind::Float, Device::Cpu));
        let mut b = Tensor::ones([2, 2], (Kind::BFloat16, Device::Cpu));
        let seen = move_all(
            [("a".to_string(), &mut a), ("b".to_string(), &mut b)],
            Place::Host,
            Device::Cpu,
        )
        .unwrap();
        assert_eq!(seen, vec!["a", "b"]);
        assert_eq!(a.device(), HOST);
        assert_eq!(b.device(), HOST);
        assert_eq!(b.kind(), Kind::BFloat16);
    }

    #[test]
    fn host_copy_of_a_host_tensor_is_the_tensor() {
        let t = Tensor::ones([4], (Kind::Float, Device::Cpu));
        let h = host_copy(&t, Device::Cpu).unwrap();
        assert_eq!(h.device(), HOST);
        assert_eq!(h.data_ptr(), t.data_ptr());
    }

    #[test]
    fn flags_follow_the_section_and_needs() {
        let sec = MegatronSection {
            param_offload: true,
            optimizer_offload: true,
            ..MegatronSection::default()
        };
        let o = Offload::of(&sec);
        assert_eq!(
            o,
            Offload {
                params: true,
                grads: false,
                optimizer: true
            }
        );
        assert!(o.any());
        assert!(!Offload::default().any());
        assert!(Need::Train.grads() && Need::Train.optimizer());
        assert!(!Need::State.grads() && Need::State.optimizer());
        assert!(!Need::Params.grads() && !Need::Params.optimizer());
    }
}

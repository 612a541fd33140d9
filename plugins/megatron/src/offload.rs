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
//! blocks share their parameters with the model) follows. On a GPU every offloaded tensor has a
//! home in host memory ([`HostHomes`]) from its first move there: views of one page-locked buffer
//! per dtype, allocated once, exactly the size of what they hold (libtorch's pinned allocator
//! would round a block per tensor up to a power of two). Sending tensors to the host copies them
//! into their homes on a side stream and waits once for all of them; bringing one back copies the
//! home to a new device tensor, without waiting for the device. What the caller knows of the
//! values ([`Contents`]) saves copies: parameters a call only read go back without one, and
//! gradient buffers that are zero (checked) neither leave nor come back by copy. An update's
//! optimizer state comes over on a side stream ([`prefetch_all`]) joined before the step. On the CPU the device is the host and every move is a no-op (in the tests the homes are
//! used there too, a move to the "device" making a copy: see `homes_apply`). Moves are exact copies:
//! results are bit-identical with and without offloading.

use std::collections::{HashMap, HashSet};

use tch::{Device, Tensor};
use verl_backend_kit::host_params::{host_buffers, Fill};

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
    /// What a call needing this leaves in the parameters it brought over: generate, log-probs,
    /// values and export only read them.
    pub fn param_contents(self) -> Contents {
        if self == Need::Params {
            Contents::Unchanged
        } else {
            Contents::Changed
        }
    }

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

/// What a move may assume about the values of the tensors it moves (through [`HostHomes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Contents {
    /// Anything: a move to the host copies.
    #[default]
    Changed,
    /// Unchanged since they were brought from their homes (a call that only read them: generate,
    /// log-probs, values, export): a move to the host points them back at their homes, which
    /// already hold these values, without copying.
    Unchanged,
    /// Usually zeros (the gradient buffers, zeroed at the end of every update): a move to the
    /// host checks each tensor, and a zero one whose home is known to hold zeros is not copied;
    /// a move to the device then makes zeros there instead of copying them over.
    Zeros,
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

/// Host homes of a role's offloaded tensors, by label (see the module documentation).
#[derive(Default)]
pub struct HostHomes {
    homes: HashMap<String, Tensor>,
    /// Labels whose home is known to hold zeros (see [`Contents::Zeros`]).
    zero: HashSet<String>,
}

impl HostHomes {
    /// Bytes of host memory the homes hold.
    pub fn bytes(&self) -> usize {
        self.homes
            .values()
            .map(|t| t.numel() * t.kind().elt_size_in_bytes())
            .sum()
    }

    /// The home of the tensor labelled `label`, if it has one.
    pub fn get(&self, label: &str) -> Option<&Tensor> {
        self.homes.get(label)
    }
}

static HOMES_ON_CPU: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes moves on the CPU go through [`HostHomes`] too, for this process (every move then copies,
/// as on a GPU): what the offload tests check on a machine without one.
#[doc(hidden)]
pub fn use_host_homes_on_cpu() {
    HOMES_ON_CPU.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Whether moves go through [`HostHomes`]: on a GPU, and on the CPU in this crate's unit tests or
/// after [`use_host_homes_on_cpu`].
fn homes_apply(device: Device) -> bool {
    device.is_cuda() || cfg!(test) || HOMES_ON_CPU.load(std::sync::atomic::Ordering::Relaxed)
}

/// [`move_tensor`] over `tensors` (labelled), through `homes` on a GPU, assuming `contents` of
/// them; returns the labels of the tensors visited, in order (the bookkeeping the tests check).
pub fn move_all<'a>(
    tensors: impl IntoIterator<Item = (String, &'a mut Tensor)>,
    place: Place,
    device: Device,
    homes: &mut HostHomes,
    contents: Contents,
) -> Result<Vec<String>> {
    let mut list: Vec<(String, &'a mut Tensor)> = tensors.into_iter().collect();
    let seen: Vec<String> = list.iter().map(|(l, _)| l.clone()).collect();
    if !homes_apply(device) {
        for (_, t) in list.iter_mut() {
            move_tensor(t, place, device)?;
        }
    } else {
        match place {
            Place::Host => to_homes(&mut list, device, homes, contents)?,
            Place::Device => from_homes(&mut list, device, homes, None)?,
        }
    }
    if place == Place::Host && matches!(device, Device::Cuda(_)) && !seen.is_empty() {
        // The freed device blocks go back to the driver, as verl's offload does with
        // torch.cuda.empty_cache(): otherwise the caching allocator keeps them.
        verl_torch_ext::cuda_empty_cache()?;
    }
    Ok(seen)
}

/// Copies every tensor into its home (making the homes that are missing, or no longer fit, as
/// one batch of flat buffers holding their values) and points the tensor at it.
fn to_homes(
    list: &mut [(String, &mut Tensor)],
    device: Device,
    homes: &mut HostHomes,
    contents: Contents,
) -> Result<()> {
    let fits = |home: Option<&Tensor>, t: &Tensor| {
        home.is_some_and(|h| h.size() == t.size() && h.kind() == t.kind())
    };
    let missing: Vec<usize> = (0..list.len())
        .filter(|&i| !fits(homes.homes.get(&list[i].0), list[i].1))
        .collect();
    // Tensors not at home now; which of them are zeros (Contents::Zeros only).
    let away: Vec<bool> = list
        .iter()
        .map(|(label, t)| {
            homes
                .homes
                .get(label.as_str())
                .is_none_or(|h| h.data_ptr() != t.data_ptr())
        })
        .collect();
    let mut zero_now = vec![false; list.len()];
    if contents == Contents::Zeros {
        for (i, (_, t)) in list.iter().enumerate() {
            if away[i] {
                zero_now[i] = !t
                    .f_any()
                    .and_then(|x| x.f_is_nonzero())
                    .ctx("offload: zero check")?;
            }
        }
    }
    // Which of the tensors away from an existing home need no copy into it.
    let same: Vec<bool> = (0..list.len())
        .map(|i| {
            let label = list[i].0.as_str();
            away[i]
                && !missing.contains(&i)
                && match contents {
                    Contents::Changed => false,
                    Contents::Unchanged => true,
                    Contents::Zeros => zero_now[i] && homes.zero.contains(label),
                }
        })
        .collect();
    if !missing.is_empty() {
        let srcs: Vec<Tensor> = missing
            .iter()
            .map(|&i| list[i].1.f_detach())
            .collect::<std::result::Result<_, _>>()
            .ctx("offload to host")?;
        let refs: Vec<&Tensor> = srcs.iter().collect();
        let made = host_buffers(&refs, None, Fill::Copy, device)?;
        for (&i, h) in missing.iter().zip(made) {
            homes.homes.insert(list[i].0.clone(), h);
        }
    }
    // One wait for all the copies (on a side stream behind the work that wrote the tensors)
    // instead of one per tensor; the device memory is not reused before its copy has run.
    let mut copies = verl_torch_ext::SideCopies::new(device)?;
    copies.fence()?;
    tch::no_grad(|| -> Result<()> {
        for (i, (label, t)) in list.iter_mut().enumerate() {
            let home = &homes.homes[label.as_str()];
            if !missing.contains(&i) && !same[i] && t.data_ptr() != home.data_ptr() {
                copies.copy(home, &t.f_detach().ctx("offload to host")?)?;
            }
            t.f_set_data(home).ctx("offload: set_data")?;
        }
        Ok(())
    })?;
    copies.finish()?;
    // What the homes hold now: an unchanged tensor's home kept its values; a copied one holds
    // zeros exactly where the check found zeros.
    for (i, (label, _)) in list.iter().enumerate() {
        if away[i] && contents != Contents::Unchanged {
            if zero_now[i] {
                homes.zero.insert(label.clone());
            } else {
                homes.zero.remove(label.as_str());
            }
        }
    }
    Ok(())
}

/// Gives every tensor living in its home a device copy of it (a copy that does not wait for the
/// device, or zeros made on the device where the home is known to hold zeros); any other tensor
/// not on the device goes there as [`move_tensor`] moves it. With `side` the copies from the homes
/// run on its stream, which the caller joins before the tensors are used.
fn from_homes(
    list: &mut [(String, &mut Tensor)],
    device: Device,
    homes: &HostHomes,
    mut side: Option<&mut verl_torch_ext::SideCopies>,
) -> Result<()> {
    tch::no_grad(|| -> Result<()> {
        for (label, t) in list.iter_mut() {
            match homes.homes.get(label.as_str()) {
                Some(h) if h.data_ptr() == t.data_ptr() => {
                    let d = if homes.zero.contains(label.as_str()) {
                        Tensor::f_zeros(h.size().as_slice(), (h.kind(), device))
                            .ctx("load to device")?
                    } else if let Some(s) = side.as_deref_mut() {
                        let d = Tensor::f_empty(h.size().as_slice(), (h.kind(), device))
                            .ctx("load to device")?;
                        s.copy(&d, h)?;
                        d
                    } else {
                        h.f_to_device_(device, h.kind(), true, true)
                            .ctx("load to device")?
                    };
                    t.f_set_data(&d).ctx("offload: set_data")?;
                }
                _ => {
                    move_tensor(t, Place::Device, device)?;
                }
            }
        }
        Ok(())
    })
}

/// [`move_all`] to the device with the copies from the homes queued on a side stream, so they
/// overlap the work queued next on the current stream; the returned copies must be joined
/// ([`verl_torch_ext::SideCopies::join`]) before that stream uses the tensors.
pub fn prefetch_all<'a>(
    tensors: impl IntoIterator<Item = (String, &'a mut Tensor)>,
    device: Device,
    homes: &mut HostHomes,
) -> Result<(Vec<String>, verl_torch_ext::SideCopies)> {
    let mut list: Vec<(String, &'a mut Tensor)> = tensors.into_iter().collect();
    let seen: Vec<String> = list.iter().map(|(l, _)| l.clone()).collect();
    let mut side = verl_torch_ext::SideCopies::new(device)?;
    // The device memory the copies write may have served work still queued on the current
    // stream (the caching allocator orders reuse on that stream only).
    side.fence()?;
    if homes_apply(device) {
        from_homes(&mut list, device, homes, Some(&mut side))?;
    } else {
        for (_, t) in list.iter_mut() {
            move_tensor(t, Place::Device, device)?;
        }
    }
    side.close_batch()?;
    Ok((seen, side))
}

/// Moves the model's parameters (this rank's slices, compute dtype) to `place`
/// (`param_offload`); returns their names.
pub fn move_params(
    model: &mut TpModel,
    place: Place,
    homes: &mut HostHomes,
    contents: Contents,
) -> Result<Vec<String>> {
    let device = model.device();
    move_all(
        model
            .params
            .iter_mut()
            .map(|p| (p.name.clone(), &mut p.local)),
        place,
        device,
        homes,
        contents,
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
        let mut homes = HostHomes::default();
        let seen = move_all(
            [("a".to_string(), &mut a), ("b".to_string(), &mut b)],
            Place::Host,
            Device::Cpu,
            &mut homes,
            Contents::Changed,
        )
        .unwrap();
        assert_eq!(seen, vec!["a", "b"]);
        assert_eq!(a.device(), HOST);
        assert_eq!(b.device(), HOST);
        assert_eq!(b.kind(), Kind::BFloat16);
    }

    fn values(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(t.detach().to_kind(Kind::Float).reshape([-1])).unwrap()
    }

    #[test]
    fn homes_are_allocated_once_and_carry_every_update() {
        // (In the unit tests the homes apply on the CPU too: a move to the "device" copies.)
        let mut a = Tensor::arange(6, (Kind::Float, Device::Cpu))
            .reshape([2, 3])
            .set_requires_grad(true);
        let alias = a.shallow_clone();
        let mut b = Tensor::full([4], 3.5, (Kind::Float, Device::Cpu));
        let mut c = Tensor::ones([2, 2], (Kind::BFloat16, Device::Cpu));
        let mut homes = HostHomes::default();
        fn cycle(
            homes: &mut HostHomes,
            (a, b, c): (&mut Tensor, &mut Tensor, &mut Tensor),
            place: Place,
        ) {
            let list = [
                ("a".to_string(), a),
                ("b".to_string(), b),
                ("c".to_string(), c),
            ];
            move_all(list, place, Device::Cpu, homes, Contents::Changed).unwrap();
        }
        cycle(&mut homes, (&mut a, &mut b, &mut c), Place::Host);
        let (pa, pb, pc) = (a.data_ptr(), b.data_ptr(), c.data_ptr());
        // One flat buffer per dtype: a and b are consecutive slices, c has its own.
        assert_eq!(pb as usize, pa as usize + 6 * 4);
        assert_ne!(pc as usize, pb as usize + 4 * 4);
        for round in 1..=3 {
            cycle(&mut homes, (&mut a, &mut b, &mut c), Place::Device);
            assert_ne!(a.data_ptr(), pa, "a device copy, not the home");
            assert_eq!(alias.data_ptr(), a.data_ptr(), "aliases follow");
            assert!(a.requires_grad());
            // What the update does on the device must reach the home.
            tch::no_grad(|| {
                let _ = a.shallow_clone().f_add_scalar_(1.0).unwrap();
                let _ = c.shallow_clone().f_mul_scalar_(2.0).unwrap();
            });
            cycle(&mut homes, (&mut a, &mut b, &mut c), Place::Host);
            assert_eq!(
                (a.data_ptr(), b.data_ptr(), c.data_ptr()),
                (pa, pb, pc),
                "same homes"
            );
            let want: Vec<f32> = (0..6).map(|i| i as f32 + round as f32).collect();
            assert_eq!(values(&alias), want);
            assert_eq!(values(&b), vec![3.5; 4]);
            assert_eq!(values(&c), vec![f32::powi(2.0, round); 4]);
            assert_eq!(c.kind(), Kind::BFloat16);
        }
        let bytes = homes.bytes();
        assert_eq!(bytes, 6 * 4 + 4 * 4 + 4 * 2);
        // A tensor whose shape changed (a checkpoint of another size) gets a new home.
        cycle(&mut homes, (&mut a, &mut b, &mut c), Place::Device);
        b = Tensor::zeros([5], (Kind::Float, Device::Cpu));
        cycle(&mut homes, (&mut a, &mut b, &mut c), Place::Host);
        assert_eq!(homes.get("b").unwrap().size(), vec![5]);
        assert_eq!(values(&b), vec![0.0; 5]);
        assert_eq!(
            values(&alias),
            (0..6).map(|i| i as f32 + 3.0).collect::<Vec<_>>()
        );
    }

    #[test]
    fn unchanged_tensors_go_back_to_their_homes_without_a_copy() {
        let mut a = Tensor::arange(4, (Kind::Float, Device::Cpu));
        let mut homes = HostHomes::default();
        let mv = |a: &mut Tensor, homes: &mut HostHomes, place, contents| {
            move_all([("a".to_string(), a)], place, Device::Cpu, homes, contents).unwrap();
        };
        mv(&mut a, &mut homes, Place::Host, Contents::Changed);
        let home = a.data_ptr();
        mv(&mut a, &mut homes, Place::Device, Contents::Changed);
        assert_ne!(a.data_ptr(), home);
        // A write the caller declares away (Unchanged) does not reach the home: no copy ran.
        let _ = a.f_add_scalar_(10.0).unwrap();
        mv(&mut a, &mut homes, Place::Host, Contents::Unchanged);
        assert_eq!(a.data_ptr(), home);
        assert_eq!(values(&a), vec![0.0, 1.0, 2.0, 3.0]);
        // Changed: it does.
        mv(&mut a, &mut homes, Place::Device, Contents::Changed);
        let _ = a.f_add_scalar_(10.0).unwrap();
        mv(&mut a, &mut homes, Place::Host, Contents::Changed);
        assert_eq!(a.data_ptr(), home);
        assert_eq!(values(&a), vec![10.0, 11.0, 12.0, 13.0]);
    }

    #[test]
    fn zero_tensors_are_not_copied_and_come_back_as_zeros() {
        let mut g = Tensor::zeros([5], (Kind::Float, Device::Cpu));
        let mut homes = HostHomes::default();
        let mv = |g: &mut Tensor, homes: &mut HostHomes, place| {
            move_all(
                [("g".to_string(), g)],
                place,
                Device::Cpu,
                homes,
                Contents::Zeros,
            )
            .unwrap();
        };
        mv(&mut g, &mut homes, Place::Host);
        let home = homes.get("g").unwrap().shallow_clone();
        assert!(homes.zero.contains("g"));
        // Poison the home: a move that copies from it would bring the poison back.
        mv(&mut g, &mut homes, Place::Device);
        let _ = home.shallow_clone().fill_(7.0);
        assert_eq!(values(&g), vec![0.0; 5], "zeros made on the device");
        // Still zero when it goes back: no copy (the poison stays in the home).
        mv(&mut g, &mut homes, Place::Host);
        assert_eq!(values(&g), vec![7.0; 5]);
        let _ = home.shallow_clone().fill_(0.0);
        // Not zero: copied, and the home is no longer known to be zeros.
        mv(&mut g, &mut homes, Place::Device);
        let _ = g.f_add_scalar_(2.5).unwrap();
        mv(&mut g, &mut homes, Place::Host);
        assert!(!homes.zero.contains("g"));
        assert_eq!(values(&g), vec![2.5; 5]);
        mv(&mut g, &mut homes, Place::Device);
        assert_eq!(values(&g), vec![2.5; 5], "copied from the home");
        // Zero again: copied once (the home held 2.5), then known zero.
        let _ = g.f_zero_().unwrap();
        mv(&mut g, &mut homes, Place::Host);
        assert!(homes.zero.contains("g"));
        assert_eq!(values(&g), vec![0.0; 5]);
    }

    #[test]
    fn prefetched_tensors_hold_their_homes_values() {
        let mut a = Tensor::arange(6, (Kind::Float, Device::Cpu));
        let mut b = Tensor::full([3], -1.5, (Kind::Float, Device::Cpu));
        let mut homes = HostHomes::default();
        move_all(
            [("a".to_string(), &mut a), ("b".to_string(), &mut b)],
            Place::Host,
            Device::Cpu,
            &mut homes,
            Contents::Changed,
        )
        .unwrap();
        let (pa, pb) = (a.data_ptr(), b.data_ptr());
        let (seen, mut up) = prefetch_all(
            [("a".to_string(), &mut a), ("b".to_string(), &mut b)],
            Device::Cpu,
            &mut homes,
        )
        .unwrap();
        up.join().unwrap();
        assert_eq!(seen, vec!["a", "b"]);
        assert!(a.data_ptr() != pa && b.data_ptr() != pb, "device copies");
        assert_eq!(values(&a), (0..6).map(|i| i as f32).collect::<Vec<_>>());
        assert_eq!(values(&b), vec![-1.5; 3]);
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

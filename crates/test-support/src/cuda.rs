//! The GPU-only tests. Each is marked `#[ignore = "needs CUDA"]` and named `…_on_cuda`, so that
//! the CPU suite (`make test`, CI) lists it as ignored instead of counting a pass that ran
//! nothing, and `make test-gpu` runs exactly these. Run on a machine without CUDA they fail with
//! [`NO_CUDA`] instead of returning early.

use tch::Device;

/// The reason every GPU-only test is ignored with: `#[ignore = "needs CUDA"]`.
pub const NEEDS_CUDA: &str = "needs CUDA";

/// What a GPU-only test says where it cannot run.
pub const NO_CUDA: &str = "this test needs a CUDA device and tch::Cuda::is_available() is false \
     (no GPU or driver, or a CPU-only libtorch); it is #[ignore = \"needs CUDA\"]: run it on a GPU \
     machine with `make test-gpu`";

/// `cuda:0`, or a panic with [`NO_CUDA`] where there is no CUDA device.
pub fn cuda_device() -> Device {
    assert!(tch::Cuda::is_available(), "{NO_CUDA}");
    Device::Cuda(0)
}

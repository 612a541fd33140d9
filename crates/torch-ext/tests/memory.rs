//! `cuda_memory_stats`: the caching allocator's statistics (`torch.cuda.memory_allocated`,
//! `max_memory_allocated`, `memory_reserved`, `max_memory_reserved`) and what `cuda_empty_cache`
//! would hand back to the driver, read without releasing anything (GPU: `…_on_cuda`, run by
//! `make test-gpu`; without one only the call's failure-free path runs).

use tch::{Kind, Tensor};
use verl_test_support::cuda::cuda_device;
use verl_torch_ext::{cuda_empty_cache, cuda_memory_stats, CudaMemoryStats};

/// Without a device: nothing was ever allocated (or no statistics). Only checks something where
/// there is no GPU; on a GPU machine it says so and returns (the `_on_cuda` test below is the
/// check there).
#[test]
fn statistics_are_empty_without_a_device() {
    if tch::Cuda::is_available() {
        eprintln!("not applicable: this machine has a GPU (see the `_on_cuda` test)");
        return;
    }
    assert_eq!(
        cuda_memory_stats(0).unwrap_or_default(),
        CudaMemoryStats::default()
    );
}

#[test]
#[ignore = "needs CUDA"]
fn statistics_follow_allocations_and_the_releasable_cache_on_cuda() {
    let dev = cuda_device();
    let _warm = Tensor::zeros([1], (Kind::Float, dev));
    cuda_empty_cache().unwrap();
    let base = cuda_memory_stats(0).unwrap();
    assert_eq!(base.releasable, 0, "after empty_cache: {base:?}");
    assert!(base.reserved >= base.allocated, "{base:?}");
    let mib = 1u64 << 20;
    let big = Tensor::zeros([64 << 20], (Kind::Float, dev)); // 256 MiB
    let held = cuda_memory_stats(0).unwrap();
    assert!(held.allocated >= base.allocated + 256 * mib, "{held:?}");
    assert!(held.max_allocated >= held.allocated, "{held:?}");
    assert!(held.reserved >= held.allocated && held.max_reserved >= held.reserved);
    assert!(
        held.releasable < 256 * mib,
        "a live tensor's segment is not releasable: {held:?}"
    );
    drop(big);
    let freed = cuda_memory_stats(0).unwrap();
    assert_eq!(freed.allocated, base.allocated, "{freed:?}");
    assert_eq!(
        freed.max_allocated, held.max_allocated,
        "the peak stays: {freed:?}"
    );
    assert!(
        freed.releasable >= 256 * mib,
        "the freed 256 MiB segment stays cached and counts: {freed:?}"
    );
    cuda_empty_cache().unwrap();
    let released = cuda_memory_stats(0).unwrap();
    assert_eq!(released.releasable, 0, "{released:?}");
    assert!(
        released.reserved + 256 * mib <= freed.reserved,
        "{released:?} vs {freed:?}"
    );
}

/// `set_cuda_allocator_settings` hands its text to libtorch's allocator-settings parser: a known
/// option at its default value is taken, an unknown one is refused with libtorch's message, text
/// with a NUL byte never reaches it. (The parser is libtorch's own, with or without a device.)
#[test]
fn allocator_settings_are_parsed_by_libtorch() {
    use verl_torch_ext::set_cuda_allocator_settings;
    match set_cuda_allocator_settings("expandable_segments:False") {
        Ok(()) => {
            let e = set_cuda_allocator_settings("verl_no_such_option:1")
                .expect_err("an unknown allocator option must be refused")
                .to_string();
            assert!(e.contains("verl_no_such_option"), "{e}");
        }
        // A build of the extension without CUDA says so.
        Err(e) => assert!(e.to_string().contains("no CUDA"), "{e}"),
    }
    let e = set_cuda_allocator_settings("expandable_segments:\0True")
        .expect_err("NUL inside the settings")
        .to_string();
    assert!(e.contains("without NUL"), "{e}");
}

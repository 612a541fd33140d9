//! `cuda_memory_stats`: the caching allocator's statistics (`torch.cuda.memory_allocated`,
//! `max_memory_allocated`, `memory_reserved`, `max_memory_reserved`) and what `cuda_empty_cache`
//! would hand back to the driver, read without releasing anything (GPU; on a machine without one
//! only the call's failure-free path runs).

use tch::{Device, Kind, Tensor};
use verl_torch_ext::{cuda_empty_cache, cuda_memory_stats, CudaMemoryStats};

#[test]
fn statistics_follow_allocations_and_the_releasable_cache() {
    if !tch::Cuda::is_available() {
        // Nothing was ever allocated (or no statistics without a device).
        assert_eq!(
            cuda_memory_stats(0).unwrap_or_default(),
            CudaMemoryStats::default()
        );
        return;
    }
    let dev = Device::Cuda(0);
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

//! `cuda_releasable_bytes`: what `cuda_empty_cache` would hand back to the driver, read from the
//! caching allocator's statistics without releasing anything (GPU; on a machine without one only
//! the call's failure-free path runs).

use tch::{Device, Kind, Tensor};
use verl_torch_ext::{cuda_empty_cache, cuda_releasable_bytes};

#[test]
fn releasable_bytes_are_the_cached_segments_empty_cache_frees() {
    if !tch::Cuda::is_available() {
        // Nothing was ever cached: nothing to release (or no statistics without a device).
        assert_eq!(cuda_releasable_bytes(0).unwrap_or(0), 0);
        return;
    }
    let dev = Device::Cuda(0);
    let _warm = Tensor::zeros([1], (Kind::Float, dev));
    cuda_empty_cache().unwrap();
    assert_eq!(cuda_releasable_bytes(0).unwrap(), 0, "after empty_cache");
    let mib = 1u64 << 20;
    let big = Tensor::zeros([64 << 20], (Kind::Float, dev)); // 256 MiB
    let held = cuda_releasable_bytes(0).unwrap();
    assert!(
        held < 256 * mib,
        "a live tensor's segment is not releasable: {held}"
    );
    drop(big);
    let freed = cuda_releasable_bytes(0).unwrap();
    assert!(
        freed >= 256 * mib,
        "the freed 256 MiB segment stays cached and counts: {freed}"
    );
    cuda_empty_cache().unwrap();
    assert_eq!(cuda_releasable_bytes(0).unwrap(), 0, "released");
}

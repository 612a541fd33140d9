//! `upload_slice`: a host slice as a device tensor without zeroing a staging buffer first. The
//! result holds the slice's values in its shape and owns them (changing the slice afterwards
//! changes nothing), on the CPU and on a GPU (the `…_on_cuda` tests, run by `make test-gpu`), for
//! the element kinds the batch columns use; a shape that does not fit the data is an error, not a
//! read past it. `upload_slice_blocking` (the batch columns' copy straight from the slice)
//! likewise.

use tch::{Device, Kind, Tensor};
use verl_test_support::cuda::cuda_device;
use verl_torch_ext::{upload_slice, upload_slice_blocking};

#[test]
fn values_shape_and_ownership() {
    values_shape_and_ownership_case(Device::Cpu);
}

#[test]
#[ignore = "needs CUDA"]
fn values_shape_and_ownership_on_cuda() {
    values_shape_and_ownership_case(cuda_device());
}

fn values_shape_and_ownership_case(dev: Device) {
    let mut ids: Vec<i64> = (0..6 * 1000).map(|i| i * 7 - 3).collect();
    let t = upload_slice(&ids, &[6, 1000], dev).unwrap();
    assert_eq!(t.size(), vec![6, 1000], "{dev:?}");
    assert_eq!(t.kind(), Kind::Int64);
    assert_eq!(t.device(), dev);
    let want = Tensor::from_slice(&ids).reshape([6, 1000]);
    for x in ids.iter_mut() {
        *x = -1; // the tensor must not alias the slice
    }
    let got = t.to_device(Device::Cpu);
    assert!(got.equal(&want), "{dev:?}: values differ");

    let mut adv: Vec<f32> = (0..512).map(|i| i as f32 * 0.25 - 9.0).collect();
    let t = upload_slice(&adv, &[2, 256], dev).unwrap();
    let want = Tensor::from_slice(&adv).reshape([2, 256]);
    adv.clear();
    drop(adv);
    assert_eq!(t.kind(), Kind::Float);
    assert!(
        t.to_device(Device::Cpu).equal(&want),
        "{dev:?}: f32 values differ"
    );
}

#[test]
fn empty_data_and_a_shape_that_does_not_fit() {
    empty_data_and_a_shape_that_does_not_fit_case(Device::Cpu);
}

#[test]
#[ignore = "needs CUDA"]
fn empty_data_and_a_shape_that_does_not_fit_on_cuda() {
    empty_data_and_a_shape_that_does_not_fit_case(cuda_device());
}

fn empty_data_and_a_shape_that_does_not_fit_case(dev: Device) {
    let t = upload_slice::<i64>(&[], &[0, 5], dev).unwrap();
    assert_eq!(t.size(), vec![0, 5]);
    let err = upload_slice(&[1i64, 2, 3], &[2, 2], dev).unwrap_err();
    assert!(err.to_string().contains("shape"), "{dev:?}: {err}");
}

#[test]
#[ignore = "needs CUDA"]
fn many_uploads_in_flight_keep_their_values_on_cuda() {
    // Non-blocking copies from pinned blocks that libtorch's host allocator recycles: every
    // upload must still hold its own values once the device has run them all.
    let dev = cuda_device();
    let keep: Vec<(Vec<i64>, Tensor)> = (0..64)
        .map(|k| {
            let v: Vec<i64> = (0..4096).map(|i| i * 31 + k).collect();
            let t = upload_slice(&v, &[4096], dev).unwrap();
            (v, t)
        })
        .collect();
    tch::Cuda::synchronize(0);
    for (k, (v, t)) in keep.iter().enumerate() {
        assert!(
            t.to_device(Device::Cpu).equal(&Tensor::from_slice(v)),
            "upload {k} differs"
        );
    }
}

#[test]
fn blocking_upload_values_shape_and_ownership() {
    blocking_upload_values_shape_and_ownership_case(Device::Cpu);
}

#[test]
#[ignore = "needs CUDA"]
fn blocking_upload_values_shape_and_ownership_on_cuda() {
    blocking_upload_values_shape_and_ownership_case(cuda_device());
}

fn blocking_upload_values_shape_and_ownership_case(dev: Device) {
    let mut ids: Vec<i64> = (0..512 * 256).map(|i| i * 5 - 11).collect();
    let t = upload_slice_blocking(&ids, &[512, 256], dev).unwrap();
    assert_eq!(
        (t.size(), t.kind(), t.device()),
        (vec![512, 256], Kind::Int64, dev)
    );
    let want = Tensor::from_slice(&ids).reshape([512, 256]);
    ids.iter_mut().for_each(|x| *x = 0); // the tensor must not alias the slice
    drop(ids);
    assert!(
        t.to_device(Device::Cpu).equal(&want),
        "{dev:?}: values differ"
    );

    let adv: Vec<f32> = (0..6).map(|i| i as f32 - 2.5).collect();
    let t = upload_slice_blocking(&adv, &[3, 2], dev).unwrap();
    assert!(t
        .to_device(Device::Cpu)
        .equal(&Tensor::from_slice(&adv).reshape([3, 2])));

    let t = upload_slice_blocking::<i64>(&[], &[0, 3], dev).unwrap();
    assert_eq!(t.size(), vec![0, 3]);
    let err = upload_slice_blocking(&[1i64, 2, 3], &[2, 2], dev).unwrap_err();
    assert!(err.to_string().contains("shape"), "{dev:?}: {err}");
}

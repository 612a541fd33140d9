//! The NCCL backend on a machine without a GPU: clear errors, never a panic. (Its collectives
//! run on GPUs through `examples/nccl_smoke.rs`.)

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use verl_comm::{CommError, NcclCommunicator, NcclLibrary, NcclOptions};
use verl_store::{StoreClient, StoreServer};

#[test]
fn a_missing_library_is_nccl_unavailable_listing_the_paths_searched() {
    let dir = std::env::temp_dir().join(format!("verl-comm-no-nccl-{}", std::process::id()));
    let wanted = dir.join("libnccl.so.2");
    let err = NcclLibrary::load_from(std::slice::from_ref(&wanted)).unwrap_err();
    match &err {
        CommError::NcclUnavailable { searched, .. } => {
            assert_eq!(searched.as_slice(), std::slice::from_ref(&wanted))
        }
        other => panic!("expected NcclUnavailable, got {other}"),
    }
    assert!(
        err.to_string().contains(&wanted.display().to_string()),
        "{err}"
    );
}

#[test]
fn a_file_that_is_not_nccl_is_refused_with_the_loader_message() {
    let dir = std::env::temp_dir().join(format!("verl-comm-bad-nccl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fake = dir.join("libnccl.so.2");
    std::fs::write(&fake, b"not an ELF file").unwrap();
    let err = NcclLibrary::load_from(std::slice::from_ref(&fake)).unwrap_err();
    let _ = std::fs::remove_dir_all(&dir);
    let CommError::NcclUnavailable { reason, .. } = &err else {
        panic!("expected NcclUnavailable, got {err}");
    };
    assert!(reason.contains(&fake.display().to_string()), "{reason}");
}

#[test]
fn the_search_prefers_the_copy_libtorch_already_mapped() {
    let paths = NcclLibrary::search_paths(false);
    assert_eq!(paths.last(), Some(&PathBuf::from("libnccl.so.2")));
    match NcclLibrary::get() {
        Ok(lib) => {
            // torch's CUDA wheels ship NCCL even on CPU-only machines; it loads without a GPU.
            let v = lib.version().unwrap();
            assert!(v >= 2_00_00, "NCCL version code {v}");
            println!("NCCL {v} at {}", lib.path().display());
        }
        Err(e) => println!("no NCCL on this machine (fine for CPU-only libtorch): {e}"),
    }
}

/// Only checks something on a machine without a GPU (CI); with one it says so and passes without
/// checking: no GPU path is tested here (NCCL on GPUs: `examples/nccl_smoke.rs`).
#[test]
fn without_a_gpu_the_communicator_is_an_error_value_not_a_panic() {
    if tch::Cuda::is_available() {
        println!(
            "not applicable: this machine has a GPU and the test checks the error without one \
             (NCCL on GPUs: examples/nccl_smoke.rs)"
        );
        return;
    }
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let store =
        Arc::new(StoreClient::connect(server.connect_addr(), Duration::from_secs(5)).unwrap());
    let err = NcclCommunicator::new(store, 0, 1, NcclOptions::default())
        .err()
        .expect("no GPU here");
    assert!(
        matches!(
            err,
            CommError::NcclUnavailable { .. } | CommError::CudaUnavailable { .. }
        ),
        "{err}"
    );
    println!("{err}");
}

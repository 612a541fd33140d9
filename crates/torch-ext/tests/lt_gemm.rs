//! Decode GEMMs through cuBLASLt with a timed algorithm: every tuned shape gives libtorch's bits
//! (at its own rows and as rows of a training-size GEMM), eagerly and replayed from a CUDA graph;
//! untuned shapes are left to the caller; tuning refuses to run inside a capture. GPU tests, run
//! under the GEMM settings of `consistent_attention` (cuBLASLt, 1 KiB workspace), ignored
//! ("needs CUDA") and run by `make test-gpu`; they fail where there is no CUDA device.

use std::sync::Once;

use tch::{Device, Kind, Tensor};
use verl_test_support::cuda::cuda_device;
use verl_torch_ext::{
    capture, forget_tuned_linears, tune_linear, tuned_gemm_scope, tuned_gemms_available,
    tuned_linear, tuned_linear_report,
};

fn gpu() -> Device {
    let dev = cuda_device();
    assert!(
        tuned_gemms_available(),
        "a CUDA device but no cuBLASLt: the tuned GEMMs are unavailable"
    );
    static SETUP: Once = Once::new();
    SETUP.call_once(|| {
        // What the FSDP actor sets under `consistent_attention` before its first GEMM.
        std::env::set_var("TORCH_CUBLASLT_WORKSPACE_SIZE", "1");
        std::env::set_var("CUBLASLT_WORKSPACE_SIZE", "1");
        // A cache file of this run's own.
        let file =
            std::env::temp_dir().join(format!("verl_tuned_gemms_{}.txt", std::process::id()));
        let _ = std::fs::remove_file(&file);
        std::env::set_var("VERL_TUNED_GEMMS_CACHE", &file);
        verl_torch_ext::prefer_cublaslt().unwrap();
    });
    dev
}

fn torch_gemm(x: &Tensor, w: &Tensor, b: Option<&Tensor>, fp32: bool) -> Tensor {
    if fp32 {
        x.mm_dtype(&w.tr(), Kind::Float)
    } else {
        x.linear(w, b)
    }
}

fn bits_equal(a: &Tensor, b: &Tensor) -> bool {
    a.size() == b.size() && a.kind() == b.kind() && a.equal(b)
}

#[test]
#[ignore = "needs CUDA"]
fn tuned_gemms_give_libtorchs_rows_eagerly_and_from_a_graph_on_cuda() {
    let dev = gpu();
    let _g = tch::no_grad_guard();
    tch::manual_seed(3);
    // Qwen2.5-0.5B and 1.5B decode projections (fused q/k/v + bias, o, fused gate/up, down) and
    // LM heads (fp32 logits), at a full decode batch and a small one.
    let shapes: &[(i64, i64, bool, bool)] = &[
        (1152, 896, true, false),
        (896, 896, false, false),
        (9728, 896, false, false),
        (896, 4864, false, false),
        (151_936, 896, false, true),
        (2048, 1536, true, false),
        (1536, 1536, false, false),
        (17_920, 1536, false, false),
        (1536, 8960, false, false),
        (151_936, 1536, false, true),
    ];
    let mut taken = 0;
    let mut first_choice = std::collections::HashMap::new();
    for &rows in &[512i64, 8] {
        for &(n, k, bias, fp32) in shapes {
            let what = format!("{rows} rows, {k} -> {n}, bias {bias}, fp32 {fp32}");
            let w = Tensor::randn([n, k], (Kind::BFloat16, dev)) * 0.05;
            let b = bias.then(|| Tensor::randn([n], (Kind::BFloat16, dev)));
            let t = std::time::Instant::now();
            let tuned = tune_linear(rows, &w, b.as_ref(), fp32, rows == 512).unwrap();
            assert!(tuned.fresh && !tuned.from_file, "{what}: {tuned:?}");
            let chosen = tuned.chosen;
            if rows == 512 {
                first_choice.insert((n, k, bias, fp32), chosen);
            }
            eprintln!("{what}: tuned in {:.3} s", t.elapsed().as_secs_f64());
            taken += usize::from(chosen);
            // Tuning again is a cache hit with the same answer.
            let again = tune_linear(rows, &w, b.as_ref(), fp32, false).unwrap();
            assert_eq!(
                (again.chosen, again.fresh, again.from_file),
                (chosen, false, false),
                "{what}"
            );
            // Rows of a training-size GEMM, the first `rows` of which are this step's.
            let big = Tensor::randn([4096, k], (Kind::BFloat16, dev));
            let x = big.narrow(0, 0, rows).view([rows, 1, k]);
            let want_big = torch_gemm(&big, &w, b.as_ref(), fp32).narrow(0, 0, rows);
            let want = torch_gemm(&x.view([rows, k]), &w, b.as_ref(), fp32);
            assert!(bits_equal(&want, &want_big), "libtorch itself: {what}");
            assert!(
                tuned_linear(&x, &w, b.as_ref(), fp32).unwrap().is_none(),
                "nothing runs outside a scope: {what}"
            );
            let _s = tuned_gemm_scope(true);
            let got = tuned_linear(&x, &w, b.as_ref(), fp32).unwrap();
            assert_eq!(got.is_some(), chosen, "{what}");
            let Some(y) = got else { continue };
            assert_eq!(y.size(), vec![rows, 1, n], "{what}");
            assert!(bits_equal(&y.view([rows, n]), &want), "{what}");

            // Captured and replayed over new inputs in the same buffer.
            let xs = x.copy();
            let (graph, out) = capture(None, 0, || {
                tuned_linear(&xs, &w, b.as_ref(), fp32).map(|y| y.expect("tuned"))
            })
            .unwrap();
            let fresh = Tensor::randn([rows, 1, k], (Kind::BFloat16, dev));
            xs.shallow_clone().copy_(&fresh);
            graph.replay().unwrap();
            let want = torch_gemm(&fresh.view([rows, k]), &w, b.as_ref(), fp32);
            assert!(bits_equal(&out.view([rows, n]), &want), "replay: {what}");
        }
    }
    let report = tuned_linear_report().unwrap();
    for line in &report {
        eprintln!("{line}");
    }
    assert!(report.len() >= 2 * shapes.len(), "{report:?}");
    eprintln!(
        "{taken} of {} shapes took a cuBLASLt algorithm",
        2 * shapes.len()
    );

    // A later process (here: this one, its choices forgotten) reads the cache file instead of
    // timing again, and gets the same choice and the same bits.
    forget_tuned_linears().unwrap();
    let rows = 512;
    for &(n, k, bias, fp32) in &shapes[..5] {
        let w = Tensor::randn([n, k], (Kind::BFloat16, dev)) * 0.05;
        let b = bias.then(|| Tensor::randn([n], (Kind::BFloat16, dev)));
        let t = std::time::Instant::now();
        let tuned = tune_linear(rows, &w, b.as_ref(), fp32, true).unwrap();
        eprintln!(
            "{k} -> {n}: from the cache file in {:.3} s",
            t.elapsed().as_secs_f64()
        );
        assert!(tuned.fresh && tuned.from_file, "{tuned:?}");
        assert_eq!(tuned.chosen, first_choice[&(n, k, bias, fp32)], "{n}x{k}");
        let x = Tensor::randn([rows, k], (Kind::BFloat16, dev));
        let want = torch_gemm(&x, &w, b.as_ref(), fp32);
        let _s = tuned_gemm_scope(true);
        match tuned_linear(&x, &w, b.as_ref(), fp32).unwrap() {
            Some(y) => assert!(tuned.chosen && bits_equal(&y, &want)),
            None => assert!(!tuned.chosen),
        }
    }
    let report = tuned_linear_report().unwrap();
    assert_eq!(report.len(), 5, "{report:?}");
    assert!(report.iter().all(|l| l.contains("[from ")), "{report:?}");
}

#[test]
#[ignore = "needs CUDA"]
fn where_libtorchs_small_batch_rows_differ_a_tuned_choice_gives_the_training_sizes_on_cuda() {
    let dev = gpu();
    let _g = tch::no_grad_guard();
    // fp32-logits LM heads (the quickstart's tiny one, Qwen2.5-0.5B's) at 1 and 2 rows: libtorch
    // picks other kernels there than for a training-size GEMM, and its rows can differ.
    for &(n, k) in &[(455i64, 128i64), (151_936, 896)] {
        for &rows in &[1i64, 2] {
            let w = Tensor::randn([n, k], (Kind::BFloat16, dev)) * 0.05;
            let big = Tensor::randn([4096, k], (Kind::BFloat16, dev));
            let x = big.narrow(0, 0, rows);
            let want = torch_gemm(&big, &w, None, true).narrow(0, 0, rows);
            let libtorch_same = bits_equal(&torch_gemm(&x, &w, None, true), &want);
            let tuned = tune_linear(rows, &w, None, true, false).unwrap();
            let _s = tuned_gemm_scope(true);
            let got = tuned_linear(&x, &w, None, true).unwrap();
            eprintln!(
                "{rows} rows, {k} -> {n}: libtorch row-consistent {libtorch_same}, tuned {}",
                got.is_some()
            );
            assert_eq!(got.is_some(), tuned.chosen);
            match got {
                Some(y) => assert!(bits_equal(&y, &want), "{rows} rows, {k} -> {n}"),
                // libtorch stays only where it is row-consistent or nothing was.
                None => {
                    let report = tuned_linear_report().unwrap();
                    let line = report
                        .iter()
                        .find(|l| l.starts_with(&format!("{rows}x{k} @ {k}x{n} ")))
                        .unwrap_or_else(|| panic!("{report:?}"));
                    assert!(
                        !line.contains("differ from the reference") || line.contains(" 0 of "),
                        "libtorch kept though not row-consistent: {line}"
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs CUDA"]
fn untuned_shapes_are_left_to_libtorch_and_a_capture_cannot_tune_on_cuda() {
    let dev = gpu();
    let _g = tch::no_grad_guard();
    let w = Tensor::randn([384, 256], (Kind::BFloat16, dev));
    let x = Tensor::randn([24, 256], (Kind::BFloat16, dev));
    let _s = tuned_gemm_scope(true);
    assert!(tuned_linear(&x, &w, None, false).unwrap().is_none());
    // fp32 inputs, odd shapes and bias with fp32 outputs are the caller's.
    let e = tune_linear(24, &w.to_kind(Kind::Float), None, false, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("weight must be a contiguous 2-D bf16/fp16 CUDA tensor"),
        "{e}"
    );
    let b = Tensor::randn([384], (Kind::BFloat16, dev));
    let e = tune_linear(24, &w, Some(&b), true, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("fp32 outputs take none"), "{e}");
    let e = tune_linear(0, &w, None, false, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rows must be in 1..4096, got 0"), "{e}");
    let e = match capture(None, 0, || tune_linear(24, &w, None, false, false)) {
        Ok(_) => panic!("tuning inside a capture must fail"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("was not tuned before a CUDA graph capture"),
        "{e}"
    );
    // Afterwards the shape tunes normally.
    tune_linear(24, &w, None, false, false).unwrap();
}

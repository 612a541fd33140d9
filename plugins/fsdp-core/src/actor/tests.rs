use super::{allocator_settings_plan, cublas_workspace_kib, gemm_env_plan, GemmEnvPlan};

#[test]
fn an_offloaded_reference_scores_on_loaded_parameters_and_puts_them_back() {
    use verl_plugin_api::{col, Actor, InitArgs, LogProbOptions, Role};
    let dir = crate::test_model::tiny_model_dir();
    let reference = |offload: bool| {
        let cfg = serde_json::json!({
            "trainer": {"device": "cpu"},
            "actor_rollout_ref": {
                "model": {"path": dir.path().to_str().unwrap()},
                "ref": {"log_prob_micro_batch_size_per_gpu": 2,
                        "fsdp_config": {"param_offload": offload}},
            },
        });
        super::FsdpActor::create(&InitArgs::new(Role::Reference, cfg), true).unwrap()
    };
    let mut b = verl_plugin_api::Batch::new();
    b.insert_tensor(col::PROMPTS, &[2, 3], &[5i64, 6, 7, 0, 8, 9]);
    b.insert_tensor(col::PROMPT_MASK, &[2, 3], &[1i64, 1, 1, 0, 1, 1]);
    b.insert_tensor(col::RESPONSES, &[2, 3], &[20i64, 21, 1, 22, 1, 0]);
    b.insert_tensor(col::RESPONSE_MASK, &[2, 3], &[1i64, 1, 1, 1, 1, 0]);
    let opts = LogProbOptions::default();
    let mut plain = reference(false);
    assert!(plain.host_params.is_none());
    let want = plain.compute_log_prob(&b, &opts).unwrap();
    let mut off = reference(true);
    let host_ptrs = |a: &super::FsdpActor| -> Vec<usize> {
        a.model()
            .named_parameters()
            .iter()
            .map(|(_, p)| p.data_ptr() as usize)
            .collect()
    };
    let before = host_ptrs(&off);
    assert!(!off.host_params.as_ref().unwrap().on_device());
    let got = off.compute_log_prob(&b, &opts).unwrap();
    assert_eq!(
        want.tensor::<f32>(col::LOG_PROBS).unwrap(),
        got.tensor::<f32>(col::LOG_PROBS).unwrap()
    );
    // Back on the host views after the call.
    assert!(!off.host_params.as_ref().unwrap().on_device());
    assert_eq!(host_ptrs(&off), before);
}

/// cuBLASLt with its 1 KiB workspace where it can be selected: the two size keys are set when
/// absent, a user's own value is kept.
#[test]
fn allocator_settings_plan_sets_expandable_segments_only_for_one_unconfigured_process() {
    let none = |_: &str| None;
    assert_eq!(
        allocator_settings_plan(none, 1),
        Some("expandable_segments:True")
    );
    assert_eq!(allocator_settings_plan(none, 2), None);
    for key in ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"] {
        let set = |k: &str| (k == key).then(|| "max_split_size_mb:128".to_string());
        assert_eq!(
            allocator_settings_plan(set, 1),
            None,
            "{key} set by the user"
        );
    }
}
#[test]
fn batch_invariant_gemms_prefer_cublaslt_and_keep_what_is_set() {
    let plan = gemm_env_plan(
        |k| match k {
            "CUBLASLT_WORKSPACE_SIZE" => Some("1024".into()),
            "CUBLAS_WORKSPACE_CONFIG" => Some(":4096:8".into()),
            _ => None,
        },
        true,
    );
    assert_eq!(
        plan,
        GemmEnvPlan {
            prefer_lt: true,
            env: vec![
                ("TORCH_CUBLASLT_WORKSPACE_SIZE", "1", None),
                ("CUBLASLT_WORKSPACE_SIZE", "1", Some("1024".to_string())),
            ],
        }
    );
}

/// Without cuBLASLt, or with the user's zero cuBLAS workspace (libtorch's cuBLASLt path then
/// fails to allocate), every workspace is zero.
#[test]
fn batch_invariant_gemms_fall_back_to_no_workspace() {
    let plan = gemm_env_plan(
        |k| match k {
            "TORCH_CUBLASLT_WORKSPACE_SIZE" => Some("0".into()),
            _ => None,
        },
        false,
    );
    assert_eq!(
        plan,
        GemmEnvPlan {
            prefer_lt: false,
            env: vec![
                ("CUBLAS_WORKSPACE_CONFIG", ":0:0", None),
                ("CUBLASLT_WORKSPACE_SIZE", "0", None),
            ],
        }
    );
    let plan = gemm_env_plan(
        |k| (k == "CUBLAS_WORKSPACE_CONFIG").then(|| ":0:0".to_string()),
        true,
    );
    assert!(!plan.prefer_lt);
    assert_eq!(plan.env.len(), 2, "{plan:?}");
    assert_eq!(cublas_workspace_kib(":4096:2:16:8"), Some(8320));
    assert_eq!(cublas_workspace_kib(":0:4"), Some(0));
    assert_eq!(cublas_workspace_kib("4096:8"), None);
    assert_eq!(cublas_workspace_kib(":4096"), None);
}

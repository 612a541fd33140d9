#[test]
fn an_offloaded_reference_scores_on_loaded_parameters_and_puts_them_back() {
    use verl_plugin_api::{col, Actor, InitArgs, LogProbOptions, Role};
    let dir = verl_test_support::tiny::tiny_model_dir();
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

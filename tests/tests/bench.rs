//! `verl bench grpo` end to end on the CPU: the real binary, the real fsdp plugin, the `tiny`
//! architecture (random init), one JSON line with the keys `bench/ratio_table.py` reads.

use verl_e2e::*;

/// `verl bench grpo` on the CPU with the `tiny` architecture and a small fixed workload (two
/// steps), as JSON, plus `extra`.
fn tiny_bench_args<'a>(fsdp: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "bench",
        "grpo",
        "--plugin",
        fsdp,
        "--arch",
        "tiny",
        "--prompts",
        "2",
        "--n",
        "2",
        "--prompt-len",
        "16",
        "--response-len",
        "8",
        "--ignore-eos",
        "--device",
        "cpu",
        "--steps",
        "2",
        "--calibrate-n",
        "64",
        "--json",
    ];
    args.extend_from_slice(extra);
    args
}

/// The single JSON line a `--json` run prints on stdout.
fn one_json_line(o: &std::process::Output) -> serde_json::Value {
    let out = stdout(o);
    let lines: Vec<&str> = out.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one JSON line on stdout, got:\n{out}");
    serde_json::from_str(lines[0]).expect("JSON")
}

#[test]
fn bench_grpo_tiny_on_cpu_prints_one_json_line() {
    let verl = verl_bin();
    let fsdp = plugin("libverl_fsdp.so");
    let o = run(&verl, &tiny_bench_args(fsdp.to_str().unwrap(), &[]));
    assert!(o.status.success(), "{}", stderr(&o));
    let v = one_json_line(&o);
    assert_eq!(v["system"], "verl-rs");
    assert_eq!(v["backend"], "fsdp");
    assert_eq!(v["arch"], "tiny");
    assert_eq!(v["tokens"], 2 * 2 * (16 + 8));
    assert_eq!(v["response_tokens"], 2 * 2 * 8);
    // The bench's default (a no-op on the CPU, where the paged kernel does not exist).
    assert_eq!(v["consistent_attention"], true, "{v}");
    // The bench's default: the 2 samples of each prompt share its forward.
    assert_eq!(v["prefix_grouper"], true, "{v}");
    // One mini-batch per step: the timed step skips the old-log-prob pass as the trainer does;
    // the warm-up step runs it (for the exactness check below).
    assert_eq!(v["old_log_prob_skipped"], true, "{v}");
    assert_eq!(v["old_log_prob"].as_f64(), Some(0.0), "{v}");
    let warm_old = v["per_step"][0]["old_log_prob"].as_f64().unwrap_or(0.0);
    assert!(warm_old > 0.0, "warm-up step old_log_prob = {warm_old}");
    assert_eq!(v["per_step"][0]["old_log_prob_skipped"], false, "{v}");
    for k in [
        "gen",
        "ref",
        "update",
        "step",
        "tokens_per_s",
        "gen_tokens_per_s",
        "peak_tflops",
        "hbm_gbps",
        "mfu_gen",
        "mfu_update",
        "mfu_step",
        "decode_hbm_fraction",
        "peak_mem_gb",
    ] {
        let x = v[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {v}"));
        assert!(x > 0.0 && x.is_finite(), "{k} = {x}");
    }
    assert_eq!(v["per_step"].as_array().map(Vec::len), Some(2), "{v}");
    // The sampler's log-probs and the training forward's agree on the same tokens (fp32 on CPU;
    // the bench model is random, so a broken rollout log-prob would be off by O(1)).
    let gap = v["rollout_logprob_abs_diff_mean"]
        .as_f64()
        .expect("exactness in the JSON");
    let gap_max = v["rollout_logprob_abs_diff_max"].as_f64().unwrap();
    assert!(
        gap < 1e-4 && gap_max < 1e-3,
        "rollout vs training log-probs: {gap} / {gap_max}"
    );
    // The table goes to stderr with --json.
    let err = stderr(&o);
    assert!(err.contains("decode") || err.contains("HBM roof"), "{err}");
}

/// The digest of the warm-up step's sampled tokens names them: the same seed samples the same
/// tokens (so two builds or settings can be checked for it), another seed others.
#[test]
fn bench_grpo_digest_follows_the_sampled_tokens() {
    let verl = verl_bin();
    let fsdp = plugin("libverl_fsdp.so");
    let digest = |extra: &[&str]| {
        let o = run(&verl, &tiny_bench_args(fsdp.to_str().unwrap(), extra));
        assert!(o.status.success(), "{}", stderr(&o));
        let v = one_json_line(&o);
        let d = v["responses_digest"].as_str().expect("digest").to_string();
        assert_eq!(d.len(), 16, "{v}");
        d
    };
    let a = digest(&[]);
    assert_eq!(a, digest(&[]), "same seed, same tokens");
    assert_ne!(
        a,
        digest(&["--seed", "1"]),
        "another seed samples other tokens"
    );
}

/// The same workload through the Megatron backend (users A/B backends on one job): it answers
/// the bench's `calibrate` and `memory` calls, and the JSON names it.
#[test]
fn bench_grpo_runs_on_the_megatron_backend() {
    let verl = verl_bin();
    let megatron = plugin("libverl_megatron.so");
    let o = run(&verl, &tiny_bench_args(megatron.to_str().unwrap(), &[]));
    assert!(o.status.success(), "{}", stderr(&o));
    let v = one_json_line(&o);
    assert_eq!(v["backend"], "megatron", "{v}");
    for k in [
        "gen",
        "ref",
        "update",
        "step",
        "peak_tflops",
        "hbm_gbps",
        "peak_mem_gb",
    ] {
        let x = v[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {v}"));
        assert!(x > 0.0 && x.is_finite(), "{k} = {x}");
    }
    let gap = v["rollout_logprob_abs_diff_mean"]
        .as_f64()
        .expect("exactness");
    assert!(gap < 1e-2, "rollout vs training log-probs: {gap}");
    // It has no consistent-attention path: the bench measures without one and says so, rather
    // than report the mode the FSDP backend would run.
    assert_eq!(v["consistent_attention"], false, "{v}");
    assert_eq!(v["prefix_grouper"], false, "{v}");
    let err = stderr(&o);
    assert!(err.contains("megatron backend"), "{err}");
    assert!(
        err.contains("refused the bench's defaults")
            && err.contains("actor_rollout_ref.rollout.consistent_attention=false")
            && err.contains("actor_rollout_ref.actor.use_prefix_grouper=false"),
        "{err}"
    );
    // Asked for explicitly, the refusal is the answer.
    let o = run(
        &verl,
        &tiny_bench_args(
            megatron.to_str().unwrap(),
            &[
                "--set",
                "actor_rollout_ref.rollout.consistent_attention=true",
            ],
        ),
    );
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("megatron backend refused the bench job")
            && err.contains("actor_rollout_ref.rollout.consistent_attention"),
        "{err}"
    );
}

#[test]
fn bench_grpo_rejects_an_unknown_arch() {
    let o = run(
        &verl_bin(),
        &["bench", "grpo", "--arch", "gpt9", "--device", "cpu"],
    );
    assert_one_line_error(&o, &["--arch", "gpt9", "qwen2.5-0.5b"]);
}

/// Off-policy steps (two mini-batches) run the old-log-prob pass; bypass mode uses the rollout's
/// log-probs instead, on every timed step, and says so in the JSON.
#[test]
fn bench_grpo_bypass_mode_skips_the_off_policy_old_pass() {
    let fsdp = plugin("libverl_fsdp.so");
    let bench = |extra: &[&str]| {
        let mut all = vec!["--set", "actor_rollout_ref.actor.ppo_mini_batch_size=1"];
        all.extend_from_slice(extra);
        let args = tiny_bench_args(fsdp.to_str().unwrap(), &all);
        let o = run(&verl_bin(), &args);
        assert!(o.status.success(), "{}", stderr(&o));
        let out = stdout(&o);
        let line = out.lines().find(|l| l.starts_with('{')).expect("JSON line");
        serde_json::from_str::<serde_json::Value>(line).unwrap()
    };
    let off = bench(&[]);
    assert_eq!(off["bypass_mode"], false, "{off}");
    assert_eq!(off["old_log_prob_skipped"], false, "{off}");
    assert!(off["old_log_prob"].as_f64().unwrap() > 0.0, "{off}");
    let by = bench(&["--set", "algorithm.rollout_correction.bypass_mode=true"]);
    assert_eq!(by["bypass_mode"], true, "{by}");
    assert_eq!(by["old_log_prob_skipped"], true, "{by}");
    assert_eq!(by["old_log_prob"].as_f64(), Some(0.0), "{by}");
    // Decoupled weights need rewards, which the bench has not: refused by name.
    let o = run(
        &verl_bin(),
        &tiny_bench_args(
            fsdp.to_str().unwrap(),
            &["--set", "algorithm.rollout_correction.rollout_is=token"],
        ),
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains("bypass_mode"), "{}", stderr(&o));
}

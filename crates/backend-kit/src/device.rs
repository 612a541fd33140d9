//! Process-wide CUDA settings a backend applies before it allocates: the caching allocator's
//! expandable segments, and GEMMs that give the same bits at every batch size.

/// The GEMM settings under which a GEMM sums each output in the same order whatever its number
/// of rows, for `rollout.consistent_attention`. cuBLAS chooses split-K kernels (which reduce over
/// K in pieces, a different order) only when it has a workspace, and it chooses them for the few
/// rows of a decode step, not for the thousands of a training forward: measured on an H200
/// (`verl bench grpo`, Qwen2.5-0.5B shapes), 64 decoding sequences gave rollout-vs-training
/// log-probs 8.2e-3 apart with the default workspace and 7.0e-8 without.
///
/// Taking cuBLAS's workspace away costs host time, though: every GEMM then took 76–86 µs to launch
/// (172–198 µs with a bias) against 19–29 µs, which left the GPU waiting for the host in training
/// passes (H100, libtorch 2.11). So libtorch's GEMMs go through cuBLASLt instead, with a 1 KiB
/// workspace of their own (no split-K fits in it; cuBLAS keeps its workspace): rows of
/// 1–512-row GEMMs equal the 4096-row GEMM's bit for bit on every Qwen2.5 projection shape, at
/// the default launch cost. Where cuBLASLt cannot be selected, or the user set cuBLAS's workspace
/// to zero (with which libtorch's cuBLASLt path fails), every workspace is zero instead, as
/// before. Set before the process's first GEMM (libtorch reads the sizes once); a value the user
/// set is kept, with a warning.
pub fn batch_invariant_gemms() {
    let get = |k: &str| std::env::var(k).ok();
    let mut plan = gemm_env_plan(get, true);
    if plan.prefer_lt {
        if let Err(e) = verl_torch_ext::prefer_cublaslt() {
            tracing::warn!(
                "consistent_attention: GEMMs stay on cuBLAS, without a workspace (slower to \
                 launch): {e}"
            );
            plan = gemm_env_plan(get, false);
        }
    }
    for (key, value, kept) in plan.env {
        match kept {
            None => std::env::set_var(key, value),
            Some(v) => tracing::warn!(
                "{key}={v} is kept; actor_rollout_ref.rollout.consistent_attention wants {value} \
                 (no split-K GEMMs): with room for split-K, rollout log-probs of small decode \
                 batches can differ from the training forward's by ~1e-2"
            ),
        }
    }
}

/// Turns on the CUDA caching allocator's expandable segments for a one-process job unless the
/// user configured the allocator (`PYTORCH_CUDA_ALLOC_CONF` / `PYTORCH_ALLOC_CONF`). Each
/// generate call sizes its KV cache from the device memory tensors do not hold, counting the
/// allocator's wholly free segments as free; after an update, the segments its activations and
/// the previous call's KV pool left behind are partly in use, and none of that counts. Measured
/// on one H200 (`verl bench grpo --arch llama3-8b --prompts 32 ... --micro-batch 8
/// --logprob-micro-batch 8 --set actor_rollout_ref.rollout.gpu_memory_utilization=0.9`): after the
/// first update 17.3 GiB sat in partly used segments and the second call's KV budget fell from
/// 56.4 to 39.3 GiB; with 64 prompts it fell to 22.2 GiB, too little for every sequence at once
/// (178 preemptions, generation 17.3 s against 15.6 s for the first, tuning included). With
/// `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` nothing was stranded (0.0 GiB; budget 56.8
/// and 56.6 GiB) at the same speed. Set through libtorch's run-time allocator settings
/// (`torch.cuda.memory._set_allocator_settings`), which apply to the segments created later, so
/// it belongs before the role's first CUDA tensor. Several ranks keep libtorch's default (not
/// measured with NCCL here).
pub fn expandable_segments(world: usize) {
    // Once per process (every role of a one-process job calls this).
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| apply_allocator_settings(world));
}

fn apply_allocator_settings(world: usize) {
    let get = |k: &str| std::env::var(k).ok();
    let Some(settings) = allocator_settings_plan(get, world) else {
        return;
    };
    match verl_torch_ext::set_cuda_allocator_settings(settings) {
        Ok(()) => tracing::info!(
            "CUDA caching allocator: {settings} (set by the backend for a one-process job: each \
             generate call sizes its KV cache from memory no tensor holds, which partly used \
             segments would otherwise keep; PYTORCH_CUDA_ALLOC_CONF chooses otherwise)"
        ),
        Err(e) => tracing::warn!("CUDA caching allocator: {settings} not applied: {e}"),
    }
}

/// The allocator settings [`expandable_segments`] applies, if any.
fn allocator_settings_plan(
    get: impl Fn(&str) -> Option<String>,
    world: usize,
) -> Option<&'static str> {
    let configured = ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"]
        .iter()
        .any(|k| get(k).is_some());
    (world == 1 && !configured).then_some("expandable_segments:True")
}

/// What [`batch_invariant_gemms`] does.
#[derive(Debug, PartialEq)]
struct GemmEnvPlan {
    /// Route libtorch's GEMMs through cuBLASLt.
    prefer_lt: bool,
    /// `(key, wanted, None)` to set, `(key, wanted, Some(user's value))` to keep with a warning;
    /// keys already as wanted are left out.
    env: Vec<(&'static str, &'static str, Option<String>)>,
}

/// [`GemmEnvPlan`] given the environment and whether cuBLASLt can be selected.
fn gemm_env_plan(get: impl Fn(&str) -> Option<String>, lt_available: bool) -> GemmEnvPlan {
    const LT: [(&str, &str); 2] = [
        ("TORCH_CUBLASLT_WORKSPACE_SIZE", "1"),
        ("CUBLASLT_WORKSPACE_SIZE", "1"),
    ];
    const NONE: [(&str, &str); 3] = [
        ("CUBLAS_WORKSPACE_CONFIG", ":0:0"),
        ("CUBLASLT_WORKSPACE_SIZE", "0"),
        ("TORCH_CUBLASLT_WORKSPACE_SIZE", "0"),
    ];
    let zero_cublas =
        get("CUBLAS_WORKSPACE_CONFIG").is_some_and(|v| cublas_workspace_kib(&v) == Some(0));
    let prefer_lt = lt_available && !zero_cublas;
    let vars: &[(&'static str, &'static str)] = if prefer_lt { &LT } else { &NONE };
    let env = vars
        .iter()
        .filter_map(|&(key, value)| match get(key) {
            Some(v) if v == value => None,
            other => Some((key, value, other)),
        })
        .collect();
    GemmEnvPlan { prefer_lt, env }
}

/// Total KiB of a `CUBLAS_WORKSPACE_CONFIG` value (`:SIZE:COUNT` pairs, SIZE in KiB); `None` when
/// it does not parse.
fn cublas_workspace_kib(value: &str) -> Option<u64> {
    let parts: Vec<&str> = value.strip_prefix(':')?.split(':').collect();
    if !parts.len().is_multiple_of(2) {
        return None;
    }
    parts.chunks(2).try_fold(0u64, |acc, pair| {
        let size: u64 = pair[0].trim().parse().ok()?;
        let count: u64 = pair[1].trim().parse().ok()?;
        Some(acc + size * count)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

//! Batch-size arithmetic, checked before anything runs.
//!
//! verl's semantics: `data.train_batch_size` and `*.ppo_mini_batch_size` count prompts; each
//! prompt yields `rollout.n` responses. A worker with data-parallel size D trains on
//! `ppo_mini_batch_size × n / D` responses per mini-batch, split into micro-batches of
//! `ppo_micro_batch_size_per_gpu` (gradient accumulation) unless `use_dynamic_bsz` packs by
//! tokens instead. verl finds a bad combination mid-run (an "equal chunk" assertion, a silently
//! floored mini-batch); here every rule is checked up front and an error spells out the
//! arithmetic and a value that would work.
//!
//! verl-rs is stricter than verl in one place: each rank generates for its own prompts, so a
//! GRPO group never leaves its rank; `train_batch_size` itself must split evenly over ranks.

use serde::Serialize;

use crate::error::{ConfigError, Result};
use crate::schema::{Config, MegatronConfig};

/// How the job's processes are arranged: how many ranks each role's data is split over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Layout {
    /// Processes (GPUs) in the job.
    pub world_size: u64,
    /// Data-parallel size of the actor (world / (sequence- or model-parallel size)).
    pub dp_size_actor: u64,
    /// Data-parallel size of the critic.
    pub dp_size_critic: u64,
    /// Data-parallel size of the reference policy.
    pub dp_size_ref: u64,
}

impl Layout {
    /// Pure data parallelism over `world_size` ranks.
    pub fn data_parallel(world_size: u64) -> Layout {
        Layout {
            world_size,
            dp_size_actor: world_size,
            dp_size_critic: world_size,
            dp_size_ref: world_size,
        }
    }

    /// The layout verl would build: `trainer.nnodes × trainer.n_gpus_per_node` ranks, divided
    /// per role by tensor × pipeline × context parallel sizes (megatron).
    pub fn from_config(cfg: &Config) -> Result<Layout> {
        let world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node;
        if world == 0 {
            return Err(ConfigError::Layout {
                key: "trainer.n_gpus_per_node".into(),
                message: format!(
                    "trainer.nnodes={} × trainer.n_gpus_per_node={} = 0 GPUs; at least one is needed",
                    cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node
                ),
            });
        }
        let arr = &cfg.actor_rollout_ref;
        Ok(Layout {
            world_size: world,
            dp_size_actor: role_dp(
                world,
                "actor_rollout_ref.actor",
                &arr.actor.strategy,
                &arr.actor.megatron,
            )?,
            dp_size_ref: role_dp(
                world,
                "actor_rollout_ref.ref",
                &arr.reference.strategy,
                &arr.reference.megatron,
            )?,
            dp_size_critic: role_dp(world, "critic", &cfg.critic.strategy, &cfg.critic.megatron)?,
        })
    }
}

/// A role's data-parallel size: every rank with FSDP, the ranks over tensor × pipeline ×
/// context groups with Megatron.
fn role_dp(world: u64, prefix: &str, strategy: &str, mg: &MegatronConfig) -> Result<u64> {
    if strategy != "megatron" {
        return Ok(world);
    }
    let (tp, pp, cp) = (
        mg.tensor_model_parallel_size,
        mg.pipeline_model_parallel_size,
        mg.context_parallel_size,
    );
    let mp = tp * pp * cp;
    if mp == 0 || world % mp != 0 {
        return Err(ConfigError::Layout {
            key: format!("{prefix}.megatron.tensor_model_parallel_size"),
            message: format!(
                "{world} GPUs cannot be split into model-parallel groups of tensor_model_parallel_size={tp} × pipeline_model_parallel_size={pp} × context_parallel_size={cp} = {mp}"
            ),
        });
    }
    Ok(world / mp)
}

/// The derived numbers of one training step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BatchPlan {
    pub layout: Layout,
    /// `data.train_batch_size`.
    pub prompts_per_step: u64,
    /// `actor_rollout_ref.rollout.n`.
    pub rollout_n: u64,
    /// prompts × n.
    pub responses_per_step: u64,
    /// Prompts each actor rank generates for.
    pub prompts_per_rank: u64,
    /// Responses each actor rank holds.
    pub responses_per_rank: u64,
    pub actor: UpdatePlan,
    /// `None` when no critic runs.
    pub critic: Option<UpdatePlan>,
    /// Recomputing the behaviour policy's log-probs (`actor_rollout_ref.rollout.log_prob_*`).
    pub old_log_prob: ForwardPlan,
    /// `None` when no reference policy runs.
    pub ref_log_prob: Option<ForwardPlan>,
    /// Critic value computation (`critic.forward_*`); `None` when no critic runs.
    pub critic_values: Option<ForwardPlan>,
    pub validation: ValidationPlan,
    /// Legal but probably unintended settings.
    pub warnings: Vec<String>,
}

/// A role's parameter update within one step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UpdatePlan {
    pub dp_size: u64,
    /// `ppo_mini_batch_size` (prompts).
    pub mini_batch_prompts: u64,
    /// mini-batch prompts × n, over all ranks.
    pub mini_batch_responses: u64,
    /// Responses in one mini-batch on one rank.
    pub mini_batch_per_rank: u64,
    /// train_batch_size / ppo_mini_batch_size.
    pub mini_batches_per_step: u64,
    pub ppo_epochs: u64,
    /// mini-batches × epochs.
    pub optimizer_steps_per_step: u64,
    /// `None` with dynamic batch sizes.
    pub micro_batch_per_gpu: Option<u64>,
    /// Micro-batches per mini-batch per rank; `None` with dynamic batch sizes.
    pub micro_batches_per_mini_batch: Option<u64>,
    /// Backward passes accumulated per optimizer step (= micro-batches per mini-batch).
    pub grad_accumulation_steps: Option<u64>,
    pub dynamic_bsz: bool,
    /// Token budget per micro-batch with dynamic batch sizes.
    pub max_token_len_per_gpu: Option<u64>,
}

/// A forward-only pass over a rank's whole batch (log-probs, values).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ForwardPlan {
    pub dp_size: u64,
    pub responses_per_rank: u64,
    pub micro_batch_per_gpu: Option<u64>,
    pub micro_batches_per_rank: Option<u64>,
    pub dynamic_bsz: bool,
    pub max_token_len_per_gpu: Option<u64>,
}

/// Validation generation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ValidationPlan {
    /// `data.val_batch_size`; `None`: the whole validation set at once (verl's behaviour).
    pub prompts_per_batch: Option<u64>,
    /// `rollout.val_kwargs.n`.
    pub n: u64,
    pub responses_per_batch: Option<u64>,
    /// Prompts each rank generates for, after padding the batch to a multiple of the
    /// data-parallel size (verl pads validation batches rather than failing).
    pub prompts_per_rank: Option<u64>,
    pub padding_prompts: Option<u64>,
}

/// The value nearest to `from` (within a generous window) that satisfies `ok`; on a tie the
/// lower (`prefer_lower`) or higher candidate wins.
fn nearest(from: u64, prefer_lower: bool, ok: impl Fn(u64) -> bool) -> Option<u64> {
    let limit = from.max(64) * 8;
    for d in 0..=limit {
        let lo = from.checked_sub(d).filter(|v| *v >= 1);
        let hi = Some(from + d);
        let order = if prefer_lower { [lo, hi] } else { [hi, lo] };
        for v in order.into_iter().flatten() {
            if ok(v) {
                return Some(v);
            }
        }
    }
    None
}

fn err(key: &str, value: u64, message: String, suggested: Option<u64>) -> ConfigError {
    ConfigError::BatchSize {
        key: key.to_string(),
        value,
        message,
        suggested,
    }
}

/// Micro-batch size of a role, from `*_per_gpu` or verl's deprecated global key
/// (divided by the data-parallel size, as verl does).
struct Micro<'a> {
    per_gpu_key: &'a str,
    per_gpu: Option<u64>,
    global_key: &'a str,
    global: Option<u64>,
}

impl Micro<'_> {
    /// The per-GPU micro-batch, or `None` when neither key is set.
    fn resolve(&self, dp: u64, role: &str) -> Result<Option<(u64, &str)>> {
        match (self.per_gpu, self.global) {
            (Some(_), Some(g)) => Err(err(
                self.global_key,
                g,
                format!(
                    "both {} and the deprecated {}={g} are set; remove {}",
                    self.per_gpu_key, self.global_key, self.global_key
                ),
                None,
            )),
            (Some(0), None) => Err(err(
                self.per_gpu_key,
                0,
                format!(
                    "{}=0: a micro-batch needs at least one response",
                    self.per_gpu_key
                ),
                Some(1),
            )),
            (Some(m), None) => Ok(Some((m, self.per_gpu_key))),
            (None, Some(g)) => {
                if g == 0 || g % dp != 0 {
                    return Err(err(
                        self.global_key,
                        g,
                        format!(
                            "the deprecated global {}={g} is not divisible by the {role} data-parallel size {dp} (it is divided over ranks); prefer {} per GPU",
                            self.global_key, self.per_gpu_key
                        ),
                        nearest(g.max(1), false, |v| v % dp == 0),
                    ));
                }
                Ok(Some((g / dp, self.global_key)))
            }
            (None, None) => Ok(None),
        }
    }
}

/// Checks every batch-size rule for `cfg` laid out as `layout`, and derives the step's numbers.
pub fn validate_batches(cfg: &Config, layout: Layout) -> Result<BatchPlan> {
    let arr = &cfg.actor_rollout_ref;
    let actor = &arr.actor;
    let tbs = cfg.data.train_batch_size;
    let n = arr.rollout.n;
    let use_critic = cfg.need_critic();
    // With LoRA the reference is the actor's base (adapters off): its log-probs are an actor pass,
    // micro-batched as the actor's (verl's ref_in_actor).
    let use_ref = cfg.need_reference_policy() && !cfg.policy_lora();
    let dp_a = layout.dp_size_actor;
    let dp_c = layout.dp_size_critic;
    let dp_r = layout.dp_size_ref;

    for (key, v) in [
        ("data.train_batch_size", tbs),
        ("actor_rollout_ref.rollout.n", n),
        ("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs),
    ] {
        if v == 0 {
            return Err(err(
                key,
                0,
                format!("{key}=0; it must be at least 1"),
                Some(1),
            ));
        }
    }
    for (what, v) in [
        ("world size", layout.world_size),
        ("actor data-parallel size", dp_a),
        ("critic data-parallel size", dp_c),
        ("ref data-parallel size", dp_r),
    ] {
        if v == 0 {
            return Err(ConfigError::Layout {
                key: "layout".into(),
                message: format!("the {what} is 0"),
            });
        }
    }
    if use_critic && cfg.critic.ppo_epochs == 0 {
        return Err(err(
            "critic.ppo_epochs",
            0,
            "critic.ppo_epochs=0; it must be at least 1".into(),
            Some(1),
        ));
    }

    // The per-rank batch each forward pass must split into equal micro-batches.
    let lp_micro_ok = |micro: Option<u64>, dp: u64, t: u64| {
        micro.is_none_or(|m| (t * n) % dp == 0 && ((t * n) / dp) % m == 0)
    };
    let rollout_lp_micro = if arr.rollout.log_prob_use_dynamic_bsz {
        None
    } else {
        arr.rollout.log_prob_micro_batch_size_per_gpu
    };
    let ref_lp_micro = if use_ref && !arr.reference.log_prob_use_dynamic_bsz {
        arr.reference.log_prob_micro_batch_size_per_gpu
    } else {
        None
    };
    let critic_fwd_micro = if use_critic && !cfg.critic.use_dynamic_bsz {
        cfg.critic.forward_micro_batch_size_per_gpu
    } else {
        None
    };
    let tbs_ok = |t: u64| {
        t % dp_a == 0
            && (!use_ref || t % dp_r == 0)
            && (!use_critic || t % dp_c == 0)
            && t >= actor.ppo_mini_batch_size
            && actor.ppo_mini_batch_size > 0
            && t % actor.ppo_mini_batch_size == 0
            && (!use_critic
                || (cfg.critic.ppo_mini_batch_size > 0
                    && t >= cfg.critic.ppo_mini_batch_size
                    && t % cfg.critic.ppo_mini_batch_size == 0))
            && lp_micro_ok(rollout_lp_micro, dp_a, t)
            && lp_micro_ok(ref_lp_micro, dp_r, t)
            && lp_micro_ok(critic_fwd_micro, dp_c, t)
    };

    // 1. The step's prompts split over the ranks that generate them.
    for (dp, role, used) in [
        (dp_a, "actor", true),
        (dp_r, "ref", use_ref),
        (dp_c, "critic", use_critic),
    ] {
        if used && tbs % dp != 0 {
            return Err(err(
                "data.train_batch_size",
                tbs,
                format!(
                    "data.train_batch_size={tbs} prompts (× rollout.n={n} = {} responses) cannot be split evenly over the {role} data-parallel size {dp}: {tbs} mod {dp} = {}; each rank generates and scores whole prompt groups",
                    tbs * n,
                    tbs % dp
                ),
                nearest(tbs, false, tbs_ok),
            ));
        }
    }
    let prompts_per_rank = tbs / dp_a;
    let responses_per_rank = prompts_per_rank * n;

    // 2. Actor update.
    let actor_plan = update_plan(
        Role {
            prefix: "actor_rollout_ref.actor",
            name: "actor",
            mini: actor.ppo_mini_batch_size,
            micro: Micro {
                per_gpu_key: "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                per_gpu: actor.ppo_micro_batch_size_per_gpu,
                global_key: "actor_rollout_ref.actor.ppo_micro_batch_size",
                global: actor.ppo_micro_batch_size,
            },
            dynamic: actor.use_dynamic_bsz,
            max_tokens: actor.ppo_max_token_len_per_gpu,
            max_tokens_key: "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
            epochs: actor.ppo_epochs,
        },
        cfg,
        dp_a,
    )?;

    // 3. Forward passes: old log-probs, reference log-probs, critic values.
    let seq_len = arr.rollout.prompt_length + arr.rollout.response_length;
    let old_log_prob = forward_plan(
        ForwardRole {
            prefix: "actor_rollout_ref.rollout",
            name: "rollout log-prob",
            micro: Micro {
                per_gpu_key: "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                per_gpu: arr.rollout.log_prob_micro_batch_size_per_gpu,
                global_key: "actor_rollout_ref.rollout.log_prob_micro_batch_size",
                global: arr.rollout.log_prob_micro_batch_size,
            },
            dynamic: arr.rollout.log_prob_use_dynamic_bsz,
            max_tokens: arr.rollout.log_prob_max_token_len_per_gpu,
            max_tokens_key: "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        },
        tbs,
        n,
        dp_a,
        seq_len,
    )?;
    let ref_log_prob = if use_ref {
        let r = &arr.reference;
        Some(forward_plan(
            ForwardRole {
                prefix: "actor_rollout_ref.ref",
                name: "ref log-prob",
                micro: Micro {
                    per_gpu_key: "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                    per_gpu: r.log_prob_micro_batch_size_per_gpu,
                    global_key: "actor_rollout_ref.ref.log_prob_micro_batch_size",
                    global: r.log_prob_micro_batch_size,
                },
                dynamic: r.log_prob_use_dynamic_bsz,
                max_tokens: r.log_prob_max_token_len_per_gpu,
                max_tokens_key: "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
            },
            tbs,
            n,
            dp_r,
            seq_len,
        )?)
    } else {
        None
    };

    // 4. Critic.
    let (critic_plan, critic_values) = if use_critic {
        let c = &cfg.critic;
        let plan = update_plan(
            Role {
                prefix: "critic",
                name: "critic",
                mini: c.ppo_mini_batch_size,
                micro: Micro {
                    per_gpu_key: "critic.ppo_micro_batch_size_per_gpu",
                    per_gpu: c.ppo_micro_batch_size_per_gpu,
                    global_key: "critic.ppo_micro_batch_size",
                    global: c.ppo_micro_batch_size,
                },
                dynamic: c.use_dynamic_bsz,
                max_tokens: c.ppo_max_token_len_per_gpu,
                max_tokens_key: "critic.ppo_max_token_len_per_gpu",
                epochs: c.ppo_epochs,
            },
            cfg,
            dp_c,
        )?;
        let values = forward_plan(
            ForwardRole {
                prefix: "critic",
                name: "critic value",
                micro: Micro {
                    per_gpu_key: "critic.forward_micro_batch_size_per_gpu",
                    per_gpu: c.forward_micro_batch_size_per_gpu,
                    global_key: "critic.forward_micro_batch_size",
                    // verl derives the forward global size from ppo_micro_batch_size; when that
                    // per-GPU value was derived too, the per-GPU key already carries it.
                    global: c
                        .forward_micro_batch_size
                        .filter(|_| c.forward_micro_batch_size_per_gpu.is_none()),
                },
                dynamic: c.use_dynamic_bsz,
                max_tokens: c.forward_max_token_len_per_gpu,
                max_tokens_key: "critic.forward_max_token_len_per_gpu",
            },
            tbs,
            n,
            dp_c,
            seq_len,
        )?;
        (Some(plan), Some(values))
    } else {
        (None, None)
    };

    // 5. Validation.
    let val_n = arr.rollout.val_kwargs.n;
    if val_n == 0 {
        return Err(err(
            "actor_rollout_ref.rollout.val_kwargs.n",
            0,
            "actor_rollout_ref.rollout.val_kwargs.n=0; validation needs at least one response per prompt".into(),
            Some(1),
        ));
    }
    let validation = match cfg.data.val_batch_size {
        Some(0) => {
            return Err(err(
                "data.val_batch_size",
                0,
                "data.val_batch_size=0; use null to validate on the whole set at once".into(),
                None,
            ))
        }
        Some(v) => {
            let per_rank = v.div_ceil(dp_a);
            ValidationPlan {
                prompts_per_batch: Some(v),
                n: val_n,
                responses_per_batch: Some(v * val_n),
                prompts_per_rank: Some(per_rank),
                padding_prompts: Some(per_rank * dp_a - v),
            }
        }
        None => ValidationPlan {
            prompts_per_batch: None,
            n: val_n,
            responses_per_batch: None,
            prompts_per_rank: None,
            padding_prompts: None,
        },
    };

    let mut warnings = Vec::new();
    let group_based = matches!(
        cfg.algorithm.adv_estimator.as_str(),
        "grpo"
            | "grpo_passk"
            | "grpo_vectorized"
            | "rloo"
            | "rloo_vectorized"
            | "opo"
            | "reinforce_plus_plus_baseline"
    );
    if group_based && n == 1 {
        warnings.push(format!(
            "algorithm.adv_estimator={} compares responses within a prompt group, but actor_rollout_ref.rollout.n=1: every advantage will be 0",
            cfg.algorithm.adv_estimator
        ));
    }
    if cfg.algorithm.use_kl_in_reward && actor.use_kl_loss {
        warnings.push(
            "both algorithm.use_kl_in_reward and actor_rollout_ref.actor.use_kl_loss are on: KL is penalised twice".into(),
        );
    }
    if arr.rollout.val_kwargs.do_sample && arr.rollout.val_kwargs.temperature <= 0.0 {
        warnings.push(format!(
            "actor_rollout_ref.rollout.val_kwargs.do_sample=true with temperature={}: sampling at temperature 0 is greedy decoding",
            arr.rollout.val_kwargs.temperature
        ));
    }
    if let Some(v) = validation.padding_prompts.filter(|p| *p > 0) {
        warnings.push(format!(
            "data.val_batch_size={} is not a multiple of the data-parallel size {dp_a}: each validation batch is padded with {v} prompt(s)",
            cfg.data.val_batch_size.unwrap_or(0)
        ));
    }

    Ok(BatchPlan {
        layout,
        prompts_per_step: tbs,
        rollout_n: n,
        responses_per_step: tbs * n,
        prompts_per_rank,
        responses_per_rank,
        actor: actor_plan,
        critic: critic_plan,
        old_log_prob,
        ref_log_prob,
        critic_values,
        validation,
        warnings,
    })
}

struct Role<'a> {
    prefix: &'a str,
    name: &'a str,
    mini: u64,
    micro: Micro<'a>,
    dynamic: bool,
    max_tokens: u64,
    max_tokens_key: &'a str,
    epochs: u64,
}

fn update_plan(r: Role<'_>, cfg: &Config, dp: u64) -> Result<UpdatePlan> {
    let tbs = cfg.data.train_batch_size;
    let n = cfg.actor_rollout_ref.rollout.n;
    let mini_key = format!("{}.ppo_mini_batch_size", r.prefix);
    let mini = r.mini;
    let micro_given = if r.dynamic { None } else { r.micro.per_gpu };
    let mini_ok = |m: u64| {
        m >= 1
            && m <= tbs
            && tbs % m == 0
            && (m * n) % dp == 0
            && micro_given.is_none_or(|mu| ((m * n) / dp) % mu == 0)
    };
    if mini == 0 || mini > tbs {
        return Err(err(
            &mini_key,
            mini,
            format!("{mini_key}={mini} prompts must be between 1 and data.train_batch_size={tbs}"),
            nearest(mini.clamp(1, tbs), true, mini_ok),
        ));
    }
    if tbs % mini != 0 {
        return Err(err(
            &mini_key,
            mini,
            format!(
                "data.train_batch_size={tbs} is not a whole number of {} mini-batches of {mini_key}={mini}: {tbs} mod {mini} = {}",
                r.name,
                tbs % mini
            ),
            nearest(mini, true, mini_ok),
        ));
    }
    let mini_responses = mini * n;
    if mini_responses % dp != 0 {
        return Err(err(
            &mini_key,
            mini,
            format!(
                "{mini_key}={mini} × rollout.n={n} = {mini_responses} responses is not divisible by the {} data-parallel size {dp}: {mini_responses} mod {dp} = {}",
                r.name,
                mini_responses % dp
            ),
            nearest(mini, false, mini_ok),
        ));
    }
    let per_rank = mini_responses / dp;
    let mini_batches = tbs / mini;

    let (micro, micro_batches) = if r.dynamic {
        check_token_budget(r.max_tokens_key, r.max_tokens, cfg)?;
        (None, None)
    } else {
        let Some((micro, key)) = r.micro.resolve(dp, r.name)? else {
            let example = nearest(per_rank.min(4), true, |v| per_rank % v == 0);
            return Err(err(
                r.micro.per_gpu_key,
                0,
                format!(
                    "{} without use_dynamic_bsz needs a micro-batch size: set {} (a divisor of the {per_rank} responses per rank in each mini-batch) or {}.use_dynamic_bsz=true",
                    r.name, r.micro.per_gpu_key, r.prefix
                ),
                example,
            ));
        };
        // verl splits each rank's mini-batch into chunks of the micro-batch size: one larger than
        // the rank's rows is one micro-batch of all of them.
        if micro >= per_rank {
            return Ok(UpdatePlan {
                dp_size: dp,
                mini_batch_prompts: mini,
                mini_batch_responses: mini_responses,
                mini_batch_per_rank: per_rank,
                mini_batches_per_step: mini_batches,
                ppo_epochs: r.epochs,
                optimizer_steps_per_step: mini_batches * r.epochs,
                micro_batch_per_gpu: Some(per_rank),
                micro_batches_per_mini_batch: Some(1),
                grad_accumulation_steps: Some(1),
                dynamic_bsz: false,
                max_token_len_per_gpu: None,
            });
        }
        if per_rank % micro != 0 {
            let shown = if key == r.micro.global_key {
                micro * dp
            } else {
                micro
            };
            return Err(err(
                key,
                shown,
                format!(
                    "the {} mini-batch on each rank is {mini_key}={mini} × rollout.n={n} / data-parallel size {dp} = {per_rank} responses, which does not split into micro-batches of {micro}{}: {per_rank} mod {micro} = {}",
                    r.name,
                    if key == r.micro.global_key { format!(" ({key}={shown} / {dp})") } else { String::new() },
                    per_rank % micro
                ),
                nearest(micro.min(per_rank), true, |v| per_rank % v == 0)
                    .map(|v| if key == r.micro.global_key { v * dp } else { v }),
            ));
        }
        (Some(micro), Some(per_rank / micro))
    };

    Ok(UpdatePlan {
        dp_size: dp,
        mini_batch_prompts: mini,
        mini_batch_responses: mini_responses,
        mini_batch_per_rank: per_rank,
        mini_batches_per_step: mini_batches,
        ppo_epochs: r.epochs,
        optimizer_steps_per_step: mini_batches * r.epochs,
        micro_batch_per_gpu: micro,
        micro_batches_per_mini_batch: micro_batches,
        grad_accumulation_steps: micro_batches,
        dynamic_bsz: r.dynamic,
        max_token_len_per_gpu: r.dynamic.then_some(r.max_tokens),
    })
}

struct ForwardRole<'a> {
    prefix: &'a str,
    name: &'a str,
    micro: Micro<'a>,
    dynamic: bool,
    max_tokens: u64,
    max_tokens_key: &'a str,
}

fn forward_plan(
    r: ForwardRole<'_>,
    tbs: u64,
    n: u64,
    dp: u64,
    seq_len: u64,
) -> Result<ForwardPlan> {
    let total = tbs * n;
    if total % dp != 0 {
        return Err(err(
            "data.train_batch_size",
            tbs,
            format!(
                "data.train_batch_size={tbs} × rollout.n={n} = {total} responses is not divisible by the {} data-parallel size {dp}",
                r.name
            ),
            nearest(tbs, false, |t| (t * n) % dp == 0),
        ));
    }
    let per_rank = total / dp;
    if r.dynamic {
        if r.max_tokens < seq_len {
            return Err(err(
                r.max_tokens_key,
                r.max_tokens,
                format!(
                    "{}={} tokens cannot hold one full sequence of rollout.prompt_length + rollout.response_length = {seq_len} tokens (dynamic batching packs whole sequences)",
                    r.max_tokens_key, r.max_tokens,
                ),
                Some(seq_len),
            ));
        }
        return Ok(ForwardPlan {
            dp_size: dp,
            responses_per_rank: per_rank,
            micro_batch_per_gpu: None,
            micro_batches_per_rank: None,
            dynamic_bsz: true,
            max_token_len_per_gpu: Some(r.max_tokens),
        });
    }
    let Some((micro, key)) = r.micro.resolve(dp, r.name)? else {
        return Err(err(
            r.micro.per_gpu_key,
            0,
            format!(
                "the {} pass without dynamic batch sizes needs a micro-batch size: set {} (a divisor of the {per_rank} responses per rank) or {}.log_prob_use_dynamic_bsz=true",
                r.name, r.micro.per_gpu_key, r.prefix
            ),
            nearest(per_rank.min(4), true, |v| per_rank % v == 0),
        ));
    };
    if micro < per_rank && per_rank % micro != 0 {
        let is_global = key == r.micro.global_key;
        let shown = if is_global { micro * dp } else { micro };
        return Err(err(
            key,
            shown,
            format!(
                "each rank's {} batch is data.train_batch_size={tbs} × rollout.n={n} / data-parallel size {dp} = {per_rank} responses, which does not split into micro-batches of {micro}: {per_rank} mod {micro} = {}",
                r.name,
                per_rank % micro
            ),
            nearest(micro.min(per_rank), true, |v| per_rank % v == 0)
                .map(|v| if is_global { v * dp } else { v }),
        ));
    }
    Ok(ForwardPlan {
        dp_size: dp,
        responses_per_rank: per_rank,
        micro_batch_per_gpu: Some(micro.min(per_rank)),
        micro_batches_per_rank: Some(per_rank.div_ceil(micro)),
        dynamic_bsz: false,
        max_token_len_per_gpu: None,
    })
}

fn check_token_budget(key: &str, max_tokens: u64, cfg: &Config) -> Result<()> {
    let r = &cfg.actor_rollout_ref.rollout;
    let seq_len = r.prompt_length + r.response_length;
    if max_tokens < seq_len {
        return Err(err(
            key,
            max_tokens,
            format!(
                "{key}={max_tokens} tokens cannot hold one full sequence of rollout.prompt_length={} + rollout.response_length={} = {seq_len} tokens (dynamic batching packs whole sequences)",
                r.prompt_length,
                r.response_length
            ),
            Some(seq_len),
        ));
    }
    Ok(())
}

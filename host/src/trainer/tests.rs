//! The trainer's own pieces: settings, seeds, rank slices, batch balancing, metric merging.

use std::sync::Arc;

use verl_algos::{Grid, KlController, KlPenalty};
use verl_config::Config;
use verl_plugin_api::{col, Batch};

use super::reduce::Ranks;
use super::rollout::{
    balance_rollout, call_seed, generate_options, rank_slice, validation_options, Balanced,
    SALT_GREEDY, SALT_TRAIN, SALT_VAL,
};
use super::setup::{algorithm_settings, data_config, DataLayout};
use super::step::{merge, rollout_probs_diff};
use crate::dist::HostGroup;

/// The config accepts exactly the estimators the trainer computes (the two crates do not
/// depend on each other, so the lists are compared here).
#[test]
fn the_config_accepts_the_estimators_the_trainer_computes() {
    assert_eq!(
        verl_config::IMPLEMENTED_ESTIMATORS,
        verl_algos::AdvantageEstimator::NAMES
    );
    for name in verl_config::IMPLEMENTED_ESTIMATORS {
        assert!(verl_config::ADV_ESTIMATORS.contains(name), "{name}");
    }
}

#[test]
fn call_seeds_depend_on_step_and_purpose_only() {
    assert_eq!(call_seed(42, 3, SALT_TRAIN), call_seed(42, 3, SALT_TRAIN));
    let all = [
        call_seed(42, 3, SALT_TRAIN),
        call_seed(42, 4, SALT_TRAIN),
        call_seed(42, 3, SALT_GREEDY),
        call_seed(42, 3, SALT_VAL),
        call_seed(43, 3, SALT_TRAIN),
    ];
    for i in 0..all.len() {
        for j in i + 1..all.len() {
            assert_ne!(all[i], all[j], "{i} vs {j}");
        }
    }
}

fn job(overrides: &[&str]) -> Config {
    Config::from_overrides(overrides).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn data_keys_reach_the_data_loader() {
    let d = data_config(&job(&[
        "data.prompt_key=question",
        "data.reward_fn_key=source",
        "data.max_prompt_length=77",
        "data.filter_overlong_prompts=true",
        "data.truncation=middle",
        "data.train_max_samples=100",
        "data.val_max_samples=20",
        "data.shuffle=false",
        "data.seed=9",
        "data.train_batch_size=12",
        "data.val_batch_size=5",
        "data.validation_shuffle=true",
        "data.image_key=pictures",
        "data.video_key=clips",
        "data.audio_key=sounds",
    ]))
    .unwrap();
    assert_eq!(d.prompt_key, "question");
    assert_eq!(d.reward_fn_key, "source");
    assert_eq!(d.max_prompt_length, 77);
    assert!(d.filter_overlong_prompts);
    assert_eq!(d.truncation, verl_data::Truncation::Middle);
    assert_eq!((d.train_max_samples, d.val_max_samples), (100, 20));
    assert!(!d.shuffle && d.validation_shuffle);
    assert_eq!(d.seed, Some(9));
    assert_eq!((d.train_batch_size, d.val_batch_size), (12, Some(5)));
    let columns: Vec<&str> = d.media_columns.iter().map(|(_, c)| c.as_str()).collect();
    assert_eq!(columns, ["pictures", "clips", "sounds"]);
    // verl seeds the sampler with data.seed; unset, verl-rs uses its own trainer.seed.
    let d = data_config(&job(&["trainer.seed=5"])).unwrap();
    assert_eq!(d.seed, Some(5));
}

#[test]
fn rollout_keys_reach_generation() {
    let cfg = job(&[
        "actor_rollout_ref.rollout.n=3",
        "actor_rollout_ref.rollout.temperature=0.7",
        "actor_rollout_ref.rollout.top_p=0.9",
        "actor_rollout_ref.rollout.top_k=20",
        "actor_rollout_ref.rollout.do_sample=false",
        "actor_rollout_ref.rollout.ignore_eos=true",
        "data.max_response_length=64",
        "actor_rollout_ref.rollout.val_kwargs.n=4",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.5",
        "actor_rollout_ref.rollout.val_kwargs.top_p=0.8",
        "actor_rollout_ref.rollout.val_kwargs.top_k=5",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
    ]);
    let g = generate_options(&cfg, &[7, 8], 0, 11);
    assert_eq!((g.n, g.max_new_tokens), (3, 64));
    assert_eq!((g.temperature, g.top_p, g.top_k), (0.7, 0.9, 20));
    assert!(!g.do_sample && g.ignore_eos && !g.validate);
    assert_eq!((g.eos_token_ids.clone(), g.seed), (vec![7, 8], Some(11)));
    let v = validation_options(&cfg, &[7], 0, 12);
    assert_eq!((v.n, v.max_new_tokens), (4, 64));
    assert_eq!((v.temperature, v.top_p, v.top_k), (0.5, 0.8, 5));
    assert!(v.do_sample && v.validate);
    // rollout.response_length follows data.max_response_length unless set itself.
    let cfg = job(&["actor_rollout_ref.rollout.response_length=32"]);
    assert_eq!(generate_options(&cfg, &[1], 0, 1).max_new_tokens, 32);
}

#[test]
fn algorithm_keys_reach_the_advantage_and_kl_settings() {
    let (p, penalty, ctrl) = algorithm_settings(&job(&[
        "algorithm.gamma=0.9",
        "algorithm.lam=0.8",
        "algorithm.norm_adv_by_std_in_grpo=false",
        "algorithm.kl_penalty=low_var_kl",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.2",
        "algorithm.kl_ctrl.target_kl=0.05",
        "algorithm.kl_ctrl.horizon=500",
    ]))
    .unwrap();
    assert_eq!(
        (p.gamma, p.lam, p.norm_adv_by_std_in_grpo),
        (0.9, 0.8, false)
    );
    assert_eq!(penalty, KlPenalty::LowVarKl);
    assert_eq!(
        ctrl,
        KlController::Adaptive {
            value: 0.2,
            target: 0.05,
            horizon: 500.0
        }
    );
    let (_, penalty, ctrl) = algorithm_settings(&job(&[
        "algorithm.kl_penalty=mse",
        "algorithm.kl_ctrl.kl_coef=0.3",
    ]))
    .unwrap();
    assert_eq!(penalty, KlPenalty::Mse);
    assert_eq!(ctrl, KlController::fixed(0.3));
}

/// A generation output of `n = 2` samples per prompt with these prompt / response lengths.
fn generated(lengths: &[(usize, usize)], first_prompt: usize) -> Batch {
    let (pw, rw) = (12, 12);
    let rows = lengths.len();
    let mut pm = vec![0i64; rows * pw];
    let mut rm = vec![0i64; rows * rw];
    for (r, &(p, q)) in lengths.iter().enumerate() {
        pm[r * pw + pw - p..(r + 1) * pw].fill(1);
        rm[r * rw..r * rw + q].fill(1);
    }
    let mut b = Batch::new();
    b.insert_tensor(col::PROMPT_MASK, &[rows, pw], &pm);
    b.insert_tensor(col::RESPONSE_MASK, &[rows, rw], &rm);
    let ids: Vec<i64> = (0..rows).map(|r| (r / 2) as i64).collect();
    b.insert_tensor(col::PROMPT_INDEX, &[rows], &ids);
    // The row's global number, to see where it went.
    let tag: Vec<i64> = (0..rows).map(|r| (first_prompt * 2 + r) as i64).collect();
    b.insert_tensor("tag", &[rows], &tag);
    b
}

const LENGTHS: [(usize, usize); 8] = [
    (6, 4),
    (2, 1),
    (4, 3),
    (3, 2),
    (5, 4),
    (1, 1),
    (5, 3),
    (2, 2),
];

/// `trainer.balance_batch` on one rank.
#[test]
fn one_rank_keeps_its_rows_in_verls_balanced_order() {
    let cfg = job(&[]);
    let dp = DataLayout::new(&cfg, 0, 1).unwrap();
    let b = balance_rollout(&cfg, generated(&LENGTHS, 0), 0..4, &dp, Ranks::default()).unwrap();
    // Sequence lengths 10 3 7 5 9 2 8 4: sorted by workload 5 1 7 3 2 6 4 0, then verl's
    // zigzag (even positions, then the odd ones reversed).
    assert_eq!(
        b.batch.tensor::<i64>("tag").unwrap().data,
        vec![5, 7, 2, 4, 0, 6, 3, 1]
    );
    // The rows answer prompts 2 3 1 2 0 3 1 0, listed in first-seen order.
    assert_eq!(b.prompts, vec![2, 3, 1, 0]);
    assert_eq!(
        b.batch.tensor::<i64>(col::PROMPT_INDEX).unwrap().data,
        vec![0, 1, 2, 0, 3, 1, 2, 3]
    );
    let m: std::collections::BTreeMap<_, _> = b.metrics.into_iter().collect();
    assert_eq!(m["global_seqlen/min"], 48.0);
    assert_eq!(m["global_seqlen/balanced_max"], 48.0);
    assert_eq!(m["global_seqlen/mean"], 48.0);
}

/// `trainer.balance_batch` across data-parallel ranks.
#[test]
fn ranks_trade_whole_prompt_groups_until_their_work_is_equal() {
    use verl_store::{StoreClient, StoreServer};
    let cfg = job(&["trainer.n_gpus_per_node=2"]);
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.connect_addr();
    let outs: Vec<Balanced> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2usize)
            .map(|r| {
                let cfg = &cfg;
                s.spawn(move || {
                    let c = StoreClient::connect_as(addr, r, std::time::Duration::from_secs(5))
                        .unwrap();
                    let g = HostGroup::new(Arc::new(c), r, 2, std::time::Duration::from_secs(10));
                    let dp = DataLayout::new(cfg, r as u32, 2).unwrap();
                    let mine = &LENGTHS[r * 4..(r + 1) * 4];
                    let slice = r * 2..(r + 1) * 2;
                    balance_rollout(
                        cfg,
                        generated(mine, r * 2),
                        slice,
                        &dp,
                        Ranks::new(Some(&g)),
                    )
                    .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Group sizes 13 12 11 12 tokens: before, ranks hold 25 and 23; after, 24 and 24.
    let tokens = |b: &Balanced| -> usize {
        b.batch
            .tensor::<i64>("tag")
            .unwrap()
            .data
            .iter()
            .map(|&t| LENGTHS[t as usize].0 + LENGTHS[t as usize].1)
            .sum()
    };
    assert_eq!((tokens(&outs[0]), tokens(&outs[1])), (24, 24));
    let mut all: Vec<i64> = outs
        .iter()
        .flat_map(|b| b.batch.tensor::<i64>("tag").unwrap().data)
        .collect();
    all.sort();
    assert_eq!(
        all,
        (0..8).collect::<Vec<i64>>(),
        "every row on exactly one rank"
    );
    for b in &outs {
        // Whole groups: each prompt's two samples on the same rank.
        assert_eq!(b.prompts.len(), 2);
        let tags = b.batch.tensor::<i64>("tag").unwrap().data;
        for p in &b.prompts {
            assert_eq!(tags.iter().filter(|&&t| t as usize / 2 == *p).count(), 2);
        }
    }
    assert_eq!(outs[0].metrics, outs[1].metrics);
    let m: std::collections::BTreeMap<_, _> = outs[0].metrics.iter().cloned().collect();
    assert_eq!(
        (m["global_seqlen/min"], m["global_seqlen/max"]),
        (23.0, 25.0)
    );
    assert_eq!(
        (
            m["global_seqlen/balanced_min"],
            m["global_seqlen/balanced_max"]
        ),
        (24.0, 24.0)
    );
}

#[test]
fn ranks_get_disjoint_whole_prompt_slices() {
    assert_eq!(rank_slice(8, 0, 1).unwrap(), 0..8);
    assert_eq!(rank_slice(8, 1, 4).unwrap(), 2..4);
    let err = rank_slice(6, 0, 4).unwrap_err().to_string();
    assert!(err.contains("6 prompts") && err.contains("4"), "{err}");
}

#[test]
fn later_metrics_replace_earlier_ones_in_place() {
    let mut m = vec![("a".to_string(), 1.0), ("b".to_string(), 2.0)];
    merge(&mut m, vec![("a".to_string(), 3.0), ("c".to_string(), 4.0)]);
    assert_eq!(
        m,
        vec![
            ("a".to_string(), 3.0),
            ("b".to_string(), 2.0),
            ("c".to_string(), 4.0)
        ]
    );
}

#[test]
fn probs_diff_ignores_padding() {
    let mask = Grid::new(1, 3, vec![1.0, 1.0, 0.0]).unwrap();
    let m = rollout_probs_diff(
        &[0.0, -1.0, -5.0],
        &[0.0, -1.0, 0.0],
        &mask,
        Ranks::default(),
    )
    .unwrap();
    assert_eq!(m[0], ("training/rollout_probs_diff_max".to_string(), 0.0));
}

use super::*;
use crate::models::{LentModel, ScoringModel};
use crate::trainer::plugins::{InProcessReward, RewardFactory};
use std::sync::{Arc, Mutex};
use verl_plugin_api::client::RewardModelClient;
use verl_plugin_api::{
    BuildInfo, Capability, InitArgs, PluginInfo, Result, Reward, RewardPlugin, Role,
};

/// Scores the response length, and adds `reward_extra/len`.
struct LenRewards;
struct LenReward;

impl RewardPlugin for LenRewards {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "len".into(),
            version: "0".into(),
            description: "response length".into(),
            capabilities: vec![Capability::ready(Role::Reward)],
            build: BuildInfo::plain(),
        }
    }
    fn create_reward(_: &InitArgs) -> Result<Box<dyn Reward>> {
        Ok(Box::new(LenReward))
    }
}

impl Reward for LenReward {
    fn score(&mut self, batch: &Batch, _: &ScoreOptions) -> Result<Batch> {
        let s: Vec<f32> = batch
            .strings(col::RESPONSE_TEXT)?
            .iter()
            .map(|t| t.len() as f32)
            .collect();
        let mut out = Batch::new();
        out.insert_tensor(col::SCORES, &[s.len()], &s);
        out.insert_tensor("reward_extra/len", &[s.len()], &s);
        Ok(out)
    }
}

fn client() -> RewardClient {
    let cfg = serde_json::Value::Null;
    InProcessReward::<LenRewards>::default()
        .create_reward(&InitArgs::new(Role::Reward, cfg), &SharedModels::default())
        .unwrap()
}

fn policy_tokenizer() -> &'static Tokenizer {
    static T: std::sync::OnceLock<(tempfile::TempDir, Tokenizer)> = std::sync::OnceLock::new();
    &T.get_or_init(|| {
        let dir = tokenizer_dir(
            &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            serde_json::json!({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"}),
        );
        let t = Tokenizer::from_dir(dir.path()).unwrap();
        (dir, t)
    })
    .1
}

fn tokenizer_dir(specials: &[&str], config: serde_json::Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let corpus = ["What is 2 + 2? The answer is 4, ok. Say something kind."; 8];
    let tok = verl_chat::train_bpe(&corpus, 300, specials).unwrap();
    tok.save(dir.path().join("tokenizer.json"), false).unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

const NO_PROMPT: &[Message] = &[];

fn input<'a>(
    texts: &'a [String],
    sources: &'a [String],
    gt: &'a [serde_json::Value],
    responses: &'a Tensor<i64>,
    mask: &'a Tensor<i64>,
) -> RewardInput<'a> {
    static EMPTY: std::sync::OnceLock<Tensor<i64>> = std::sync::OnceLock::new();
    let empty = EMPTY.get_or_init(|| Tensor {
        shape: vec![0, 0],
        data: vec![],
    });
    static RAW: [&[Message]; 4] = [NO_PROMPT; 4];
    RewardInput {
        prompt_text: texts,
        response_text: texts,
        data_source: sources,
        ground_truth: gt,
        extra_info: gt,
        responses,
        response_mask: mask,
        raw_prompt: &RAW[..texts.len()],
        prompts: empty,
        prompt_mask: empty,
        policy_tokenizer: policy_tokenizer(),
    }
}

#[test]
fn routes_by_data_source_and_puts_the_score_on_the_last_valid_token() {
    let cfg = Config::from_overrides(&["plugins.reward.routes={b: other}"]).unwrap();
    let mut router = RewardRouter::new(
        vec![
            ("rewards".into(), client().into()),
            ("other".into(), client().into()),
        ],
        SharedModels::default(),
        &cfg,
    )
    .unwrap();
    let texts = vec!["abc".to_string(), "hello".to_string()];
    let sources = vec!["a".to_string(), "b".to_string()];
    let gt = vec![serde_json::Value::Null; 2];
    let responses = Tensor {
        shape: vec![2, 3],
        data: vec![1, 2, 0, 1, 2, 3],
    };
    let mask = Tensor {
        shape: vec![2, 3],
        data: vec![1, 1, 0, 1, 1, 1],
    };
    let out = router
        .score(&cfg, &input(&texts, &sources, &gt, &responses, &mask))
        .unwrap();
    assert_eq!(out.scores, vec![3.0, 5.0]);
    assert_eq!(out.token_level_scores, vec![0.0, 3.0, 0.0, 0.0, 0.0, 5.0]);
    assert_eq!(out.extra["len"], vec![3.0, 5.0]);
}

#[test]
fn an_unloaded_route_names_the_data_source_and_the_plugin() {
    let cfg = Config::from_overrides(&["plugins.reward.routes={b: missing}"]).unwrap();
    let mut router = RewardRouter::new(
        vec![("rewards".into(), client().into())],
        SharedModels::default(),
        &cfg,
    )
    .unwrap();
    let texts = vec!["x".to_string()];
    let sources = vec!["b".to_string()];
    let gt = vec![serde_json::Value::Null];
    let t = Tensor {
        shape: vec![1, 1],
        data: vec![1],
    };
    let err = router
        .score(&cfg, &input(&texts, &sources, &gt, &t, &t))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("`b`") && err.contains("`missing`") && err.contains("loaded: rewards"),
        "{err}"
    );
}

/// A reward model that records what it was given and scores the token count.
struct Recording(Arc<Mutex<Vec<Vec<i64>>>>);

impl Reward for Recording {
    fn score(&mut self, batch: &Batch, _: &ScoreOptions) -> Result<Batch> {
        let ids = batch.tensor::<i64>(col::INPUT_IDS)?;
        let mask = batch.tensor::<i64>(col::ATTENTION_MASK)?;
        let mut seen = self.0.lock().unwrap();
        let mut s = Vec::new();
        for r in 0..ids.rows() {
            let n = mask.row(r).iter().filter(|&&m| m != 0).count();
            // Right padding: the real tokens come first.
            assert!(mask.row(r)[..n].iter().all(|&m| m == 1));
            seen.push(ids.row(r)[..n].to_vec());
            s.push(n as f32);
        }
        let mut out = Batch::new();
        out.insert_tensor(col::SCORES, &[s.len()], &s);
        Ok(out)
    }
}

#[test]
fn the_reward_model_reads_the_response_in_its_own_template_cut_to_max_length() {
    // The reward model: another vocabulary, a Llama-3 style template with a BOS.
    let specials = [
        "<|begin_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ];
    let rm_dir = tokenizer_dir(
        &specials,
        serde_json::json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
            "chat_template": "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endfor %}"}),
    );
    let policy = policy_tokenizer();
    let enc = |t: &str| -> Vec<i64> {
        policy
            .encode(t, false)
            .unwrap()
            .iter()
            .map(|&x| x as i64)
            .collect()
    };
    let special = |t: &str| policy.token_to_id(t).unwrap() as i64;
    // Row 0: a response with a special token mid-way (kept, as verl decodes) and the EOS
    // (removed); row 1: a short one, then padding.
    let mut r0 = enc("The answer is 4");
    r0.push(special("<|im_start|>"));
    r0.extend(enc(" ok"));
    r0.push(special("<|im_end|>"));
    let r1 = enc("4");
    let width = r0.len() + 2;
    let mut data = vec![0i64; 2 * width];
    let mut mask = vec![0i64; 2 * width];
    data[..r0.len()].copy_from_slice(&r0);
    mask[..r0.len()].fill(1);
    data[width..width + r1.len()].copy_from_slice(&r1);
    mask[width..width + r1.len()].fill(1);
    let responses = Tensor {
        shape: vec![2, width],
        data,
    };
    let response_mask = Tensor {
        shape: vec![2, width],
        data: mask,
    };
    let prompt_ids: Vec<i64> = enc("What is 2 + 2?");
    let pw = prompt_ids.len();
    let prompts = Tensor {
        shape: vec![2, pw],
        data: [prompt_ids.clone(), prompt_ids.clone()].concat(),
    };
    let prompt_mask = Tensor {
        shape: vec![2, pw],
        data: vec![1; 2 * pw],
    };
    let chat = [Message::new("user", "What is 2 + 2?")];
    let raw: [&[Message]; 2] = [&chat, &chat];
    let texts = vec![String::new(); 2];
    let sources = vec!["chat".to_string(), "chat".to_string()];
    let gt = vec![serde_json::Value::Null; 2];
    let input = RewardInput {
        prompt_text: &texts,
        response_text: &texts,
        data_source: &sources,
        ground_truth: &gt,
        extra_info: &gt,
        responses: &responses,
        response_mask: &response_mask,
        raw_prompt: &raw,
        prompts: &prompts,
        prompt_mask: &prompt_mask,
        policy_tokenizer: policy,
    };
    let rm_tok = Tokenizer::from_dir(rm_dir.path()).unwrap();
    let rm_ids = |t: &str| -> Vec<i64> {
        rm_tok
            .encode(t, false)
            .unwrap()
            .iter()
            .map(|&x| x as i64)
            .collect()
    };
    let run = |overrides: &[&str]| -> (Vec<Vec<i64>>, RewardOutput) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let client = RewardModelClient::new(
            verl_plugin_api::sdk::reward_box(Box::new(Recording(seen.clone()))),
            "fake",
        );
        let cfg = Config::from_overrides(overrides).unwrap();
        let max = cfg.reward_model.max_length.map(|m| m as usize);
        let models = SharedModels::new(vec![(
            REWARD_MODEL.to_string(),
            LentModel::Score(ScoringModel::new(rm_dir.path(), max, client).unwrap()),
        )]);
        let mut router = RewardRouter::new(vec![], models, &cfg).unwrap();
        let out = router.score(&cfg, &input).unwrap();
        let seen = seen.lock().unwrap().clone();
        (seen, out)
    };

    let (seen, out) = run(&[
        "reward_model.enable=true",
        "reward_model.model.path=/rm",
        "reward_model.max_length=100",
    ]);
    let turn = |answer: &str| {
        format!("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n{answer}<|eot_id|>")
    };
    assert_eq!(seen[0], rm_ids(&turn("The answer is 4<|im_start|> ok")));
    assert_eq!(seen[1], rm_ids(&turn("4")));
    // The score sits on the last response token.
    assert_eq!(out.scores[1], seen[1].len() as f64);
    assert_eq!(
        out.token_level_scores[width + r1.len() - 1],
        seen[1].len() as f64
    );

    // Without reward_model.max_length: the policy's prompt + response width (verl).
    let (seen, _) = run(&["reward_model.enable=true", "reward_model.model.path=/rm"]);
    assert_eq!(
        seen[0],
        rm_ids(&turn("The answer is 4<|im_start|> ok"))[..pw + width].to_vec()
    );
    // Cut from the right to reward_model.max_length.
    let (seen, _) = run(&[
        "reward_model.enable=true",
        "reward_model.model.path=/rm",
        "reward_model.max_length=9",
    ]);
    assert_eq!(
        seen[0],
        rm_ids(&turn("The answer is 4<|im_start|> ok"))[..9].to_vec()
    );

    // input_tokenizer null: the policy's own prompt + response tokens, as they are.
    let (seen, _) = run(&[
        "reward_model.enable=true",
        "reward_model.model.path=/rm",
        "reward_model.model.input_tokenizer=null",
    ]);
    assert_eq!(seen[0], [prompt_ids.clone(), r0.clone()].concat());
    assert_eq!(seen[1], [prompt_ids, r1].concat());
}

#[test]
fn dapo_overlong_penalties_equal_verls_golden_cases() {
    // Generated by scripts/golden_dapo.py from verl 0.9.1's DAPORewardManager.run_single.
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/golden/dapo_overlong.json"
    );
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = golden["cases"].as_array().unwrap();
    assert!(cases.len() > 50);
    for c in cases {
        let b = &c["overlong_buffer_cfg"];
        let overrides = [
            "reward.reward_manager.name=dapo".to_string(),
            format!(
                "+reward.reward_kwargs.overlong_buffer_cfg.enable={}",
                b["enable"]
            ),
            format!("+reward.reward_kwargs.overlong_buffer_cfg.len={}", b["len"]),
            format!(
                "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor={}",
                b["penalty_factor"]
            ),
            format!("+reward.reward_kwargs.overlong_buffer_cfg.log={}", b["log"]),
            format!("+reward.reward_kwargs.max_resp_len={}", c["max_resp_len"]),
        ];
        let cfg = Config::from_overrides(&overrides).unwrap();
        let o = Overlong::from_config(&cfg).unwrap();
        let valid = c["valid_response_length"].as_u64().unwrap() as usize;
        let score = c["score"].as_f64().unwrap();
        let got = score + o.map_or(0.0, |o| o.reward(valid));
        assert!((got - c["reward"].as_f64().unwrap()).abs() < 1e-12, "{c}");
        match (o, c["extra"].get("overlong_reward")) {
            (Some(o), Some(want)) if o.log => {
                assert!(
                    (o.reward(valid) - want.as_f64().unwrap()).abs() < 1e-12,
                    "{c}"
                );
                assert_eq!(
                    (o.reward(valid) < 0.0) as u8 as f64,
                    c["extra"]["overlong"].as_f64().unwrap()
                );
            }
            (Some(o), None) => assert!(!o.log, "{c}"),
            (None, None) => {}
            _ => panic!("log mismatch: {c}"),
        }
    }
    // A buffer longer than the response budget is refused as verl refuses it.
    let cfg = Config::from_overrides(&[
        "reward.reward_manager.name=dapo",
        "+reward.reward_kwargs.overlong_buffer_cfg.enable=true",
        "+reward.reward_kwargs.overlong_buffer_cfg.len=64",
        "+reward.reward_kwargs.max_resp_len=32",
    ])
    .unwrap();
    let e = Overlong::from_config(&cfg).unwrap_err().to_string();
    assert!(e.contains("max_resp_len=32") && e.contains("len=64"), "{e}");
}

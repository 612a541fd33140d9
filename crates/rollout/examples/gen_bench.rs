//! Prefill and decode throughput of the generation engines on a random model: the paged engine
//! (`v2`, what `generate` runs) against the dense-cache one (`v1`), with a ratio column.
//!
//! CPU, tiny model (default):
//!   cargo run --release -p verl-rollout --example gen_bench
//! Qwen2.5-0.5B-shaped model in bf16 on a GPU, 64 prompts x 8 samples x 512 tokens:
//!   gen_bench --model qwen2.5-0.5b --device cuda --dtype bf16 --batches 64 --n 8 --new-tokens 512
//! Flags: --batches 1,8,64  --prompt-len N  --new-tokens N  --n N (samples per prompt)
//!        --greedy  --consistent (rollout.consistent_attention)  --iters N (timed runs per batch, after one warm-up)  --threads N (CPU intra-op)
//!        --engines v1,v2,v2e (v2e: v2 without CUDA graphs; ratios vs the first)  --block-size N  --kv-tokens N (paged KV budget; default: everything fits)
//!        --max-seqs N  --eos-frac F (token ids below F * vocab end a response: uneven lengths)

use std::process::ExitCode;

use serde_json::json;
use tch::{Device, Kind, Tensor};
use verl_nn::{ModelConfig, ModelOptions, Transformer};
use verl_rollout::{generate_with_config, v1, EngineConfig, GenerationStats, SamplingParams};

struct Args {
    model: String,
    device: Device,
    dtype: Kind,
    batches: Vec<i64>,
    prompt_len: Option<i64>,
    new_tokens: Option<usize>,
    n: usize,
    greedy: bool,
    /// `rollout.consistent_attention`: every attention through the paged kernel, one split.
    consistent: bool,
    iters: usize,
    threads: Option<i32>,
    engines: Vec<String>,
    engine: EngineConfig,
    eos_frac: f64,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        model: "tiny".into(),
        device: Device::Cpu,
        dtype: Kind::Float,
        batches: vec![1, 8, 64],
        prompt_len: None,
        new_tokens: None,
        n: 1,
        greedy: false,
        consistent: false,
        iters: 2,
        threads: None,
        engines: vec!["v1".into(), "v2".into()],
        engine: EngineConfig::default(),
        eos_frac: 0.0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => a.model = value()?,
            "--device" => {
                a.device = match value()?.as_str() {
                    "cpu" => Device::Cpu,
                    "cuda" => Device::Cuda(0),
                    d => return Err(format!("--device: expected cpu or cuda, found {d}")),
                }
            }
            "--dtype" => {
                a.dtype = match value()?.as_str() {
                    "f32" | "fp32" => Kind::Float,
                    "bf16" => Kind::BFloat16,
                    "f16" | "fp16" => Kind::Half,
                    d => return Err(format!("--dtype: expected f32, bf16 or f16, found {d}")),
                }
            }
            "--batches" => {
                a.batches = value()?
                    .split(',')
                    .map(|s| s.trim().parse::<i64>().map_err(|e| format!("--batches {s}: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "--prompt-len" => a.prompt_len = Some(num(&flag, &value()?)?),
            "--new-tokens" => a.new_tokens = Some(num(&flag, &value()?)?),
            "--n" => a.n = num(&flag, &value()?)?,
            "--iters" => a.iters = num::<usize>(&flag, &value()?)?.max(1),
            "--threads" => a.threads = Some(num(&flag, &value()?)?),
            "--greedy" => a.greedy = true,
            "--consistent" => a.consistent = true,
            "--engines" => {
                a.engines = value()?.split(',').map(|s| s.trim().to_string()).collect();
                if let Some(e) = a.engines.iter().find(|e| !["v1", "v2", "v2e"].contains(&e.as_str())) {
                    return Err(format!("--engines: expected v1, v2 and/or v2e (v2 without CUDA graphs), found {e}"));
                }
            }
            "--block-size" => a.engine.block_size = num(&flag, &value()?)?,
            "--kv-tokens" => a.engine.kv_cache_tokens = Some(num(&flag, &value()?)?),
            "--max-seqs" => a.engine.max_num_seqs = Some(num(&flag, &value()?)?),
            "--eos-frac" => a.eos_frac = num(&flag, &value()?)?,
            "-h" | "--help" => {
                return Err("flags: --model tiny|qwen2.5-0.5b|qwen2.5-1.5b --device cpu|cuda --dtype f32|bf16|f16 \
                     --batches 1,8,64 --prompt-len N --new-tokens N --n N --greedy --consistent --iters N --threads N \
                     --engines v1,v2,v2e --block-size N --kv-tokens N --max-seqs N --eos-frac F"
                    .into())
            }
            f => return Err(format!("unknown flag {f} (try --help)")),
        }
    }
    Ok(a)
}

fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    v.parse().map_err(|e| format!("{flag} {v}: {e}"))
}

fn config(name: &str) -> Result<ModelConfig, String> {
    let v = match name {
        "tiny" => json!({
            "model_type": "qwen2", "vocab_size": 1024, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 4096, "tie_word_embeddings": false,
        }),
        "qwen2.5-0.5b" => json!({
            "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
            "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": true,
        }),
        "qwen2.5-1.5b" => json!({
            "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536,
            "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
            "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": true,
        }),
        m => {
            return Err(format!(
                "--model: expected tiny, qwen2.5-0.5b or qwen2.5-1.5b, found {m}"
            ))
        }
    };
    ModelConfig::from_value(v, format!("<{name} preset>")).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    // Engine logs (e.g. the VERL_PROFILE phase table) on stderr, at RUST_LOG's level (info).
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gen_bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let a = parse()?;
    if a.device != Device::Cpu && !tch::Cuda::is_available() {
        return Err("--device cuda: no CUDA device visible to libtorch".into());
    }
    if let Some(t) = a.threads {
        tch::set_num_threads(t);
    }
    let cfg = config(&a.model)?;
    let vocab = cfg.vocab_size;
    let (p, m) = match a.model.as_str() {
        "tiny" => (a.prompt_len.unwrap_or(64), a.new_tokens.unwrap_or(64)),
        _ => (a.prompt_len.unwrap_or(256), a.new_tokens.unwrap_or(256)),
    };
    tch::manual_seed(0);
    let mut model = Transformer::new(
        cfg,
        &ModelOptions {
            device: a.device,
            dtype: a.dtype,
            ..ModelOptions::default()
        },
    )
    .map_err(|e| e.to_string())?;
    model.set_consistent_attention(a.consistent);
    println!(
        "model {} ({:?}, {:?}), prompt {p} tokens, {m} new tokens, n={}, {}",
        a.model,
        a.dtype,
        a.device,
        a.n,
        if a.greedy { "greedy" } else { "sampling T=1" }
    );
    println!(
        "{:>6} {:>6} {:>6} {:>9} {:>11} {:>10} {:>13} {:>9} {:>10} {:>8} {:>7} {:>10}",
        "batch",
        "rows",
        "engine",
        "total s",
        "gen tok/s",
        "TTFT ms",
        "decode tok/s",
        "step ms",
        "peak blks",
        "preempt",
        "vs first",
        "same rows"
    );
    let eos: Vec<i64> = (0..(a.eos_frac * vocab as f64) as i64).collect();
    let params = SamplingParams {
        n: a.n,
        max_new_tokens: m,
        do_sample: !a.greedy,
        seed: Some(0),
        ignore_eos: eos.is_empty(),
        eos_token_ids: eos,
        ..SamplingParams::default()
    };
    for &b in &a.batches {
        let ids =
            Tensor::f_randint(vocab, [b, p], (Kind::Int64, a.device)).map_err(|e| e.to_string())?;
        let mask = Tensor::f_ones([b, p], (Kind::Int64, a.device)).map_err(|e| e.to_string())?;
        let mut v1_rate = None;
        let mut v1_rows: Option<Vec<Vec<i64>>> = None;
        for engine in &a.engines {
            let mut runs: Vec<(f64, GenerationStats)> = Vec::new();
            let mut responses = None;
            for i in 0..=a.iters {
                let t0 = std::time::Instant::now();
                let (g, s) = if engine == "v1" {
                    v1::generate_with_stats(&model, &ids, &mask, &params, None)
                } else {
                    let config = EngineConfig {
                        cuda_graphs: engine == "v2",
                        ..a.engine.clone()
                    };
                    generate_with_config(&model, &ids, &mask, &params, None, &config)
                }
                .map_err(|e| e.to_string())?;
                if let Device::Cuda(d) = a.device {
                    tch::Cuda::synchronize(d as i64);
                }
                if i > 0 {
                    runs.push((t0.elapsed().as_secs_f64(), s));
                }
                responses = Some(g.responses);
            }
            // Greedy/sampled rows of the two engines agree token for token in fp32; in bf16 a
            // near-tie can flip a token and the row diverges from there.
            let got = match responses {
                Some(r) => Vec::<Vec<i64>>::try_from(&r.to_device(Device::Cpu))
                    .map_err(|e| e.to_string())?,
                None => Vec::new(),
            };
            let same = match &v1_rows {
                Some(want) => format!(
                    "{}/{}",
                    want.iter().zip(&got).filter(|(x, y)| x == y).count(),
                    got.len()
                ),
                None => "-".to_string(),
            };
            if v1_rows.is_none() {
                v1_rows = Some(got);
            }
            let k = runs.len() as f64;
            let mean =
                |f: &dyn Fn(&(f64, GenerationStats)) -> f64| runs.iter().map(f).sum::<f64>() / k;
            let total = mean(&|r| r.0);
            let generated = mean(&|r| r.1.generated_tokens as f64);
            let rate = generated / total;
            let decode_secs = mean(&|r| r.1.decode_secs);
            let steps = mean(&|r| r.1.decode_steps as f64);
            // Rates and rows are compared with the first engine listed.
            let ratio = match v1_rate {
                None => {
                    v1_rate = Some(rate);
                    "1.00x".to_string()
                }
                Some(base) => format!("{:.2}x", rate / base),
            };
            println!(
                "{:>6} {:>6} {:>6} {:>9.3} {:>11.0} {:>10.2} {:>13.0} {:>9.3} {:>10.0} {:>8.0} {:>7} {:>10}",
                b,
                b as usize * a.n,
                engine,
                total,
                rate,
                mean(&|r| r.1.prefill_secs) * 1e3,
                mean(&|r| r.1.decode_tokens as f64) / decode_secs.max(1e-9),
                decode_secs * 1e3 / steps.max(1.0),
                mean(&|r| r.1.peak_kv_blocks as f64),
                mean(&|r| r.1.preemptions as f64),
                ratio,
                same,
            );
        }
    }
    Ok(())
}

//! `verl data`: verl-format datasets from GSM8K and MATH, and seeded arithmetic problems.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum DataCmd {
    /// Turn GSM8K's raw `train.jsonl`/`test.jsonl` into verl-format parquet (the rows verl's
    /// `examples/data_preprocess/gsm8k.py` writes).
    /// With `--tools calculator`: train/test.parquet for verl's `tool_agent` loop instead, plus
    /// sft_train/sft_test.parquet, multi-turn conversations calling the calculator where GSM8K's
    /// `<<48/2=24>>` annotations compute.
    Gsm8k {
        raw_dir: PathBuf,
        out_dir: PathBuf,
        /// The tool (the one there is: `calculator`).
        #[arg(long, value_parser = ["calculator"])]
        tools: Option<String>,
    },
    /// Turn a raw copy of DigitalLearningGmbH/MATH-lighteval (`data/{train,test}-*.parquet`, as
    /// `huggingface-cli download` leaves it, or `train.jsonl`/`test.jsonl`) into the verl-format
    /// parquet and `*_example.json` that verl's `examples/data_preprocess/math_dataset.py` writes.
    Math { raw_dir: PathBuf, out_dir: PathBuf },
    /// Generate seeded arithmetic word problems as verl GSM8K-format parquet (train.parquet,
    /// val.parquet; data_source openai/gsm8k) plus SFT pairs (sft_train/sft_val.parquet).
    /// With `--tools calculator`: the tool variant (RL rows for verl's `tool_agent` loop, SFT
    /// rows as multi-turn conversations, `--tool-rate` of them calling the calculator).
    Arith {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 2000)]
        train: usize,
        #[arg(long, default_value_t = 128)]
        val: usize,
        #[arg(long, default_value_t = 7)]
        seed: u64,
        /// Fewest operations per problem.
        #[arg(long, default_value_t = 1)]
        min_ops: usize,
        /// Most operations per problem.
        #[arg(long, default_value_t = 2)]
        max_ops: usize,
        /// Operands are drawn from min_operand..=max_operand.
        #[arg(long, default_value_t = 1)]
        min_operand: u32,
        #[arg(long, default_value_t = 9)]
        max_operand: u32,
        /// A deliberately noisy SFT teacher: this fraction of the SFT training answers ends in a
        /// final `#### N` one too high (RL/validation ground truth always correct).
        #[arg(long, default_value_t = 0.0)]
        sft_noise: f64,
        /// The tool variant's tool (the one there is: `calculator`).
        #[arg(long, value_parser = ["calculator"])]
        tools: Option<String>,
        /// Tool variant: the fraction of SFT conversations that call the tool (the rest answer
        /// directly).
        #[arg(long, requires = "tools", default_value_t = 0.3)]
        tool_rate: f64,
    },
}

pub fn run(cmd: &DataCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        DataCmd::Gsm8k {
            raw_dir,
            out_dir,
            tools: None,
        } => {
            let out = verl_data::gsm8k_preprocess(raw_dir, out_dir)?;
            println!("{} ({} rows)", out.train.display(), out.train_rows);
            println!("{} ({} rows)", out.test.display(), out.test_rows);
        }
        DataCmd::Gsm8k {
            raw_dir,
            out_dir,
            tools: Some(_),
        } => {
            let o = verl_data::gsm8k_tools_preprocess(raw_dir, out_dir)?;
            let agent = verl_data::TOOL_AGENT;
            println!("{} ({} rows, {agent})", o.train.display(), o.train_rows);
            println!("{} ({} rows, {agent})", o.test.display(), o.test_rows);
            println!("{}: {}", o.sft_train.display(), o.sft_train_stats);
            println!("{}: {}", o.sft_test.display(), o.sft_test_stats);
        }
        DataCmd::Math { raw_dir, out_dir } => {
            let out = verl_data::math_preprocess(raw_dir, out_dir)?;
            println!("{} ({} rows)", out.train.display(), out.train_rows);
            println!("{} ({} rows)", out.test.display(), out.test_rows);
        }
        DataCmd::Arith {
            out,
            train,
            val,
            seed,
            min_ops,
            max_ops,
            min_operand,
            max_operand,
            sft_noise,
            tools,
            tool_rate,
        } => {
            let cfg = verl_data::ArithConfig {
                train: *train,
                val: *val,
                seed: *seed,
                min_ops: *min_ops,
                max_ops: *max_ops,
                min_operand: *min_operand,
                max_operand: *max_operand,
                sft_noise: *sft_noise,
                tool_rate: tools.as_ref().map(|_| *tool_rate),
            };
            let o = verl_data::arith_write(out, &cfg)?;
            println!("{} ({} rows)", o.train.display(), o.train_rows);
            println!("{} ({} rows)", o.val.display(), o.val_rows);
            match o.sft_tool_calls {
                Some(calls) => println!(
                    "{} ({} conversations, {calls} calling the {} tool)",
                    o.sft_train.display(),
                    o.train_rows,
                    verl_data::CALCULATOR_TOOL
                ),
                None => println!("{} ({} rows)", o.sft_train.display(), o.train_rows),
            }
            println!("{} ({} rows)", o.sft_val.display(), o.val_rows);
        }
    }
    Ok(ExitCode::SUCCESS)
}

//! `verl data`: verl-format datasets from GSM8K and MATH, and seeded arithmetic problems.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum DataCmd {
    /// Turn GSM8K's raw `train.jsonl`/`test.jsonl` into verl-format parquet (the rows verl's
    /// `examples/data_preprocess/gsm8k.py` writes).
    Gsm8k { raw_dir: PathBuf, out_dir: PathBuf },
    /// Turn a raw copy of DigitalLearningGmbH/MATH-lighteval (`data/{train,test}-*.parquet`, as
    /// `huggingface-cli download` leaves it, or `train.jsonl`/`test.jsonl`) into the verl-format
    /// parquet and `*_example.json` that verl's `examples/data_preprocess/math_dataset.py` writes.
    Math { raw_dir: PathBuf, out_dir: PathBuf },
    /// Generate seeded arithmetic word problems as verl GSM8K-format parquet (train.parquet,
    /// val.parquet; data_source openai/gsm8k) plus SFT pairs (sft_train/sft_val.parquet).
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
        /// Operands are drawn from 1..=max_operand.
        #[arg(long, default_value_t = 9)]
        max_operand: u32,
        /// A deliberately noisy SFT teacher: this fraction of the SFT training answers ends in a
        /// final `#### N` one too high (RL/validation ground truth always correct).
        #[arg(long, default_value_t = 0.0)]
        sft_noise: f64,
    },
}

pub fn run(cmd: &DataCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        DataCmd::Gsm8k { raw_dir, out_dir } => {
            let out = verl_data::gsm8k_preprocess(raw_dir, out_dir)?;
            println!("{} ({} rows)", out.train.display(), out.train_rows);
            println!("{} ({} rows)", out.test.display(), out.test_rows);
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
            max_operand,
            sft_noise,
        } => {
            let cfg = verl_data::ArithConfig {
                train: *train,
                val: *val,
                seed: *seed,
                min_ops: *min_ops,
                max_ops: *max_ops,
                max_operand: *max_operand,
                sft_noise: *sft_noise,
            };
            let o = verl_data::arith_write(out, &cfg)?;
            println!("{} ({} rows)", o.train.display(), o.train_rows);
            println!("{} ({} rows)", o.val.display(), o.val_rows);
            println!("{} ({} rows)", o.sft_train.display(), o.train_rows);
            println!("{} ({} rows)", o.sft_val.display(), o.val_rows);
        }
    }
    Ok(ExitCode::SUCCESS)
}

//! verl-format RL datasets for the host: reading parquet / Arrow IPC / JSONL files into
//! [`Sample`]s, verl's `data.*` row selection and overlong-prompt filtering, prompt
//! truncation, a resumable batch loader, the GSM8K and MATH preprocessing verl ships, the
//! quickstart's self-generated arithmetic task (and its calculator-tool variant) and SFT data:
//! (prompt, response) pairs and multi-turn conversations.
//!
//! This crate must not tokenize or render chat templates (the host passes a prompt-length
//! function built from the chat crate), must not link libtorch, and must not know about
//! training: it hands out prompts and the state needed to resume.

pub mod arith;
mod columns;
mod config;
mod dataset;
mod error;
pub mod gsm8k;
pub mod gsm8k_tools;
mod loader;
pub mod math;
mod py_json;
mod read;
mod sample;
mod sft;
mod shuffle;
mod write;

pub use arith::{
    arith_splits, arith_write, calculator_tool_schema, tool_call_text, ArithConfig, ArithOutput,
    ArithProblem, CALCULATOR_TOOL, TOOL_AGENT, TOOL_INSTRUCTION,
};
pub use config::{truncate, DataConfig, Split, Truncation};
pub use dataset::{BoxError, Dataset, FilterReport, PromptLenFn};
pub use error::{DataError, Result, Unboxed};
pub use gsm8k::{extract_solution, gsm8k_preprocess, Gsm8kOutput};
pub use gsm8k_tools::{
    gsm8k_tools_preprocess, Gsm8kToolStats, Gsm8kToolsOutput, GSM8K_TOOL_INSTRUCTION,
};
pub use loader::{Batch, DataLoader, DataLoaderState, LoaderOptions};
pub use math::{extract_boxed_answer, math_preprocess, MathOutput};
pub use read::{array_to_json, batch_to_rows, Format};
pub use sample::{Message, Origin, RewardModel, Sample};
pub use sft::{
    read_sft_conversations, read_sft_pairs, text_corpus, MultiturnKeys, SftConversation, SftKeys,
    SftPair,
};
pub use write::{write_arrow_ipc, write_jsonl, write_parquet};

//! Training a small byte-level BPE tokenizer (GPT-2/Qwen family layout) from text, for
//! quickstarts and tests that must not download a real model's tokenizer.

use crate::error::{ChatError, Result};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

/// Trains a byte-level BPE on `texts`: GPT-2 pre-tokenization regex, no prefix space, byte-level
/// decoder, so any UTF-8 text round-trips through encode/decode. `special_tokens` get the first
/// ids (0, 1, ...) in the given order and are registered as special added tokens.
/// `vocab_size` counts the special tokens and the 256 byte symbols, so it must exceed both.
pub fn train_bpe<S: AsRef<str> + Sync>(
    texts: &[S],
    vocab_size: usize,
    special_tokens: &[&str],
) -> Result<tokenizers::Tokenizer> {
    let floor = special_tokens.len() + ByteLevel::alphabet().len();
    if vocab_size <= floor {
        return Err(ChatError::Training {
            message: format!(
                "vocab_size {vocab_size} leaves no room for merges: {} special tokens + 256 byte \
                 symbols already take {floor}",
                special_tokens.len()
            ),
        });
    }
    let byte_level = ByteLevel::new(false, false, true);
    let mut tokenizer = tokenizers::Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(byte_level));
    tokenizer.with_decoder(Some(byte_level));
    tokenizer.with_post_processor(Some(byte_level));
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(0)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(
            special_tokens
                .iter()
                .map(|t| AddedToken::from(*t, true))
                .collect(),
        )
        .build()
        .into();
    tokenizer
        .train(&mut trainer, texts.iter().map(|t| t.as_ref()))
        .map_err(|e| ChatError::Training {
            message: e.to_string(),
        })?;
    Ok(tokenizer)
}

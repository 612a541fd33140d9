//! Training a small byte-level BPE tokenizer (GPT-2/Qwen family layout) from text, for
//! quickstarts and tests that must not download a real model's tokenizer.

use crate::error::{ChatError, Result};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

/// GPT-2's pre-tokenization regex with its digit runs (`\p{N}+`) cut into groups of at most
/// `{group}` digits from the left.
fn digit_group_pattern(group: u8) -> String {
    format!(
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{{L}}+|\p{{N}}{{1,{group}}}| ?[^\s\p{{L}}\p{{N}}]+|\s+(?!\S)|\s+"
    )
}

/// How [`train_bpe_with`] pre-tokenizes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BpeOptions {
    /// `Some(n)`: numbers are cut into groups of at most `n` digits from the left, with no space
    /// before them, so a number is the same tokens wherever it appears (`Some(1)`: one token per
    /// digit, as Qwen2's tokenizer). `None`: GPT-2's runs of digits, a leading space included.
    pub digit_group: Option<u8>,
}

/// Trains a byte-level BPE on `texts`: GPT-2 pre-tokenization regex, no prefix space, byte-level
/// decoder, so any UTF-8 text round-trips through encode/decode. `special_tokens` get the first
/// ids (0, 1, ...) in the given order and are registered as special added tokens.
/// `vocab_size` counts the special tokens and the 256 byte symbols, so it must exceed both.
pub fn train_bpe<S: AsRef<str> + Sync>(
    texts: &[S],
    vocab_size: usize,
    special_tokens: &[&str],
) -> Result<tokenizers::Tokenizer> {
    train_bpe_with(texts, vocab_size, special_tokens, BpeOptions::default())
}

/// [`train_bpe`] with pre-tokenization options.
pub fn train_bpe_with<S: AsRef<str> + Sync>(
    texts: &[S],
    vocab_size: usize,
    special_tokens: &[&str],
    opts: BpeOptions,
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
    if let Some(group) = opts.digit_group {
        if group == 0 {
            return Err(ChatError::Training {
                message: "digit groups must hold at least one digit".into(),
            });
        }
        let split = Split::new(
            SplitPattern::Regex(digit_group_pattern(group)),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| ChatError::Training {
            message: format!("digit-group pattern: {e}"),
        })?;
        // The regex does the splitting; ByteLevel only maps bytes to its alphabet.
        let bytes_only = ByteLevel::new(false, false, false);
        tokenizer.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            split.into(),
            bytes_only.into(),
        ]))));
    } else {
        tokenizer.with_pre_tokenizer(Some(byte_level));
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &[&str] = &["Mia has 4821 apples. #### 4821", "\n10104\n", "x 7 y 12345"];

    fn pieces(tok: &tokenizers::Tokenizer, text: &str) -> Vec<String> {
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        ids.iter()
            .map(|&i| tok.decode(&[i], false).unwrap())
            .collect()
    }

    #[test]
    fn digit_groups_cut_numbers_the_same_way_everywhere() {
        let one = train_bpe_with(
            TEXT,
            400,
            &["<|endoftext|>"],
            BpeOptions {
                digit_group: Some(1),
            },
        )
        .unwrap();
        assert_eq!(pieces(&one, " 4821\n"), [" ", "4", "8", "2", "1", "\n"]);
        let two = train_bpe_with(
            TEXT,
            400,
            &["<|endoftext|>"],
            BpeOptions {
                digit_group: Some(2),
            },
        )
        .unwrap();
        assert_eq!(pieces(&two, "\n10104\n"), ["\n", "10", "10", "4", "\n"]);
        // Text round-trips through encode/decode.
        let ids = two.encode("Mia has 4821 apples.", false).unwrap();
        assert_eq!(
            two.decode(ids.get_ids(), false).unwrap(),
            "Mia has 4821 apples."
        );
        let e = train_bpe_with(
            TEXT,
            400,
            &[],
            BpeOptions {
                digit_group: Some(0),
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("at least one digit"), "{e}");
    }
}

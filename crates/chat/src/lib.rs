//! `verl-chat`: turns a HF model folder's tokenizer files into a [`Tokenizer`] (encode/decode,
//! special tokens, eos/pad ids) and renders its chat template exactly as HF transformers does
//! (Jinja2 semantics on minijinja; see [`ChatTemplate`]).
//!
//! It owns text <-> token ids and conversation -> prompt text. It must not know about datasets,
//! padding/batching of tensors or models: callers get plain `Vec<u32>`/`String`, and nothing
//! here touches the network (folders are read from disk only).

mod error;
mod pyfmt;
mod template;
mod tokenizer;
mod train;

pub use error::{ChatError, Result};
pub use template::{ChatOptions, ChatTemplate, Message};
pub use tokenizer::{
    ChatTemplates, SpecialTokens, Tokenizer, ADDITIONAL_CHAT_TEMPLATES_DIR, CHAT_TEMPLATE_FILE,
    CHAT_TEMPLATE_JSON_FILE, GENERATION_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE,
    TOKENIZER_CONFIG_FILE, TOKENIZER_FILE,
};
pub use train::{train_bpe, train_bpe_with, BpeOptions};

/// Re-exported so callers can name the training/`inner()` type without their own dependency.
pub use tokenizers;

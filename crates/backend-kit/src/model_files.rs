//! A role's model files: a random initialisation instead of the checkpoint's weights (`verl bench`),
//! and the tokenizer files an HF export copies next to the weights.

use std::path::Path;

use verl_plugin_api::InitArgs;

use crate::error::{BackendError, Result};

/// `InitArgs.extra.random_init.seed` (`verl bench`): build the model from the folder's config.json
/// with fresh weights instead of loading safetensors.
pub fn random_init_seed(init: &InitArgs) -> Result<Option<u64>> {
    let Some(r) = init.extra.get("random_init") else {
        return Ok(None);
    };
    match r.get("seed") {
        None => Ok(Some(0)),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            BackendError::config("InitArgs.extra.random_init.seed", "an unsigned integer", v)
        }),
    }
}

/// Files HF tokenizers and generation read next to the weights.
fn is_tokenizer_file(name: &str) -> bool {
    name.starts_with("tokenizer")
        || name.starts_with("vocab.")
        || name.starts_with("chat_template")
        || name.ends_with(".tiktoken")
        || matches!(
            name,
            "merges.txt"
                | "special_tokens_map.json"
                | "added_tokens.json"
                | "generation_config.json"
        )
}

/// Copies the tokenizer and generation files of `from` that `to` lacks (an HF folder is loadable
/// on its own).
pub fn copy_tokenizer_files(from: &Path, to: &Path) -> Result<()> {
    let entries = std::fs::read_dir(from).map_err(|source| BackendError::Io {
        path: from.to_path_buf(),
        source,
    })?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if entry.path().is_file() && is_tokenizer_file(&name) && !to.join(&name).exists() {
            std::fs::copy(entry.path(), to.join(&name)).map_err(|source| BackendError::Io {
                path: entry.path(),
                source,
            })?;
        }
    }
    Ok(())
}

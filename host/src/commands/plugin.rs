//! `verl plugin new reward NAME`: the skeleton of a reward plugin, the one in
//! `examples/reward-plugin` (a [`verl_plugin_api::RowReward`] with its unit test) under a new name.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

const EXAMPLE_LIB: &str = include_str!("../../examples/reward-plugin/src/lib.rs");

fn camel(name: &str) -> String {
    name.split(['_', '-'])
        .filter(|p| !p.is_empty())
        .map(|p| {
            let mut c = p.chars();
            c.next()
                .map(|f| f.to_uppercase().collect::<String>() + c.as_str())
                .unwrap_or_default()
        })
        .collect()
}

/// Writes `dir/NAME/{Cargo.toml, src/lib.rs}`; `api_path` is the verl-rs checkout's `plugin-api`
/// folder the crate depends on (`None`: a placeholder to fill in). Returns the crate folder.
pub fn new_reward(name: &str, dir: &Path, api_path: Option<&Path>) -> anyhow::Result<PathBuf> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        || name.starts_with(|c: char| c.is_ascii_digit())
    {
        bail!("plugin name `{name}`: use letters, digits, `_` or `-`, not starting with a digit");
    }
    let krate = dir.join(name);
    if krate.exists() {
        bail!("{} exists already", krate.display());
    }
    let lib_name = name.replace('-', "_");
    let ty = camel(name);
    let dep = match api_path {
        Some(p) => {
            let p =
                std::fs::canonicalize(p).with_context(|| format!("--api-path {}", p.display()))?;
            if !p.join("Cargo.toml").is_file() {
                bail!(
                    "--api-path {}: no Cargo.toml (expected verl-rs's plugin-api folder)",
                    p.display()
                );
            }
            format!("verl-plugin-api = {{ path = \"{}\" }}", p.display())
        }
        None => "# Point this at your verl-rs checkout's plugin-api folder (or use --api-path):\n\
                 verl-plugin-api = { path = \"../verl-rs/plugin-api\" }"
            .to_string(),
    };
    let cargo = format!(
        "[package]\nname = \"{name}\"\nversion = \"0.1.0\"\nedition = \"2021\"\npublish = false\n\
         description = \"A verl-rs reward plugin.\"\n\n\
         [lib]\nname = \"{lib_name}\"\n\
         # cdylib: the plugin `verl --plugin` loads; rlib: so `cargo test` can run it in-process.\n\
         crate-type = [\"cdylib\", \"rlib\"]\n\n\
         [dependencies]\n{dep}\nserde_json = \"1\"\n\n\
         # Its own workspace, wherever it is created.\n[workspace]\n"
    );
    let lib = EXAMPLE_LIB
        .replace("libkeyword_reward.so", &format!("lib{lib_name}.so"))
        .replace(
            "plugins.reward.default=keyword",
            &format!("plugins.reward.default={name}"),
        )
        .replace("Keyword", &ty)
        .replace("\"keyword\"", &format!("\"{name}\""));
    std::fs::create_dir_all(krate.join("src"))?;
    std::fs::write(krate.join("Cargo.toml"), cargo)?;
    std::fs::write(krate.join("src/lib.rs"), lib)?;
    Ok(krate)
}

//! `verl plugin`: a plugin's header and compatibility (`inspect`), the plugins on the plugin path
//! (`list`), and `new reward NAME`: the skeleton of a reward plugin, the one in
//! `examples/reward-plugin` (a [`verl_plugin_api::RowReward`] with its unit test) under a new name.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::Subcommand;

use crate::{LoadError, Loader};

#[derive(Subcommand)]
pub enum PluginCmd {
    /// Print a plugin's header (name, version, kind, roles, build) and check it can be loaded.
    Inspect { plugin: String },
    /// List the plugins on the plugin path.
    List,
    /// Start a plugin crate: `verl plugin new reward NAME [--dir DIR] [--api-path PLUGIN_API]`
    /// writes the skeleton of `examples/reward-plugin` (a row scorer and its unit test).
    New {
        /// What kind of plugin: `reward`.
        kind: String,
        name: String,
        /// Where the crate folder is created.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// The verl-rs checkout's `plugin-api` folder to depend on.
        #[arg(long)]
        api_path: Option<PathBuf>,
    },
}

pub fn run(cmd: &PluginCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        PluginCmd::Inspect { plugin } => inspect(plugin),
        PluginCmd::List => list(),
        PluginCmd::New {
            kind,
            name,
            dir,
            api_path,
        } => {
            if kind != "reward" {
                bail!("`verl plugin new {kind}`: the skeleton is for reward plugins (`verl plugin new reward NAME`); a backend starts from plugins/fsdp");
            }
            let krate = new_reward(name, dir, api_path.as_deref())?;
            println!(
                "{} (cargo test; cargo build --release; verl --plugin target/release/lib{}.so run job.yaml plugins.reward.default={name})",
                krate.display(),
                name.replace('-', "_")
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn inspect(spec: &str) -> anyhow::Result<ExitCode> {
    let mut loader = Loader::new(&[]);
    let i = loader.inspect(spec)?;
    let h = &i.header;
    println!("path          {}", i.path.display());
    println!("name          {}", h.name);
    println!("version       {}", h.version);
    println!("kind          {}", h.kind);
    if !h.description.is_empty() {
        println!("description   {}", h.description);
    }
    println!(
        "plugin-api    {} (this verl: {})",
        h.api_version,
        verl_plugin_api::API_VERSION
    );
    if h.kind == verl_plugin_api::PluginKind::Tool {
        println!("tools         {}", h.tools.join(", "));
    } else {
        println!("roles");
    }
    for c in &h.capabilities {
        let state = if c.implemented {
            "ready"
        } else {
            "not implemented"
        };
        let note = if c.note.is_empty() {
            String::new()
        } else {
            format!(" — {}", c.note)
        };
        println!("  {:<10} {state}{note}", c.role.as_str());
    }
    println!("build");
    println!(
        "  libtorch   {}",
        h.build
            .libtorch
            .as_deref()
            .unwrap_or("none (does not link libtorch)")
    );
    println!("  device     {}", h.build.device);
    if let Some(cuda) = &h.build.cuda {
        println!("  cuda       {cuda}");
    }
    println!("  profile    {}", h.build.profile);
    println!("  target     {}", h.build.target);
    if let Some(t) = &i.torch {
        println!(
            "libtorch      {} preloaded from {} ({})",
            t.version.as_deref().unwrap_or("unknown version"),
            t.lib_dir.display(),
            t.found_by
        );
        if let (Some(built), Some(found)) = (h.build.libtorch.as_deref(), t.base_version()) {
            if built.split('+').next() != Some(found) {
                bail!(
                    "{}: plugin `{}` was built against libtorch {built} but the libtorch found is {found}; install torch=={built} or rebuild the plugin",
                    i.path.display(),
                    h.name
                );
            }
        }
    }
    if let Err(why) = &i.compatible {
        bail!(
            "{}: plugin `{}` is incompatible: {why}; rebuild it against verl-plugin-api {}",
            i.path.display(),
            h.name,
            verl_plugin_api::API_VERSION
        );
    }
    // Full handshake: the root module's layout and initialisation.
    let plugin = loader.load(spec)?;
    println!("compatible    yes (header, plugin-api semver and root-module layout checked)");
    if h.kind == verl_plugin_api::PluginKind::Tool {
        describe_tools(&plugin);
    }
    Ok(ExitCode::SUCCESS)
}

/// Each tool class created with an empty config: the tool's name and description, or why it
/// needs a config.
fn describe_tools(plugin: &crate::LoadedPlugin) {
    println!("tool schemas  (each class with an empty config)");
    for class in &plugin.header.tools {
        let init = verl_plugin_api::ToolInit::new(class.clone(), serde_json::json!({}));
        match plugin.create_tool(&init) {
            Ok(tool) => {
                let description = tool.schema()["function"]["description"]
                    .as_str()
                    .unwrap_or_default()
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                println!("  {class:<34} `{}`: {description}", tool.name());
            }
            Err(e) => println!("  {class:<34} needs a config: {e:#}"),
        }
    }
}

fn list() -> anyhow::Result<ExitCode> {
    let loader = Loader::new(&[]);
    for f in loader.discover() {
        match loader.inspect(&f.display().to_string()) {
            Ok(i) => println!(
                "{} {:<10} {:<8} {:<8} {}",
                if i.compatible.is_ok() { "✓" } else { "✗" },
                i.header.name,
                i.header.version,
                i.header.kind.to_string(),
                i.path.display()
            ),
            Err(LoadError::NotAPlugin { .. }) => {}
            Err(e) => println!("✗ {e}"),
        }
    }
    Ok(ExitCode::SUCCESS)
}

const EXAMPLE_LIB: &str = include_str!("../../../examples/reward-plugin/src/lib.rs");

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

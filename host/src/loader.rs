//! The plugin loader: resolve a plugin by path or name, check it is a shared library, preload
//! libtorch when it needs it, read its header through one C symbol before touching anything else,
//! check API compatibility, then let abi_stable check the root module's layout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use abi_stable::library::{lib_header_from_path, LibHeader, LibraryError};
use verl_plugin_api::ffi::{BackendModuleRef, RewardModuleRef, ToolModuleRef};
use verl_plugin_api::header::HEADER_SYMBOL;
use verl_plugin_api::{api_compatible, PluginHeader, PluginKind, API_VERSION};

use crate::torchlib::{self, TorchLib};

/// Everything that can go wrong loading a plugin; each message is one line naming the path.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("plugin not found: {path} (no such file)")]
    NotFound { path: PathBuf },
    #[error("no plugin named `{name}` on the plugin path (looked for {candidates} in: {dirs}); pass --plugin PATH or set VERL_PLUGIN_PATH")]
    NameNotFound {
        name: String,
        candidates: String,
        dirs: String,
    },
    #[error("{path} is not a shared library: {reason}")]
    NotSharedLibrary { path: PathBuf, reason: String },
    #[error("{path} needs libtorch ({needed}) but none was found ({tried}); run `bash scripts/setup.sh` and `source scripts/env.sh`, or set LIBTORCH=/path/to/libtorch")]
    NoLibtorch {
        path: PathBuf,
        needed: String,
        tried: String,
    },
    #[error("cannot load {path}: {reason}")]
    Open { path: PathBuf, reason: String },
    #[error(
        "{path} is a shared library but not a verl plugin (it exports no `{HEADER_SYMBOL}` symbol)"
    )]
    NotAPlugin { path: PathBuf },
    #[error("{path}: unreadable plugin header: {reason}")]
    BadHeader { path: PathBuf, reason: String },
    #[error("{path}: plugin `{name}` {version} is incompatible: {reason}; rebuild it against verl-plugin-api {host_api}")]
    IncompatibleApi {
        path: PathBuf,
        name: String,
        version: String,
        reason: String,
        host_api: String,
    },
    #[error("{path}: plugin `{name}`'s root module does not match this verl's plugin-api {host_api} (type layout differs; rebuild the plugin against the same verl-plugin-api source{hint})")]
    LayoutMismatch {
        path: PathBuf,
        name: String,
        host_api: String,
        /// abi_stable's full report, shown with --verbose.
        detail: String,
        hint: String,
    },
    #[error("{path}: plugin `{name}` failed to initialise: {reason}")]
    InitFailed {
        path: PathBuf,
        name: String,
        reason: String,
    },
    #[error("{path}: plugin `{name}` is a {found} plugin, but a {expected} plugin is needed here")]
    WrongKind {
        path: PathBuf,
        name: String,
        expected: PluginKind,
        found: PluginKind,
    },
}

impl LoadError {
    /// abi_stable's layout report, when there is one (for `--verbose`).
    pub fn detail(&self) -> Option<&str> {
        match self {
            LoadError::LayoutMismatch { detail, .. } => Some(detail),
            _ => None,
        }
    }
}

/// A loaded plugin's root module.
#[derive(Clone, Copy)]
pub enum Module {
    Backend(BackendModuleRef),
    Reward(RewardModuleRef),
    Tool(ToolModuleRef),
}

/// A plugin loaded into this process (never unloaded).
#[derive(Clone)]
pub struct LoadedPlugin {
    pub path: PathBuf,
    pub header: PluginHeader,
    pub module: Module,
    /// The libtorch the host preloaded for it, if it links libtorch.
    pub torch: Option<TorchLib>,
}

impl LoadedPlugin {
    pub fn backend(&self) -> Result<BackendModuleRef, LoadError> {
        match self.module {
            Module::Backend(m) => Ok(m),
            _ => Err(self.wrong_kind(PluginKind::Backend)),
        }
    }
    pub fn reward(&self) -> Result<RewardModuleRef, LoadError> {
        match self.module {
            Module::Reward(m) => Ok(m),
            _ => Err(self.wrong_kind(PluginKind::Reward)),
        }
    }
    pub fn tool(&self) -> Result<ToolModuleRef, LoadError> {
        match self.module {
            Module::Tool(m) => Ok(m),
            _ => Err(self.wrong_kind(PluginKind::Tool)),
        }
    }
    fn wrong_kind(&self, expected: PluginKind) -> LoadError {
        LoadError::WrongKind {
            path: self.path.clone(),
            name: self.header.name.clone(),
            expected,
            found: self.header.kind,
        }
    }
}

/// Just the header and the facts needed to describe a library, without loading its root module.
#[derive(Debug, Clone)]
pub struct Inspection {
    pub path: PathBuf,
    pub header: PluginHeader,
    pub needs_libtorch: bool,
    pub torch: Option<TorchLib>,
    /// `Err` with the reason when this host cannot use the plugin.
    pub compatible: Result<(), String>,
}

/// Resolves and loads plugins; remembers what it loaded (by canonical path).
pub struct Loader {
    search_path: Vec<PathBuf>,
    loaded: BTreeMap<PathBuf, LoadedPlugin>,
}

impl Loader {
    /// The search path: `extra` (config `plugins.search_path`), then `VERL_PLUGIN_PATH`, then the
    /// directory of the `verl` binary.
    pub fn new(extra: &[PathBuf]) -> Self {
        let mut search_path: Vec<PathBuf> = extra.to_vec();
        if let Some(p) = std::env::var_os("VERL_PLUGIN_PATH") {
            search_path.extend(std::env::split_paths(&p).filter(|p| !p.as_os_str().is_empty()));
        }
        if let Some(dir) = std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(Path::to_path_buf))
        {
            search_path.push(dir);
        }
        Loader {
            search_path,
            loaded: BTreeMap::new(),
        }
    }

    pub fn search_path(&self) -> &[PathBuf] {
        &self.search_path
    }

    /// A spec with a `/` or a `.so` suffix is a path; anything else is a name looked up as
    /// `lib<name>.so`, `libverl_<name>.so`, `<name>.so` in each search-path directory.
    pub fn resolve(&self, spec: &str) -> Result<PathBuf, LoadError> {
        if spec.contains('/') || spec.ends_with(".so") || Path::new(spec).is_file() {
            let p = PathBuf::from(spec);
            return if p.exists() {
                Ok(p)
            } else {
                Err(LoadError::NotFound { path: p })
            };
        }
        let names = candidate_files(spec);
        for dir in &self.search_path {
            for n in &names {
                let p = dir.join(n);
                if p.is_file() {
                    return Ok(p);
                }
            }
        }
        Err(LoadError::NameNotFound {
            name: spec.into(),
            candidates: names.join(", "),
            dirs: self
                .search_path
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(":"),
        })
    }

    /// Every library file on the search path (for `verl doctor`).
    pub fn discover(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for dir in &self.search_path {
            let Ok(rd) = std::fs::read_dir(dir) else {
                continue;
            };
            let mut files: Vec<PathBuf> = rd
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.extension().is_some_and(|e| e == "so")
                        && p.file_name()
                            .and_then(|n| n.to_str())
                            .is_some_and(|n| n.starts_with("lib"))
                })
                .collect();
            files.sort();
            out.extend(files);
        }
        out
    }

    /// Read and check a plugin's header without loading its root module.
    pub fn inspect(&self, spec: &str) -> Result<Inspection, LoadError> {
        let path = self.resolve(spec)?;
        let (needs_libtorch, torch) = prepare(&path)?;
        let header = read_header(&path)?;
        let compatible = api_compatible(&header.api_version, API_VERSION);
        Ok(Inspection {
            path,
            header,
            needs_libtorch,
            torch,
            compatible,
        })
    }

    /// Load a plugin (or return the one already loaded from the same file).
    pub fn load(&mut self, spec: &str) -> Result<LoadedPlugin, LoadError> {
        let path = self.resolve(spec)?;
        let key = std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone());
        if let Some(p) = self.loaded.get(&key) {
            return Ok(p.clone());
        }
        let (_, torch) = prepare(&path)?;
        let header = read_header(&path)?;
        if let Err(reason) = api_compatible(&header.api_version, API_VERSION) {
            return Err(LoadError::IncompatibleApi {
                path,
                name: header.name,
                version: header.version,
                reason,
                host_api: API_VERSION.into(),
            });
        }
        let lib = lib_header_from_path(&path).map_err(|e| library_error(&path, &header, e))?;
        let module = match header.kind {
            PluginKind::Backend => {
                Module::Backend(backend_root(lib).map_err(|e| library_error(&path, &header, e))?)
            }
            PluginKind::Reward => {
                Module::Reward(reward_root(lib).map_err(|e| library_error(&path, &header, e))?)
            }
            PluginKind::Tool => Module::Tool(
                lib.init_root_module::<ToolModuleRef>()
                    .map_err(|e| library_error(&path, &header, e))?,
            ),
        };
        let callbacks = verl_plugin_api::forward_to_tracing(verl_plugin_api::current_max_level());
        match module {
            Module::Backend(m) => (m.set_host())(callbacks),
            Module::Reward(m) => (m.set_host())(callbacks),
            Module::Tool(m) => (m.set_host())(callbacks),
        }
        tracing::debug!(plugin = %header.name, path = %path.display(), "plugin loaded");
        let loaded = LoadedPlugin {
            path,
            header,
            module,
            torch,
        };
        self.loaded.insert(key, loaded.clone());
        Ok(loaded)
    }

    /// The first tool plugin on the search path that serves `class_name` (its header lists it),
    /// loaded. Libraries that link libtorch are skipped unopened: a tool plugin never does, and
    /// opening a backend would load libtorch for nothing.
    pub fn find_tool_plugin(
        &mut self,
        class_name: &str,
    ) -> Option<Result<LoadedPlugin, LoadError>> {
        for path in self.discover() {
            if torch_dependencies(&path).map_or(true, |deps| !deps.is_empty()) {
                continue;
            }
            let Ok(header) = read_header(&path) else {
                continue;
            };
            if header.provides_tool(class_name) {
                return Some(self.load(&path.display().to_string()));
            }
        }
        None
    }
}

/// A backend's root module. One built before fields were appended to [`BackendModuleRef`] fails
/// abi_stable's check (a plugin may have more prefix-type fields than the host, not fewer); it is
/// then checked against the frozen prefix (`ffi::v1`) and, when it has none of the appended fields,
/// used with those fields absent (their accessors return `None`, e.g. no upfront `validate`).
fn backend_root(lib: &'static LibHeader) -> Result<BackendModuleRef, LibraryError> {
    use verl_plugin_api::ffi::{v1, v2, v3};
    match lib.init_root_module::<BackendModuleRef>() {
        Err(full @ LibraryError::AbiInstability(_)) => {
            let older = lib
                .init_root_module::<v3::BackendModuleRef>()
                .ok()
                .and_then(v3::as_current)
                .or_else(|| {
                    lib.init_root_module::<v2::BackendModuleRef>()
                        .ok()
                        .and_then(v2::as_current)
                })
                .or_else(|| {
                    lib.init_root_module::<v1::BackendModuleRef>()
                        .ok()
                        .and_then(v1::as_current)
                });
            match older {
                Some(m) => {
                    tracing::debug!("plugin built before the root module's appended fields");
                    Ok(m)
                }
                None => Err(full),
            }
        }
        other => other,
    }
}

/// A reward plugin's root module; one built before model services is used without them (see
/// [`backend_root`]).
fn reward_root(lib: &'static LibHeader) -> Result<RewardModuleRef, LibraryError> {
    use verl_plugin_api::ffi::reward_v1;
    match lib.init_root_module::<RewardModuleRef>() {
        Err(full @ LibraryError::AbiInstability(_)) => {
            match lib
                .init_root_module::<reward_v1::RewardModuleRef>()
                .ok()
                .and_then(reward_v1::as_current)
            {
                Some(m) => {
                    tracing::debug!("reward plugin built before model services");
                    Ok(m)
                }
                None => Err(full),
            }
        }
        other => other,
    }
}

fn candidate_files(name: &str) -> Vec<String> {
    let mut v = vec![format!("lib{name}.so")];
    if !name.starts_with("verl_") {
        v.push(format!("libverl_{}.so", name.replace('-', "_")));
    }
    v.push(format!("{name}.so"));
    v
}

/// Check the file is an ELF shared library and preload libtorch if it needs it.
fn prepare(path: &Path) -> Result<(bool, Option<TorchLib>), LoadError> {
    let torch_needed = torch_dependencies(path)?;
    if torch_needed.is_empty() {
        return Ok((false, None));
    }
    let torch = torchlib::preload(&torch_needed).map_err(|tried| LoadError::NoLibtorch {
        path: path.into(),
        needed: torch_needed.join(", "),
        tried,
    })?;
    Ok((true, Some(torch)))
}

/// The libtorch libraries an ELF shared library links (checked to be one; nothing is loaded).
fn torch_dependencies(path: &Path) -> Result<Vec<String>, LoadError> {
    let data = std::fs::read(path).map_err(|e| LoadError::Open {
        path: path.into(),
        reason: e.to_string(),
    })?;
    let not_so = |reason: String| LoadError::NotSharedLibrary {
        path: path.into(),
        reason,
    };
    if data.len() < 4 || &data[..4] != b"\x7fELF" {
        return Err(not_so("no ELF magic (not a compiled library)".into()));
    }
    let elf = goblin::elf::Elf::parse(&data).map_err(|e| not_so(format!("malformed ELF: {e}")))?;
    if elf.header.e_type != goblin::elf::header::ET_DYN {
        return Err(not_so(format!(
            "ELF type {} (an executable or object file, not a .so)",
            goblin::elf::header::et_to_str(elf.header.e_type)
        )));
    }
    Ok(elf
        .libraries
        .iter()
        .filter(|l| torchlib::is_torch_library(l))
        .map(|l| l.to_string())
        .collect())
}

fn read_header(path: &Path) -> Result<PluginHeader, LoadError> {
    // SAFETY: loading runs the library's initialisers; the handle is leaked on purpose (plugins
    // are never unloaded, and abi_stable's own load of the same path reuses this mapping).
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| LoadError::Open {
        path: path.into(),
        reason: e.to_string(),
    })?;
    let json = {
        // SAFETY: the symbol is `extern "C" fn() -> *const c_char` by the plugin-api contract;
        // a library exporting the name with another type is not a verl plugin we can help.
        let f: libloading::Symbol<unsafe extern "C" fn() -> *const std::os::raw::c_char> =
            unsafe { lib.get(HEADER_SYMBOL.as_bytes()) }
                .map_err(|_| LoadError::NotAPlugin { path: path.into() })?;
        let ptr = unsafe { f() };
        if ptr.is_null() {
            return Err(LoadError::BadHeader {
                path: path.into(),
                reason: "the header function returned null".into(),
            });
        }
        unsafe { std::ffi::CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned()
    };
    std::mem::forget(lib);
    PluginHeader::parse(&json).map_err(|reason| LoadError::BadHeader {
        path: path.into(),
        reason,
    })
}

fn library_error(path: &Path, header: &PluginHeader, e: LibraryError) -> LoadError {
    match e {
        LibraryError::AbiInstability(detail) => LoadError::LayoutMismatch {
            path: path.into(),
            name: header.name.clone(),
            host_api: API_VERSION.into(),
            detail: detail.to_string(),
            hint: "; run with --verbose for abi_stable's layout report".into(),
        },
        LibraryError::IncompatibleVersionNumber {
            expected_version,
            actual_version,
            ..
        } => LoadError::IncompatibleApi {
            path: path.into(),
            name: header.name.clone(),
            version: header.version.clone(),
            reason: format!(
                "its root module is version {actual_version}, this verl expects {expected_version}"
            ),
            host_api: API_VERSION.into(),
        },
        LibraryError::RootModule { err, .. } => LoadError::InitFailed {
            path: path.into(),
            name: header.name.clone(),
            reason: err.to_string(),
        },
        LibraryError::GetSymbolError { .. } => LoadError::NotAPlugin { path: path.into() },
        other => LoadError::Open {
            path: path.into(),
            reason: first_line(&other.to_string()),
        },
    }
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").to_string()
}

/// Creating roles from a loaded plugin: the checked clients of `verl_plugin_api::client`.
impl LoadedPlugin {
    fn init_json(init: &verl_plugin_api::InitArgs) -> String {
        serde_json::to_string(init).expect("init args serialise")
    }

    pub fn create_actor(
        &self,
        init: &verl_plugin_api::InitArgs,
    ) -> anyhow::Result<verl_plugin_api::client::ActorClient> {
        let m = self.backend()?;
        let obj = (m.create_actor())(Self::init_json(init).as_str().into())
            .into_result()
            .map_err(|e| ffi_error(e, &self.header.name, "create_actor"))?;
        Ok(verl_plugin_api::client::ActorClient::of_module(
            obj,
            m,
            self.header.name.clone(),
            "actor",
        ))
    }

    pub fn create_reference(
        &self,
        init: &verl_plugin_api::InitArgs,
    ) -> anyhow::Result<verl_plugin_api::client::ActorClient> {
        let m = self.backend()?;
        let obj = (m.create_reference())(Self::init_json(init).as_str().into())
            .into_result()
            .map_err(|e| ffi_error(e, &self.header.name, "create_reference"))?;
        Ok(verl_plugin_api::client::ActorClient::of_module(
            obj,
            m,
            self.header.name.clone(),
            "reference",
        ))
    }

    pub fn create_critic(
        &self,
        init: &verl_plugin_api::InitArgs,
    ) -> anyhow::Result<verl_plugin_api::client::CriticClient> {
        let m = self.backend()?;
        let obj = (m.create_critic())(Self::init_json(init).as_str().into())
            .into_result()
            .map_err(|e| ffi_error(e, &self.header.name, "create_critic"))?;
        Ok(verl_plugin_api::client::CriticClient::new(
            obj,
            self.header.name.clone(),
        ))
    }

    /// The backend's upfront layout check (`verl run --dry-run`, and before ranks are launched):
    /// `None` when the backend has none (a plugin built before the check existed, or one that
    /// does not provide it), else its summary (one line per role) or its error.
    pub fn validate_layout(
        &self,
        init: &verl_plugin_api::InitArgs,
    ) -> Option<anyhow::Result<String>> {
        let m = match self.backend() {
            Ok(m) => m,
            Err(e) => return Some(Err(e.into())),
        };
        verl_plugin_api::client::validate_layout(m, &self.header.name, init)
            .map(|r| r.map_err(Into::into))
    }

    /// The backend's reward model role; a backend without one (or built before the role
    /// existed) is an error naming the plugin.
    pub fn create_reward_model(
        &self,
        init: &verl_plugin_api::InitArgs,
    ) -> anyhow::Result<verl_plugin_api::client::RewardModelClient> {
        let m = self.backend()?;
        let Some(create) = m.create_reward_model() else {
            anyhow::bail!(
                "backend plugin `{}` ({}) has no reward model role: it was built against a \
                 plugin API before reward models; rebuild it, or use a backend that has one (fsdp, \
                 megatron)",
                self.header.name,
                self.path.display()
            );
        };
        let obj = create(Self::init_json(init).as_str().into())
            .into_result()
            .map_err(|e| ffi_error(e, &self.header.name, "create_reward_model"))?;
        Ok(verl_plugin_api::client::RewardModelClient::new(
            obj,
            self.header.name.clone(),
        ))
    }

    /// Creates the reward role, lending it `services` when the plugin takes them (plugins built
    /// before model services are created without).
    pub fn create_reward(
        &self,
        init: &verl_plugin_api::InitArgs,
        services: Option<verl_plugin_api::ffi::ModelServicesBox>,
    ) -> anyhow::Result<verl_plugin_api::client::RewardClient> {
        let m = self.reward()?;
        let json = Self::init_json(init);
        let obj = match (m.create_reward_with_services(), services) {
            (Some(create), Some(services)) => create(json.as_str().into(), services),
            _ => (m.create_reward())(json.as_str().into()),
        }
        .into_result()
        .map_err(|e| ffi_error(e, &self.header.name, "create_reward"))?;
        Ok(verl_plugin_api::client::RewardClient::new(
            obj,
            self.header.name.clone(),
        ))
    }
}

/// Creating a tool from a loaded tool plugin.
impl LoadedPlugin {
    /// Creates the tool of one tool config entry; its schema is read and checked.
    pub fn create_tool(
        &self,
        init: &verl_plugin_api::ToolInit,
    ) -> anyhow::Result<verl_plugin_api::client::ToolClient> {
        let m = self.tool()?;
        let json = serde_json::to_string(init).expect("tool init serialises");
        let obj = (m.create_tool())(json.as_str().into())
            .into_result()
            .map_err(|e| ffi_error(e, &self.header.name, "create_tool"))?;
        Ok(verl_plugin_api::client::ToolClient::new(
            obj,
            self.header.name.clone(),
        )?)
    }
}

fn ffi_error(
    e: verl_plugin_api::error::FfiError,
    plugin: &str,
    call: &str,
) -> verl_plugin_api::Error {
    verl_plugin_api::Error::from_ffi(e, plugin, call)
}

//! The tools of multi-turn rollouts: verl's tool config (`actor_rollout_ref.rollout.multi_turn.
//! tool_config_path`) loaded into a [`ToolSet`], and one tool call made as verl's `_call_tool`
//! makes it (create → execute → release), under a deadline, never failing the job.
//!
//! Each entry's `class_name` is served by a tool plugin given with `--plugin`, else by the
//! built-in `tools` plugin (`libverl_tools.so` next to the binary: `calculator`, `gsm8k` and
//! verl's `verl.tools.gsm8k_tool.Gsm8kTool`, `python`), else by the first tool plugin on the
//! plugin path whose header lists it. This module owns the config checks, the lifecycle and the
//! deadline; the agent loop owns the turns and applies [`truncate_tool_response`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use verl_plugin_api::client::ToolClient;
use verl_plugin_api::contract::tool_schema_name;
use verl_plugin_api::{ErrorKind, ToolInit, ToolOutput};

use crate::{LoadedPlugin, Loader};

/// The plugin of the built-in tools, found by name like every plugin (`libverl_tools.so`).
pub const BUILTIN_PLUGIN: &str = "tools";
/// How long a call may take when its tool's config sets no `timeout`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Added to a configured `timeout`, so a tool that enforces its own (the `python` built-in) can
/// answer with its own timed-out text first.
pub const TIMEOUT_GRACE: Duration = Duration::from_secs(2);
/// Calls of one tool past their deadline that may still be running before the tool is no longer
/// called (each holds a thread).
pub const MAX_HUNG_CALLS: usize = 64;

const SANDBOX_FUSION: &str = "verl.tools.sandbox_fusion_tools.SandboxFusionTool";

/// What is wrong with a tool config: the file, the entry and key, what was expected and found.
#[derive(Debug, thiserror::Error)]
pub enum ToolConfigError {
    #[error("{file}: cannot read the tool config: {reason}")]
    Read { file: PathBuf, reason: String },
    #[error("{file}: not a YAML tool config: {reason}")]
    Yaml { file: PathBuf, reason: String },
    #[error("{file}: `{key}`: expected {expected}, found {found}")]
    Key {
        file: PathBuf,
        /// The key's path in the file, e.g. `tools[1].config.timeout`.
        key: String,
        expected: String,
        found: String,
    },
    #[error("{file}: `tools[{index}].class_name` `{class_name}`: {reason}")]
    Tool {
        file: PathBuf,
        index: usize,
        class_name: String,
        reason: String,
    },
    #[error("{file}: `tools[{index}]` and `tools[{first}]` both define a tool named `{name}` (the `function.name` of their schemas); names must be unique")]
    DuplicateName {
        file: PathBuf,
        index: usize,
        first: usize,
        name: String,
    },
}

/// Why a tool call did not give the tool's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolErrorKind {
    /// The model called a tool the config does not have.
    UnknownTool,
    /// The arguments are not a JSON object.
    BadArguments,
    /// The tool returned an error (from create, execute or its reply).
    Failed,
    /// No answer before the deadline.
    TimedOut,
    /// The tool panicked (caught inside the plugin) or its call ended without an answer.
    Crashed,
}

impl ToolErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ToolErrorKind::UnknownTool => "unknown_tool",
            ToolErrorKind::BadArguments => "bad_arguments",
            ToolErrorKind::Failed => "failed",
            ToolErrorKind::TimedOut => "timed_out",
            ToolErrorKind::Crashed => "crashed",
        }
    }
}

impl std::fmt::Display for ToolErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One tool call's outcome, as verl's `_call_tool` returns it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCallResult {
    /// The tool message's text: the tool's answer, or on failure the text verl gives the model
    /// (`Unknown function ...`, `Invalid JSON in arguments for ...`, `Error executing tool ...`).
    /// Not truncated: see [`ToolCallResult::truncated`].
    pub text: String,
    /// The step reward: the tool's (`None` when it gives none), 0.0 on failure as in verl.
    pub reward: Option<f64>,
    /// `None` when the tool answered.
    pub error: Option<ToolErrorKind>,
    /// Wall-clock seconds of the call.
    pub seconds: f64,
    /// The tool's metrics for the call (verl's `res`); empty on failure.
    pub metrics: Map<String, Value>,
}

impl ToolCallResult {
    /// The result of a call whose thread ended without an answer (it panicked outside the
    /// plugin's own panic guard).
    pub fn crashed(name: &str) -> Self {
        failure(
            name,
            ToolErrorKind::Crashed,
            format!("Error executing tool '{name}': the call ended without an answer"),
            None,
            Instant::now(),
        )
    }

    /// verl's truncation to `max_tool_response_length` characters, applied as verl does: to a
    /// tool's answer only (verl returns its failure texts before truncating).
    pub fn truncated(mut self, max_len: usize, side: &str) -> Self {
        if self.error.is_none() {
            self.text = truncate_tool_response(&self.text, max_len, side);
        }
        self
    }
}

/// verl's `max_tool_response_length` / `tool_response_truncate_side`, in characters: a text
/// longer than `max_len` keeps its last `max_len` characters after `(truncated)...` (`left`), its
/// first ones before `...(truncated)` (`right`), or, for any other side (`middle`), `max_len / 2`
/// of each end around `...(truncated)...`. Python's slices included: `max_len` 0 keeps the whole
/// text on the left side (`text[-0:]`), and so does `middle` for `max_len` below 2.
pub fn truncate_tool_response(text: &str, max_len: usize, side: &str) -> String {
    let n = text.chars().count();
    if n == 0 || n <= max_len {
        return text.to_string();
    }
    // Python's `text[-k:]`: the last k characters, all of them when k is 0.
    let last = |k: usize| -> String {
        if k == 0 {
            text.to_string()
        } else {
            text.chars().skip(n - k).collect()
        }
    };
    let first = |k: usize| -> String { text.chars().take(k).collect() };
    match side {
        "left" => format!("(truncated)...{}", last(max_len)),
        "right" => format!("{}...(truncated)", first(max_len)),
        _ => {
            let half = max_len / 2;
            format!("{}...(truncated)...{}", first(half), last(half))
        }
    }
}

/// Where the classes of a tool config are looked for: the tool plugins given with `--plugin`
/// (first), then the built-in `tools` plugin and the tool plugins on the plugin path (the
/// config's `plugins.search_path`, then `VERL_PLUGIN_PATH`, then the folder of the binary).
#[derive(Clone, Default)]
pub struct ToolPlugins {
    /// Plugins given with `--plugin`; only the tool plugins among them are asked.
    pub given: Vec<LoadedPlugin>,
    /// `plugins.search_path` of the job's config.
    pub search_path: Vec<PathBuf>,
}

impl ToolPlugins {
    pub fn new(given: Vec<LoadedPlugin>, search_path: Vec<PathBuf>) -> Self {
        ToolPlugins { given, search_path }
    }
}

/// One configured tool.
struct Entry {
    index: usize,
    class_name: String,
    client: ToolClient,
    /// How long a call waits for its answer.
    deadline: Duration,
    /// `config.timeout`, when set.
    configured: Option<Duration>,
    /// Calls past their deadline still running.
    hung: AtomicUsize,
}

/// The job's tools, in config order. `Send + Sync`: share it behind an `Arc` and call it from
/// any number of threads.
pub struct ToolSet {
    file: PathBuf,
    tools: Vec<Arc<Entry>>,
}

impl std::fmt::Debug for ToolSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolSet")
            .field("file", &self.file)
            .field("tools", &self.names())
            .finish()
    }
}

fn found(v: Option<&Value>) -> String {
    v.map_or("nothing".into(), |v| v.to_string())
}

impl ToolSet {
    /// Reads verl's tool config at `path` and creates every tool, each from the plugin that
    /// serves its `class_name` ([`ToolPlugins`]). Every error names the file.
    pub fn load(path: &Path, plugins: &ToolPlugins) -> Result<ToolSet, ToolConfigError> {
        let file = path.to_path_buf();
        let text = std::fs::read_to_string(path).map_err(|e| ToolConfigError::Read {
            file: file.clone(),
            reason: e.to_string(),
        })?;
        let doc: Value = serde_yaml::from_str(&text).map_err(|e| ToolConfigError::Yaml {
            file: file.clone(),
            reason: e.to_string(),
        })?;
        let key_error = |key: String, expected: &str, value: Option<&Value>| ToolConfigError::Key {
            file: file.clone(),
            key,
            expected: expected.into(),
            found: found(value),
        };
        let top = doc
            .as_object()
            .ok_or_else(|| key_error("(top level)".into(), "a mapping with `tools`", Some(&doc)))?;
        if let Some(k) = top.keys().find(|k| *k != "tools") {
            return Err(ToolConfigError::Key {
                file: file.clone(),
                key: k.clone(),
                expected: "only `tools` at the top level".into(),
                found: "an unknown key".into(),
            });
        }
        let entries = match top.get("tools") {
            Some(Value::Array(a)) => a.as_slice(),
            Some(Value::Null) => &[],
            other => return Err(key_error("tools".into(), "a list of tool entries", other)),
        };
        let mut resolver = Resolver {
            loader: Loader::new(&plugins.search_path),
            given: &plugins.given,
            builtin: None,
        };
        let mut tools: Vec<Arc<Entry>> = Vec::new();
        for (index, raw) in entries.iter().enumerate() {
            let spec = EntrySpec::parse(raw, index).map_err(|(key, expected, value)| {
                ToolConfigError::Key {
                    file: file.clone(),
                    key,
                    expected,
                    found: value,
                }
            })?;
            let tool_error = |reason: String| ToolConfigError::Tool {
                file: file.clone(),
                index,
                class_name: spec.init.class_name.clone(),
                reason,
            };
            let plugin = resolver
                .resolve(&spec.init.class_name)
                .map_err(tool_error)?;
            let client = plugin.create_tool(&spec.init).map_err(|e| {
                tool_error(format!(
                    "creating it with plugin `{}` ({}): {e:#}",
                    plugin.header.name,
                    plugin.path.display()
                ))
            })?;
            if let Some(name) = &spec.schema_name {
                if client.name() != name {
                    return Err(tool_error(format!(
                        "plugin `{}` named the tool `{}`, not `{name}` as its tool_schema does \
                         (a plugin must use the config's tool_schema)",
                        plugin.header.name,
                        client.name()
                    )));
                }
            }
            if let Some(first) = tools.iter().find(|t| t.client.name() == client.name()) {
                return Err(ToolConfigError::DuplicateName {
                    file: file.clone(),
                    index,
                    first: first.index,
                    name: client.name().to_string(),
                });
            }
            tracing::debug!(
                tool = client.name(),
                class_name = %spec.init.class_name,
                plugin = %plugin.header.name,
                "tool ready"
            );
            tools.push(Arc::new(Entry {
                index,
                class_name: spec.init.class_name,
                client,
                deadline: spec.timeout.map_or(DEFAULT_TIMEOUT, |t| t + TIMEOUT_GRACE),
                configured: spec.timeout,
                hung: AtomicUsize::new(0),
            }));
        }
        Ok(ToolSet { file, tools })
    }

    /// The config file the tools came from.
    pub fn file(&self) -> &Path {
        &self.file
    }

    pub fn len(&self) -> usize {
        self.tools.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// The tools' OpenAI function schemas in config order, as verl hands them to the chat
    /// template (`tools`): pydantic's `model_dump(exclude_unset=True, exclude_none=True)` of
    /// its schema models, so only the fields those models know, in their order.
    pub fn schemas(&self) -> Vec<Value> {
        self.tools
            .iter()
            .map(|t| verl_schema_dump(t.client.schema()))
            .collect()
    }

    /// The tools' names (what the model calls), in config order.
    pub fn names(&self) -> Vec<String> {
        self.tools
            .iter()
            .map(|t| t.client.name().to_string())
            .collect()
    }

    /// The tool named `name`, for calls beyond verl's lifecycle (`calc_reward`, `call`).
    pub fn client(&self, name: &str) -> Option<&ToolClient> {
        self.entry(name).map(|e| &e.client)
    }

    /// The `class_name` the config gave the tool named `name`.
    pub fn class_name(&self, name: &str) -> Option<&str> {
        self.entry(name).map(|e| e.class_name.as_str())
    }

    fn entry(&self, name: &str) -> Option<&Arc<Entry>> {
        self.tools.iter().find(|t| t.client.name() == name)
    }

    /// One tool call as verl's `_call_tool` makes it: the name and the JSON arguments checked,
    /// then create (with the row's `tools_kwargs[name].create_kwargs`) → execute → release, on a
    /// thread of its own, waited for until the tool's deadline (`config.timeout` + 2 s, else 30
    /// s). Never fails the job: every failure becomes the text verl would give the model, with
    /// `error` saying which failure, and is logged once (warn). A call past its deadline keeps
    /// running on its thread and releases its instance if it ever returns.
    pub fn call(&self, name: &str, arguments: &str, tools_kwargs: &Value) -> ToolCallResult {
        let started = Instant::now();
        let Some(entry) = self.entry(name) else {
            let text = format!(
                "Unknown function '{name}'. Available tools: {}",
                py_list(&self.names())
            );
            return failure(name, ToolErrorKind::UnknownTool, text, None, started);
        };
        let args: Value = match serde_json::from_str(arguments) {
            Ok(v @ Value::Object(_)) => v,
            Ok(other) => {
                let text = format!(
                    "Invalid JSON in arguments for '{name}': expected a JSON object, found {other}"
                );
                return failure(name, ToolErrorKind::BadArguments, text, None, started);
            }
            Err(e) => {
                let text = format!("Invalid JSON in arguments for '{name}': {e}");
                return failure(name, ToolErrorKind::BadArguments, text, None, started);
            }
        };
        let hung = entry.hung.load(Ordering::SeqCst);
        if hung >= MAX_HUNG_CALLS {
            let text = format!(
                "Error executing tool '{name}': {hung} earlier calls never returned; it is not \
                 called again until they do"
            );
            return failure(name, ToolErrorKind::TimedOut, text, None, started);
        }
        let create_kwargs = tools_kwargs
            .get(name)
            .and_then(|k| k.get("create_kwargs"))
            .filter(|k| !k.is_null())
            .cloned()
            .unwrap_or_else(|| json!({}));

        const RUNNING: u8 = 0;
        const DONE: u8 = 1;
        const ABANDONED: u8 = 2;
        let state = Arc::new(AtomicU8::new(RUNNING));
        let (tx, rx) = mpsc::channel();
        let worker = {
            let entry = entry.clone();
            let state = state.clone();
            std::thread::Builder::new()
                .name(format!("tool-{name}"))
                .spawn(move || {
                    let result = lifecycle(&entry.client, &create_kwargs, &args);
                    if state
                        .compare_exchange(RUNNING, DONE, Ordering::SeqCst, Ordering::SeqCst)
                        .is_err()
                    {
                        entry.hung.fetch_sub(1, Ordering::SeqCst);
                        tracing::debug!(
                            tool = entry.client.name(),
                            "a call past its deadline returned at last"
                        );
                    }
                    let _ = tx.send(result);
                })
        };
        if let Err(e) = worker {
            let text = format!("Error executing tool '{name}': cannot start its thread: {e}");
            return failure(name, ToolErrorKind::Failed, text, None, started);
        }
        let answer = match rx.recv_timeout(entry.deadline) {
            Ok(r) => Some(r),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                entry.hung.fetch_add(1, Ordering::SeqCst);
                if state
                    .compare_exchange(RUNNING, ABANDONED, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
                {
                    None
                } else {
                    // It answered just now.
                    entry.hung.fetch_sub(1, Ordering::SeqCst);
                    rx.recv().ok()
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return ToolCallResult {
                    seconds: started.elapsed().as_secs_f64(),
                    ..ToolCallResult::crashed(name)
                };
            }
        };
        match answer {
            Some(Ok(out)) => ToolCallResult {
                text: out.text,
                reward: out.reward,
                error: None,
                seconds: started.elapsed().as_secs_f64(),
                metrics: out.metrics,
            },
            Some(Err(e)) => {
                let kind = if e.kind() == ErrorKind::Panic {
                    ToolErrorKind::Crashed
                } else {
                    ToolErrorKind::Failed
                };
                let text = format!("Error executing tool '{name}': {}", model_message(&e));
                failure(name, kind, text, Some(e.to_string()), started)
            }
            None => {
                let limit = match entry.configured {
                    Some(t) => format!(
                        "{} s (config.timeout {} s of tools[{}] + {} s grace)",
                        secs(entry.deadline),
                        secs(t),
                        entry.index,
                        secs(TIMEOUT_GRACE)
                    ),
                    None => format!(
                        "{} s (the default; set config.timeout of tools[{}] to change it)",
                        secs(entry.deadline),
                        entry.index
                    ),
                };
                let text = format!("Error executing tool '{name}': timed out after {limit}");
                failure(name, ToolErrorKind::TimedOut, text, None, started)
            }
        }
    }
}

/// create → execute → release of one call; release runs whenever create succeeded.
fn lifecycle(
    client: &ToolClient,
    create_kwargs: &Value,
    args: &Value,
) -> verl_plugin_api::Result<ToolOutput> {
    let id = client.create(create_kwargs)?;
    let out = client.execute(&id, args);
    if let Err(e) = client.release(&id) {
        tracing::warn!(tool = client.name(), "releasing instance `{id}`: {e}");
    }
    out
}

fn failure(
    name: &str,
    kind: ToolErrorKind,
    text: String,
    detail: Option<String>,
    started: Instant,
) -> ToolCallResult {
    match detail {
        Some(d) => tracing::warn!(tool = name, error = kind.as_str(), "{text} ({d})"),
        None => tracing::warn!(tool = name, error = kind.as_str(), "{text}"),
    }
    ToolCallResult {
        text,
        reward: Some(0.0),
        error: Some(kind),
        seconds: started.elapsed().as_secs_f64(),
        metrics: Map::new(),
    }
}

/// The error as the model reads it (verl's `{e}`): the plugin's message, without the plugin and
/// call names the log line carries.
fn model_message(e: &verl_plugin_api::Error) -> String {
    match e {
        verl_plugin_api::Error::Plugin { kind, message, .. } => match kind {
            ErrorKind::Panic => format!("panicked: {message}"),
            ErrorKind::NotImplemented => format!("not implemented: {message}"),
            _ => message.clone(),
        },
        other => other.to_string(),
    }
}

fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{}", s as u64)
    } else {
        format!("{s}")
    }
}

/// A list of names as Python prints a `list` of `str` (verl's `Available tools: [...]`).
fn py_list(names: &[String]) -> String {
    let items: Vec<String> = names
        .iter()
        .map(|n| {
            if n.contains('\'') && !n.contains('"') {
                format!("\"{}\"", n.replace('\\', "\\\\"))
            } else {
                format!("'{}'", n.replace('\\', "\\\\").replace('\'', "\\'"))
            }
        })
        .collect();
    format!("[{}]", items.join(", "))
}

/// An OpenAI function schema as verl's pydantic models dump it (`exclude_unset`,
/// `exclude_none`): `type`, `function` {`name`, `description`, `parameters` {`type`,
/// `properties` {each: `type`, `description`, `enum`}, `required`}, `strict`}, in that order,
/// each only when given; other keys are dropped, as verl drops them.
pub fn verl_schema_dump(schema: &Value) -> Value {
    fn pick(src: &Value, keys: &[&str]) -> Map<String, Value> {
        keys.iter()
            .filter_map(|k| {
                src.get(*k)
                    .filter(|v| !v.is_null())
                    .map(|v| (k.to_string(), v.clone()))
            })
            .collect()
    }
    let mut top = pick(schema, &["type"]);
    if let Some(f) = schema.get("function") {
        let mut func = pick(f, &["name", "description"]);
        if let Some(p) = f.get("parameters").filter(|p| !p.is_null()) {
            let mut params = pick(p, &["type"]);
            if let Some(Value::Object(props)) = p.get("properties") {
                let props: Map<String, Value> = props
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.clone(),
                            Value::Object(pick(v, &["type", "description", "enum"])),
                        )
                    })
                    .collect();
                params.insert("properties".into(), Value::Object(props));
            }
            params.extend(pick(p, &["required"]));
            func.insert("parameters".into(), Value::Object(params));
        }
        func.extend(pick(f, &["strict"]));
        top.insert("function".into(), Value::Object(func));
    }
    Value::Object(top)
}

/// One tool config entry, checked.
struct EntrySpec {
    init: ToolInit,
    timeout: Option<Duration>,
    /// The name its `tool_schema` gives, when it has one.
    schema_name: Option<String>,
}

type KeyProblem = (String, String, String);

impl EntrySpec {
    fn parse(raw: &Value, index: usize) -> Result<EntrySpec, KeyProblem> {
        let at = |key: &str| format!("tools[{index}]{key}");
        let problem = |key: &str, expected: &str, value: Option<&Value>| {
            (at(key), expected.to_string(), found(value))
        };
        let obj = raw.as_object().ok_or_else(|| {
            problem(
                "",
                "a mapping with class_name, config and tool_schema",
                Some(raw),
            )
        })?;
        if let Some(k) = obj
            .keys()
            .find(|k| !["class_name", "config", "tool_schema"].contains(&k.as_str()))
        {
            return Err((
                at(&format!(".{k}")),
                "one of class_name, config, tool_schema".into(),
                "an unknown key".into(),
            ));
        }
        let class_name = match obj.get("class_name") {
            Some(Value::String(s)) if !s.trim().is_empty() => s.trim().to_string(),
            other => {
                return Err(problem(
                    ".class_name",
                    "a tool class name (a built-in: calculator, gsm8k, python, verl.tools.gsm8k_tool.Gsm8kTool; or one a tool plugin serves)",
                    other,
                ))
            }
        };
        let config = match obj.get("config") {
            None | Some(Value::Null) => json!({}),
            Some(c @ Value::Object(_)) => c.clone(),
            other => return Err(problem(".config", "a mapping", other)),
        };
        match config.get("type") {
            None => {}
            Some(Value::String(t)) if t == "native" => {}
            other => {
                return Err(problem(
                    ".config.type",
                    "`native` (verl's only tool type)",
                    other,
                ))
            }
        }
        let timeout = match config.get("timeout") {
            None => None,
            Some(v) => Some(
                v.as_f64()
                    .filter(|s| *s > 0.0 && *s <= 86_400.0)
                    .map(Duration::from_secs_f64)
                    .ok_or_else(|| {
                        problem(".config.timeout", "seconds (a positive number)", Some(v))
                    })?,
            ),
        };
        let (tool_schema, schema_name) = match obj.get("tool_schema") {
            None | Some(Value::Null) => (None, None),
            Some(s) => {
                let name = tool_schema_name(s).map_err(|p| {
                    (
                        at(&format!(".tool_schema.{}", p.key)),
                        p.expected.to_string(),
                        p.found,
                    )
                })?;
                (Some(s.clone()), Some(name))
            }
        };
        if class_name == SANDBOX_FUSION {
            return Err((
                at(".class_name"),
                format!(
                    "a tool verl-rs runs; `{SANDBOX_FUSION}` sends code to a remote SandboxFusion \
                     service, which verl-rs does not call: use the built-in `python` tool \
                     (class_name: python; config: timeout, memory_limit_mb, max_output_chars) to \
                     run it locally in a sandboxed python3"
                ),
                format!("`{SANDBOX_FUSION}`"),
            ));
        }
        Ok(EntrySpec {
            init: ToolInit {
                class_name,
                config,
                tool_schema,
            },
            timeout,
            schema_name,
        })
    }
}

/// Finds the plugin serving a class name: `--plugin` tool plugins, the built-in `tools`
/// plugin, the plugin path.
struct Resolver<'a> {
    loader: Loader,
    given: &'a [LoadedPlugin],
    /// The built-in plugin, loaded on first need (or why it could not be).
    builtin: Option<Result<LoadedPlugin, String>>,
}

impl Resolver<'_> {
    fn resolve(&mut self, class_name: &str) -> Result<LoadedPlugin, String> {
        if let Some(p) = self
            .given
            .iter()
            .find(|p| p.header.provides_tool(class_name))
        {
            return Ok(p.clone());
        }
        let loader = &mut self.loader;
        let builtin = self
            .builtin
            .get_or_insert_with(|| loader.load(BUILTIN_PLUGIN).map_err(|e| e.to_string()));
        if let Ok(p) = builtin {
            if p.header.provides_tool(class_name) {
                return Ok(p.clone());
            }
        }
        match self.loader.find_tool_plugin(class_name) {
            Some(Ok(p)) => return Ok(p),
            Some(Err(e)) => return Err(e.to_string()),
            None => {}
        }
        let mut why: Vec<String> = match &self.builtin {
            Some(Ok(p)) => vec![format!(
                "the built-in `{BUILTIN_PLUGIN}` plugin serves {}",
                p.header.tools.join(", ")
            )],
            Some(Err(e)) => vec![format!(
                "the built-in `{BUILTIN_PLUGIN}` plugin did not load: {e}"
            )],
            None => vec![],
        };
        let given: Vec<String> = self
            .given
            .iter()
            .filter(|p| p.header.kind == verl_plugin_api::PluginKind::Tool)
            .map(|p| format!("`{}` serves {}", p.header.name, p.header.tools.join(", ")))
            .collect();
        if !given.is_empty() {
            why.push(format!("--plugin: {}", given.join("; ")));
        }
        if class_name.starts_with("verl.") {
            why.push(format!(
                "`{class_name}` is a Python class of verl, which verl-rs cannot import"
            ));
        }
        Err(format!(
            "no tool plugin serves it ({}); a tool of your own is a tool plugin \
             (docs/plugins.md#tool-plugins) passed with --plugin or put on the plugin path",
            why.join("; ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(text, max_len, side, expected)`: verl's truncation run in CPython 3.11 on these inputs.
    const TRUNCATION_GOLDEN: &[(&str, usize, &str, &str)] = &[
        ("", 3, "left", ""),
        ("abc", 3, "middle", "abc"),
        ("abcdef", 4, "left", "(truncated)...cdef"),
        ("abcdef", 4, "right", "abcd...(truncated)"),
        ("abcdef", 4, "middle", "ab...(truncated)...ef"),
        ("abcdefg", 5, "middle", "ab...(truncated)...fg"),
        ("abcdef", 0, "left", "(truncated)...abcdef"),
        ("abcdef", 0, "right", "...(truncated)"),
        ("abcdef", 0, "middle", "...(truncated)...abcdef"),
        ("abcdef", 1, "middle", "...(truncated)...abcdef"),
        ("héllo wörld", 5, "left", "(truncated)...wörld"),
        ("héllo wörld", 5, "right", "héllo...(truncated)"),
        ("héllo wörld", 5, "middle", "hé...(truncated)...ld"),
        ("abcdef", 4, "bogus", "ab...(truncated)...ef"),
        ("日本語のテキスト", 3, "middle", "日...(truncated)...ト"),
    ];

    #[test]
    fn truncation_matches_verl_character_for_character() {
        for (text, max_len, side, want) in TRUNCATION_GOLDEN {
            assert_eq!(
                truncate_tool_response(text, *max_len, side),
                *want,
                "{text:?} {max_len} {side}"
            );
        }
    }

    #[test]
    fn only_a_tools_answer_is_truncated_as_in_verl() {
        let answer = ToolCallResult {
            text: "abcdef".into(),
            reward: None,
            error: None,
            seconds: 0.0,
            metrics: Map::new(),
        };
        assert_eq!(
            answer.clone().truncated(4, "right").text,
            "abcd...(truncated)"
        );
        let failed = ToolCallResult {
            error: Some(ToolErrorKind::Failed),
            ..answer
        };
        assert_eq!(failed.truncated(4, "right").text, "abcdef");
    }

    #[test]
    fn available_tools_print_as_a_python_list() {
        assert_eq!(
            py_list(&["calculator".into(), "it's".into(), "a'b\"c".into()]),
            r#"['calculator', "it's", 'a\'b"c']"#
        );
        assert_eq!(py_list(&[]), "[]");
    }

    /// Inputs and what verl's `OpenAIFunctionToolSchema.model_validate(..).model_dump(
    /// exclude_unset=True, exclude_none=True)` gives for them (pydantic 2.14, CPython 3.11).
    #[test]
    fn schemas_are_dumped_as_verls_pydantic_models_dump_them() {
        let cases = [
            (
                json!({"function": {"parameters": {"required": ["a"], "properties": {"a": {"minimum": 0, "description": "x", "type": "integer"}}, "type": "object", "additionalProperties": false}, "description": "d", "name": "f", "extra": 1}, "type": "function"}),
                r#"{"type":"function","function":{"name":"f","description":"d","parameters":{"type":"object","properties":{"a":{"type":"integer","description":"x"}},"required":["a"]}}}"#,
            ),
            (
                json!({"type": "function", "function": {"strict": true, "name": "g", "description": "e", "parameters": {"type": "object", "properties": {"b": {"enum": [1, 2], "type": ["integer", "null"], "description": null}}}}}),
                r#"{"type":"function","function":{"name":"g","description":"e","parameters":{"type":"object","properties":{"b":{"type":["integer","null"],"enum":[1,2]}}},"strict":true}}"#,
            ),
            (
                json!({"type": "function", "function": {"name": "h", "description": "no params"}}),
                r#"{"type":"function","function":{"name":"h","description":"no params"}}"#,
            ),
        ];
        for (given, dumped) in cases {
            assert_eq!(
                serde_json::to_string(&verl_schema_dump(&given)).unwrap(),
                dumped
            );
        }
    }

    fn parse(entry: Value) -> Result<EntrySpec, KeyProblem> {
        EntrySpec::parse(&entry, 3)
    }

    #[test]
    fn entry_checks_name_the_key_what_was_expected_and_found() {
        let e = parse(json!({"class_name": "calculator", "config": {"type": "mcp"}}))
            .err()
            .unwrap();
        assert_eq!(e.0, "tools[3].config.type");
        assert!(e.1.contains("native") && e.2 == "\"mcp\"", "{e:?}");
        let e = parse(json!({"class_name": "calculator", "config": {"timeout": "soon"}}))
            .err()
            .unwrap();
        assert_eq!(
            (e.0.as_str(), e.2.as_str()),
            ("tools[3].config.timeout", "\"soon\"")
        );
        let e = parse(json!({"class": "calculator"})).err().unwrap();
        assert_eq!(
            (e.0.as_str(), e.2.as_str()),
            ("tools[3].class", "an unknown key")
        );
        let e = parse(json!({"config": {}})).err().unwrap();
        assert_eq!(
            (e.0.as_str(), e.2.as_str()),
            ("tools[3].class_name", "nothing")
        );
        let e = parse(json!({"class_name": "gsm8k", "tool_schema": {"type": "function", "function": {"name": "x"}}}))
            .err()
            .unwrap();
        assert_eq!(e.0, "tools[3].tool_schema.function.description");
    }

    #[test]
    fn sandbox_fusion_is_refused_and_pointed_at_the_python_tool() {
        let e = parse(json!({"class_name": SANDBOX_FUSION, "config": {"type": "native"}}))
            .err()
            .unwrap();
        assert_eq!(e.0, "tools[3].class_name");
        assert!(e.1.contains("use the built-in `python` tool"), "{e:?}");
        assert!(e.2.contains("SandboxFusionTool"), "{e:?}");
    }

    #[test]
    fn an_entry_without_config_type_or_schema_is_a_native_tool_with_its_default_schema() {
        let spec = parse(json!({"class_name": "calculator", "config": {"timeout": 2}})).unwrap();
        assert_eq!(spec.init.tool_schema, None);
        assert_eq!(spec.timeout, Some(Duration::from_secs(2)));
        assert_eq!(spec.init.config, json!({"timeout": 2}));
    }
}

//! The multi-turn tool set through the real ABI: verl tool configs naming the built-in tools
//! (`libverl_tools.so`) and the fixture tool plugin (`libtool_fixture.so`: echo, fail, hang,
//! panic), both built by cargo next to this test binary as dev-dependencies.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use verl_host::tools::{ToolConfigError, ToolErrorKind, ToolPlugins, ToolSet};
use verl_host::{LoadedPlugin, Loader};

fn deps_dir() -> PathBuf {
    std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf()
}

fn library(file: &str) -> PathBuf {
    let p = deps_dir().join(file);
    assert!(p.is_file(), "{} is not built", p.display());
    p
}

fn fixture() -> LoadedPlugin {
    Loader::new(&[])
        .load(library("libtool_fixture.so").to_str().unwrap())
        .unwrap()
}

/// The built-in plugin is found by name next to this binary, as next to `verl`.
fn plugins() -> ToolPlugins {
    library("libverl_tools.so");
    ToolPlugins::new(vec![fixture()], vec![])
}

fn config(dir: &Path, yaml: &str) -> PathBuf {
    let p = dir.join("tool_config.yaml");
    std::fs::write(&p, yaml).unwrap();
    p
}

fn load(yaml: &str) -> ToolSet {
    let dir = tempfile::tempdir().unwrap();
    ToolSet::load(&config(dir.path(), yaml), &plugins()).unwrap()
}

fn load_err(yaml: &str) -> (String, PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = config(dir.path(), yaml);
    let e = ToolSet::load(&path, &plugins()).unwrap_err().to_string();
    (e, path, dir)
}

const FIXTURE_TOOLS: &str = r#"
tools:
  - class_name: fixture.Echo
    config: {type: native}
  - class_name: fixture.Fail
  - class_name: fixture.Hang
    config: {type: native, timeout: 0.5}
  - class_name: fixture.Panic
"#;

/// verl's own example (`examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml`)
/// with the calculator and python built-ins beside it.
const BUILTIN_TOOLS: &str = r#"
tools:
  - class_name: calculator
    config:
      type: native
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
  - class_name: python
    config: {timeout: 20, memory_limit_mb: 512}
"#;

#[test]
fn built_in_tools_load_by_class_name_and_answer_as_verl_does() {
    let tools = load(BUILTIN_TOOLS);
    assert_eq!(tools.names(), ["calculator", "calc_gsm8k_reward", "python"]);
    let schemas = tools.schemas();
    assert_eq!(
        schemas[1]["function"]["description"],
        "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if \
         parsed answer is incorrect or not correctly parsed)"
    );
    assert_eq!(
        schemas[0]["function"]["parameters"]["required"],
        json!(["expression"])
    );

    let r = tools.call("calculator", r#"{"expression": "4821 + 3977"}"#, &json!({}));
    assert_eq!((r.text.as_str(), r.error), ("8798", None));

    let kwargs = json!({"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}});
    let r = tools.call("calc_gsm8k_reward", r#"{"answer": "72"}"#, &kwargs);
    assert_eq!(r.text, "Current parsed answer='72' reward=1.0");
    assert_eq!((r.reward, r.error), (Some(0.0), None));
    // Each call is its own instance (create → execute → release), as in verl's agent loop: a
    // repeated right answer is not a non-improvement.
    let r = tools.call("calc_gsm8k_reward", r#"{"answer": "72"}"#, &kwargs);
    assert_eq!(r.reward, Some(0.0));
    let r = tools.call("calc_gsm8k_reward", r#"{"answer": "71"}"#, &kwargs);
    assert_eq!(
        (r.text.as_str(), r.reward),
        ("Current parsed answer='71' reward=0.0", Some(-0.05))
    );

    let r = tools.call("python", r#"{"code": "print(6 * 7)"}"#, &json!(null));
    assert_eq!((r.text.as_str(), r.error), ("42\n", None));
    assert_eq!(r.metrics["timed_out"], false);
}

#[test]
fn a_plugin_tool_runs_create_execute_release_with_the_rows_create_kwargs() {
    let tools = load(FIXTURE_TOOLS);
    assert_eq!(tools.names(), ["echo", "fail", "hang", "panic"]);
    let kwargs = json!({"echo": {"create_kwargs": {"prefix": "row 7: "}}});
    let r = tools.call("echo", r#"{"text": "hi"}"#, &kwargs);
    assert_eq!(r.text, "row 7: hi");
    assert_eq!((r.reward, r.error), (Some(0.5), None));
    assert_eq!(r.metrics["chars"], 9);
    // Released after the call.
    let live = tools
        .client("echo")
        .unwrap()
        .call("live", &json!({}))
        .unwrap();
    assert_eq!(live["live"], 0);
    // A row without kwargs for the tool creates it with `{}`.
    let r = tools.call("echo", r#"{"text": "hi"}"#, &json!({"other": {}}));
    assert_eq!(r.text, "hi");
}

#[test]
fn a_hanging_tool_times_out_with_its_name_and_limit_and_the_others_keep_answering() {
    let tools = Arc::new(load(FIXTURE_TOOLS));
    let started = Instant::now();
    let hung = {
        let tools = tools.clone();
        std::thread::spawn(move || tools.call("hang", "{}", &json!({})))
    };
    // Meanwhile the other tools answer.
    let r = tools.call("echo", r#"{"text": "still here"}"#, &json!({}));
    assert_eq!(r.text, "still here");
    let r = hung.join().unwrap();
    let waited = started.elapsed();
    assert_eq!(r.error, Some(ToolErrorKind::TimedOut));
    assert_eq!(
        r.text,
        "Error executing tool 'hang': timed out after 2.5 s (config.timeout 0.5 s of tools[2] + 2 s grace)"
    );
    assert_eq!(r.reward, Some(0.0));
    assert!(
        waited >= Duration::from_millis(2500) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
}

#[test]
fn a_panicking_tool_is_a_crashed_call_with_its_name() {
    let tools = load(FIXTURE_TOOLS);
    let r = tools.call("panic", "{}", &json!({}));
    assert_eq!(r.error, Some(ToolErrorKind::Crashed));
    assert!(
        r.text.starts_with(
            "Error executing tool 'panic': panicked: the fixture tool panics on purpose"
        ),
        "{}",
        r.text
    );
    // The plugin survives its panic.
    let r = tools.call("echo", r#"{"text": "ok"}"#, &json!({}));
    assert_eq!((r.text.as_str(), r.error), ("ok", None));
}

#[test]
fn a_failing_tool_gives_verls_error_text() {
    let tools = load(FIXTURE_TOOLS);
    let r = tools.call("fail", "{}", &json!({}));
    assert_eq!(r.error, Some(ToolErrorKind::Failed));
    assert_eq!(
        r.text,
        "Error executing tool 'fail': the fixture tool fails on purpose"
    );
    let calc = load("tools: [{class_name: calculator}]");
    let r = calc.call("calculator", r#"{"expression": "1 / 0"}"#, &json!({}));
    assert_eq!(
        (r.text.as_str(), r.error),
        (
            "Error executing tool 'calculator': division by zero",
            Some(ToolErrorKind::Failed)
        )
    );
}

#[test]
fn unknown_tools_and_bad_arguments_give_verls_texts() {
    let tools = load(FIXTURE_TOOLS);
    let r = tools.call("search", "{}", &json!({}));
    assert_eq!(r.error, Some(ToolErrorKind::UnknownTool));
    assert_eq!(
        r.text,
        "Unknown function 'search'. Available tools: ['echo', 'fail', 'hang', 'panic']"
    );
    let r = tools.call("echo", r#"{"text": "#, &json!({}));
    assert_eq!(r.error, Some(ToolErrorKind::BadArguments));
    assert!(
        r.text.starts_with("Invalid JSON in arguments for 'echo': "),
        "{}",
        r.text
    );
    let r = tools.call("echo", "[1, 2]", &json!({}));
    assert_eq!(r.error, Some(ToolErrorKind::BadArguments));
    assert!(
        r.text.contains("expected a JSON object, found [1,2]"),
        "{}",
        r.text
    );
}

#[test]
fn parallel_calls_share_one_tool_set() {
    let tools = Arc::new(load(FIXTURE_TOOLS));
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let tools = tools.clone();
            std::thread::spawn(move || {
                let kwargs = json!({"echo": {"create_kwargs": {"prefix": format!("{i}:")}}});
                tools.call("echo", &json!({"text": "x"}).to_string(), &kwargs)
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.join().unwrap().text, format!("{i}:x"));
    }
    let live = tools
        .client("echo")
        .unwrap()
        .call("live", &json!({}))
        .unwrap();
    assert_eq!(live["live"], 0);
}

#[test]
fn a_tool_plugin_on_the_plugin_path_is_found_by_its_class_name() {
    let dir = tempfile::tempdir().unwrap();
    let plugin_dir = dir.path().join("plugins");
    std::fs::create_dir(&plugin_dir).unwrap();
    std::fs::copy(
        library("libtool_fixture.so"),
        plugin_dir.join("libtool_fixture.so"),
    )
    .unwrap();
    let path = config(dir.path(), "tools: [{class_name: fixture.Echo}]");
    let tools = ToolSet::load(&path, &ToolPlugins::new(vec![], vec![plugin_dir])).unwrap();
    assert_eq!(tools.names(), ["echo"]);
    assert_eq!(tools.class_name("echo"), Some("fixture.Echo"));
}

#[test]
fn config_errors_name_the_file_the_entry_the_key_and_what_was_found() {
    let (e, path, _dir) = load_err("tools:\n  - class_name: my_pkg.tools.SearchTool\n");
    let file = path.display().to_string();
    assert!(e.starts_with(&file), "{e}");
    assert!(
        e.contains("`tools[0].class_name` `my_pkg.tools.SearchTool`: no tool plugin serves it"),
        "{e}"
    );
    assert!(
        e.contains("the built-in `tools` plugin serves calculator"),
        "{e}"
    );
    assert!(e.contains("`tool-fixture` serves fixture.Echo"), "{e}");

    let (e, ..) = load_err("tools:\n  - class_name: calculator\n    config: {precision: 2}\n");
    assert!(e.contains("`tools[0].class_name` `calculator`"), "{e}");
    assert!(e.contains("unknown config key `config.precision`"), "{e}");

    let (e, ..) = load_err(
        "tools:\n  - class_name: calculator\n  - class_name: fixture.Echo\n    tool_schema: {type: function, function: {name: calculator, description: d}}\n",
    );
    assert!(
        e.contains("`tools[1]` and `tools[0]` both define a tool named `calculator`"),
        "{e}"
    );

    let (e, ..) = load_err("tools:\n  - class_name: python\n    config: {timeout: 0}\n");
    assert!(
        e.contains("`tools[0].config.timeout`: expected seconds (a positive number), found 0"),
        "{e}"
    );

    let (e, ..) = load_err(
        "tools:\n  - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool\n    config: {type: native, sandbox_fusion_url: 'https://x'}\n",
    );
    assert!(e.contains("`tools[0].class_name`"), "{e}");
    assert!(e.contains("use the built-in `python` tool"), "{e}");

    let (e, ..) = load_err("tool: []\n");
    assert!(
        e.contains("`tool`: expected only `tools` at the top level"),
        "{e}"
    );

    let missing = Path::new("/nonexistent/tools.yaml");
    let e = ToolSet::load(missing, &plugins()).unwrap_err();
    assert!(matches!(e, ToolConfigError::Read { .. }), "{e}");
    assert!(
        e.to_string().starts_with("/nonexistent/tools.yaml: "),
        "{e}"
    );
}

/// The example jobs' tool configs show the model the very schema their SFT conversations list
/// (the chat template renders `tools` in both, so a difference would change the prompt between
/// SFT and RL).
#[test]
fn the_example_tool_configs_list_the_schemas_their_sft_data_lists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for (config, schema) in [
        (
            "examples/quickstart/tools.yaml",
            verl_data::calculator_tool_schema(),
        ),
        (
            "examples/gsm8k_tools/tools.yaml",
            verl_data::gsm8k_tools::gsm8k_calculator_schema(),
        ),
    ] {
        let set = ToolSet::load(&root.join(config), &plugins()).unwrap();
        assert_eq!(
            serde_json::to_string(&set.schemas()).unwrap(),
            serde_json::to_string(&[schema]).unwrap(),
            "{config}"
        );
    }
}

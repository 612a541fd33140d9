//! Helpers for the end-to-end tests: find the built `verl` binary and plugin libraries of this
//! build (`cargo build --workspace` must run first; `make test` does), and run the binary in a
//! clean install-like directory.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `target/<profile>` of the build these tests belong to.
pub fn build_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test>
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_path_buf()
}

/// Path of a built artifact, with a clear failure when the workspace was not built.
pub fn artifact(name: &str) -> PathBuf {
    let p = build_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace` (or `make test`) before these tests",
        p.display()
    );
    p
}

pub fn verl_bin() -> PathBuf {
    artifact("verl")
}

/// A plugin library by file name, e.g. `libverl_rewards.so`.
pub fn plugin(file: &str) -> PathBuf {
    artifact(file)
}

/// A directory holding a copy of `verl` and the given plugins, like an installation.
pub fn install(plugins: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::copy(verl_bin(), dir.path().join("verl")).expect("copy verl");
    for p in plugins {
        std::fs::copy(plugin(p), dir.path().join(p)).expect("copy plugin");
    }
    dir
}

/// Run a `verl` binary with args, without inherited plugin-path settings.
pub fn run(bin: &Path, args: &[&str]) -> Output {
    Command::new(bin)
        .args(args)
        .env_remove("VERL_PLUGIN_PATH")
        .env_remove("VERL_LOG")
        .output()
        .expect("run verl")
}

/// Run the installed `verl` of `inst` in `cwd` (the quickstart pipelines' way): no inherited
/// plugin-path settings, metrics files under `cwd/logs`.
pub fn run_in(inst: &Path, cwd: &Path, args: &[&str]) -> Output {
    Command::new(inst.join("verl"))
        .args(args)
        .current_dir(cwd)
        .env_remove("VERL_PLUGIN_PATH")
        .env_remove("VERL_LOG")
        .env("VERL_FILE_LOGGER_ROOT", cwd.join("logs"))
        .output()
        .expect("run verl")
}

/// Assert the command succeeded, showing its output otherwise.
pub fn assert_ok(o: &Output, what: &str) {
    assert!(
        o.status.success(),
        "{what} failed\nstdout:\n{}\nstderr:\n{}",
        stdout(o),
        stderr(o)
    );
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Assert the command failed with exactly one `error:` line that contains every `needle`.
pub fn assert_one_line_error(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert!(
        !o.status.success(),
        "expected failure, got success; stderr:\n{err}"
    );
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one error line, got:\n{err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    for n in needles {
        assert!(lines[0].contains(n), "missing `{n}` in: {}", lines[0]);
    }
}

/// Write a file in `dir` and return its path.
pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write file");
    p
}

/// Inputs of a tiny job, made once per test binary with the real `verl data arith` and
/// `verl init-model`: verl-format train/val parquet and an HF model folder (tokenizer with a
/// chat template, config, weights).
pub struct TinyInputs {
    _dir: tempfile::TempDir,
    pub train: PathBuf,
    pub val: PathBuf,
    pub model: PathBuf,
}

impl TinyInputs {
    /// Overrides pointing a job at these inputs.
    pub fn overrides(&self) -> Vec<String> {
        vec![
            format!("data.train_files={}", self.train.display()),
            format!("data.val_files={}", self.val.display()),
            format!("actor_rollout_ref.model.path={}", self.model.display()),
            format!("critic.model.path={}", self.model.display()),
        ]
    }

    /// A copy of the model folder's tokenizer next to `config` (a config.json of another shape,
    /// for layout checks that need no weights).
    pub fn model_with_config(&self, dir: &Path, config: &serde_json::Value) -> PathBuf {
        std::fs::create_dir_all(dir).expect("model dir");
        for entry in std::fs::read_dir(&self.model).expect("read model dir") {
            let path = entry.expect("dir entry").path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if name.starts_with("tokenizer") || name == "special_tokens_map.json" {
                std::fs::copy(&path, dir.join(&name)).expect("copy tokenizer file");
            }
        }
        write(dir, "config.json", &config.to_string());
        dir.to_path_buf()
    }
}

/// The shared [`TinyInputs`] of this test binary.
pub fn tiny_inputs() -> &'static TinyInputs {
    static INPUTS: std::sync::OnceLock<TinyInputs> = std::sync::OnceLock::new();
    INPUTS.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let data = dir.path().join("data");
        let model = dir.path().join("model");
        let step = |args: &[&str]| {
            let o = run(&verl_bin(), args);
            assert!(o.status.success(), "verl {args:?}: {}", stderr(&o));
        };
        step(&[
            "data",
            "arith",
            "--out",
            data.to_str().unwrap(),
            "--train",
            "64",
            "--val",
            "16",
            "--seed",
            "1",
        ]);
        step(&[
            "init-model",
            "--out",
            model.to_str().unwrap(),
            "--data",
            data.join("train.parquet").to_str().unwrap(),
            "--vocab",
            "300",
            "--hidden",
            "32",
            "--intermediate",
            "64",
            "--layers",
            "1",
            "--heads",
            "2",
            "--kv-heads",
            "1",
        ]);
        TinyInputs {
            train: data.join("train.parquet"),
            val: data.join("val.parquet"),
            model,
            _dir: dir,
        }
    })
}

/// The Python the tests run transformers with: `VERL_PYTHON`, else the project's venv
/// (`.venv/bin/python`, made by `scripts/setup.sh`). Missing is a failure, not a skip.
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("VERL_PYTHON") {
        return PathBuf::from(p);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let p = root.join(".venv/bin/python");
    assert!(
        p.exists(),
        "{} is missing: run scripts/setup.sh (or set VERL_PYTHON to a Python with torch and transformers)",
        p.display()
    );
    p
}

/// A Python script of `tests/py`.
pub fn py_script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("py").join(name)
}

/// The one metrics JSONL the file logger wrote under `dir` (its `VERL_FILE_LOGGER_ROOT`).
pub fn metrics_jsonl(dir: &Path) -> PathBuf {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "jsonl") {
                found.push(p);
            }
        }
    }
    assert_eq!(
        found.len(),
        1,
        "expected one metrics file under {}, found {found:?}",
        dir.display()
    );
    found.remove(0)
}

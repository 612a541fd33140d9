//! wandb, mlflow and swanlab through their real Python clients in the sidecar: runs are read back from what the
//! clients wrote (offline run files, a real `mlflow server`'s REST API). The packages come from
//! `scripts/requirements-test.txt`; without them these tests fail, they do not skip.
//!
//! The interpreter is `$VERL_PYTHON`, else `python3` on PATH (`scripts/env.sh` puts the project's venv first).
//! Every client setting is passed to the sidecar's own environment, never set on the test process.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use verl_metrics::{
    check_loggers, LoggerOptions, MetricsError, MetricsLogger, Sink, TrackingOptions, TrackingSink,
    ValGeneration,
};

fn python() -> PathBuf {
    TrackingOptions::new("p", "e").python
}

fn env(pairs: &[(&str, &Path)]) -> Vec<(OsString, OsString)> {
    pairs
        .iter()
        .map(|(k, v)| (OsString::from(k), v.as_os_str().to_owned()))
        .collect()
}

/// A config shaped like verl's, with what MLflow's flattening treats specially: lists, null, an empty mapping.
fn run_config() -> Value {
    json!({
        "trainer": {"project_name": "verl-rs-test", "logger": ["console", "wandb"], "total_epochs": 2},
        "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}, "use_kl_loss": true}},
        "data": {"val_files": null, "custom_cls": {}},
    })
}

fn step_metrics(step: u64) -> Vec<(String, f64)> {
    let s = step as f64;
    vec![
        ("critic/score/mean".into(), 0.25 * s),
        ("actor/pg_loss".into(), -0.5 / s),
        ("val-core/gsm8k/acc/mean@1".into(), 0.125 * s),
    ]
}

/// The samples of two validations (steps 1 and 2), with what JSON and Markdown must carry through: quotes,
/// newlines, non-ASCII text beyond the BMP.
fn validations() -> [(u64, Vec<ValGeneration>); 2] {
    [
        (
            1,
            vec![
                ValGeneration::new("Q: 1+1=?\n", "The answer is \"2\"", 1.0),
                ValGeneration::new("Résous x²=4 😀", "x = ±2", 0.0),
            ],
        ),
        (
            2,
            vec![
                ValGeneration::new("Q: 1+1=?\n", "3", -0.5),
                ValGeneration::new("日本の首都は?", "東京", 0.25),
            ],
        ),
    ]
}

/// The read-back tables of `run` (`read_run.py`'s `tables`).
fn tables(run: &Value) -> Vec<Value> {
    run["tables"].as_array().unwrap().clone()
}

fn logger_options(backends: &[&str], tracking: TrackingOptions) -> LoggerOptions {
    let backends: Vec<String> = backends.iter().map(|s| s.to_string()).collect();
    let mut o =
        LoggerOptions::from_verl(&tracking.project_name, &tracking.experiment_name, &backends);
    o.tracking = tracking;
    o
}

/// An offline wandb run whose every file lands under `dir`.
fn wandb_offline(dir: &Path, experiment: &str) -> TrackingOptions {
    let mut t = TrackingOptions::new("verl-rs-test", experiment);
    t.config = run_config();
    t.env = env(&[
        ("WANDB_MODE", Path::new("offline")),
        ("WANDB_DIR", dir),
        ("WANDB_CACHE_DIR", &dir.join("cache")),
        ("WANDB_CONFIG_DIR", &dir.join("config")),
        ("WANDB_DATA_DIR", &dir.join("data")),
    ]);
    t
}

/// `read_run.py`'s view of the run under `root`.
fn read_run(client: &str, root: &Path) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/read_run.py");
    let out = Command::new(python())
        .arg(&script)
        .arg(client)
        .arg(root)
        .output()
        .expect("run read_run.py");
    assert!(
        out.status.success(),
        "read_run.py {client} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("read_run.py prints JSON")
}

/// Steps and values of a read-back history, values parsed from their JSON text (NaN included).
fn history(run: &Value) -> Vec<(u64, Vec<(String, f64)>)> {
    run["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            let mut m: Vec<(String, f64)> = row["metrics"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| {
                    let text = v.as_str().unwrap();
                    let x = if text == "NaN" {
                        f64::NAN
                    } else {
                        text.parse().unwrap()
                    };
                    (k.clone(), x)
                })
                .collect();
            m.sort_by(|a, b| a.0.cmp(&b.0));
            (row["step"].as_u64().unwrap(), m)
        })
        .collect()
}

fn sorted(mut m: Vec<(String, f64)>) -> Vec<(String, f64)> {
    m.sort_by(|a, b| a.0.cmp(&b.0));
    m
}

// ---- wandb --------------------------------------------------------------------------------------------------

#[test]
fn wandb_offline_run_records_the_config_and_every_step() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = logger_options(&["wandb"], wandb_offline(tmp.path(), "wandb-offline"));
    let mut logger = MetricsLogger::new(&opts).unwrap();
    assert_eq!(logger.sink_names(), ["wandb"]);
    for step in 1..=3 {
        logger.log(step, &step_metrics(step)).unwrap();
    }
    logger.finish().unwrap();

    let run = read_run("wandb", tmp.path());
    assert_eq!(run["project"], "verl-rs-test");
    assert_eq!(run["name"], "wandb-offline");
    assert_eq!(run["config"], run_config());
    let want: Vec<_> = (1..=3).map(|s| (s, sorted(step_metrics(s)))).collect();
    assert_eq!(history(&run), want);
    assert_eq!(run["end"], "0");
}

#[test]
fn wandb_relogs_one_table_of_every_validation_so_far_as_verl_does() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = logger_options(&["wandb"], wandb_offline(tmp.path(), "generations"));
    let mut logger = MetricsLogger::new(&opts).unwrap();
    for (step, samples) in validations() {
        logger.log(step, &step_metrics(step)).unwrap();
        logger.log_generations(step, &samples).unwrap();
    }
    logger.finish().unwrap();

    let run = read_run("wandb", tmp.path());
    let columns =
        json!(["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"]);
    let row1 = json!([
        1,
        "Q: 1+1=?\n",
        "The answer is \"2\"",
        1.0,
        "Résous x²=4 😀",
        "x = ±2",
        0.0
    ]);
    let row2 = json!([2, "Q: 1+1=?\n", "3", -0.5, "日本の首都は?", "東京", 0.25]);
    assert_eq!(
        tables(&run),
        [
            json!({"step": 1, "key": "val/generations", "content": {"columns": columns, "data": [row1]}}),
            json!({"step": 2, "key": "val/generations", "content": {"columns": columns, "data": [row1, row2]}}),
        ]
    );
    // The table shares its step's history row with the metrics.
    let want: Vec<_> = (1..=2).map(|s| (s, sorted(step_metrics(s)))).collect();
    assert_eq!(history(&run), want);
    assert_eq!(run["end"], "0");
}

#[test]
fn a_validation_with_another_number_of_samples_fails_the_wandb_table_as_in_verl() {
    let tmp = tempfile::tempdir().unwrap();
    let mut sink = TrackingSink::start("wandb", &wandb_offline(tmp.path(), "widths")).unwrap();
    let [(_, two), _] = validations();
    sink.log_generations(1, &two).unwrap();
    sink.log_generations(2, &two[..1]).unwrap();
    // wandb refuses the old 7-wide row under the new 4 columns; the refusal comes back with the next request
    // (here the finish), naming the step.
    let err = sink.finish().unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, MetricsError::SidecarFailed { .. })
            && text.contains("wandb validation generations (step 2) failed")
            && text.contains("This table expects 4 columns"),
        "{text}"
    );
    let run = read_run("wandb", tmp.path());
    assert_eq!(tables(&run).len(), 1, "the first table stays");
}

#[test]
fn a_wandb_sink_dropped_without_finish_ends_its_run_as_failed_with_its_steps() {
    let tmp = tempfile::tempdir().unwrap();
    {
        let mut sink = TrackingSink::start("wandb", &wandb_offline(tmp.path(), "dropped")).unwrap();
        assert!(sink.detail().contains("offline"), "{}", sink.detail());
        sink.log(1, &[("actor/grad_norm".into(), f64::NAN)])
            .unwrap();
        sink.log(2, &[("actor/grad_norm".into(), 1.5)]).unwrap();
    }
    let run = read_run("wandb", tmp.path());
    let h = history(&run);
    assert_eq!(h.len(), 2);
    assert!(h[0].0 == 1 && h[0].1[0].1.is_nan(), "{h:?}");
    assert_eq!(h[1], (2, vec![("actor/grad_norm".to_string(), 1.5)]));
    assert_eq!(run["end"], "1");
}

#[test]
fn the_alias_tracking_is_wandb_with_a_deprecation_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = logger_options(&["tracking", "wandb"], wandb_offline(tmp.path(), "alias"));
    let mut logger = MetricsLogger::new(&opts).unwrap();
    assert_eq!(logger.sink_names(), ["wandb"]);
    assert!(logger.warnings()[0].contains("`tracking` is deprecated"));
    logger.finish().unwrap();
}

#[test]
fn a_sidecar_that_dies_mid_run_fails_the_next_log_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let mut sink = TrackingSink::start("wandb", &wandb_offline(tmp.path(), "killed")).unwrap();
    sink.log(1, &step_metrics(1)).unwrap();
    let status = Command::new("kill")
        .args(["-KILL", &sink.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    std::thread::sleep(Duration::from_millis(300));
    let err = sink.log(2, &step_metrics(2)).unwrap_err();
    assert!(matches!(err, MetricsError::SidecarDied { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("the `wandb` sidecar") && text.contains("killed by signal 9"),
        "{text}"
    );
    assert!(!text.contains('\n'), "one line: {text}");
    // Later calls keep failing instead of pretending to log.
    assert!(sink.log(3, &step_metrics(3)).is_err());
    assert!(sink.finish().is_ok(), "nothing is left to finish");
}

// ---- swanlab ------------------------------------------------------------------------------------------------

#[test]
fn swanlab_in_cloud_mode_needs_credentials_where_swanlab_looks() {
    let tmp = tempfile::tempdir().unwrap();
    let save = tmp.path().join("save");
    std::fs::create_dir_all(&save).unwrap();
    let mut t = TrackingOptions::new("verl-rs-test", "swanlab-cloud");
    t.env = env(&[
        ("SWANLAB_MODE", Path::new("cloud")),
        ("SWANLAB_SAVE_DIR", &save),
    ]);
    let err = check_loggers(&logger_options(&["swanlab"], t.clone()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no SwanLab API key") && err.contains("SWANLAB_MODE=offline"),
        "{err}"
    );
    // What `swanlab login` writes.
    std::fs::write(
        save.join(".netrc"),
        "machine https://api.swanlab.cn\n  login user\n  password 0123456789abcdef\n",
    )
    .unwrap();
    let lines = check_loggers(&logger_options(&["swanlab"], t)).unwrap();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("credentials in") && l.contains(".netrc")),
        "{lines:?}"
    );
}

#[test]
fn swanlab_offline_run_records_the_config_and_every_step() {
    let tmp = tempfile::tempdir().unwrap();
    let mut t = TrackingOptions::new("verl-rs-test", "swanlab-offline");
    t.config = run_config();
    t.env = env(&[
        ("SWANLAB_MODE", Path::new("offline")),
        ("SWANLAB_LOG_DIR", tmp.path()),
        ("SWANLAB_SAVE_DIR", &tmp.path().join("save")),
    ]);
    let mut logger = MetricsLogger::new(&logger_options(&["swanlab"], t)).unwrap();
    for step in 1..=3 {
        logger.log(step, &step_metrics(step)).unwrap();
    }
    logger.finish().unwrap();

    let run = read_run("swanlab", tmp.path());
    assert_eq!(run["project"], "verl-rs-test");
    assert_eq!(run["name"], "swanlab-offline");
    // verl adds FRAMEWORK to swanlab's config.
    let mut want_config = json!({"FRAMEWORK": "verl"});
    for (k, v) in run_config().as_object().unwrap() {
        want_config[k] = v.clone();
    }
    assert_eq!(run["config"], want_config);
    let want: Vec<_> = (1..=3).map(|s| (s, sorted(step_metrics(s)))).collect();
    assert_eq!(history(&run), want);
    assert_eq!(run["end"], "RUN_STATE_FINISHED");
}

#[test]
fn swanlab_logs_a_table_of_each_validation_as_verl_does() {
    let tmp = tempfile::tempdir().unwrap();
    let mut t = TrackingOptions::new("verl-rs-test", "swanlab-generations");
    t.env = env(&[
        ("SWANLAB_MODE", Path::new("offline")),
        ("SWANLAB_LOG_DIR", tmp.path()),
        ("SWANLAB_SAVE_DIR", &tmp.path().join("save")),
    ]);
    let mut logger = MetricsLogger::new(&logger_options(&["swanlab"], t)).unwrap();
    for (step, samples) in validations() {
        logger.log(step, &step_metrics(step)).unwrap();
        logger.log_generations(step, &samples).unwrap();
    }
    logger.finish().unwrap();

    let run = read_run("swanlab", tmp.path());
    let col_defs =
        json!([{"field": "step"}, {"field": "input"}, {"field": "output"}, {"field": "score"}]);
    let want: Vec<Value> = validations()
        .iter()
        .map(|(step, samples)| {
            let rows: Vec<Value> = samples
                .iter()
                .map(|s| json!({"step": step, "input": s.input, "output": s.output, "score": s.score}))
                .collect();
            json!({"step": step, "key": "val/generations",
                   "content": {"_swanLab": "table", "colDefs": col_defs, "rowData": rows}})
        })
        .collect();
    assert_eq!(tables(&run), want);
    assert_eq!(run["end"], "RUN_STATE_FINISHED");
}

// ---- mlflow -------------------------------------------------------------------------------------------------

/// A real `mlflow server` on a free local port, stopped with its whole process group when dropped.
struct MlflowServer {
    child: Child,
    port: u16,
}

impl MlflowServer {
    fn start(dir: &Path) -> Self {
        let port = free_port();
        let log = std::fs::File::create(dir.join("server.log")).unwrap();
        let mut cmd = Command::new(python());
        cmd.args([
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--workers",
            "1",
        ])
        .args(["--port", &port.to_string()])
        .arg("--backend-store-uri")
        .arg(format!("sqlite:///{}", dir.join("mlflow.db").display()))
        .arg("--default-artifact-root")
        .arg(dir.join("artifacts"))
        // No background job runner: it starts a dozen worker processes a test does not need.
        .env("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut server = MlflowServer {
            child: cmd.spawn().expect("start mlflow server"),
            port,
        };
        let t0 = Instant::now();
        loop {
            if let Ok((200, _)) = http(port, "GET", "/health", None) {
                break;
            }
            let exited = server.child.try_wait().unwrap();
            let log = || std::fs::read_to_string(dir.join("server.log")).unwrap_or_default();
            assert!(
                exited.is_none(),
                "mlflow server exited ({exited:?}); its log:\n{}",
                log()
            );
            assert!(
                t0.elapsed() < Duration::from_secs(180),
                "mlflow server did not answer within 180 s; its log:\n{}",
                log()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
        server
    }

    fn uri(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn get(&self, path: &str) -> Value {
        let (status, body) = http(self.port, "GET", path, None).unwrap();
        assert_eq!(status, 200, "GET {path}: {body}");
        serde_json::from_str(&body).unwrap()
    }
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-TERM", "--", &group]).status();
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // uvicorn's worker is in the group too: make sure none of it survives.
        let _ = Command::new("kill")
            .args(["-KILL", "--", &group])
            .stderr(Stdio::null())
            .status();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A plain HTTP/1.1 request; the body of the answer (whole or chunked).
fn http(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let body = body.map(Value::to_string).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Ok((status, body))
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
    out
}

fn query(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn mlflow_tracking(server: &MlflowServer, extra: &[(&str, &str)]) -> TrackingOptions {
    let mut t = TrackingOptions::new("verl-rs-test", "mlflow-run");
    t.config = run_config();
    t.env = [("MLFLOW_TRACKING_URI", server.uri().as_str())]
        .iter()
        .chain(extra)
        .map(|(k, v)| (OsString::from(k), OsString::from(v)))
        .collect();
    t
}

fn metric_history(server: &MlflowServer, run_id: &str, key: &str) -> Vec<(u64, f64)> {
    let h = server.get(&format!(
        "/api/2.0/mlflow/metrics/get-history?run_id={}&metric_key={}",
        query(run_id),
        query(key)
    ));
    let mut points: Vec<(u64, f64)> = h["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let v = match &m["value"] {
                Value::String(s) if s == "NaN" => f64::NAN,
                v => v.as_f64().unwrap(),
            };
            (
                m["step"]
                    .as_str()
                    .map_or_else(|| m["step"].as_u64().unwrap(), |s| s.parse().unwrap()),
                v,
            )
        })
        .collect();
    points.sort_by_key(|p| p.0);
    points
}

#[test]
fn mlflow_run_on_a_real_server_has_verl_names_params_and_metric_history() {
    let tmp = tempfile::tempdir().unwrap();
    let server = MlflowServer::start(tmp.path());
    let tracking = mlflow_tracking(&server, &[]);

    // The dry-run check reaches the server but creates nothing.
    let lines = check_loggers(&logger_options(&["console", "mlflow"], tracking.clone())).unwrap();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("mlflow: mlflow ") && l.contains("answers")),
        "{lines:?}"
    );
    let (status, _) = http(
        server.port,
        "GET",
        "/api/2.0/mlflow/experiments/get-by-name?experiment_name=verl-rs-test",
        None,
    )
    .unwrap();
    assert_eq!(status, 404, "the check must not create the experiment");

    let mut logger = MetricsLogger::new(&logger_options(&["mlflow"], tracking.clone())).unwrap();
    for step in 1..=3 {
        logger.log(step, &step_metrics(step)).unwrap();
    }
    logger
        .log(4, &[("actor/grad_norm".into(), f64::NAN)])
        .unwrap();
    logger.finish().unwrap();

    let exp = server.get("/api/2.0/mlflow/experiments/get-by-name?experiment_name=verl-rs-test");
    let exp_id = exp["experiment"]["experiment_id"]
        .as_str()
        .unwrap()
        .to_string();
    let (status, body) = http(
        server.port,
        "POST",
        "/api/2.0/mlflow/runs/search",
        Some(&json!({"experiment_ids": [exp_id]})),
    )
    .unwrap();
    assert_eq!(status, 200, "{body}");
    let runs: Value = serde_json::from_str(&body).unwrap();
    let runs = runs["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1);
    let run = &runs[0];
    assert_eq!(run["info"]["run_name"], "mlflow-run");
    assert_eq!(run["info"]["status"], "FINISHED");
    let run_id = run["info"]["run_id"].as_str().unwrap().to_string();

    // verl's flattening: `/` joins keys, lists become list_len + indices, None is "None", empty maps vanish.
    let mut params: Vec<(String, String)> = run["data"]["params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["key"].as_str().unwrap().into(),
                p["value"].as_str().unwrap().into(),
            )
        })
        .collect();
    params.sort();
    let mut want: Vec<(String, String)> = [
        ("trainer/project_name", "verl-rs-test"),
        ("trainer/logger/list_len", "2"),
        ("trainer/logger/0", "console"),
        ("trainer/logger/1", "wandb"),
        ("trainer/total_epochs", "2"),
        ("actor_rollout_ref/actor/optim/lr", "1e-06"),
        ("actor_rollout_ref/actor/use_kl_loss", "True"),
        ("data/val_files", "None"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    want.sort();
    assert_eq!(params, want);

    assert_eq!(
        metric_history(&server, &run_id, "critic/score/mean"),
        [(1, 0.25), (2, 0.5), (3, 0.75)]
    );
    // verl's key sanitising: `@` becomes `_at_`.
    assert_eq!(
        metric_history(&server, &run_id, "val-core/gsm8k/acc/mean_at_1"),
        [(1, 0.125), (2, 0.25), (3, 0.375)]
    );
    let nan = metric_history(&server, &run_id, "actor/grad_norm");
    assert!(
        nan.len() == 1 && nan[0].0 == 4 && nan[0].1.is_nan(),
        "{nan:?}"
    );

    // MLFLOW_RUN_ID attaches to that run instead of creating one.
    let attach = mlflow_tracking(&server, &[("MLFLOW_RUN_ID", &run_id)]);
    let mut logger = MetricsLogger::new(&logger_options(&["mlflow"], attach)).unwrap();
    logger.log(5, &step_metrics(5)).unwrap();
    logger.finish().unwrap();
    let (_, body) = http(
        server.port,
        "POST",
        "/api/2.0/mlflow/runs/search",
        Some(&json!({"experiment_ids": [exp_id]})),
    )
    .unwrap();
    let runs: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(runs["runs"].as_array().unwrap().len(), 1);
    assert_eq!(
        metric_history(&server, &run_id, "critic/score/mean").last(),
        Some(&(5, 1.25))
    );
}

#[test]
fn mlflow_saves_each_validation_as_a_json_artifact_as_verl_does() {
    let tmp = tempfile::tempdir().unwrap();
    let server = MlflowServer::start(tmp.path());
    let mut logger =
        MetricsLogger::new(&logger_options(&["mlflow"], mlflow_tracking(&server, &[]))).unwrap();
    for (step, samples) in validations() {
        logger.log(step, &step_metrics(step)).unwrap();
        logger.log_generations(step, &samples).unwrap();
    }
    logger.finish().unwrap();

    let exp = server.get("/api/2.0/mlflow/experiments/get-by-name?experiment_name=verl-rs-test");
    let (_, body) = http(
        server.port,
        "POST",
        "/api/2.0/mlflow/runs/search",
        Some(&json!({"experiment_ids": [exp["experiment"]["experiment_id"]]})),
    )
    .unwrap();
    let runs: Value = serde_json::from_str(&body).unwrap();
    let run_id = runs["runs"][0]["info"]["run_id"]
        .as_str()
        .unwrap()
        .to_string();

    let listed = server.get(&format!(
        "/api/2.0/mlflow/artifacts/list?run_id={}",
        query(&run_id)
    ));
    let mut names: Vec<&str> = listed["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["val_step1.json", "val_step2.json"]);
    for (step, samples) in validations() {
        let (status, body) = http(
            server.port,
            "GET",
            &format!(
                "/get-artifact?path=val_step{step}.json&run_id={}",
                query(&run_id)
            ),
            None,
        )
        .unwrap();
        assert_eq!(status, 200, "{body}");
        // Python's `json.dump` defaults: ASCII with \u escapes, `, ` and `: ` separators.
        assert!(
            body.is_ascii() && body.starts_with("[{\"input\": \""),
            "{body}"
        );
        let rows: Value = serde_json::from_str(&body).unwrap();
        let want: Vec<Value> = samples
            .iter()
            .map(|s| json!({"input": s.input, "output": s.output, "score": s.score}))
            .collect();
        assert_eq!(rows, json!(want), "val_step{step}.json");
    }
}

#[test]
fn mlflow_that_cannot_reach_its_tracking_store_fails_before_training() {
    let closed = format!("http://127.0.0.1:{}", free_port());
    for uri in [closed.as_str(), "nosuchscheme://somewhere"] {
        let mut t = TrackingOptions::new("verl-rs-test", "unreachable");
        t.env = vec![("MLFLOW_TRACKING_URI".into(), uri.into())];
        let t0 = Instant::now();
        let err =
            MetricsLogger::new(&logger_options(&["console", "mlflow"], t.clone())).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, MetricsError::SidecarFailed { .. }), "{text}");
        assert!(
            text.starts_with("trainer.logger: `mlflow`: mlflow init failed:")
                && text.contains("MLFLOW_TRACKING_URI")
                && text.contains("trainer.logger=[console]")
                && !text.contains('\n'),
            "{text}"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "took {:?}",
            t0.elapsed()
        );
        let err = check_loggers(&logger_options(&["mlflow"], t)).unwrap_err();
        assert!(err.to_string().contains("mlflow check failed"), "{err}");
    }
}

// ---- missing packages, bad interpreters ---------------------------------------------------------------------

#[test]
fn a_python_without_the_package_is_a_clear_error_naming_interpreter_and_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let venv = tmp.path().join("bare");
    let made = Command::new(python())
        .args(["-m", "venv", "--without-pip"])
        .arg(&venv)
        .status()
        .unwrap();
    assert!(made.success(), "python -m venv");
    let mut t = wandb_offline(tmp.path(), "bare");
    t.python = venv.join("bin/python");
    for err in [
        MetricsLogger::new(&logger_options(&["console", "wandb"], t.clone())).unwrap_err(),
        check_loggers(&logger_options(&["wandb"], t.clone())).unwrap_err(),
    ] {
        assert!(matches!(err, MetricsError::MissingPackage { .. }), "{err}");
        let text = err.to_string();
        let interpreter = format!("`{}`", t.python.display());
        for part in [
            interpreter.as_str(),
            "No module named 'wandb'",
            "-m pip install wandb",
            "trainer.logger=[console]",
        ] {
            assert!(text.contains(part), "`{part}` missing from: {text}");
        }
        assert!(!text.contains('\n'), "one line: {text}");
    }
}

#[test]
fn an_interpreter_that_does_not_exist_is_a_clear_error() {
    let mut t = TrackingOptions::new("verl-rs-test", "nopython");
    t.python = PathBuf::from("/nonexistent/bin/python3");
    let err = MetricsLogger::new(&logger_options(&["mlflow"], t)).unwrap_err();
    assert!(matches!(err, MetricsError::PythonSpawn { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("`/nonexistent/bin/python3`")
            && text.contains("VERL_PYTHON")
            && text.contains("trainer.logger=[console]"),
        "{text}"
    );
}

#[test]
fn verl_loggers_that_verl_rs_lacks_are_errors_listing_the_available_ones() {
    for name in ["clearml", "trackio", "vemlp_wandb", "rl_insight"] {
        let opts = logger_options(&["console", name], TrackingOptions::new("p", "e"));
        let err = MetricsLogger::new(&opts).unwrap_err();
        assert!(
            matches!(err, MetricsError::UnsupportedBackend { .. }),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.contains("trainer.logger")
                && text.contains(&format!("`{name}`"))
                && text.contains("wandb")
                && text.contains("mlflow")
                && text.contains("swanlab"),
            "{text}"
        );
        assert!(check_loggers(&opts).is_err());
    }
}

//! The loggers verl runs through Python clients (wandb, mlflow, swanlab): each one is a sidecar process running
//! the official client, fed JSON lines over a pipe (protocol: `tracking_sidecar.py`). The host never links Python.
//!
//! A step's metrics are written to the pipe and not waited for: the sidecar's answers are read by a thread and
//! looked at on the next call, so a slow server delays the training step only once the pipe is full. `finish`
//! waits until the client has written (and, online, uploaded) everything.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Number, Value};

use crate::error::{MetricsError, Result};
use crate::generations::ValGeneration;
use crate::sink::Sink;

/// The `trainer.logger` values served by a sidecar, with the Python package each imports.
pub const SIDECAR_LOGGERS: [(&str, &str); 3] = [
    ("wandb", "wandb"),
    ("mlflow", "mlflow"),
    ("swanlab", "swanlab"),
];

const SCRIPT: &str = include_str!("tracking_sidecar.py");
/// The script travels in an environment variable that it removes at once, so that the command line stays short
/// and the processes the clients start do not inherit it.
const SCRIPT_ENV: &str = "VERL_TRACKING_SIDECAR";
const BOOTSTRAP: &str = "import os;exec(compile(os.environ.pop('VERL_TRACKING_SIDECAR'),'verl_tracking_sidecar.py','exec'))";

/// wandb's own `init_timeout` is 90 s; MLflow's start is capped by the sidecar's HTTP retry limits.
const START_TIMEOUT: Duration = Duration::from_secs(180);
/// Generous: an online wandb run uploads what is pending before `finish` returns.
const FINISH_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a sidecar that has answered (or died) gets to exit before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(30);
const STDERR_TAIL_LINES: usize = 6;

/// What the Python-client loggers need: verl gives them the project, the experiment and the whole resolved
/// config. The clients' own environment variables (`WANDB_MODE`, `WANDB_ENTITY`, `MLFLOW_TRACKING_URI`,
/// `MLFLOW_RUN_ID`, `SWANLAB_MODE`, ...) are read by the sidecar, as verl's `tracking.py` reads them.
#[derive(Debug, Clone, PartialEq)]
pub struct TrackingOptions {
    /// `trainer.project_name`: the wandb/swanlab project, the MLflow experiment.
    pub project_name: String,
    /// `trainer.experiment_name`: the run's name.
    pub experiment_name: String,
    /// The resolved job config: wandb's run config, MLflow's params (flattened as verl does). `Null`: none.
    pub config: Value,
    /// The interpreter that runs the sidecar: `$VERL_PYTHON`, else `python3` on `PATH`.
    pub python: PathBuf,
    /// Environment added to the sidecar's (which otherwise inherits the host's).
    pub env: Vec<(OsString, OsString)>,
}

impl TrackingOptions {
    /// Options for `project_name`/`experiment_name`, no config, the interpreter from `$VERL_PYTHON`.
    pub fn new(project_name: &str, experiment_name: &str) -> Self {
        let python = std::env::var_os("VERL_PYTHON")
            .filter(|v| !v.is_empty())
            .map_or_else(|| PathBuf::from("python3"), PathBuf::from);
        TrackingOptions {
            project_name: project_name.to_string(),
            experiment_name: experiment_name.to_string(),
            config: Value::Null,
            python,
            env: Vec::new(),
        }
    }
}

/// The Python package a sidecar logger imports.
pub(crate) fn package_of(logger: &str) -> Option<&'static str> {
    SIDECAR_LOGGERS
        .iter()
        .find(|(l, _)| *l == logger)
        .map(|(_, p)| *p)
}

/// Checks that `logger` can start, without creating a run: the sidecar imports the client and, for MLflow, asks
/// the tracking server for one experiment (a local store's folder must be writable). Returns a line on what
/// was found (client version, mode, tracking URI).
pub fn check_tracking(logger: &str, options: &TrackingOptions) -> Result<String> {
    let mut sidecar = Sidecar::spawn(logger, options, &json!({"op": "check"}))?;
    let reply = sidecar.next_reply(START_TIMEOUT, "while checking the logger");
    sidecar.closed = true;
    let reply = reply?;
    sidecar.reap(EXIT_GRACE);
    match reply {
        Reply::Ok { what, detail } if what == "checked" => Ok(detail),
        other => Err(sidecar.unexpected(other, "while checking the logger")),
    }
}

/// A `trainer.logger` value served by its Python client in a sidecar process.
pub struct TrackingSink {
    sidecar: Sidecar,
    detail: String,
}

impl std::fmt::Debug for TrackingSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrackingSink")
            .field("logger", &self.sidecar.logger)
            .field("pid", &self.sidecar.child.id())
            .field("detail", &self.detail)
            .finish()
    }
}

impl TrackingSink {
    /// Start `logger` (`wandb`, `mlflow` or `swanlab`) and wait until its run exists.
    pub fn start(logger: &str, options: &TrackingOptions) -> Result<Self> {
        let mut sink = Self::spawn(logger, options)?;
        sink.wait_ready()?;
        Ok(sink)
    }

    /// Start the sidecar and ask for the run; [`wait_ready`](Self::wait_ready) waits for it (so that several
    /// loggers start side by side).
    pub(crate) fn spawn(logger: &str, options: &TrackingOptions) -> Result<Self> {
        let init = json!({
            "op": "init",
            "project": options.project_name,
            "experiment": options.experiment_name,
            "config": options.config,
        });
        Ok(TrackingSink {
            sidecar: Sidecar::spawn(logger, options, &init)?,
            detail: String::new(),
        })
    }

    pub(crate) fn wait_ready(&mut self) -> Result<()> {
        let during = "while starting the run";
        let reply = match self.sidecar.next_reply(START_TIMEOUT, during) {
            Ok(r) => r,
            Err(e) => {
                self.sidecar.closed = true;
                return Err(e);
            }
        };
        match reply {
            Reply::Ok { what, detail } if what == "ready" => {
                tracing::info!(logger = self.sidecar.logger, "{detail}");
                self.detail = detail;
                Ok(())
            }
            other => {
                // The sidecar exits after a failed start.
                self.sidecar.closed = true;
                let e = self.sidecar.unexpected(other, during);
                self.sidecar.reap(EXIT_GRACE);
                Err(e)
            }
        }
    }

    /// The sidecar's process id.
    pub fn pid(&self) -> u32 {
        self.sidecar.child.id()
    }

    /// What the client said when its run started (version, run id, where it writes).
    pub fn detail(&self) -> &str {
        &self.detail
    }
}

impl TrackingSink {
    /// Send a request for `step` unless the sidecar is closed; an error the client reported for an earlier
    /// request, or a dead sidecar, is returned instead.
    fn request(&mut self, op: &str, step: u64, line: &str) -> Result<()> {
        if self.sidecar.closed {
            return Err(MetricsError::SidecarFailed {
                logger: self.sidecar.logger.to_string(),
                op: format!("{} {op} (step {step})", self.sidecar.logger),
                message: "the logger is closed (finished, or failed earlier)".into(),
                hint: "",
            });
        }
        let during = format!("before the {op} of step {step} was sent");
        self.sidecar.take_failures(&during)?;
        self.sidecar.send(line, &during)
    }
}

impl Sink for TrackingSink {
    fn name(&self) -> &str {
        self.sidecar.logger
    }

    /// Hands the metrics to the sidecar; an error the client reported for an earlier step, or a dead sidecar,
    /// is returned here.
    fn log(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()> {
        self.request("log", step, &log_request(step, metrics))
    }

    /// Hands the samples to the sidecar, which logs them as verl's `ValidationGenerationsLogger` does (wandb:
    /// the table of every validation so far; mlflow: a `val_step<step>.json` artifact; swanlab: a table).
    fn log_generations(&mut self, step: u64, samples: &[ValGeneration]) -> Result<()> {
        self.request("generations", step, &generations_request(step, samples))
    }

    /// Ends the run (`wandb.finish`, `mlflow.end_run`, `swanlab.finish`) and waits until it is written.
    fn finish(&mut self) -> Result<()> {
        self.sidecar.close(0)
    }
}

impl Drop for TrackingSink {
    /// A sink dropped without `finish` (an error path) ends its run as failed, like an exiting verl process.
    fn drop(&mut self) {
        if !self.sidecar.closed {
            if let Err(e) = self.sidecar.close(1) {
                tracing::error!("{e}");
            }
        }
    }
}

/// `{"op":"log",...}`: finite values as JSON numbers, the others as Python's `json` reads them.
pub(crate) fn log_request(step: u64, metrics: &[(String, f64)]) -> String {
    let mut line = format!("{{\"op\":\"log\",\"step\":{step},\"metrics\":{{");
    for (i, (k, v)) in metrics.iter().enumerate() {
        if i > 0 {
            line.push(',');
        }
        push_str(&mut line, k);
        line.push(':');
        push_number(&mut line, *v);
    }
    line.push_str("}}\n");
    line
}

/// `{"op":"generations","step":N,"samples":[{"input":..,"output":..,"score":..}, ...]}`.
pub(crate) fn generations_request(step: u64, samples: &[ValGeneration]) -> String {
    let mut line = format!("{{\"op\":\"generations\",\"step\":{step},\"samples\":[");
    for (i, s) in samples.iter().enumerate() {
        if i > 0 {
            line.push(',');
        }
        line.push_str("{\"input\":");
        push_str(&mut line, &s.input);
        line.push_str(",\"output\":");
        push_str(&mut line, &s.output);
        line.push_str(",\"score\":");
        push_number(&mut line, s.score);
        line.push('}');
    }
    line.push_str("]}\n");
    line
}

fn push_str(line: &mut String, s: &str) {
    line.push_str(&Value::from(s).to_string());
}

/// A finite value as a JSON number, the others as Python's `json` writes and reads them.
fn push_number(line: &mut String, v: f64) {
    match Number::from_f64(v) {
        Some(n) => line.push_str(&n.to_string()),
        None if v.is_nan() => line.push_str("NaN"),
        None if v > 0.0 => line.push_str("Infinity"),
        None => line.push_str("-Infinity"),
    }
}

/// An answer of the sidecar.
#[derive(Debug)]
enum Reply {
    Ok {
        what: String,
        detail: String,
    },
    Failed {
        kind: String,
        op: String,
        step: Option<u64>,
        message: String,
    },
}

impl Reply {
    fn parse(line: &str) -> Reply {
        let v: Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(e) => {
                return Reply::Failed {
                    kind: "protocol".into(),
                    op: "reply".into(),
                    step: None,
                    message: format!("unreadable reply `{line}`: {e}"),
                }
            }
        };
        let text = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        match v.get("error") {
            Some(_) => Reply::Failed {
                kind: text("kind"),
                op: text("op"),
                step: v.get("step").and_then(Value::as_u64),
                message: text("error"),
            },
            None => Reply::Ok {
                what: text("ok"),
                detail: text("detail"),
            },
        }
    }
}

/// The process, its pipes and the threads draining its output.
struct Sidecar {
    logger: &'static str,
    python: PathBuf,
    child: Child,
    stdin: Option<ChildStdin>,
    replies: Receiver<Reply>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    /// No request is sent any more (finished, failed to start, or died).
    closed: bool,
}

impl Sidecar {
    fn spawn(logger: &str, options: &TrackingOptions, first: &Value) -> Result<Self> {
        let (logger, _) = SIDECAR_LOGGERS
            .iter()
            .find(|(l, _)| *l == logger)
            .ok_or_else(|| MetricsError::UnknownBackend {
                found: logger.to_string(),
                expected: SIDECAR_LOGGERS
                    .iter()
                    .map(|(l, _)| format!("`{l}`"))
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
        let mut cmd = Command::new(&options.python);
        cmd.arg("-u")
            .arg("-c")
            .arg(BOOTSTRAP)
            .arg(logger)
            .env(SCRIPT_ENV, SCRIPT)
            .envs(options.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // Its own process group: Ctrl-C in the terminal reaches the host only, which then ends the run.
        #[cfg(unix)]
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child = cmd.spawn().map_err(|source| MetricsError::PythonSpawn {
            logger: logger.to_string(),
            python: options.python.clone(),
            source,
        })?;

        let (tx, replies) = mpsc::channel();
        let stdout = child.stdout.take().expect("stdout is piped");
        std::thread::Builder::new()
            .name(format!("{logger}-replies"))
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(Reply::parse(&line)).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| MetricsError::Io {
                op: "start a thread for",
                path: PathBuf::from(logger),
                source: e,
            })?;
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let stderr = child.stderr.take().expect("stderr is piped");
        let tail = Arc::clone(&stderr_tail);
        std::thread::Builder::new()
            .name(format!("{logger}-stderr"))
            .spawn(move || forward_stderr(logger, stderr, &tail))
            .map_err(|e| MetricsError::Io {
                op: "start a thread for",
                path: PathBuf::from(logger),
                source: e,
            })?;

        let mut sidecar = Sidecar {
            logger,
            python: options.python.clone(),
            stdin: child.stdin.take(),
            child,
            replies,
            stderr_tail,
            closed: false,
        };
        let mut request = first.to_string();
        request.push('\n');
        sidecar.send(&request, "while starting")?;
        Ok(sidecar)
    }

    fn send(&mut self, line: &str, during: &str) -> Result<()> {
        let written = match self.stdin.as_mut() {
            Some(stdin) => stdin
                .write_all(line.as_bytes())
                .and_then(|()| stdin.flush()),
            None => Err(std::io::ErrorKind::BrokenPipe.into()),
        };
        if written.is_err() {
            // A write fails only when the sidecar has gone.
            self.closed = true;
            return Err(self.died(during));
        }
        Ok(())
    }

    /// The first failure the sidecar reported since the last call, if any.
    fn take_failures(&mut self, during: &str) -> Result<()> {
        loop {
            match self.replies.try_recv() {
                Ok(Reply::Ok { .. }) => {}
                Ok(failed) => return Err(self.unexpected(failed, during)),
                // Its answers may lag its death: ask the process itself too.
                Err(TryRecvError::Empty) if matches!(self.child.try_wait(), Ok(None)) => {
                    return Ok(())
                }
                Err(_) => {
                    self.closed = true;
                    return Err(self.died(during));
                }
            }
        }
    }

    fn next_reply(&mut self, timeout: Duration, during: &str) -> Result<Reply> {
        match self.replies.recv_timeout(timeout) {
            Ok(reply) => Ok(reply),
            Err(RecvTimeoutError::Disconnected) => Err(self.died(during)),
            Err(RecvTimeoutError::Timeout) => {
                let _ = self.child.kill();
                let _ = self.child.wait();
                Err(MetricsError::SidecarTimeout {
                    logger: self.logger.to_string(),
                    pid: self.child.id(),
                    during: during.to_string(),
                    secs: timeout.as_secs(),
                })
            }
        }
    }

    /// Ask for the end of the run with `exit_code` and wait for it; every failure reported on the way is
    /// collected, the first returned.
    fn close(&mut self, exit_code: i32) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        let during = "while finishing the run";
        let sent = self.send(
            &format!("{{\"op\":\"finish\",\"exit_code\":{exit_code}}}\n"),
            during,
        );
        self.closed = true;
        // End of input also tells the sidecar to end, should it miss the request.
        drop(self.stdin.take());
        sent?;
        let mut first = None;
        let deadline = Instant::now() + FINISH_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next_reply(left, during) {
                Ok(Reply::Ok { what, .. }) if what == "finished" => break,
                Ok(Reply::Ok { .. }) => {}
                Ok(failed) => {
                    let last = matches!(&failed, Reply::Failed { kind, .. } if kind != "log");
                    first.get_or_insert(self.unexpected(failed, during));
                    if last {
                        break;
                    }
                }
                Err(e) => {
                    first.get_or_insert(e);
                    break;
                }
            }
        }
        match self.reap(EXIT_GRACE) {
            Some(status) if !status.success() && first.is_none() => Err(self.died(during)),
            _ => first.map_or(Ok(()), Err),
        }
    }

    /// Wait up to `grace` for the process to exit, then kill it.
    fn reap(&mut self, grace: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + grace;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Ok(None) => {
                    let _ = self.child.kill();
                    return self.child.wait().ok();
                }
                Err(_) => return None,
            }
        }
    }

    /// The error for a sidecar that is gone: its exit status and last stderr lines.
    fn died(&mut self, during: &str) -> MetricsError {
        let status = match self.reap(Duration::from_secs(5)) {
            Some(s) => describe_status(s),
            None => "is gone (its exit status is unknown)".to_string(),
        };
        // Give the stderr thread a moment to take the last lines.
        std::thread::sleep(Duration::from_millis(50));
        MetricsError::SidecarDied {
            logger: self.logger.to_string(),
            python: self.python.clone(),
            pid: self.child.id(),
            what: format!("{status} {during}"),
            stderr_tail: self.stderr_tail(),
        }
    }

    /// The error for an answer that is not the one expected.
    fn unexpected(&self, reply: Reply, during: &str) -> MetricsError {
        match reply {
            Reply::Failed { kind, message, .. } if kind == "import" => {
                MetricsError::MissingPackage {
                    logger: self.logger.to_string(),
                    python: self.python.clone(),
                    package: package_of(self.logger).unwrap_or(self.logger).to_string(),
                    import_error: message,
                }
            }
            Reply::Failed {
                kind,
                op,
                step,
                message,
            } => MetricsError::SidecarFailed {
                logger: self.logger.to_string(),
                op: match step {
                    Some(s) => format!("{op} (step {s})"),
                    None => op,
                },
                message,
                hint: if kind == "init" || kind == "check" {
                    start_hint(self.logger)
                } else {
                    ""
                },
            },
            Reply::Ok { what, detail } => MetricsError::SidecarFailed {
                logger: self.logger.to_string(),
                op: format!("the sidecar protocol {during}"),
                message: format!("unexpected answer `{what}` ({detail})"),
                hint: "",
            },
        }
    }

    fn stderr_tail(&self) -> String {
        let tail = self.stderr_tail.lock().unwrap_or_else(|p| p.into_inner());
        if tail.is_empty() {
            "(nothing)".to_string()
        } else {
            tail.iter().cloned().collect::<Vec<_>>().join(" | ")
        }
    }
}

/// How to get past a logger that does not start.
fn start_hint(logger: &str) -> &'static str {
    match logger {
        "wandb" => {
            "; log in (`wandb login` or WANDB_API_KEY), or set WANDB_MODE=offline, or set trainer.logger \
             without wandb (e.g. trainer.logger=[console])"
        }
        "mlflow" => {
            "; check MLFLOW_TRACKING_URI (default sqlite:////tmp/mlruns.db) and that its server answers, or set \
             trainer.logger without mlflow (e.g. trainer.logger=[console])"
        }
        _ => {
            "; check the SWANLAB_* settings (SWANLAB_API_KEY, SWANLAB_MODE), or set trainer.logger without \
             swanlab (e.g. trainer.logger=[console])"
        }
    }
}

fn describe_status(status: ExitStatus) -> String {
    #[cfg(unix)]
    if let Some(sig) = std::os::unix::process::ExitStatusExt::signal(&status) {
        return format!("was killed by signal {sig}");
    }
    match status.code() {
        Some(c) => format!("exited with code {c}"),
        None => format!("exited ({status})"),
    }
}

/// The sidecar's stderr (the clients' own messages and tracebacks) goes to the host log; the last lines are
/// kept for error messages.
fn forward_stderr(logger: &'static str, stderr: impl Read, tail: &Mutex<VecDeque<String>>) {
    let mut reader = BufReader::new(stderr);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let line = String::from_utf8_lossy(&buf);
        let line = line.trim_end();
        if line.trim().is_empty() {
            continue;
        }
        tracing::info!(target: "verl_metrics::tracking", logger, "{line}");
        let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
        if tail.len() == STDERR_TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(line.chars().take(300).collect());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_requests_are_one_json_line_with_python_spellings_of_non_finite_values() {
        let line = log_request(
            3,
            &[
                ("a/b".into(), 0.5),
                ("c@1".into(), 2.0),
                ("n".into(), f64::NAN),
                ("i".into(), f64::INFINITY),
                ("j".into(), f64::NEG_INFINITY),
            ],
        );
        assert_eq!(
            line,
            "{\"op\":\"log\",\"step\":3,\"metrics\":{\"a/b\":0.5,\"c@1\":2.0,\"n\":NaN,\"i\":Infinity,\"j\":-Infinity}}\n"
        );
    }

    #[test]
    fn generations_requests_carry_each_sample_as_an_object() {
        let line = generations_request(
            5,
            &[
                ValGeneration::new("q \"1\"\n", "é", 1.0),
                ValGeneration::new("q2", "", f64::NAN),
            ],
        );
        assert_eq!(
            line,
            "{\"op\":\"generations\",\"step\":5,\"samples\":[{\"input\":\"q \\\"1\\\"\\n\",\"output\":\"é\",\"score\":1.0},\
             {\"input\":\"q2\",\"output\":\"\",\"score\":NaN}]}\n"
        );
    }

    #[test]
    fn replies_parse_into_ready_and_failures() {
        assert!(matches!(
            Reply::parse(r#"{"ok":"ready","detail":"wandb 0.31.0"}"#),
            Reply::Ok { what, detail } if what == "ready" && detail == "wandb 0.31.0"
        ));
        assert!(matches!(
            Reply::parse(r#"{"error":"boom","kind":"log","op":"mlflow log","step":4}"#),
            Reply::Failed { kind, step: Some(4), message, .. } if kind == "log" && message == "boom"
        ));
        assert!(matches!(
            Reply::parse("wandb: hello"),
            Reply::Failed { kind, .. } if kind == "protocol"
        ));
    }
}

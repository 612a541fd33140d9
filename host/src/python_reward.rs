//! verl's `custom_reward_function`: the user's Python file, unchanged, run by the user's Python in
//! worker processes fed over pipes (the host links no Python).
//!
//! Each worker imports the file once and then answers one JSON line per request: a chunk of rows
//! in, one result per row out. It calls `name(data_source=, solution_str=, ground_truth=,
//! extra_info=, **reward_kwargs)` as verl's naive reward manager does (sync or `async def`), and
//! returns a float or a dict with `score` whose other keys become `reward_extra/<key>`. A step's
//! rows are split over the workers, one round trip each.
//!
//! Limits: every call has a timeout; each worker runs under an address-space limit and a CPU-time
//! limit (`setrlimit` in the child). A crash, a hang past the timeout or an exhausted limit ends
//! the step with one error naming the file, the function, the rows and the limit, or, with
//! `on_error: zero`, scores those rows 0 and counts them (`reward/error_ratio`). A dead or killed
//! worker is restarted.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::{json, Value};

/// The worker, run as `python -u -c WORKER path name`.
const WORKER: &str = r#"
import asyncio, importlib.util, inspect, json, math, os, sys, traceback
path, name = sys.argv[1], sys.argv[2]
out = sys.stdout
sys.stdout = sys.stderr  # the user's prints must not corrupt the protocol
def reply(obj):
    out.write(json.dumps(obj) + "\n"); out.flush()
try:
    spec = importlib.util.spec_from_file_location("custom_reward_module", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["custom_reward_module"] = module
    spec.loader.exec_module(module)
    fn = getattr(module, name)
except Exception as e:
    reply({"fatal": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}); sys.exit(0)
is_async = inspect.iscoroutinefunction(fn)
reply({"ready": True, "async": is_async})
def number(v):
    if isinstance(v, bool): return float(v)
    if isinstance(v, (int, float)): return float(v)
    try:
        import numbers
        if isinstance(v, numbers.Number): return float(v)
    except Exception: pass
    if hasattr(v, "item"):
        try: return float(v.item())
        except Exception: return None
    return None
def result_of(r):
    if isinstance(r, dict):
        if "score" not in r: return {"error": "returned a dict without `score`: keys " + ", ".join(map(str, r))}
        s = number(r["score"])
        if s is None: return {"error": f"`score` is not a number: {r['score']!r}"}
        extra = {}
        for k, v in r.items():
            x = number(v)
            if x is not None: extra[str(k)] = x
        return {"score": s, "extra": extra}
    s = number(r)
    if s is None: return {"error": f"returned {type(r).__name__} {r!r}, not a number or a dict with `score`"}
    return {"score": s, "extra": {"acc": s}}
def call(row, kwargs):
    try:
        r = fn(data_source=row["data_source"], solution_str=row["solution_str"],
               ground_truth=row["ground_truth"], extra_info=row["extra_info"], **kwargs)
        return r
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)): raise
        return {"__error__": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=4)}
async def run_async(rows, kwargs):
    async def one(row):
        try:
            return await fn(data_source=row["data_source"], solution_str=row["solution_str"],
                            ground_truth=row["ground_truth"], extra_info=row["extra_info"], **kwargs)
        except Exception as e:
            return {"__error__": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=4)}
    return await asyncio.gather(*(one(r) for r in rows))
def run_batch(rows, kwargs):
    # verl's batch reward manager: one call with lists, one result per row back.
    extras = []
    for r in rows:
        e = r["extra_info"]
        if isinstance(e, dict):
            e = {k: v for k, v in e.items() if k != "num_turns"}
        extras.append(e)
    try:
        out = fn(data_sources=[r["data_source"] for r in rows], solution_strs=[r["solution_str"] for r in rows],
                 ground_truths=[r["ground_truth"] for r in rows], extra_infos=extras, **kwargs)
        if inspect.isawaitable(out):
            out = asyncio.run(out)
        out = list(out)
    except Exception as e:
        err = {"__error__": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=4)}
        return [err] * len(rows)
    if len(out) != len(rows):
        err = {"__error__": f"returned {len(out)} results for {len(rows)} rows"}
        return [err] * len(rows)
    return [{"__batch__": True, "value": r} for r in out]
for line in sys.stdin:
    req = json.loads(line)
    rows, kwargs = req["rows"], req.get("kwargs") or {}
    if req.get("batch"):
        raw = run_batch(rows, kwargs)
    else:
        raw = asyncio.run(run_async(rows, kwargs)) if is_async else [call(r, kwargs) for r in rows]
    results = []
    for r in raw:
        if isinstance(r, dict) and "__error__" in r:
            results.append({"error": r["__error__"], "trace": r.get("trace", "")})
        elif isinstance(r, dict) and r.get("__batch__"):
            res = result_of(r["value"])
            if not isinstance(r["value"], dict) and "extra" in res:
                res["extra"] = {}  # the batch manager keeps no `acc` for a float
            results.append(res)
        else:
            results.append(result_of(r))
    reply({"results": results})
"#;

/// What to do with rows whose reward failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    /// End the step with the error.
    Fail,
    /// Score them 0 and count them.
    Zero,
}

/// The limits every worker runs under.
#[derive(Debug, Clone)]
pub struct Limits {
    pub timeout: Duration,
    /// Address space per worker (`RLIMIT_AS`), MB.
    pub memory_mb: Option<u64>,
    /// CPU time per worker (`RLIMIT_CPU`), seconds.
    pub cpu_s: Option<u64>,
    pub on_error: OnError,
}

/// One row's input.
#[derive(Debug, Clone)]
pub struct Row {
    pub data_source: String,
    pub solution_str: String,
    pub ground_truth: Value,
    pub extra_info: Value,
}

/// One row's result.
#[derive(Debug, Clone, PartialEq)]
pub enum RowResult {
    Scored {
        score: f64,
        extra: Vec<(String, f64)>,
    },
    /// The reward failed on this row (with `on_error: zero`; otherwise the call is an error).
    Failed(String),
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    stderr: Arc<Mutex<VecDeque<String>>>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct PythonReward {
    /// verl's `batch` reward manager: the function gets the whole batch as lists.
    batch: bool,
    python: PathBuf,
    path: PathBuf,
    name: String,
    kwargs: Value,
    limits: Limits,
    workers: Vec<Option<Worker>>,
}

/// The worker's address-space and CPU-time limits, set in the child before it runs.
pub(crate) fn apply_limits(cmd: &mut Command, limits: &Limits) {
    let (mem, cpu) = (limits.memory_mb, limits.cpu_s);
    // SAFETY: only async-signal-safe calls (setrlimit) between fork and exec.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(move || {
            if let Some(mb) = mem {
                let lim = libc::rlimit {
                    rlim_cur: mb * 1024 * 1024,
                    rlim_max: mb * 1024 * 1024,
                };
                libc::setrlimit(libc::RLIMIT_AS, &lim);
            }
            if let Some(s) = cpu {
                let lim = libc::rlimit {
                    rlim_cur: s,
                    rlim_max: s + 5,
                };
                libc::setrlimit(libc::RLIMIT_CPU, &lim);
            }
            Ok(())
        });
    }
}

/// How a worker ended: the signal that killed it (and the limit, for SIGXCPU) or its exit status.
pub(crate) fn ended(status: Option<std::process::ExitStatus>, limits: &Limits) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status.and_then(|s| s.signal()) {
        Some(sig) => format!(
            "was killed by {}{}",
            crate::launch::signal_name(sig),
            if sig == 24 {
                format!(
                    ": the CPU-time limit of {} s (plugins.reward.cpu_s)",
                    limits.cpu_s.unwrap_or(0)
                )
            } else {
                String::new()
            }
        ),
        None => format!(
            "exited ({})",
            status
                .map(|s| s.to_string())
                .unwrap_or_else(|| "unknown status".into())
        ),
    }
}

impl PythonReward {
    /// Starts `workers` processes that import `path` and look up `name`; a file that does not
    /// import or lacks the function is an error here, before any step.
    pub fn start(
        python: PathBuf,
        path: &Path,
        name: &str,
        kwargs: Value,
        workers: usize,
        limits: Limits,
    ) -> anyhow::Result<Self> {
        if !path.is_file() {
            bail!(
                "custom_reward_function.path={}: no such file",
                path.display()
            );
        }
        let mut me = PythonReward {
            batch: false,
            python,
            path: std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()),
            name: name.to_string(),
            kwargs,
            limits,
            workers: (0..workers.max(1)).map(|_| None).collect(),
        };
        for i in 0..me.workers.len() {
            me.workers[i] = Some(me.spawn()?);
        }
        Ok(me)
    }

    /// verl's `batch` reward manager: one call per step with lists (`data_sources`,
    /// `solution_strs`, `ground_truths`, `extra_infos`), one worker.
    pub fn batched(mut self) -> Self {
        self.batch = true;
        self
    }

    fn what(&self) -> String {
        format!("python reward `{}` in {}", self.name, self.path.display())
    }

    fn spawn(&self) -> anyhow::Result<Worker> {
        let mut cmd = Command::new(&self.python);
        cmd.arg("-u")
            .arg("-c")
            .arg(WORKER)
            .arg(&self.path)
            .arg(&self.name)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(dir) = self.path.parent() {
            // The file's own imports of its neighbours, as `python my_reward.py` would find them.
            cmd.env(
                "PYTHONPATH",
                match std::env::var_os("PYTHONPATH") {
                    Some(p) => {
                        let mut v = dir.as_os_str().to_owned();
                        v.push(":");
                        v.push(p);
                        v
                    }
                    None => dir.as_os_str().to_owned(),
                },
            );
        }
        apply_limits(&mut cmd, &self.limits);
        let mut child = cmd.spawn().with_context(|| {
            format!(
                "starting {} for custom_reward_function (set VERL_PYTHON or plugins.reward.python)",
                self.python.display()
            )
        })?;
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr_pipe = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        let tail = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr_pipe).lines() {
                let Ok(line) = line else { break };
                let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
                if t.len() == 20 {
                    t.pop_front();
                }
                t.push_back(line);
            }
        });
        let mut w = Worker {
            child,
            stdin,
            lines,
            stderr,
        };
        // The import, under the call timeout.
        let first = self.read(&mut w, "importing the file")?;
        let v: Value = serde_json::from_str(&first)
            .with_context(|| format!("{}: unexpected worker output {first:?}", self.what()))?;
        if let Some(f) = v.get("fatal").and_then(Value::as_str) {
            bail!(
                "{}: cannot load it: {f}\n{}",
                self.what(),
                v["trace"].as_str().unwrap_or("").trim_end()
            );
        }
        Ok(w)
    }

    /// The worker's next line within the timeout; a timeout or an exit is an error naming the
    /// limit or the signal.
    fn read(&self, w: &mut Worker, doing: &str) -> anyhow::Result<String> {
        match w.lines.recv_timeout(self.limits.timeout) {
            Ok(l) => Ok(l),
            Err(RecvTimeoutError::Timeout) => {
                let _ = w.child.kill();
                bail!(
                    "{} did not answer within the timeout of {} s (plugins.reward.timeout_s) while {doing}; the worker was killed",
                    self.what(),
                    self.limits.timeout.as_secs_f64()
                )
            }
            Err(RecvTimeoutError::Disconnected) => {
                let how = ended(w.child.wait().ok(), &self.limits);
                let tail: Vec<String> = w
                    .stderr
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .cloned()
                    .collect();
                bail!(
                    "{} crashed while {doing}: the worker {how}{}",
                    self.what(),
                    if tail.is_empty() {
                        String::new()
                    } else {
                        format!("; its stderr ends:\n{}", tail.join("\n"))
                    }
                )
            }
        }
    }

    /// Scores `rows`, split over the workers (each chunk one round trip, the chunks in parallel).
    pub fn score(&mut self, rows: &[Row]) -> anyhow::Result<Vec<RowResult>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let n = if self.batch {
            1
        } else {
            self.workers.len().min(rows.len())
        };
        let per = rows.len().div_ceil(n);
        let chunks: Vec<std::ops::Range<usize>> = (0..n)
            .map(|i| i * per..((i + 1) * per).min(rows.len()))
            .filter(|r| !r.is_empty())
            .collect();
        // Send every chunk first, then read the answers: the workers compute side by side.
        let mut sent = Vec::new();
        for (i, range) in chunks.iter().enumerate() {
            if self.workers[i].is_none() {
                self.workers[i] = Some(self.spawn()?);
            }
            let req = json!({
                "rows": rows[range.clone()].iter().map(|r| {
                    let mut extra = r.extra_info.clone();
                    if let Value::Object(m) = &mut extra {
                        // What verl's naive reward manager adds to extra_info.
                        m.entry("num_turns").or_insert(Value::Null);
                        m.entry("rollout_reward_scores").or_insert(json!({}));
                    }
                    json!({"data_source": r.data_source, "solution_str": r.solution_str,
                           "ground_truth": r.ground_truth, "extra_info": extra})
                }).collect::<Vec<_>>(),
                "kwargs": self.kwargs,
                "batch": self.batch,
            });
            let w = self.workers[i].as_mut().expect("spawned");
            let ok = writeln!(w.stdin, "{req}").and_then(|_| w.stdin.flush());
            sent.push(ok.is_ok());
        }
        let mut out = vec![RowResult::Failed(String::new()); rows.len()];
        let mut first_error: Option<anyhow::Error> = None;
        for (i, range) in chunks.iter().enumerate() {
            let doing = format!(
                "scoring rows {}..{} (first data_source `{}`)",
                range.start, range.end, rows[range.start].data_source
            );
            let mut w = self.workers[i].take().expect("spawned");
            let answer = if sent[i] {
                self.read(&mut w, &doing)
            } else {
                self.read(&mut w, &doing)
                    .and_then(|_| bail!("{}: the worker's input pipe closed", self.what()))
            };
            let results = answer.and_then(|line| {
                let v: Value = serde_json::from_str(&line).with_context(|| {
                    format!("{}: unexpected worker output {line:?}", self.what())
                })?;
                v["results"]
                    .as_array()
                    .cloned()
                    .filter(|a| a.len() == range.len())
                    .with_context(|| format!("{}: a malformed answer {line:?}", self.what()))
            });
            match results {
                Ok(results) => {
                    self.workers[i] = Some(w);
                    for (k, r) in results.iter().enumerate() {
                        let row = range.start + k;
                        out[row] = match r.get("error").and_then(Value::as_str) {
                            Some(e) => {
                                let msg = format!(
                                    "{} raised on row {row} (data_source `{}`): {e}{}",
                                    self.what(),
                                    rows[row].data_source,
                                    if e.starts_with("MemoryError") {
                                        match self.limits.memory_mb {
                                            Some(mb) => format!(" (the memory limit of {mb} MB, plugins.reward.memory_mb)"),
                                            None => String::new(),
                                        }
                                    } else {
                                        String::new()
                                    }
                                );
                                if self.limits.on_error == OnError::Fail && first_error.is_none() {
                                    first_error = Some(anyhow::anyhow!(
                                        "{msg}\n{}",
                                        r["trace"].as_str().unwrap_or("").trim_end()
                                    ));
                                }
                                RowResult::Failed(msg)
                            }
                            None => RowResult::Scored {
                                score: r["score"].as_f64().unwrap_or(f64::NAN),
                                extra: r["extra"]
                                    .as_object()
                                    .map(|m| {
                                        m.iter()
                                            .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
                                            .collect()
                                    })
                                    .unwrap_or_default(),
                            },
                        };
                    }
                }
                Err(e) => {
                    // The worker is gone (crash, timeout): a new one takes its place next call.
                    drop(w);
                    let msg = format!("{e:#}");
                    for r in range.clone() {
                        out[r] = RowResult::Failed(msg.clone());
                    }
                    if self.limits.on_error == OnError::Fail && first_error.is_none() {
                        first_error = Some(e);
                    }
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn python() -> PathBuf {
        std::env::var_os("VERL_PYTHON")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("python3"))
    }

    fn limits(on_error: OnError) -> Limits {
        Limits {
            timeout: Duration::from_secs(5),
            memory_mb: Some(512),
            cpu_s: None,
            on_error,
        }
    }

    fn row(ds: &str, s: &str, gt: &str) -> Row {
        Row {
            data_source: ds.into(),
            solution_str: s.into(),
            ground_truth: json!(gt),
            extra_info: json!({"index": 0}),
        }
    }

    #[test]
    fn a_users_file_scores_with_kwargs_dicts_and_async_functions() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("my_reward.py");
        std::fs::write(
            &f,
            "import asyncio\n\
             def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n\
             \x20   print('noise on stdout')\n\
             \x20   ok = solution_str.strip().endswith(ground_truth)\n\
             \x20   if data_source == 'dict':\n\
             \x20       return {'score': float(ok) + bonus, 'length': len(solution_str), 'note': 'text'}\n\
             \x20   assert extra_info['rollout_reward_scores'] == {}\n\
             \x20   return float(ok) + bonus\n\
             async def judge(data_source, solution_str, ground_truth, extra_info=None):\n\
             \x20   await asyncio.sleep(0.01)\n\
             \x20   return len(solution_str)\n",
        )
        .unwrap();
        let mut r = PythonReward::start(
            python(),
            &f,
            "compute_score",
            json!({"bonus": 0.5}),
            2,
            limits(OnError::Fail),
        )
        .unwrap();
        let rows = [
            row("a", "it is 4", "4"),
            row("dict", "no", "4"),
            row("a", "x 5", "5"),
        ];
        let got = r.score(&rows).unwrap();
        assert_eq!(
            got[0],
            RowResult::Scored {
                score: 1.5,
                extra: vec![("acc".into(), 1.5)]
            }
        );
        match &got[1] {
            RowResult::Scored { score, extra } => {
                assert_eq!(*score, 0.5);
                assert!(extra.contains(&("length".to_string(), 2.0)));
                assert!(!extra.iter().any(|(k, _)| k == "note"));
            }
            other => panic!("{other:?}"),
        }
        let mut a = PythonReward::start(python(), &f, "judge", json!({}), 1, limits(OnError::Fail))
            .unwrap();
        let got = a.score(&rows).unwrap();
        assert!(matches!(got[2], RowResult::Scored { score, .. } if score == 3.0));
        // A missing function is named at start.
        let e = PythonReward::start(python(), &f, "nope", json!({}), 1, limits(OnError::Fail))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("`nope`") && e.contains("AttributeError"), "{e}");
    }

    #[test]
    fn the_batch_manager_calls_the_function_once_with_lists() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("batch_reward.py");
        std::fs::write(
            &f,
            "def compute_score(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):\n\
             \x20   n = len(solution_strs)\n\
             \x20   assert all('num_turns' not in e for e in extra_infos)\n\
             \x20   return [{'score': scale * n, 'pos': float(i)} if i == 0 else scale * i for i in range(n)]\n",
        )
        .unwrap();
        let mut r = PythonReward::start(
            python(),
            &f,
            "compute_score",
            json!({"scale": 2.0}),
            3,
            limits(OnError::Fail),
        )
        .unwrap()
        .batched();
        let rows = [row("a", "x", "1"), row("b", "y", "2"), row("c", "z", "3")];
        let got = r.score(&rows).unwrap();
        // One call saw all three rows (n = 3), though three workers run.
        assert_eq!(
            got,
            vec![
                RowResult::Scored {
                    score: 6.0,
                    extra: vec![("score".into(), 6.0), ("pos".into(), 0.0)]
                },
                RowResult::Scored {
                    score: 2.0,
                    extra: vec![]
                },
                RowResult::Scored {
                    score: 4.0,
                    extra: vec![]
                },
            ]
        );
    }
}

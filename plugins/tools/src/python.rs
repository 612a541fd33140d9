//! `python`: runs the model's code in a `python3` subprocess, under limits, and answers with what
//! it printed (stdout, then stderr, as verl's sandbox tool does).
//!
//! What the limits guarantee (on Linux):
//! - **time**: a wall-clock `timeout`; past it the whole process group is killed (SIGKILL) and
//!   the text says so. CPU time is capped at the timeout too (RLIMIT_CPU), a backstop.
//! - **memory**: `memory_limit_mb` of address space (RLIMIT_AS): an allocation past it fails
//!   (Python raises `MemoryError`).
//! - **network**: where the kernel lets this process create a network namespace (as root, or
//!   through an unprivileged user namespace), the code runs in a fresh one: no interface but a
//!   loopback that is down, so nothing outside, not even the host's `127.0.0.1`, can be reached,
//!   whatever the code does. Where it does not (containers that forbid namespaces), socket creation
//!   is disabled inside the interpreter before the code runs: this stops Python's own networking
//!   (`socket`, `urllib`, `http`, `requests`) but not native code that makes its own system calls.
//!   [`network_isolation`] says which applies; the tool logs it when created and reports it in
//!   each call's metrics (`network`).
//! - **output**: at most `max_output_chars` characters come back (head and tail kept).
//! - **not isolated**: the file system. The code runs as the job's user in a fresh scratch
//!   folder (its working directory and `TMPDIR`, removed afterwards) and can read what that user
//!   can. Its environment is cut down to the interpreter's own variables (no job secrets).

use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use verl_plugin_api::{Error, Result, Tool, ToolInit, ToolOutput};

/// How the code is kept off the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    /// A fresh network namespace (`unshare` with these flags in the child).
    Namespace { flags: libc::c_int },
    /// Socket creation disabled inside the interpreter (best effort).
    Interpreter,
}

impl Isolation {
    pub fn as_str(self) -> &'static str {
        match self {
            Isolation::Namespace { .. } => "namespace",
            Isolation::Interpreter => "interpreter",
        }
    }
}

/// Which network isolation this machine allows, probed once per process: a network namespace
/// (as root, else inside a user namespace), else the interpreter-level block.
pub fn network_isolation() -> Isolation {
    static PROBED: OnceLock<Isolation> = OnceLock::new();
    *PROBED.get_or_init(|| {
        for flags in [libc::CLONE_NEWNET, libc::CLONE_NEWUSER | libc::CLONE_NEWNET] {
            let mut probe = Command::new("/bin/sh");
            probe
                .args(["-c", "exit 0"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            // SAFETY: between fork and exec the child only makes the `unshare` system call.
            unsafe {
                probe.pre_exec(move || {
                    if libc::unshare(flags) == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                });
            }
            if probe.status().is_ok_and(|s| s.success()) {
                return Isolation::Namespace { flags };
            }
        }
        Isolation::Interpreter
    })
}

/// The limits of one run (the tool's `config`).
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// `config.timeout`, seconds (wall clock).
    pub timeout: Duration,
    /// `config.memory_limit_mb`: address space of the interpreter.
    pub memory_limit_mb: u64,
    /// `config.max_output_chars`: characters of output returned.
    pub max_output_chars: usize,
    /// `config.python`: the interpreter.
    pub python: String,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            timeout: Duration::from_secs(10),
            memory_limit_mb: 1024,
            max_output_chars: 10_000,
            python: "python3".into(),
        }
    }
}

const CONFIG_KEYS: &[&str] = &["timeout", "memory_limit_mb", "max_output_chars", "python"];

impl Limits {
    /// The limits from a tool `config`, each key checked (name, expected, found).
    pub fn from_config(init: &ToolInit) -> Result<Limits> {
        let cfg = init.config_object(CONFIG_KEYS)?;
        let mut limits = Limits::default();
        let bad = |key: &str, expected: &str, found: &Value| {
            Error::invalid_input(format!(
                "tool `{}`: `config.{key}` must be {expected}, found {found}",
                init.class_name
            ))
        };
        if let Some(v) = cfg.get("timeout") {
            let s = v
                .as_f64()
                .filter(|s| *s > 0.0 && *s <= 3600.0)
                .ok_or_else(|| bad("timeout", "seconds in (0, 3600]", v))?;
            limits.timeout = Duration::from_secs_f64(s);
        }
        if let Some(v) = cfg.get("memory_limit_mb") {
            limits.memory_limit_mb = v
                .as_u64()
                .filter(|m| *m >= 32)
                .ok_or_else(|| bad("memory_limit_mb", "an integer of at least 32", v))?;
        }
        if let Some(v) = cfg.get("max_output_chars") {
            limits.max_output_chars = v
                .as_u64()
                .filter(|m| *m >= 16)
                .ok_or_else(|| bad("max_output_chars", "an integer of at least 16", v))?
                as usize;
        }
        if let Some(v) = cfg.get("python") {
            limits.python = v
                .as_str()
                .filter(|p| !p.is_empty())
                .ok_or_else(|| bad("python", "an interpreter name or path", v))?
                .to_string();
        }
        Ok(limits)
    }
}

/// What one run produced.
#[derive(Debug, Clone)]
pub struct RunOutput {
    pub stdout: String,
    pub stderr: String,
    /// The exit code, when the interpreter exited by itself.
    pub exit_code: Option<i32>,
    /// The signal that ended it (SIGKILL after a timeout, SIGXCPU past the CPU limit, ...).
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub seconds: f64,
    pub isolation: Isolation,
}

impl RunOutput {
    /// The tool's text: stdout then stderr, at most `max_chars` characters (head and tail), and
    /// a last line when the run was cut short.
    pub fn text(&self, limits: &Limits) -> String {
        let mut text = format!("{}{}", self.stdout, self.stderr);
        let n = text.chars().count();
        if n > limits.max_output_chars {
            let half = limits.max_output_chars / 2;
            let head: String = text.chars().take(half).collect();
            let tail: String = text.chars().skip(n - half).collect();
            text = format!("{head}\n...(output truncated)...\n{tail}");
        }
        let note = if self.timed_out {
            Some(format!(
                "TimeoutError: the code ran past the tool's timeout of {} s and was killed",
                secs(limits.timeout)
            ))
        } else {
            self.signal
                .map(|s| format!("Killed by signal {s} ({})", signal_name(s)))
        };
        if let Some(note) = note {
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(&note);
        }
        text
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

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL: killed, e.g. out of memory",
        libc::SIGXCPU => "SIGXCPU: CPU time limit",
        libc::SIGSEGV => "SIGSEGV: segmentation fault",
        libc::SIGABRT => "SIGABRT: aborted",
        libc::SIGBUS => "SIGBUS: bus error",
        libc::SIGFPE => "SIGFPE: arithmetic error",
        _ => "see `man 7 signal`",
    }
}

/// Disables socket creation inside the interpreter (the fallback when no network namespace can
/// be made).
const NO_NETWORK_PRELUDE: &str = r#"
def _verl_no_network():
    import socket, _socket
    def refuse(*args, **kwargs):
        raise OSError(101, "Network is unreachable (network access is disabled for this tool)")
    class Blocked(socket.socket):
        def __init__(self, *args, **kwargs):
            refuse()
    for module in (socket, _socket):
        module.socket = Blocked
        for name in ("create_connection", "create_server", "socketpair", "fromfd",
                     "getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
            if hasattr(module, name):
                setattr(module, name, refuse)
_verl_no_network()
del _verl_no_network
"#;

/// Runs `code.py` as `__main__` and prints an exception's traceback without this launcher's
/// frame, so the model sees what `python3 code.py` would print.
const LAUNCHER: &str = r#"
import sys
sys.argv = ["code.py"]
try:
    with open("code.py", encoding="utf-8") as _f:
        _code = compile(_f.read(), "code.py", "exec")
    exec(_code, {"__name__": "__main__", "__file__": "code.py", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as _e:
    import traceback
    traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    sys.exit(1)
"#;

/// Environment variables the interpreter may need; everything else (tokens, keys) stays out.
const KEPT_ENV: &[&str] = &[
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "LD_LIBRARY_PATH",
    "PYENV_ROOT",
    "PYENV_VERSION",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
];

/// Runs `code` under `limits`. `Err` only when the interpreter could not be started.
pub fn run(code: &str, limits: &Limits, isolation: Isolation) -> std::io::Result<RunOutput> {
    let started = Instant::now();
    let scratch = tempfile::Builder::new().prefix("verl-python-").tempdir()?;
    std::fs::write(scratch.path().join("code.py"), code)?;
    let launcher = match isolation {
        Isolation::Interpreter => format!("{NO_NETWORK_PRELUDE}{LAUNCHER}"),
        Isolation::Namespace { .. } => LAUNCHER.to_string(),
    };
    let mut cmd = Command::new(&limits.python);
    cmd.args(["-I", "-u", "-c", &launcher])
        .current_dir(scratch.path())
        .env_clear()
        .envs(
            KEPT_ENV
                .iter()
                .filter_map(|k| std::env::var_os(k).map(|v| (k, v))),
        )
        .env("TMPDIR", scratch.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let memory = limits.memory_limit_mb.saturating_mul(1024 * 1024) as libc::rlim_t;
    let cpu = limits.timeout.as_secs().saturating_add(1) as libc::rlim_t;
    let unshare = match isolation {
        Isolation::Namespace { flags } => flags,
        Isolation::Interpreter => 0,
    };
    // SAFETY: between fork and exec the child makes only system calls (setpgid, setrlimit,
    // unshare), which are async-signal-safe, and touches no memory the parent's threads own.
    unsafe {
        cmd.pre_exec(move || {
            let check = |rc: libc::c_int| {
                if rc == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            };
            // Its own process group, so a timeout kills whatever it started too.
            check(libc::setpgid(0, 0))?;
            let limit = |resource, value| {
                let lim = libc::rlimit {
                    rlim_cur: value,
                    rlim_max: value,
                };
                check(libc::setrlimit(resource, &lim))
            };
            limit(libc::RLIMIT_AS, memory)?;
            limit(libc::RLIMIT_CPU, cpu)?;
            limit(libc::RLIMIT_CORE, 0)?;
            if unshare != 0 {
                check(libc::unshare(unshare))?;
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    let pgid = child.id() as libc::pid_t;
    let cap = limits.max_output_chars.saturating_mul(4).max(64);
    let stdout = Capture::start(child.stdout.take(), cap);
    let stderr = Capture::start(child.stderr.take(), cap);

    let deadline = started + limits.timeout;
    let mut timed_out = false;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            timed_out = true;
            // SAFETY: plain system call; the group is the child's own (set before exec).
            unsafe { libc::killpg(pgid, libc::SIGKILL) };
            break child.wait()?;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    // Whatever the code left running in its group goes too (it would hold the pipes open).
    // SAFETY: as above; ESRCH (nothing left) is fine.
    unsafe { libc::killpg(pgid, libc::SIGKILL) };
    let grace = Duration::from_secs(1);
    Ok(RunOutput {
        stdout: stdout.finish(grace),
        stderr: stderr.finish(grace),
        exit_code: status.code(),
        signal: if timed_out { None } else { status.signal() },
        timed_out,
        seconds: started.elapsed().as_secs_f64(),
        isolation,
    })
}

/// One output stream read on its own thread: the first `cap` bytes and the last `cap` bytes
/// kept, the middle drained, so the child never blocks on a full pipe and memory stays bounded.
struct Capture {
    kept: Arc<Mutex<Kept>>,
    done: std::sync::mpsc::Receiver<()>,
}

#[derive(Default)]
struct Kept {
    head: Vec<u8>,
    tail: std::collections::VecDeque<u8>,
    dropped: u64,
}

impl Kept {
    fn push(&mut self, mut bytes: &[u8], cap: usize) {
        let room = cap.saturating_sub(self.head.len());
        let (h, rest) = bytes.split_at(room.min(bytes.len()));
        self.head.extend_from_slice(h);
        bytes = rest;
        self.tail.extend(bytes);
        while self.tail.len() > cap {
            self.tail.pop_front();
            self.dropped += 1;
        }
    }

    fn text(&self) -> String {
        let mut b = self.head.clone();
        if self.dropped > 0 {
            b.extend_from_slice(format!("\n...({} bytes not kept)...\n", self.dropped).as_bytes());
        }
        b.extend(self.tail.iter());
        String::from_utf8_lossy(&b).into_owned()
    }
}

impl Capture {
    fn start(stream: Option<impl Read + Send + 'static>, cap: usize) -> Capture {
        let kept = Arc::new(Mutex::new(Kept::default()));
        let (tx, done) = std::sync::mpsc::channel();
        let sink = kept.clone();
        std::thread::spawn(move || {
            if let Some(mut s) = stream {
                let mut chunk = [0u8; 8192];
                while let Ok(n) = s.read(&mut chunk) {
                    if n == 0 {
                        break;
                    }
                    let mut k = sink.lock().unwrap_or_else(|p| p.into_inner());
                    k.push(&chunk[..n], cap);
                }
            }
            let _ = tx.send(());
        });
        Capture { kept, done }
    }

    /// What was read; waits at most `grace` for the end of the stream (a process that escaped
    /// the group may hold it open).
    fn finish(self, grace: Duration) -> String {
        let _ = self.done.recv_timeout(grace);
        let k = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        k.text()
    }
}

/// The python tool.
pub struct PythonTool {
    schema: Value,
    limits: Limits,
    isolation: Isolation,
}

fn default_schema() -> Value {
    json!({
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python 3 code and return what it prints (stdout, then stderr). \
                No network; limited time and memory. Print the values you need.",
            "parameters": {
                "type": "object",
                "properties": {
                    "code": {"type": "string", "description": "The Python code to run."}
                },
                "required": ["code"],
            }
        }
    })
}

impl PythonTool {
    /// Reads the limits and checks the interpreter runs, so a missing `python3` fails the job at
    /// start, not at the first call.
    pub fn create(init: &ToolInit) -> Result<Self> {
        let limits = Limits::from_config(init)?;
        let isolation = network_isolation();
        let probe = Limits {
            timeout: Duration::from_secs(30),
            ..limits.clone()
        };
        let check =
            run("import sys; print(sys.version_info[0])", &probe, isolation).map_err(|e| {
                Error::failed(format!(
                    "tool `{}`: cannot run the interpreter `{}` (config.python): {e}",
                    init.class_name, limits.python
                ))
            })?;
        if check.stdout.trim() != "3" {
            return Err(Error::failed(format!(
                "tool `{}`: `{}` (config.python) is not a working Python 3 under a {} MB \
                 memory limit: {}",
                init.class_name,
                limits.python,
                limits.memory_limit_mb,
                check.text(&limits).trim()
            )));
        }
        match isolation {
            Isolation::Namespace { .. } => {
                tracing::info!("python tool: code runs in its own network namespace (no network)")
            }
            Isolation::Interpreter => tracing::warn!(
                "python tool: this machine does not allow network namespaces; sockets are \
                 disabled inside the interpreter instead (native code could still reach the \
                 network)"
            ),
        }
        Ok(PythonTool {
            schema: init.schema_or(default_schema()),
            limits,
            isolation,
        })
    }
}

impl Tool for PythonTool {
    fn schema(&self) -> Value {
        self.schema.clone()
    }

    fn execute(&self, _instance_id: &str, arguments: &Value) -> Result<ToolOutput> {
        let code = match arguments.get("code") {
            Some(Value::String(s)) => s,
            Some(other) => {
                return Err(Error::invalid_input(format!(
                    "the `code` argument must be a string, found {other}"
                )))
            }
            None => {
                return Err(Error::invalid_input(
                    "missing the `code` argument (a string)",
                ))
            }
        };
        let out = run(code, &self.limits, self.isolation).map_err(|e| {
            Error::failed(format!(
                "cannot run the interpreter `{}`: {e}",
                self.limits.python
            ))
        })?;
        let mut result = ToolOutput::text(out.text(&self.limits));
        result.metrics = json!({
            "exit_code": out.exit_code,
            "timed_out": out.timed_out,
            "seconds": out.seconds,
            "network": out.isolation.as_str(),
        })
        .as_object()
        .cloned()
        .unwrap_or_default();
        Ok(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(timeout_s: f64, memory_mb: u64) -> Limits {
        Limits {
            timeout: Duration::from_secs_f64(timeout_s),
            memory_limit_mb: memory_mb,
            ..Limits::default()
        }
    }

    /// Running or sleeping; a zombie waiting for a reaper that never comes (PID 1 of a
    /// container) is dead.
    fn alive(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            let state = stat.rsplit(") ").next().and_then(|r| r.chars().next());
            !matches!(state, Some('Z' | 'X'))
        })
    }

    #[test]
    fn prints_stdout_then_stderr_and_tracebacks_as_python_would() {
        let l = limits(20.0, 1024);
        let out = run(
            "import sys\nprint('hello')\nprint('warn', file=sys.stderr)\n",
            &l,
            network_isolation(),
        )
        .unwrap();
        assert_eq!(out.text(&l), "hello\nwarn\n");
        assert_eq!(out.exit_code, Some(0));
        let out = run("x = 1\n1 / 0\n", &l, network_isolation()).unwrap();
        let text = out.text(&l);
        assert_eq!(out.exit_code, Some(1));
        assert!(
            text.starts_with("Traceback (most recent call last):\n  File \"code.py\", line 2"),
            "{text}"
        );
        assert!(
            text.contains("ZeroDivisionError: division by zero"),
            "{text}"
        );
        assert!(
            !text.contains("<string>"),
            "the launcher's frame shows: {text}"
        );
        let text = run("1 +\n", &l, network_isolation()).unwrap().text(&l);
        assert!(text.contains("SyntaxError"), "{text}");
    }

    #[test]
    fn a_timeout_kills_the_code_and_everything_it_started() {
        let l = limits(1.5, 1024);
        let started = Instant::now();
        let out = run(
            "import subprocess, sys, time\n\
             child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n\
             import os\nprint(os.getpid(), child.pid, flush=True)\n\
             time.sleep(120)\n",
            &l,
            network_isolation(),
        )
        .unwrap();
        let waited = started.elapsed();
        assert!(out.timed_out, "{out:?}");
        assert!(waited < Duration::from_secs(10), "took {waited:?}");
        let text = out.text(&l);
        assert!(
            text.contains(
                "TimeoutError: the code ran past the tool's timeout of 1.5 s and was killed"
            ),
            "{text}"
        );
        let pids: Vec<i32> = out
            .stdout
            .split_whitespace()
            .map(|p| p.parse().unwrap())
            .collect();
        assert_eq!(pids.len(), 2, "{text}");
        std::thread::sleep(Duration::from_millis(200));
        for pid in pids {
            assert!(!alive(pid), "process {pid} survived the timeout");
        }
    }

    #[test]
    fn the_memory_limit_stops_an_allocation_past_it() {
        let l = limits(20.0, 256);
        let small = run(
            "b = bytearray(50 * 2**20)\nprint(len(b))\n",
            &l,
            network_isolation(),
        )
        .unwrap();
        assert_eq!(small.stdout, format!("{}\n", 50 * (1 << 20)), "{small:?}");
        let big = run(
            "b = bytearray(1024 * 2**20)\nprint('allocated')\n",
            &l,
            network_isolation(),
        )
        .unwrap();
        let text = big.text(&l);
        assert!(text.contains("MemoryError"), "{text}");
        assert!(!text.contains("allocated"), "{text}");
    }

    #[test]
    fn the_code_cannot_reach_a_server_on_this_machine() {
        let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = server.local_addr().unwrap().port();
        let l = limits(20.0, 1024);
        let code = format!(
            "import socket\n\
             try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=3)\n    print('connected')\n\
             except OSError as e:\n    print('refused:', e)\n"
        );
        let out = run(&code, &l, network_isolation()).unwrap();
        let text = out.text(&l);
        assert!(text.starts_with("refused:"), "{text}");
        // The same code outside the sandbox does connect: the test can fail.
        let direct = Command::new("python3")
            .args(["-c", &code])
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&direct.stdout).starts_with("connected"),
            "{direct:?}"
        );
    }

    #[test]
    fn the_interpreter_level_block_refuses_sockets_too() {
        let l = limits(20.0, 1024);
        let out = run(
            "import socket\ntry:\n    socket.socket()\n    print('socket made')\nexcept OSError as e:\n    print('refused:', e)\n",
            &l,
            Isolation::Interpreter,
        )
        .unwrap();
        assert!(
            out.stdout.starts_with("refused:") && out.stdout.contains("disabled"),
            "{out:?}"
        );
    }

    #[test]
    fn output_is_cut_to_its_limit_keeping_head_and_tail() {
        let l = Limits {
            max_output_chars: 100,
            ..limits(20.0, 1024)
        };
        let out = run(
            "print('A' * 500)\nprint('the end')\n",
            &l,
            network_isolation(),
        )
        .unwrap();
        let text = out.text(&l);
        assert!(text.starts_with(&"A".repeat(50)), "{text}");
        assert!(text.contains("\n...(output truncated)...\n"), "{text}");
        assert_eq!(
            text.chars().count(),
            100 + "\n...(output truncated)...\n".len()
        );
        assert!(text.ends_with("the end\n"), "{text}");
    }

    #[test]
    fn the_code_sees_no_job_secrets_and_works_in_a_scratch_folder() {
        // A variable of this test process the interpreter does not need (cargo sets several).
        let (secret, _) = std::env::vars()
            .find(|(k, _)| {
                !KEPT_ENV.contains(&k.as_str()) && !k.starts_with("PYENV") && !k.starts_with("LC_")
            })
            .expect("the test process has an environment variable to hide");
        let l = limits(20.0, 1024);
        let out = run(
            &format!(
                "import os\nprint(os.environ.get({secret:?}))\nprint(os.path.basename(os.getcwd())[:12])\n"
            ),
            &l,
            network_isolation(),
        )
        .unwrap();
        assert_eq!(out.stdout, "None\nverl-python-\n", "{secret}: {out:?}");
    }

    #[test]
    fn config_keys_are_read_and_unknown_ones_refused() {
        let init = ToolInit::new(
            "python",
            json!({"type": "native", "timeout": 2.5, "memory_limit_mb": 512, "max_output_chars": 300}),
        );
        let l = Limits::from_config(&init).unwrap();
        assert_eq!(l.timeout, Duration::from_millis(2500));
        assert_eq!((l.memory_limit_mb, l.max_output_chars), (512, 300));
        let e = Limits::from_config(&ToolInit::new("python", json!({"sandbox_fusion_url": "x"})))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`config.sandbox_fusion_url`"), "{e}");
        let e = Limits::from_config(&ToolInit::new("python", json!({"timeout": -1})))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`config.timeout` must be seconds in (0, 3600], found -1"),
            "{e}"
        );
    }

    #[test]
    fn the_tool_reports_its_limits_in_metrics() {
        let tool = PythonTool::create(&ToolInit::new("python", json!({"timeout": 20}))).unwrap();
        let out = tool.execute("i", &json!({"code": "print(6 * 7)"})).unwrap();
        assert_eq!(out.text, "42\n");
        assert_eq!(out.metrics["exit_code"], 0);
        assert_eq!(out.metrics["timed_out"], false);
        assert_eq!(out.metrics["network"], network_isolation().as_str());
        let e = tool.execute("i", &json!({})).unwrap_err().to_string();
        assert!(e.contains("missing the `code` argument"), "{e}");
        let e = PythonTool::create(&ToolInit::new(
            "python",
            json!({"python": "/no/such/python"}),
        ))
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains("cannot run the interpreter `/no/such/python` (config.python)"),
            "{e}"
        );
    }
}

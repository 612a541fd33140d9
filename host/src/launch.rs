//! How `verl run` takes part in an SPMD job: as the only process, as one rank of a job that
//! torchrun, SLURM or our own launcher started, or as the launcher of the local ranks.
//!
//! The launcher hosts the rendezvous store itself (children get `VERL_STORE_EXTERNAL=1`), spawns
//! one child per rank with torchrun's environment, forwards rank 0's output and ends the whole
//! job as soon as one rank fails, with that rank's own error. It never loads a backend for
//! training: each child is a full `verl run` of its own.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use verl_store::{DistEnv, StoreClient, StoreError, StoreServer, EXTERNAL_STORE_VAR};

/// Set in the children of our launcher: they print no config report of their own.
pub const LAUNCHED_VAR: &str = "VERL_LAUNCHED";
/// Seconds the ranks wait for each other at rendezvous (default 300).
pub const RENDEZVOUS_TIMEOUT_VAR: &str = "VERL_RENDEZVOUS_TIMEOUT";
/// The port torchrun and verl's launcher use when `MASTER_PORT` is not given under SLURM.
pub const DEFAULT_MASTER_PORT: u16 = 29500;
/// How long the other ranks get to exit on their own after a failure before they are stopped.
const KILL_GRACE: Duration = Duration::from_secs(3);
/// Lines of a non-zero rank's stderr kept for the failure report.
const KEEP_LINES: usize = 40;

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("environment variable {var}: expected {expected}, found {found:?}")]
    Env {
        var: &'static str,
        expected: String,
        found: Option<String>,
    },
    #[error("{0}")]
    Store(Box<StoreError>),
    #[error("trainer.nnodes={nnodes} × trainer.n_gpus_per_node={per_node} = {world} ranks, but the environment ({source_name}) says WORLD_SIZE={env_world}; make them agree (set trainer.nnodes / trainer.n_gpus_per_node to the launched layout)")]
    WorldMismatch {
        nnodes: u64,
        per_node: u64,
        world: u64,
        env_world: usize,
        source_name: &'static str,
    },
    #[error("trainer.nnodes={nnodes}: a multi-node job needs one process per GPU on every node; start them with torchrun on each node (`torchrun --nnodes={nnodes} --nproc-per-node={per_node} --node-rank=<i> --master-addr=<node 0> --master-port=29500 --no-python verl run ...`) or under SLURM (`srun --nodes={nnodes} --ntasks={world} --ntasks-per-node={per_node} verl run ...`)")]
    MultiNode {
        nnodes: u64,
        per_node: u64,
        world: u64,
    },
    #[error("trainer.n_gpus_per_node={wanted} but {visible} GPU(s) are visible ({how}); lower trainer.n_gpus_per_node, fix CUDA_VISIBLE_DEVICES, or use trainer.device=cpu")]
    NotEnoughGpus {
        wanted: u64,
        visible: usize,
        how: String,
    },
    #[error("cannot start rank {rank}: {exe}: {source}")]
    Spawn {
        rank: usize,
        exe: String,
        #[source]
        source: std::io::Error,
    },
}

impl From<StoreError> for LaunchError {
    fn from(e: StoreError) -> Self {
        LaunchError::Store(Box::new(e))
    }
}

/// Where a rank's environment came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvSource {
    /// `RANK`/`WORLD_SIZE` set by verl's own launcher.
    Verl,
    /// `RANK`/`WORLD_SIZE` set by torchrun (or any launcher that speaks its protocol).
    Torchrun,
    /// `SLURM_PROCID`/`SLURM_NTASKS`.
    Slurm,
}

impl EnvSource {
    pub fn name(self) -> &'static str {
        match self {
            EnvSource::Verl => "verl run",
            EnvSource::Torchrun => "torchrun",
            EnvSource::Slurm => "SLURM",
        }
    }
}

/// What this `verl run` process does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaunchMode {
    /// The whole job in this process.
    Single,
    /// Spawn `world` local ranks and supervise them.
    Launcher { world: usize },
    /// One rank of an SPMD job.
    Rank { env: DistEnv, source: EnvSource },
}

/// Decides the launch mode from the environment (`var`) and the config's layout.
pub fn detect(
    var: impl Fn(&str) -> Option<String>,
    nnodes: u64,
    n_gpus_per_node: u64,
) -> Result<LaunchMode, LaunchError> {
    let world = nnodes * n_gpus_per_node;
    let from_env = if var("RANK").is_some() || var("WORLD_SIZE").is_some() {
        let source = if var(LAUNCHED_VAR).is_some() {
            EnvSource::Verl
        } else {
            EnvSource::Torchrun
        };
        Some((DistEnv::from_lookup(&var)?, source))
    } else {
        slurm_env(&var)?.map(|e| (e, EnvSource::Slurm))
    };
    if let Some((env, source)) = from_env {
        if env.world_size as u64 != world {
            return Err(LaunchError::WorldMismatch {
                nnodes,
                per_node: n_gpus_per_node,
                world,
                env_world: env.world_size,
                source_name: source.name(),
            });
        }
        return Ok(LaunchMode::Rank { env, source });
    }
    match (world, nnodes) {
        (1, _) => Ok(LaunchMode::Single),
        (_, 1) => Ok(LaunchMode::Launcher {
            world: world as usize,
        }),
        _ => Err(LaunchError::MultiNode {
            nnodes,
            per_node: n_gpus_per_node,
            world,
        }),
    }
}

/// A rank's environment under SLURM (`srun`), when it runs more than one task: `SLURM_PROCID`,
/// `SLURM_NTASKS`, `SLURM_LOCALID`, `MASTER_ADDR` (default: the first host of
/// `SLURM_JOB_NODELIST`) and `MASTER_PORT` (default 29500).
pub fn slurm_env(var: impl Fn(&str) -> Option<String>) -> Result<Option<DistEnv>, LaunchError> {
    let (Some(procid), Some(ntasks)) = (var("SLURM_PROCID"), var("SLURM_NTASKS")) else {
        return Ok(None);
    };
    // One task (an `sbatch` script running `verl run` once per node): verl launches locally.
    if ntasks.trim() == "1" {
        return Ok(None);
    }
    let master_addr = match var("MASTER_ADDR") {
        Some(a) => a,
        None => {
            let list = var("SLURM_JOB_NODELIST")
                .or_else(|| var("SLURM_NODELIST"))
                .ok_or(LaunchError::Env {
                    var: "SLURM_JOB_NODELIST",
                    expected: "the job's node list (or MASTER_ADDR) to find rank 0's host".into(),
                    found: None,
                })?;
            first_host(&list).ok_or_else(|| LaunchError::Env {
                var: "SLURM_JOB_NODELIST",
                expected: "a SLURM host list like `node[01-04],gpu7`".into(),
                found: Some(list.clone()),
            })?
        }
    };
    let port = var("MASTER_PORT").unwrap_or_else(|| DEFAULT_MASTER_PORT.to_string());
    let mapped = |k: &str| -> Option<String> {
        match k {
            "RANK" => Some(procid.clone()),
            "WORLD_SIZE" => Some(ntasks.clone()),
            "LOCAL_RANK" => var("SLURM_LOCALID"),
            "MASTER_ADDR" => Some(master_addr.clone()),
            "MASTER_PORT" => Some(port.clone()),
            other => var(other),
        }
    };
    Ok(Some(DistEnv::from_lookup(mapped)?))
}

/// The first host of a SLURM host list: `node[01-04,07],gpu5` → `node01`,
/// `n[001-002]-ib` → `n001-ib`, `host1,host2` → `host1`.
pub fn first_host(list: &str) -> Option<String> {
    let mut depth = 0usize;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth = depth.saturating_sub(1),
                _ => {}
            }
            c == ',' && depth == 0
        })
        .map(|(i, _)| i)
        .unwrap_or(list.len());
    let entry = list[..end].trim();
    if entry.is_empty() {
        return None;
    }
    let Some(open) = entry.find('[') else {
        return Some(entry.to_string());
    };
    let close = entry[open..].find(']')? + open;
    let inner = &entry[open + 1..close];
    let first = inner.split(',').next()?.split('-').next()?.trim();
    if first.is_empty() {
        return None;
    }
    Some(format!("{}{first}{}", &entry[..open], &entry[close + 1..]))
}

/// GPUs this process may use: `CUDA_VISIBLE_DEVICES` when set, else the driver's device list.
/// `None` when neither says anything (no NVIDIA driver).
pub fn visible_gpus(var: impl Fn(&str) -> Option<String>) -> Option<(usize, String)> {
    if let Some(v) = var("CUDA_VISIBLE_DEVICES") {
        let n = v
            .split(',')
            .map(str::trim)
            .take_while(|s| !s.is_empty() && !s.starts_with('-'))
            .count();
        return Some((n, format!("CUDA_VISIBLE_DEVICES={v}")));
    }
    let n = std::fs::read_dir("/proc/driver/nvidia/gpus").ok()?.count();
    Some((n, "/proc/driver/nvidia/gpus".into()))
}

/// The check verl's launcher does before spawning CUDA ranks: one GPU per local rank.
pub fn check_gpus(n_gpus_per_node: u64) -> Result<(), LaunchError> {
    let (visible, how) =
        visible_gpus(|k| std::env::var(k).ok()).unwrap_or((0, "no NVIDIA driver found".into()));
    if (visible as u64) < n_gpus_per_node {
        return Err(LaunchError::NotEnoughGpus {
            wanted: n_gpus_per_node,
            visible,
            how,
        });
    }
    Ok(())
}

/// The rendezvous timeout ([`RENDEZVOUS_TIMEOUT_VAR`], default 300 s).
pub fn rendezvous_timeout() -> Result<Duration, LaunchError> {
    match std::env::var(RENDEZVOUS_TIMEOUT_VAR) {
        Err(_) => Ok(Duration::from_secs(300)),
        Ok(s) => s
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v > 0.0)
            .map(Duration::from_secs_f64)
            .ok_or(LaunchError::Env {
                var: RENDEZVOUS_TIMEOUT_VAR,
                expected: "a positive number of seconds".into(),
                found: Some(s),
            }),
    }
}

// ---------------------------------------------------------------------------------------------
// The launcher.

/// What to launch.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    pub world: usize,
    /// The arguments of every child (this process's own, minus the program name).
    pub args: Vec<OsString>,
    /// Forward every rank's stderr live, prefixed `[rank N]`.
    pub verbose: bool,
    /// `MASTER_PORT`, when the user fixed one; a free port otherwise.
    pub master_port: Option<u16>,
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn install_signal_handlers() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// What one rank's stderr reader keeps.
#[derive(Default)]
struct Captured {
    /// The rank's last `error: ...` line, without the prefix.
    last_error: Option<String>,
    /// Its last lines (non-zero ranks), for the failure report.
    tail: VecDeque<String>,
}

struct RankProc {
    rank: usize,
    child: Child,
    captured: Arc<Mutex<Captured>>,
    reader: Option<JoinHandle<()>>,
    exit: Option<(ExitStatus, Instant)>,
}

fn reader_thread(
    rank: usize,
    stream: impl std::io::Read + Send + 'static,
    captured: Arc<Mutex<Captured>>,
    verbose: bool,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            let mut c = captured.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(msg) = line.strip_prefix("error: ") {
                c.last_error = Some(msg.to_string());
                continue;
            }
            if rank == 0 {
                eprintln!("{line}");
            } else {
                if verbose {
                    eprintln!("[rank {rank}] {line}");
                }
                if c.tail.len() == KEEP_LINES {
                    c.tail.pop_front();
                }
                c.tail.push_back(line);
            }
        }
    })
}

/// `signal N (NAME)` for the signals a crashed process usually dies of.
pub(crate) fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGKILL => "SIGKILL",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        _ => return format!("signal {sig}"),
    };
    format!("signal {sig} ({name})")
}

fn kill(child: &mut Child, sig: i32) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: `pid` is our own child, not yet reaped (we only signal before `try_wait` sees
        // it exit), so it cannot name another process.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

/// Spawns the local ranks and supervises them; returns the launcher's exit code. The first
/// failing rank's error is printed as one `error:` line.
pub fn launch(opts: &LaunchOptions) -> Result<i32, LaunchError> {
    let server = StoreServer::bind(("127.0.0.1", opts.master_port.unwrap_or(0)))?;
    let addr = server.connect_addr();
    install_signal_handlers();
    let exe = std::env::current_exe().map_err(|source| LaunchError::Spawn {
        rank: 0,
        exe: "the verl executable".into(),
        source,
    })?;
    let mut procs: Vec<RankProc> = Vec::with_capacity(opts.world);
    for rank in 0..opts.world {
        let mut cmd = Command::new(&exe);
        cmd.args(&opts.args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", opts.world.to_string())
            .env("LOCAL_WORLD_SIZE", opts.world.to_string())
            .env("MASTER_ADDR", addr.ip().to_string())
            .env("MASTER_PORT", addr.port().to_string())
            .env(EXTERNAL_STORE_VAR, "1")
            .env(LAUNCHED_VAR, "1")
            .stdin(Stdio::null())
            .stdout(if rank == 0 {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .stderr(Stdio::piped());
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(source) => {
                for p in &mut procs {
                    kill(&mut p.child, libc::SIGKILL);
                    let _ = p.child.wait();
                }
                return Err(LaunchError::Spawn {
                    rank,
                    exe: exe.display().to_string(),
                    source,
                });
            }
        };
        let captured = Arc::new(Mutex::new(Captured::default()));
        let reader = child
            .stderr
            .take()
            .map(|s| reader_thread(rank, s, captured.clone(), opts.verbose));
        procs.push(RankProc {
            rank,
            child,
            captured,
            reader,
            exit: None,
        });
    }

    loop {
        for p in procs.iter_mut().filter(|p| p.exit.is_none()) {
            if let Ok(Some(status)) = p.child.try_wait() {
                p.exit = Some((status, Instant::now()));
            }
        }
        let failed = procs
            .iter()
            .any(|p| p.exit.is_some_and(|(s, _)| !s.success()));
        let interrupted = INTERRUPTED.load(Ordering::SeqCst);
        if failed || interrupted {
            stop_all(
                &mut procs,
                if interrupted {
                    Duration::ZERO
                } else {
                    KILL_GRACE
                },
            );
            join_readers(&mut procs);
            if interrupted {
                let _ = std::io::stdout().flush();
                eprintln!(
                    "error: interrupted: stopped all {} rank(s) of the job",
                    opts.world
                );
                return Ok(130);
            }
            let root = root_failure(&addr, &procs);
            report_failure(&procs, root, opts.world);
            return Ok(1);
        }
        if procs.iter().all(|p| p.exit.is_some()) {
            join_readers(&mut procs);
            // Rank 0 succeeded and so did every other rank (a failure returned above).
            return Ok(0);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Ends the ranks still running. After a failure they get `wait_first` to exit by themselves
/// (those blocked in a collective see the failure through the store, and finish writing what
/// they logged); then SIGTERM, and SIGKILL a second later.
fn stop_all(procs: &mut [RankProc], wait_first: Duration) {
    let reap = |procs: &mut [RankProc]| {
        for p in procs.iter_mut().filter(|p| p.exit.is_none()) {
            if let Ok(Some(status)) = p.child.try_wait() {
                p.exit = Some((status, Instant::now()));
            }
        }
        procs.iter().all(|p| p.exit.is_some())
    };
    let wait = |procs: &mut [RankProc], d: Duration| {
        let deadline = Instant::now() + d;
        loop {
            if reap(procs) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    if wait(procs, wait_first) {
        return;
    }
    for p in procs.iter_mut().filter(|p| p.exit.is_none()) {
        kill(&mut p.child, libc::SIGTERM);
    }
    if wait(procs, Duration::from_secs(1)) {
        return;
    }
    for p in procs.iter_mut().filter(|p| p.exit.is_none()) {
        kill(&mut p.child, libc::SIGKILL);
        if let Ok(status) = p.child.wait() {
            p.exit = Some((status, Instant::now()));
        }
    }
}

fn join_readers(procs: &mut [RankProc]) {
    for p in procs.iter_mut() {
        if let Some(h) = p.reader.take() {
            let _ = h.join();
        }
    }
}

/// The rank that failed first: the store's first posted failure (a rank's own error, or its
/// connection dropping) is the root cause; ranks that failed because of it come later. A rank
/// that died before joining the store is found by exit order.
fn root_failure(addr: &std::net::SocketAddr, procs: &[RankProc]) -> usize {
    if let Ok(c) = StoreClient::connect(addr, Duration::from_secs(2)) {
        if let Err(e) = c.check_error() {
            if let Some(rank) = e.failed_rank() {
                if rank < procs.len() {
                    return rank;
                }
            }
        }
    }
    procs
        .iter()
        .filter_map(|p| match p.exit {
            Some((s, t)) if !s.success() => Some((t, p.rank)),
            _ => None,
        })
        .min()
        .map(|(_, r)| r)
        .unwrap_or(0)
}

fn report_failure(procs: &[RankProc], rank: usize, world: usize) {
    let p = &procs[rank];
    let c = p.captured.lock().unwrap_or_else(|e| e.into_inner());
    use std::os::unix::process::ExitStatusExt;
    let how = match p.exit {
        Some((s, _)) => match (s.code(), s.signal()) {
            (_, Some(sig)) => format!("killed by {}", signal_name(sig)),
            (Some(code), _) => format!("exited with status {code}"),
            _ => "ended".into(),
        },
        None => "did not exit".into(),
    };
    // Without -v the failed rank's stderr was held back; show it now, before the error line.
    if rank != 0 {
        for line in &c.tail {
            eprintln!("[rank {rank}] {line}");
        }
    }
    let own_prefix = format!("rank {rank} of {world}: ");
    let message = match &c.last_error {
        Some(e) => e.strip_prefix(&own_prefix).unwrap_or(e).to_string(),
        None => how,
    };
    let _ = std::io::stdout().flush();
    eprintln!("error: rank {rank} of {world} failed: {message} (the other ranks were stopped)");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn first_host_of_slurm_lists() {
        assert_eq!(first_host("node[01-04,07],gpu5").as_deref(), Some("node01"));
        assert_eq!(first_host("n[001-002]-ib").as_deref(), Some("n001-ib"));
        assert_eq!(first_host("host1,host2").as_deref(), Some("host1"));
        assert_eq!(first_host("gpu[7,3]").as_deref(), Some("gpu7"));
        assert_eq!(first_host("solo").as_deref(), Some("solo"));
        assert_eq!(first_host(""), None);
        assert_eq!(first_host("bad[").as_deref(), None);
    }

    #[test]
    fn slurm_env_maps_to_torchrun_ranks() {
        let e = slurm_env(env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[10-13]"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank), (5, 8, 1), "{e:?}");
        assert_eq!((e.master_addr.as_str(), e.master_port), ("gpu10", 29500));
        assert!(!e.external_store);

        let e = slurm_env(env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("MASTER_ADDR", "10.0.0.7"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((e.master_addr.as_str(), e.master_port), ("10.0.0.7", 1234));
        assert_eq!(e.local_rank, 0, "LOCAL_RANK defaults to the rank");

        // One task: verl launches its local ranks itself.
        assert!(
            slurm_env(env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]))
                .unwrap()
                .is_none()
        );
        let err = slurm_env(env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("SLURM_JOB_NODELIST"), "{err}");
        let err = slurm_env(env(&[
            ("SLURM_PROCID", "x"),
            ("SLURM_NTASKS", "2"),
            ("MASTER_ADDR", "h"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(err.contains("RANK") && err.contains("\"x\""), "{err}");
    }

    #[test]
    fn detect_picks_single_launcher_rank_or_explains() {
        assert_eq!(detect(env(&[]), 1, 1).unwrap(), LaunchMode::Single);
        assert_eq!(
            detect(env(&[]), 1, 4).unwrap(),
            LaunchMode::Launcher { world: 4 }
        );
        let err = detect(env(&[]), 2, 4).unwrap_err().to_string();
        assert!(
            err.contains("trainer.nnodes=2") && err.contains("srun"),
            "{err}"
        );

        let torchrun = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29501"),
        ]);
        match detect(&torchrun, 1, 2).unwrap() {
            LaunchMode::Rank { env, source } => {
                assert_eq!((env.rank, env.world_size, env.master_port), (1, 2, 29501));
                assert_eq!(source, EnvSource::Torchrun);
            }
            other => panic!("{other:?}"),
        }
        let err = detect(&torchrun, 1, 4).unwrap_err().to_string();
        assert!(
            err.contains("WORLD_SIZE=2") && err.contains("= 4 ranks"),
            "{err}"
        );

        let slurm = env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "a[1-2]"),
        ]);
        match detect(&slurm, 2, 2).unwrap() {
            LaunchMode::Rank { env, source } => {
                assert_eq!(
                    (env.rank, env.local_rank, env.master_addr.as_str()),
                    (3, 1, "a1")
                );
                assert_eq!(source, EnvSource::Slurm);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn visible_gpus_counts_cuda_visible_devices() {
        assert_eq!(
            visible_gpus(env(&[("CUDA_VISIBLE_DEVICES", "0,1,3")]))
                .unwrap()
                .0,
            3
        );
        assert_eq!(
            visible_gpus(env(&[("CUDA_VISIBLE_DEVICES", "")]))
                .unwrap()
                .0,
            0
        );
        // CUDA stops at the first invalid entry.
        assert_eq!(
            visible_gpus(env(&[("CUDA_VISIBLE_DEVICES", "2,-1,3")]))
                .unwrap()
                .0,
            1
        );
    }
}

//! A reward plugin in a worker process (`plugins.reward.isolate`): `verl __reward-worker PLUGIN`
//! loads the library and answers score calls over its stdin/stdout, framed as
//! `[u8 kind][u64 length][bytes]` with `Batch` bytes in and out. A crash, a hang past
//! `plugins.reward.timeout_s` or an exhausted limit costs the worker, never the job: the call
//! fails with one error naming the plugin, the call and the limit (or, with `on_error: zero`, its
//! rows score 0), and a new worker takes over on the next call.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};

use anyhow::{bail, Context};
use verl_plugin_api::{Batch, InitArgs, ScoreOptions};

use crate::python_reward::Limits;

const INIT: u8 = 1;
const SCORE: u8 = 2;
const OK: u8 = 3;
const ERR: u8 = 4;

pub fn write_frame(w: &mut impl Write, kind: u8, bytes: &[u8]) -> std::io::Result<()> {
    w.write_all(&[kind])?;
    w.write_all(&(bytes.len() as u64).to_le_bytes())?;
    w.write_all(bytes)?;
    w.flush()
}

pub fn read_frame(r: &mut impl Read) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 9];
    r.read_exact(&mut head)?;
    let len = u64::from_le_bytes(head[1..].try_into().expect("8 bytes")) as usize;
    let mut bytes = vec![0u8; len];
    r.read_exact(&mut bytes)?;
    Ok((head[0], bytes))
}

/// The worker's side (`verl __reward-worker PLUGIN`): serve until stdin closes.
pub fn serve(plugin: &str) -> anyhow::Result<()> {
    let mut loader = crate::Loader::new(&[]);
    let lib = loader.load(plugin)?;
    let (mut input, mut output) = (std::io::stdin().lock(), std::io::stdout().lock());
    let mut reward = None;
    loop {
        let (kind, bytes) = match read_frame(&mut input) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let answer = match kind {
            INIT => serde_json::from_slice::<InitArgs>(&bytes)
                .map_err(anyhow::Error::from)
                .and_then(|init| lib.create_reward(&init, None))
                .map(|r| {
                    reward = Some(r);
                    Batch::new()
                }),
            SCORE => (|| {
                let olen = u64::from_le_bytes(bytes[..8].try_into()?) as usize;
                let opts: ScoreOptions = serde_json::from_slice(&bytes[8..8 + olen])?;
                let batch = Batch::from_bytes(&bytes[8 + olen..])?;
                let r = reward.as_mut().context("score before init")?;
                Ok(r.score(&batch, &opts)?)
            })(),
            other => Err(anyhow::anyhow!("unknown frame kind {other}")),
        };
        match answer {
            Ok(b) => write_frame(&mut output, OK, &b.to_bytes())?,
            Err(e) => write_frame(&mut output, ERR, format!("{e:#}").as_bytes())?,
        }
    }
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
    frames: Receiver<(u8, Vec<u8>)>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The host's side: a reward plugin behind a worker process.
pub struct IsolatedReward {
    verl: PathBuf,
    library: PathBuf,
    name: String,
    init: InitArgs,
    pub limits: Limits,
    worker: Option<Worker>,
}

impl IsolatedReward {
    /// Starts the worker and creates the plugin's reward role in it.
    pub fn start(
        verl: PathBuf,
        library: &Path,
        name: &str,
        init: InitArgs,
        limits: Limits,
    ) -> anyhow::Result<Self> {
        let mut me = IsolatedReward {
            verl,
            library: library.to_path_buf(),
            name: name.to_string(),
            init,
            limits,
            worker: None,
        };
        me.ensure_worker()?;
        Ok(me)
    }

    fn what(&self) -> String {
        format!(
            "reward plugin `{}` ({}, isolated)",
            self.name,
            self.library.display()
        )
    }

    fn ensure_worker(&mut self) -> anyhow::Result<()> {
        if self.worker.is_some() {
            return Ok(());
        }
        let mut cmd = Command::new(&self.verl);
        cmd.arg("__reward-worker")
            .arg(&self.library)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        crate::python_reward::apply_limits(&mut cmd, &self.limits);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting a worker for {}", self.what()))?;
        let stdin = child.stdin.take().expect("piped");
        let mut stdout = child.stdout.take().expect("piped");
        let (tx, frames) = mpsc::channel();
        std::thread::spawn(move || {
            while let Ok(f) = read_frame(&mut stdout) {
                if tx.send(f).is_err() {
                    break;
                }
            }
        });
        let mut w = Worker {
            child,
            stdin,
            frames,
        };
        let init = serde_json::to_vec(&self.init)?;
        write_frame(&mut w.stdin, INIT, &init)?;
        self.answer(&mut w, "create_reward")?;
        self.worker = Some(w);
        Ok(())
    }

    fn answer(&self, w: &mut Worker, call: &str) -> anyhow::Result<Batch> {
        match w.frames.recv_timeout(self.limits.timeout) {
            Ok((OK, bytes)) => Ok(Batch::from_bytes(&bytes)?),
            Ok((_, bytes)) => bail!(
                "{} {call}: {}",
                self.what(),
                String::from_utf8_lossy(&bytes)
            ),
            Err(RecvTimeoutError::Timeout) => {
                let _ = w.child.kill();
                bail!(
                    "{} {call} did not answer within the timeout of {} s (plugins.reward.timeout_s); the worker was killed",
                    self.what(),
                    self.limits.timeout.as_secs_f64()
                )
            }
            Err(RecvTimeoutError::Disconnected) => {
                let how = crate::python_reward::ended(w.child.wait().ok(), &self.limits);
                bail!("{} crashed during {call}: the worker {how}", self.what())
            }
        }
    }

    /// One score call; a failed worker is dropped (and replaced on the next call).
    pub fn score(&mut self, batch: &Batch, options: &ScoreOptions) -> anyhow::Result<Batch> {
        self.ensure_worker()?;
        let mut w = self.worker.take().expect("started");
        let opts = serde_json::to_vec(options)?;
        let mut frame = (opts.len() as u64).to_le_bytes().to_vec();
        frame.extend_from_slice(&opts);
        frame.extend_from_slice(&batch.to_bytes());
        let sent = write_frame(&mut w.stdin, SCORE, &frame);
        let res = self.answer(&mut w, "score");
        match (&res, sent) {
            // A plugin error (ERR frame) leaves a healthy worker.
            (Err(e), _)
                if !e.to_string().contains("crashed") && !e.to_string().contains("timeout") =>
            {
                self.worker = Some(w)
            }
            (Ok(_), Ok(())) => self.worker = Some(w),
            _ => drop(w),
        }
        res
    }
}

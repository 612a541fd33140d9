//! The store server: one thread accepting connections, one thread per connection.
//!
//! Ranks number in the tens, so a thread per connection is simpler than an event loop and costs
//! nothing that matters. Blocking requests (`get`, `wait`, `barrier`, `wait_error`) park their
//! connection's thread on one condition variable that every mutation and every failure notifies.

use std::collections::{BTreeSet, HashMap};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::wire::{self, Op, Status, MAX_KEY_BYTES, MAX_VALUE_BYTES};
use crate::StoreError;

/// A running store. Dropping it stops the server and closes every client connection.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept_thread: Option<JoinHandle<()>>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    stopping: AtomicBool,
    /// Clones of live client sockets, so that `Drop` can unblock their reader threads.
    connections: Mutex<HashMap<u64, TcpStream>>,
}

#[derive(Default)]
struct State {
    kv: HashMap<String, Vec<u8>>,
    /// The first failure posted; later ones are dropped so every rank reports the same root cause.
    failure: Option<(usize, String)>,
    barriers: HashMap<String, BarrierState>,
}

struct BarrierState {
    world_size: usize,
    generation: u64,
    arrived: BTreeSet<usize>,
}

impl StoreServer {
    /// Starts a server on `addr` (`"0.0.0.0:29500"`, or port 0 for a free port; see
    /// [`StoreServer::local_addr`]).
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<StoreServer, StoreError> {
        let shown = format!("{addr:?}").trim_matches('"').to_string();
        let listener = TcpListener::bind(&addr).map_err(|source| StoreError::Bind {
            addr: shown.clone(),
            source,
        })?;
        let local = listener.local_addr().map_err(|source| StoreError::Bind {
            addr: shown,
            source,
        })?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
            connections: Mutex::new(HashMap::new()),
        });
        let accept_shared = Arc::clone(&shared);
        let accept_thread = std::thread::Builder::new()
            .name("verl-store-accept".into())
            .spawn(move || accept_loop(listener, accept_shared))
            .map_err(|source| StoreError::Bind {
                addr: local.to_string(),
                source,
            })?;
        Ok(StoreServer {
            addr: local,
            shared,
            accept_thread: Some(accept_thread),
        })
    }

    /// The bound address (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// An address clients on this host can connect to (`0.0.0.0` becomes loopback).
    pub fn connect_addr(&self) -> SocketAddr {
        let mut a = self.addr;
        if a.ip().is_unspecified() {
            a.set_ip(match a {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        a
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        // Wake the accept loop with a connection of our own; it sees `stopping` and returns.
        let _ = TcpStream::connect_timeout(&self.connect_addr(), Duration::from_secs(1));
        for (_, s) in lock(&self.shared.connections).drain() {
            let _ = s.shutdown(Shutdown::Both);
        }
        if let Some(t) = self.accept_thread.take() {
            let _ = t.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking connection thread must not take the whole store down with it.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut next_id = 0u64;
    for stream in listener.incoming() {
        if shared.stopping.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = stream else { continue };
        let _ = stream.set_nodelay(true);
        let id = next_id;
        next_id += 1;
        if let Ok(clone) = stream.try_clone() {
            lock(&shared.connections).insert(id, clone);
        }
        let conn_shared = Arc::clone(&shared);
        let spawned = std::thread::Builder::new()
            .name(format!("verl-store-conn-{id}"))
            .spawn(move || {
                serve_connection(stream, &conn_shared);
                lock(&conn_shared.connections).remove(&id);
            });
        if spawned.is_err() {
            lock(&shared.connections).remove(&id);
        }
    }
}

/// Serves one client until it says goodbye or disconnects. A client that announced its rank and
/// disconnects without goodbye is presumed dead, which is posted as that rank's failure: a crashed
/// rank then ends the others promptly instead of leaving them blocked until their timeouts.
fn serve_connection(stream: TcpStream, shared: &Shared) {
    let Ok(write_half) = stream.try_clone() else {
        return;
    };
    let mut r = BufReader::new(stream);
    let mut w = BufWriter::new(write_half);
    let mut magic = [0u8; 8];
    if r.read_exact(&mut magic).is_err() || &magic != wire::MAGIC {
        return;
    }
    let mut watched_rank: Option<usize> = None;
    while let Some(op) = wire::read_u8(&mut r).ok().and_then(Op::from_u8) {
        if op == Op::Bye {
            return;
        }
        if let Op::Hello = op {
            match wire::read_u64(&mut r) {
                Ok(rank) => watched_rank = Some(rank as usize),
                Err(_) => break,
            }
            if reply_ok(&mut w, |_| Ok(())).is_err() {
                break;
            }
            continue;
        }
        if handle(op, &mut r, &mut w, shared)
            .and_then(|_| w.flush())
            .is_err()
        {
            break;
        }
    }
    if let Some(rank) = watched_rank {
        if !shared.stopping.load(Ordering::SeqCst) {
            post_failure(
                shared,
                rank,
                "lost its connection to the rendezvous store without saying goodbye \
                 (the process exited or crashed)"
                    .to_string(),
            );
        }
    }
}

fn post_failure(shared: &Shared, rank: usize, message: String) {
    let mut st = lock(&shared.state);
    if st.failure.is_none() {
        st.failure = Some((rank, message));
    }
    drop(st);
    shared.changed.notify_all();
}

fn reply_ok<W: Write>(w: &mut W, body: impl FnOnce(&mut W) -> io::Result<()>) -> io::Result<()> {
    wire::write_u8(w, Status::Ok as u8)?;
    body(w)?;
    w.flush()
}

fn reply_failed(w: &mut impl Write, (rank, msg): &(usize, String)) -> io::Result<()> {
    wire::write_u8(w, Status::RankFailed as u8)?;
    wire::write_u64(w, *rank as u64)?;
    wire::write_str(w, msg)
}

fn reply_refused(w: &mut impl Write, msg: &str) -> io::Result<()> {
    wire::write_u8(w, Status::Refused as u8)?;
    wire::write_str(w, msg)
}

fn read_timeout(r: &mut impl Read) -> io::Result<Duration> {
    Ok(Duration::from_millis(wire::read_u64(r)?))
}

enum Waited<T> {
    Ready(T),
    Failed((usize, String)),
    TimedOut,
    Stopping,
}

/// Parks until `ready` yields a value, a failure is posted, the deadline passes or the server
/// stops. `ready` runs under the state lock after every change.
fn wait_until<T>(
    shared: &Shared,
    timeout: Duration,
    mut ready: impl FnMut(&mut State) -> Option<T>,
) -> Waited<T> {
    let deadline = Instant::now() + timeout;
    let mut st = lock(&shared.state);
    loop {
        if let Some(f) = &st.failure {
            return Waited::Failed(f.clone());
        }
        if shared.stopping.load(Ordering::SeqCst) {
            return Waited::Stopping;
        }
        if let Some(v) = ready(&mut st) {
            return Waited::Ready(v);
        }
        let now = Instant::now();
        if now >= deadline {
            return Waited::TimedOut;
        }
        st = shared
            .changed
            .wait_timeout(st, deadline - now)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

fn handle(op: Op, r: &mut impl Read, w: &mut impl Write, shared: &Shared) -> io::Result<()> {
    match op {
        Op::Set => {
            let key = wire::read_str(r, MAX_KEY_BYTES)?;
            let value = wire::read_bytes(r, MAX_VALUE_BYTES)?;
            lock(&shared.state).kv.insert(key, value);
            shared.changed.notify_all();
            reply_ok(w, |_| Ok(()))
        }
        Op::Get => {
            let key = wire::read_str(r, MAX_KEY_BYTES)?;
            let timeout = read_timeout(r)?;
            match wait_until(shared, timeout, |st| st.kv.get(&key).cloned()) {
                Waited::Ready(v) => reply_ok(w, |w| wire::write_bytes(w, &v)),
                Waited::Failed(f) => reply_failed(w, &f),
                Waited::TimedOut => wire::write_u8(w, Status::Timeout as u8),
                Waited::Stopping => Err(stopping()),
            }
        }
        Op::TryGet => {
            let key = wire::read_str(r, MAX_KEY_BYTES)?;
            let v = lock(&shared.state).kv.get(&key).cloned();
            reply_ok(w, |w| match v {
                Some(v) => {
                    wire::write_u8(w, 1)?;
                    wire::write_bytes(w, &v)
                }
                None => wire::write_u8(w, 0),
            })
        }
        Op::Add => {
            let key = wire::read_str(r, MAX_KEY_BYTES)?;
            let delta = wire::read_i64(r)?;
            let mut st = lock(&shared.state);
            let current = match st.kv.get(&key) {
                None => 0,
                Some(v) => match parse_counter(v) {
                    Some(c) => c,
                    None => {
                        let msg = format!(
                            "`add` needs a counter (a decimal i64) under the key, found {} bytes \
                             that are not one",
                            v.len()
                        );
                        drop(st);
                        return reply_refused(w, &msg);
                    }
                },
            };
            let Some(new) = current.checked_add(delta) else {
                drop(st);
                return reply_refused(w, &format!("counter {current} + {delta} overflows i64"));
            };
            st.kv.insert(key, new.to_string().into_bytes());
            drop(st);
            shared.changed.notify_all();
            reply_ok(w, |w| wire::write_i64(w, new))
        }
        Op::Wait => {
            let n = wire::read_len(r)?;
            let keys = (0..n)
                .map(|_| wire::read_str(r, MAX_KEY_BYTES))
                .collect::<io::Result<Vec<_>>>()?;
            let timeout = read_timeout(r)?;
            let all_set = |st: &mut State| keys.iter().all(|k| st.kv.contains_key(k)).then_some(());
            match wait_until(shared, timeout, all_set) {
                Waited::Ready(()) => reply_ok(w, |_| Ok(())),
                Waited::Failed(f) => reply_failed(w, &f),
                Waited::TimedOut => {
                    let st = lock(&shared.state);
                    let missing: Vec<&String> =
                        keys.iter().filter(|k| !st.kv.contains_key(*k)).collect();
                    wire::write_u8(w, Status::Timeout as u8)?;
                    wire::write_u64(w, missing.len() as u64)?;
                    missing.iter().try_for_each(|k| wire::write_str(w, k))
                }
                Waited::Stopping => Err(stopping()),
            }
        }
        Op::Barrier => barrier(r, w, shared),
        Op::SetError => {
            let rank = wire::read_u64(r)? as usize;
            let message = wire::read_str(r, MAX_VALUE_BYTES)?;
            post_failure(shared, rank, message);
            reply_ok(w, |_| Ok(()))
        }
        Op::CheckError => {
            let f = lock(&shared.state).failure.clone();
            match f {
                Some(f) => reply_failed(w, &f),
                None => reply_ok(w, |_| Ok(())),
            }
        }
        Op::WaitError => {
            let timeout = read_timeout(r)?;
            match wait_until(shared, timeout, |_| None::<()>) {
                Waited::Failed(f) => reply_failed(w, &f),
                Waited::TimedOut | Waited::Ready(()) => reply_ok(w, |_| Ok(())),
                Waited::Stopping => Err(stopping()),
            }
        }
        Op::Delete => {
            let key = wire::read_str(r, MAX_KEY_BYTES)?;
            let existed = lock(&shared.state).kv.remove(&key).is_some();
            reply_ok(w, |w| wire::write_u8(w, existed as u8))
        }
        Op::Hello | Op::Bye => unreachable!("handled by serve_connection"),
    }
}

fn barrier(r: &mut impl Read, w: &mut impl Write, shared: &Shared) -> io::Result<()> {
    let name = wire::read_str(r, MAX_KEY_BYTES)?;
    let rank = wire::read_u64(r)? as usize;
    let world_size = wire::read_u64(r)? as usize;
    let timeout = read_timeout(r)?;
    if rank >= world_size {
        return reply_refused(
            w,
            &format!("rank {rank} is outside a world of {world_size}"),
        );
    }
    let generation = {
        let mut st = lock(&shared.state);
        if let Some(f) = &st.failure {
            let f = f.clone();
            drop(st);
            return reply_failed(w, &f);
        }
        let b = st
            .barriers
            .entry(name.clone())
            .or_insert_with(|| BarrierState {
                world_size,
                generation: 0,
                arrived: BTreeSet::new(),
            });
        if b.world_size != world_size {
            let msg = format!(
                "rank {rank} arrived with world size {world_size}, earlier ranks with {}",
                b.world_size
            );
            drop(st);
            return reply_refused(w, &msg);
        }
        // A rank already in this round is retrying after its own timeout: it rejoins the round.
        b.arrived.insert(rank);
        let generation = b.generation;
        if b.arrived.len() == world_size {
            b.generation += 1;
            b.arrived.clear();
            drop(st);
            shared.changed.notify_all();
            return reply_ok(w, |_| Ok(()));
        }
        generation
    };
    let passed = |st: &mut State| {
        st.barriers
            .get(&name)
            .is_some_and(|b| b.generation != generation)
            .then_some(())
    };
    match wait_until(shared, timeout, passed) {
        Waited::Ready(()) => reply_ok(w, |_| Ok(())),
        Waited::Failed(f) => reply_failed(w, &f),
        Waited::TimedOut => {
            let st = lock(&shared.state);
            let missing: Vec<usize> = match st.barriers.get(&name) {
                // Arrivals stay recorded: every rank that times out names the same missing ranks.
                Some(b) if b.generation == generation => {
                    (0..world_size).filter(|r| !b.arrived.contains(r)).collect()
                }
                _ => Vec::new(),
            };
            drop(st);
            wire::write_u8(w, Status::Timeout as u8)?;
            wire::write_u64(w, missing.len() as u64)?;
            missing
                .iter()
                .try_for_each(|r| wire::write_u64(w, *r as u64))
        }
        Waited::Stopping => Err(stopping()),
    }
}

fn parse_counter(v: &[u8]) -> Option<i64> {
    std::str::from_utf8(v).ok()?.parse().ok()
}

fn stopping() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "the store is shutting down",
    )
}

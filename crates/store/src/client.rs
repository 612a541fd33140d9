//! The store client: one TCP connection, one request at a time.

use std::io::{self, BufReader, BufWriter, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::wire::{self, Op, Status, MAX_KEY_BYTES, MAX_VALUE_BYTES};
use crate::StoreError;

/// How long past a request's own deadline the client waits for the server's answer before it
/// declares the server unresponsive; the server enforces the deadline itself.
const REPLY_GRACE: Duration = Duration::from_secs(10);
/// Deadline for requests that never block on other ranks (`set`, `add`, ...).
const QUICK_REPLY: Duration = Duration::from_secs(60);

/// A connection to a [`crate::StoreServer`].
///
/// Requests on one client are serialised: a blocking `get` holds the connection until it
/// returns. Threads that need to block independently (a failure watcher, say) open their own
/// connection with [`StoreClient::duplicate`].
pub struct StoreClient {
    addr: SocketAddr,
    conn: Mutex<Conn>,
    rank: Option<usize>,
}

struct Conn {
    r: BufReader<TcpStream>,
    w: BufWriter<TcpStream>,
}

impl StoreClient {
    /// Connects without announcing a rank, retrying until `timeout` (ranks usually start before
    /// the server is up).
    pub fn connect(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        timeout: Duration,
    ) -> Result<StoreClient, StoreError> {
        Self::open(addr, timeout, None)
    }

    /// Connects as `rank`. Should this connection drop without [`Drop`] having said goodbye (the
    /// process crashed or was killed), the server posts a failure for `rank`, so every other rank
    /// stops waiting at once.
    pub fn connect_as(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        rank: usize,
        timeout: Duration,
    ) -> Result<StoreClient, StoreError> {
        Self::open(addr, timeout, Some(rank))
    }

    fn open(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        timeout: Duration,
        rank: Option<usize>,
    ) -> Result<StoreClient, StoreError> {
        let shown = format!("{addr:?}").trim_matches('"').to_string();
        let deadline = Instant::now() + timeout;
        let connect_err = |source| StoreError::Connect {
            addr: shown.clone(),
            timeout,
            source,
        };
        let stream = loop {
            let attempt = addr.to_socket_addrs().and_then(|addrs| {
                let mut last = io::Error::new(io::ErrorKind::NotFound, "no address resolved");
                for a in addrs {
                    let left = deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(10));
                    match TcpStream::connect_timeout(&a, left) {
                        Ok(s) => return Ok(s),
                        Err(e) => last = e,
                    }
                }
                Err(last)
            });
            match attempt {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => return Err(connect_err(e)),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let peer = stream.peer_addr().map_err(connect_err)?;
        stream.set_nodelay(true).map_err(connect_err)?;
        let write_half = stream.try_clone().map_err(connect_err)?;
        let mut conn = Conn {
            r: BufReader::new(stream),
            w: BufWriter::new(write_half),
        };
        conn.w.write_all(wire::MAGIC).map_err(connect_err)?;
        let client = StoreClient {
            addr: peer,
            conn: Mutex::new(conn),
            rank,
        };
        match rank {
            Some(r) => {
                client.request(Op::Hello, "hello", QUICK_REPLY, |w| {
                    wire::write_u64(w, r as u64)
                })?;
            }
            None => {
                let mut c = client.lock();
                c.w.flush().map_err(connect_err)?;
            }
        }
        Ok(client)
    }

    /// A second, independent connection to the same server (without a rank: its loss is not a
    /// failure).
    pub fn duplicate(&self, timeout: Duration) -> Result<StoreClient, StoreError> {
        Self::connect(self.addr, timeout)
    }

    /// The server's address as connected.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The local address of this connection: on a multi-host job, the interface through which this
    /// host reaches the store, and so a good address to publish to peers.
    pub fn local_addr(&self) -> Result<SocketAddr, StoreError> {
        self.lock()
            .r
            .get_ref()
            .local_addr()
            .map_err(|source| self.io_err("local_addr", "", source))
    }

    /// The rank this client announced, if any.
    pub fn rank(&self) -> Option<usize> {
        self.rank
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.request(Op::Set, key, QUICK_REPLY, |w| {
            wire::write_str(w, key)?;
            wire::write_bytes(w, value)
        })?;
        Ok(())
    }

    /// Blocks until `key` is set, then returns its value.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        let mut c = self.send(Op::Get, key, |w| {
            wire::write_str(w, key)?;
            write_timeout(w, timeout)
        })?;
        match self.status(&mut c, "get", key, timeout + REPLY_GRACE)? {
            Status::Ok => self.read(&mut c, "get", key, |r| wire::read_bytes(r, MAX_VALUE_BYTES)),
            Status::Timeout => Err(StoreError::GetTimeout {
                key: key.to_string(),
                timeout,
            }),
            s => Err(self.failure(&mut c, s, "get", key)),
        }
    }

    /// The value under `key` if it is set now; never blocks on other ranks.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let mut c = self.send(Op::TryGet, key, |w| wire::write_str(w, key))?;
        match self.status(&mut c, "try_get", key, QUICK_REPLY)? {
            Status::Ok => self.read(&mut c, "try_get", key, |r| match wire::read_u8(r)? {
                0 => Ok(None),
                _ => wire::read_bytes(r, MAX_VALUE_BYTES).map(Some),
            }),
            s => Err(self.failure(&mut c, s, "try_get", key)),
        }
    }

    /// Adds `delta` to the counter under `key` (absent counts as 0) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let mut c = self.send(Op::Add, key, |w| {
            wire::write_str(w, key)?;
            wire::write_i64(w, delta)
        })?;
        match self.status(&mut c, "add", key, QUICK_REPLY)? {
            Status::Ok => self.read(&mut c, "add", key, wire::read_i64),
            s => Err(self.failure(&mut c, s, "add", key)),
        }
    }

    /// Blocks until every key in `keys` is set.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let shown = keys.join(",");
        let mut c = self.send(Op::Wait, &shown, |w| {
            wire::write_u64(w, keys.len() as u64)?;
            keys.iter().try_for_each(|k| wire::write_str(w, k))?;
            write_timeout(w, timeout)
        })?;
        match self.status(&mut c, "wait", &shown, timeout + REPLY_GRACE)? {
            Status::Ok => Ok(()),
            Status::Timeout => {
                let missing = self.read(&mut c, "wait", &shown, |r| {
                    let n = wire::read_len(r)?;
                    (0..n).map(|_| wire::read_str(r, MAX_KEY_BYTES)).collect()
                })?;
                Err(StoreError::WaitTimeout { missing, timeout })
            }
            s => Err(self.failure(&mut c, s, "wait", &shown)),
        }
    }

    /// Blocks until all `world_size` ranks have entered barrier `name`. Names are reusable: each
    /// completed round opens the next. A timeout names the ranks that never arrived.
    pub fn barrier(
        &self,
        name: &str,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<(), StoreError> {
        let mut c = self.send(Op::Barrier, name, |w| {
            wire::write_str(w, name)?;
            wire::write_u64(w, rank as u64)?;
            wire::write_u64(w, world_size as u64)?;
            write_timeout(w, timeout)
        })?;
        match self.status(&mut c, "barrier", name, timeout + REPLY_GRACE)? {
            Status::Ok => Ok(()),
            Status::Timeout => {
                let missing = self.read(&mut c, "barrier", name, |r| {
                    let n = wire::read_len(r)?;
                    (0..n)
                        .map(|_| wire::read_u64(r).map(|v| v as usize))
                        .collect()
                })?;
                Err(StoreError::BarrierTimeout {
                    name: name.to_string(),
                    timeout,
                    missing,
                    world_size,
                })
            }
            s => Err(self.failure(&mut c, s, "barrier", name)),
        }
    }

    /// Broadcasts the failure of `rank`: every blocked and later `get`/`wait`/`barrier` on every
    /// rank returns [`StoreError::RankFailed`] with this message. The first failure posted wins.
    pub fn set_error(&self, rank: usize, message: &str) -> Result<(), StoreError> {
        self.request(Op::SetError, "<error>", QUICK_REPLY, |w| {
            wire::write_u64(w, rank as u64)?;
            wire::write_str(w, message)
        })?;
        Ok(())
    }

    /// `Err(RankFailed)` if any rank has posted a failure.
    pub fn check_error(&self) -> Result<(), StoreError> {
        self.request(Op::CheckError, "<error>", QUICK_REPLY, |_| Ok(()))?;
        Ok(())
    }

    /// Blocks until some rank posts a failure (`Err(RankFailed)`) or `timeout` passes (`Ok`).
    /// Meant for a watcher thread on its own [`StoreClient::duplicate`] connection.
    pub fn wait_error(&self, timeout: Duration) -> Result<(), StoreError> {
        self.request(Op::WaitError, "<error>", timeout + REPLY_GRACE, |w| {
            write_timeout(w, timeout)
        })?;
        Ok(())
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let mut c = self.send(Op::Delete, key, |w| wire::write_str(w, key))?;
        match self.status(&mut c, "delete", key, QUICK_REPLY)? {
            Status::Ok => self.read(&mut c, "delete", key, |r| wire::read_u8(r).map(|b| b != 0)),
            s => Err(self.failure(&mut c, s, "delete", key)),
        }
    }

    /// A handle that can close this connection from another thread even while a request holds it.
    pub fn shutdown_handle(&self) -> Result<ShutdownHandle, StoreError> {
        let s = self
            .lock()
            .r
            .get_ref()
            .try_clone()
            .map_err(|source| self.io_err("shutdown_handle", "", source))?;
        Ok(ShutdownHandle(s))
    }

    fn lock(&self) -> MutexGuard<'_, Conn> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn io_err(&self, op: &'static str, key: &str, source: io::Error) -> StoreError {
        StoreError::Io {
            addr: self.addr,
            op,
            key: key.to_string(),
            source,
        }
    }

    fn send(
        &self,
        op: Op,
        key: &str,
        body: impl FnOnce(&mut BufWriter<TcpStream>) -> io::Result<()>,
    ) -> Result<MutexGuard<'_, Conn>, StoreError> {
        let mut c = self.lock();
        let res = (|| {
            wire::write_u8(&mut c.w, op as u8)?;
            body(&mut c.w)?;
            c.w.flush()
        })();
        res.map_err(|source| self.io_err(op_name(op), key, source))?;
        Ok(c)
    }

    fn status(
        &self,
        c: &mut Conn,
        op: &'static str,
        key: &str,
        reply_within: Duration,
    ) -> Result<Status, StoreError> {
        let sock = c.r.get_ref();
        sock.set_read_timeout(Some(reply_within.max(Duration::from_millis(1))))
            .map_err(|source| self.io_err(op, key, source))?;
        let b = wire::read_u8(&mut c.r).map_err(|source| self.io_err(op, key, source))?;
        Status::from_u8(b).ok_or_else(|| {
            self.io_err(
                op,
                key,
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("unknown reply status {b}"),
                ),
            )
        })
    }

    fn read<T>(
        &self,
        c: &mut Conn,
        op: &'static str,
        key: &str,
        f: impl FnOnce(&mut BufReader<TcpStream>) -> io::Result<T>,
    ) -> Result<T, StoreError> {
        f(&mut c.r).map_err(|source| self.io_err(op, key, source))
    }

    /// Decodes a `RankFailed` or `Refused` reply (or an unexpected status) into an error.
    fn failure(&self, c: &mut Conn, s: Status, op: &'static str, key: &str) -> StoreError {
        let decoded = match s {
            Status::RankFailed => self.read(c, op, key, |r| {
                let rank = wire::read_u64(r)? as usize;
                let message = wire::read_str(r, MAX_VALUE_BYTES)?;
                Ok(StoreError::RankFailed { rank, message })
            }),
            Status::Refused => self.read(c, op, key, |r| {
                Ok(StoreError::Refused {
                    addr: self.addr,
                    op,
                    key: key.to_string(),
                    message: wire::read_str(r, MAX_VALUE_BYTES)?,
                })
            }),
            other => Ok(self.io_err(
                op,
                key,
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("unexpected reply status {other:?}"),
                ),
            )),
        };
        decoded.unwrap_or_else(|e| e)
    }

    /// Sends a request whose only success reply is a bare `Ok`.
    fn request(
        &self,
        op: Op,
        key: &str,
        reply_within: Duration,
        body: impl FnOnce(&mut BufWriter<TcpStream>) -> io::Result<()>,
    ) -> Result<(), StoreError> {
        let name = op_name(op);
        let mut c = self.send(op, key, body)?;
        match self.status(&mut c, name, key, reply_within)? {
            Status::Ok => Ok(()),
            s => Err(self.failure(&mut c, s, name, key)),
        }
    }
}

impl Drop for StoreClient {
    fn drop(&mut self) {
        // Goodbye tells the server this rank left on purpose, not by crashing.
        let mut c = self.lock();
        let _ = wire::write_u8(&mut c.w, Op::Bye as u8).and_then(|_| c.w.flush());
        let _ = c.r.get_ref().shutdown(Shutdown::Write);
    }
}

/// Closes a client's connection from another thread.
pub struct ShutdownHandle(TcpStream);

impl ShutdownHandle {
    pub fn shutdown(&self) {
        let _ = self.0.shutdown(Shutdown::Both);
    }
}

fn write_timeout(w: &mut impl Write, t: Duration) -> io::Result<()> {
    wire::write_u64(w, t.as_millis().min(u64::MAX as u128) as u64)
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Hello => "hello",
        Op::Set => "set",
        Op::Get => "get",
        Op::TryGet => "try_get",
        Op::Add => "add",
        Op::Wait => "wait",
        Op::Barrier => "barrier",
        Op::SetError => "set_error",
        Op::CheckError => "check_error",
        Op::WaitError => "wait_error",
        Op::Delete => "delete",
        Op::Bye => "bye",
    }
}

#[allow(dead_code)]
fn _assert_sync() {
    fn is<T: Send + Sync>() {}
    is::<StoreClient>();
}

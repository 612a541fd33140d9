//! The CPU backend: a full mesh of TCP connections between the group's ranks, set up through the
//! store (each rank publishes its listening address).
//!
//! Reductions are computed by the owner of each chunk from every rank's contribution *in rank
//! order* with libtorch's own elementwise ops, so results are bit-identical to the single-process
//! expression `((x0 + x1) + x2) + ...` whatever the arrival order: data-parallel parity tests
//! depend on that. Bandwidth is secondary; the data moves in a pairwise-exchange schedule (step
//! `s`: send to `rank + s`, receive from `rank - s`), which never deadlocks on full socket buffers.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use verl_store::StoreClient;

use crate::error::torch;
use crate::tensor::{self, Staged};
use crate::watch::Watch;
use crate::{Backend, CommError, Communicator, ReduceOp};

const BACKEND: &str = "cpu";
const HELLO_MAGIC: &[u8; 8] = b"verlcomm";
const MSG_MAGIC: u32 = 0x7663_6d31;
/// Messages up to this size are written before reading without a helper thread: they fit in the
/// kernel's socket buffers, so the pairwise schedule cannot deadlock on them.
const INLINE_BYTES: usize = 16 * 1024;
/// How long a rank that lost a connection waits for the failure broadcast to explain why, before
/// reporting the lost connection itself.
const EXPLAIN_GRACE: Duration = Duration::from_millis(500);

#[derive(Clone, Debug)]
pub struct CpuOptions {
    /// Deadline for the rendezvous (all ranks publishing and connecting).
    pub timeout: Duration,
    /// Deadline for any single receive inside a collective; `None` waits forever (a failed rank
    /// still ends the wait through the failure broadcast).
    pub op_timeout: Option<Duration>,
}

impl Default for CpuOptions {
    fn default() -> Self {
        CpuOptions {
            timeout: Duration::from_secs(300),
            op_timeout: Some(Duration::from_secs(30 * 60)),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Op {
    AllReduce = 1,
    AllGather = 2,
    ReduceScatter = 3,
    Broadcast = 4,
    P2p = 5,
    AllToAll = 6,
    Barrier = 7,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
            Op::P2p => "send/recv",
            Op::AllToAll => "all_to_all",
            Op::Barrier => "barrier",
        }
    }
    fn from_u8(b: u8) -> Option<Op> {
        [
            Op::AllReduce,
            Op::AllGather,
            Op::ReduceScatter,
            Op::Broadcast,
            Op::P2p,
            Op::AllToAll,
            Op::Barrier,
        ]
        .into_iter()
        .find(|o| *o as u8 == b)
    }
}

struct Peer {
    rd: Mutex<TcpStream>,
    wr: Mutex<TcpStream>,
}

/// The CPU backend of [`Communicator`].
pub struct CpuCommunicator {
    rank: usize,
    world: usize,
    global: Vec<usize>,
    prefix: String,
    store: Arc<StoreClient>,
    watch: Arc<Watch>,
    hook: u64,
    /// Indexed by group rank; `None` at our own rank.
    peers: Vec<Option<Peer>>,
    /// Clones of every socket, to cut them all at once on abort.
    sockets: Vec<TcpStream>,
    opts: CpuOptions,
    group_counts: Mutex<HashMap<Vec<usize>, usize>>,
    aborted: Mutex<Option<String>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl CpuCommunicator {
    /// The world communicator of `world_size` ranks rendezvousing on `store` under the prefix
    /// `verl-comm/cpu/world`.
    pub fn new(
        store: Arc<StoreClient>,
        rank: usize,
        world_size: usize,
        opts: CpuOptions,
    ) -> Result<CpuCommunicator, CommError> {
        Self::with_prefix(store, "verl-comm/cpu/world", rank, world_size, opts)
    }

    /// As [`CpuCommunicator::new`] under a prefix of the caller's (unique per communicator on
    /// this store).
    pub fn with_prefix(
        store: Arc<StoreClient>,
        prefix: &str,
        rank: usize,
        world_size: usize,
        opts: CpuOptions,
    ) -> Result<CpuCommunicator, CommError> {
        if rank >= world_size {
            return Err(CommError::InvalidRank {
                op: "rendezvous",
                rank,
                world_size,
            });
        }
        let watch = Watch::start(&store, opts.timeout)?;
        Self::connect(
            store,
            watch,
            prefix.to_string(),
            rank,
            (0..world_size).collect(),
            opts,
        )
    }

    fn connect(
        store: Arc<StoreClient>,
        watch: Arc<Watch>,
        prefix: String,
        rank: usize,
        global: Vec<usize>,
        opts: CpuOptions,
    ) -> Result<CpuCommunicator, CommError> {
        let op = "rendezvous";
        let world = global.len();
        let me = global[rank];
        let io = |peer: usize| move |source: io::Error| CommError::Io { op, peer, source };
        // The interface through which this host reaches the store is one its peers can reach.
        let ip = store.local_addr()?.ip();
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).map_err(io(me))?;
        let addr = listener.local_addr().map_err(io(me))?;
        store.set(
            &format!("{prefix}/addr/{rank}"),
            addr.to_string().as_bytes(),
        )?;
        store.barrier(&format!("{prefix}/rendezvous"), rank, world, opts.timeout)?;

        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        for (j, slot) in streams.iter_mut().enumerate().take(rank) {
            let raw = store.get(&format!("{prefix}/addr/{j}"), opts.timeout)?;
            let peer_addr: SocketAddr =
                String::from_utf8_lossy(&raw)
                    .parse()
                    .map_err(|_| CommError::Shape {
                        op,
                        what: format!("store key `{prefix}/addr/{j}`"),
                        expected: "a socket address".into(),
                        found: String::from_utf8_lossy(&raw).into_owned(),
                    })?;
            let mut s =
                TcpStream::connect_timeout(&peer_addr, opts.timeout).map_err(io(global[j]))?;
            let mut hello = Vec::with_capacity(32 + prefix.len());
            hello.extend_from_slice(HELLO_MAGIC);
            hello.extend_from_slice(&(rank as u64).to_le_bytes());
            hello.extend_from_slice(&(world as u64).to_le_bytes());
            hello.extend_from_slice(&(prefix.len() as u64).to_le_bytes());
            hello.extend_from_slice(prefix.as_bytes());
            s.write_all(&hello).map_err(io(global[j]))?;
            *slot = Some(s);
        }

        let deadline = Instant::now() + opts.timeout;
        listener.set_nonblocking(true).map_err(io(me))?;
        let mut pending = world - rank - 1;
        while pending > 0 {
            match listener.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false).map_err(io(me))?;
                    s.set_read_timeout(Some(opts.timeout)).map_err(io(me))?;
                    // A stray or stale connection (another group's retry) is dropped, not fatal.
                    if let Some(j) = read_hello(&mut s, &prefix, world, rank) {
                        if streams[j].is_none() {
                            streams[j] = Some(s);
                            pending -= 1;
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if let Some((r, m)) = watch.failure() {
                        return Err(CommError::PeerFailed {
                            rank: r,
                            message: m,
                        });
                    }
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = (rank + 1..world)
                            .filter(|j| streams[*j].is_none())
                            .map(|j| global[j])
                            .collect();
                        return Err(CommError::Io {
                            op,
                            peer: missing[0],
                            source: io::Error::new(
                                io::ErrorKind::TimedOut,
                                format!(
                                    "ranks {missing:?} did not connect within {:?}",
                                    opts.timeout
                                ),
                            ),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(io(me)(e)),
            }
        }

        let mut peers = Vec::with_capacity(world);
        let mut sockets = Vec::new();
        for (j, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                peers.push(None);
                continue;
            };
            let e = io(global[j]);
            s.set_nodelay(true).map_err(e)?;
            s.set_read_timeout(opts.op_timeout).map_err(io(global[j]))?;
            s.set_write_timeout(opts.op_timeout)
                .map_err(io(global[j]))?;
            sockets.push(s.try_clone().map_err(io(global[j]))?);
            let wr = s.try_clone().map_err(io(global[j]))?;
            peers.push(Some(Peer {
                rd: Mutex::new(s),
                wr: Mutex::new(wr),
            }));
        }
        let cut: Vec<TcpStream> = sockets
            .iter()
            .map(|s| s.try_clone())
            .collect::<io::Result<_>>()
            .map_err(io(me))?;
        let hook = watch.register(Box::new(move || {
            for s in &cut {
                let _ = s.shutdown(Shutdown::Both);
            }
        }));
        Ok(CpuCommunicator {
            rank,
            world,
            global,
            prefix,
            store,
            watch,
            hook,
            peers,
            sockets,
            opts,
            group_counts: Mutex::new(HashMap::new()),
            aborted: Mutex::new(None),
        })
    }

    /// The store prefix under which this communicator rendezvoused.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn peer(&self, j: usize) -> &Peer {
        self.peers[j]
            .as_ref()
            .expect("collectives never address their own rank's connection")
    }

    /// Runs one collective: refuses if the group is already broken, and on failure tells every
    /// other rank (unless the failure came from another rank in the first place).
    fn run<T>(&self, op: Op, f: impl FnOnce() -> Result<T, CommError>) -> Result<T, CommError> {
        if let Some(message) = lock(&self.aborted).clone() {
            return Err(CommError::Aborted {
                rank: self.global[self.rank],
                message,
            });
        }
        if let Some((rank, message)) = self.watch.failure() {
            return Err(CommError::PeerFailed { rank, message });
        }
        let res = f();
        if let Err(e) = &res {
            if !matches!(e, CommError::PeerFailed { .. } | CommError::Aborted { .. }) {
                let me = self.global[self.rank];
                let _ = self
                    .store
                    .set_error(me, &format!("{} on rank {me}: {e}", op.name()));
            }
        }
        res
    }

    /// Turns a socket error into the most useful explanation: the failure broadcast if some rank
    /// failed (a lost connection is usually its consequence), else the error itself.
    fn io_error(&self, op: Op, peer: usize, e: io::Error) -> CommError {
        let explained = || {
            if let Some(m) = lock(&self.aborted).clone() {
                return Some(CommError::Aborted {
                    rank: self.global[self.rank],
                    message: m,
                });
            }
            self.watch
                .failure()
                .map(|(rank, message)| CommError::PeerFailed { rank, message })
        };
        if let Some(err) = explained() {
            return err;
        }
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            return CommError::Timeout {
                op: op.name(),
                peer: self.global[peer],
                after: self.opts.op_timeout.unwrap_or_default(),
            };
        }
        let deadline = Instant::now() + EXPLAIN_GRACE;
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
            if let Some(err) = explained() {
                return err;
            }
        }
        if let Err(verl_store::StoreError::RankFailed { rank, message }) = self.store.check_error()
        {
            return CommError::PeerFailed { rank, message };
        }
        CommError::Io {
            op: op.name(),
            peer: self.global[peer],
            source: e,
        }
    }

    fn send_msg(&self, op: Op, kind: u8, peer: usize, data: &[u8]) -> Result<(), CommError> {
        let mut header = [0u8; 16];
        header[..4].copy_from_slice(&MSG_MAGIC.to_le_bytes());
        header[4] = op as u8;
        header[5] = kind;
        header[8..].copy_from_slice(&(data.len() as u64).to_le_bytes());
        let mut w = lock(&self.peer(peer).wr);
        w.write_all(&header)
            .and_then(|_| w.write_all(data))
            .map_err(|e| self.io_error(op, peer, e))
    }

    fn recv_msg(&self, op: Op, kind: u8, peer: usize, buf: &mut [u8]) -> Result<(), CommError> {
        let mut r = lock(&self.peer(peer).rd);
        let mut header = [0u8; 16];
        r.read_exact(&mut header)
            .map_err(|e| self.io_error(op, peer, e))?;
        let magic = u32::from_le_bytes(header[..4].try_into().expect("4 bytes"));
        let found_op = Op::from_u8(header[4]);
        let found_kind = header[5];
        let len = u64::from_le_bytes(header[8..].try_into().expect("8 bytes")) as usize;
        if magic != MSG_MAGIC || found_op != Some(op) || found_kind != kind || len != buf.len() {
            let describe = |o: Option<Op>, k: u8, n: usize| match o {
                Some(o) if magic == MSG_MAGIC => {
                    format!("`{}` of {n} bytes ({})", o.name(), tensor::kind_name(k))
                }
                _ => "bytes that are not a collective message".to_string(),
            };
            return Err(CommError::Mismatch {
                op: op.name(),
                peer: self.global[peer],
                expected: describe(Some(op), kind, buf.len()),
                found: describe(found_op, found_kind, len),
            });
        }
        r.read_exact(buf).map_err(|e| self.io_error(op, peer, e))
    }

    /// Pairwise exchange: `sends[j]` goes to rank `j`, `recvs[j]` is filled from rank `j`.
    /// Entries at our own rank are ignored; `None` means nothing to exchange with that rank.
    fn exchange(
        &self,
        op: Op,
        kind: u8,
        sends: &[Option<&[u8]>],
        recvs: &mut [Option<&mut [u8]>],
    ) -> Result<(), CommError> {
        let (r, w) = (self.rank, self.world);
        for s in 1..w {
            let dst = (r + s) % w;
            let src = (r + w - s) % w;
            let out = sends[dst];
            let inn = recvs[src].take();
            match (out, inn) {
                (Some(out), Some(inn)) if out.len() > INLINE_BYTES => {
                    std::thread::scope(|scope| {
                        let sender = scope.spawn(|| self.send_msg(op, kind, dst, out));
                        let received = self.recv_msg(op, kind, src, inn);
                        let sent = sender.join().unwrap_or_else(|_| {
                            Err(CommError::Io {
                                op: op.name(),
                                peer: self.global[dst],
                                source: io::Error::other("sender thread panicked"),
                            })
                        });
                        // Report the receive error first: a failed send is often its echo.
                        received.and(sent)
                    })?;
                }
                (out, inn) => {
                    if let Some(out) = out {
                        self.send_msg(op, kind, dst, out)?;
                    }
                    if let Some(inn) = inn {
                        self.recv_msg(op, kind, src, inn)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn check_rank(&self, op: &'static str, rank: usize) -> Result<(), CommError> {
        if rank >= self.world {
            return Err(CommError::InvalidRank {
                op,
                rank,
                world_size: self.world,
            });
        }
        Ok(())
    }
}

fn read_hello(s: &mut TcpStream, prefix: &str, world: usize, rank: usize) -> Option<usize> {
    let mut head = [0u8; 32];
    s.read_exact(&mut head).ok()?;
    if &head[..8] != HELLO_MAGIC {
        return None;
    }
    let field = |i: usize| u64::from_le_bytes(head[i..i + 8].try_into().expect("8 bytes")) as usize;
    let (j, their_world, plen) = (field(8), field(16), field(24));
    if their_world != world || plen != prefix.len() || j <= rank || j >= world {
        return None;
    }
    let mut p = vec![0u8; plen];
    s.read_exact(&mut p).ok()?;
    (p == prefix.as_bytes()).then_some(j)
}

fn wire_kind(op: &'static str, kind: Kind) -> Result<u8, CommError> {
    tensor::kind_code(kind).ok_or_else(|| CommError::UnsupportedDtype {
        op,
        backend: BACKEND,
        kind: format!("{kind:?}"),
        for_reduction: false,
    })
}

fn reducible(op: &'static str, kind: Kind) -> Result<u8, CommError> {
    let code = wire_kind(op, kind)?;
    if kind == Kind::Bool {
        return Err(CommError::UnsupportedDtype {
            op,
            backend: BACKEND,
            kind: format!("{kind:?}"),
            for_reduction: true,
        });
    }
    Ok(code)
}

/// Reduces equal-length contributions in rank order with libtorch's elementwise ops, writing the
/// result into `out`.
fn reduce_into(
    op_name: &'static str,
    parts: &[&[u8]],
    kind: Kind,
    op: ReduceOp,
    out: &mut [u8],
) -> Result<(), CommError> {
    let n = out.len() / kind.elt_size_in_bytes();
    if n == 0 {
        return Ok(());
    }
    let e = torch(op_name);
    let t = |b: &[u8]| Tensor::f_from_data_size(b, &[n as i64], kind);
    let mut acc = t(parts[0]).map_err(torch(op_name))?;
    for p in &parts[1..] {
        let x = t(p).map_err(torch(op_name))?;
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => acc.f_add(&x),
            ReduceOp::Max => acc.f_maximum(&x),
            ReduceOp::Min => acc.f_minimum(&x),
        }
        .map_err(torch(op_name))?;
    }
    if op == ReduceOp::Avg {
        // An integer scalar keeps integer tensors integral (a float one would promote them).
        let w = parts.len() as i64;
        acc = if tensor::is_integral(kind) {
            acc.f_div_scalar_mode(w, "trunc")
        } else {
            acc.f_div_scalar(w as f64)
        }
        .map_err(torch(op_name))?;
    }
    acc.f_copy_data_u8(out, n).map_err(e)
}

impl Communicator for CpuCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn global_ranks(&self) -> &[usize] {
        &self.global
    }

    fn backend(&self) -> Backend {
        Backend::Cpu
    }

    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), CommError> {
        let name = "all_reduce";
        self.run(Op::AllReduce, || {
            let kind = tensor.kind();
            let code = reducible(name, kind)?;
            let mut st = Staged::new(tensor, Device::Cpu, name)?;
            let es = kind.elt_size_in_bytes();
            let chunks = tensor::partition(st.t.numel(), self.world);
            let mine = chunks[self.rank].clone();
            // SAFETY: `st.t` is a contiguous CPU tensor only this function touches meanwhile.
            let data = unsafe { tensor::bytes_mut(&mut st.t) };
            let byte_range = |r: &Range<usize>| r.start * es..r.end * es;

            // Phase 1 (reduce-scatter): rank j owns chunk j and reduces it in rank order.
            let mut scratch: Vec<Vec<u8>> = (0..self.world)
                .map(|j| {
                    if j == self.rank {
                        Vec::new()
                    } else {
                        vec![0u8; mine.len() * es]
                    }
                })
                .collect();
            {
                let sends: Vec<Option<&[u8]>> =
                    chunks.iter().map(|c| Some(&data[byte_range(c)])).collect();
                let mut recvs: Vec<Option<&mut [u8]>> =
                    scratch.iter_mut().map(|v| Some(v.as_mut_slice())).collect();
                self.exchange(Op::AllReduce, code, &sends, &mut recvs)?;
            }
            let own = data[byte_range(&mine)].to_vec();
            let parts: Vec<&[u8]> = (0..self.world)
                .map(|j| {
                    if j == self.rank {
                        own.as_slice()
                    } else {
                        scratch[j].as_slice()
                    }
                })
                .collect();
            reduce_into(name, &parts, kind, op, &mut data[byte_range(&mine)])?;

            // Phase 2 (all-gather of the reduced chunks).
            let mut views = tensor::split_mut(data, &chunks, es);
            let reduced: &[u8] = std::mem::take(&mut views[self.rank]) as &[u8];
            let sends: Vec<Option<&[u8]>> = vec![Some(reduced); self.world];
            let mut recvs: Vec<Option<&mut [u8]>> = views.into_iter().map(Some).collect();
            self.exchange(Op::AllReduce, code, &sends, &mut recvs)?;
            st.finish(tensor, name)
        })
    }

    fn all_gather_into(&self, output: &mut Tensor, input: &Tensor) -> Result<(), CommError> {
        let name = "all_gather";
        self.run(Op::AllGather, || {
            let kind = input.kind();
            let code = wire_kind(name, kind)?;
            tensor::check_same_kind(name, "output", kind, output.kind())?;
            let n = input.numel();
            if output.numel() != n * self.world {
                return Err(CommError::Shape {
                    op: name,
                    what: "output element count".into(),
                    expected: format!("{} (world size {} x input {n})", n * self.world, self.world),
                    found: format!("{} (shape {:?})", output.numel(), output.size()),
                });
            }
            let inp = Staged::new(input, Device::Cpu, name)?;
            let mut out = Staged::new(output, Device::Cpu, name)?;
            let es = kind.elt_size_in_bytes();
            // SAFETY: both are contiguous CPU tensors; `out` is distinct storage from `inp` unless
            // the caller aliased them, which the collective's contract forbids.
            let src = unsafe { tensor::bytes(&inp.t) };
            let dst = unsafe { tensor::bytes_mut(&mut out.t) };
            let blocks: Vec<Range<usize>> = (0..self.world).map(|j| j * n..(j + 1) * n).collect();
            let mut views = tensor::split_mut(dst, &blocks, es);
            views[self.rank].copy_from_slice(src);
            let sends = vec![Some(src); self.world];
            let mut recvs: Vec<Option<&mut [u8]>> = views.into_iter().map(Some).collect();
            self.exchange(Op::AllGather, code, &sends, &mut recvs)?;
            out.finish(output, name)
        })
    }

    fn reduce_scatter(
        &self,
        output: &mut Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let name = "reduce_scatter";
        self.run(Op::ReduceScatter, || {
            let kind = input.kind();
            let code = reducible(name, kind)?;
            tensor::check_same_kind(name, "output", kind, output.kind())?;
            let n = output.numel();
            if input.numel() != n * self.world {
                return Err(CommError::Shape {
                    op: name,
                    what: "input element count".into(),
                    expected: format!(
                        "{} (world size {} x output {n})",
                        n * self.world,
                        self.world
                    ),
                    found: format!("{} (shape {:?})", input.numel(), input.size()),
                });
            }
            let inp = Staged::new(input, Device::Cpu, name)?;
            let mut out = Staged::new(output, Device::Cpu, name)?;
            let es = kind.elt_size_in_bytes();
            // SAFETY: contiguous CPU tensors, distinct storages by the collective's contract.
            let src = unsafe { tensor::bytes(&inp.t) };
            let dst = unsafe { tensor::bytes_mut(&mut out.t) };
            let block = |j: usize| &src[j * n * es..(j + 1) * n * es];
            let mut scratch: Vec<Vec<u8>> = (0..self.world)
                .map(|j| {
                    if j == self.rank {
                        Vec::new()
                    } else {
                        vec![0u8; n * es]
                    }
                })
                .collect();
            {
                let sends: Vec<Option<&[u8]>> = (0..self.world).map(|j| Some(block(j))).collect();
                let mut recvs: Vec<Option<&mut [u8]>> =
                    scratch.iter_mut().map(|v| Some(v.as_mut_slice())).collect();
                self.exchange(Op::ReduceScatter, code, &sends, &mut recvs)?;
            }
            let parts: Vec<&[u8]> = (0..self.world)
                .map(|j| {
                    if j == self.rank {
                        block(j)
                    } else {
                        scratch[j].as_slice()
                    }
                })
                .collect();
            reduce_into(name, &parts, kind, op, dst)?;
            out.finish(output, name)
        })
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<(), CommError> {
        let name = "broadcast";
        self.run(Op::Broadcast, || {
            self.check_rank(name, root)?;
            let code = wire_kind(name, tensor.kind())?;
            let mut st = Staged::new(tensor, Device::Cpu, name)?;
            if self.rank == root {
                // SAFETY: contiguous CPU tensor.
                let data = unsafe { tensor::bytes(&st.t) };
                for s in 1..self.world {
                    self.send_msg(Op::Broadcast, code, (root + s) % self.world, data)?;
                }
                Ok(())
            } else {
                // SAFETY: contiguous CPU tensor.
                let data = unsafe { tensor::bytes_mut(&mut st.t) };
                self.recv_msg(Op::Broadcast, code, root, data)?;
                st.finish(tensor, name)
            }
        })
    }

    fn send(&self, tensor: &Tensor, dst: usize) -> Result<(), CommError> {
        let name = "send";
        self.run(Op::P2p, || {
            self.check_rank(name, dst)?;
            let code = wire_kind(name, tensor.kind())?;
            if dst == self.rank {
                return Err(CommError::InvalidRank {
                    op: name,
                    rank: dst,
                    world_size: self.world,
                });
            }
            let st = Staged::new(tensor, Device::Cpu, name)?;
            // SAFETY: contiguous CPU tensor.
            self.send_msg(Op::P2p, code, dst, unsafe { tensor::bytes(&st.t) })
        })
    }

    fn recv(&self, tensor: &mut Tensor, src: usize) -> Result<(), CommError> {
        let name = "recv";
        self.run(Op::P2p, || {
            self.check_rank(name, src)?;
            let code = wire_kind(name, tensor.kind())?;
            if src == self.rank {
                return Err(CommError::InvalidRank {
                    op: name,
                    rank: src,
                    world_size: self.world,
                });
            }
            let mut st = Staged::new(tensor, Device::Cpu, name)?;
            // SAFETY: contiguous CPU tensor.
            self.recv_msg(Op::P2p, code, src, unsafe { tensor::bytes_mut(&mut st.t) })?;
            st.finish(tensor, name)
        })
    }

    fn send_recv(
        &self,
        send: &Tensor,
        dst: usize,
        recv: &mut Tensor,
        src: usize,
    ) -> Result<(), CommError> {
        let name = "send_recv";
        self.run(Op::P2p, || {
            self.check_rank(name, dst)?;
            self.check_rank(name, src)?;
            for (peer, what) in [(dst, "dst"), (src, "src")] {
                if peer == self.rank {
                    return Err(CommError::Shape {
                        op: name,
                        what: what.into(),
                        expected: "a rank other than this one".into(),
                        found: format!("{peer}"),
                    });
                }
            }
            let send_code = wire_kind(name, send.kind())?;
            let recv_code = wire_kind(name, recv.kind())?;
            let out = Staged::new(send, Device::Cpu, name)?;
            let mut inn = Staged::new(recv, Device::Cpu, name)?;
            // SAFETY: contiguous CPU tensors, distinct storages by contract.
            let out_bytes = unsafe { tensor::bytes(&out.t) };
            let in_bytes = unsafe { tensor::bytes_mut(&mut inn.t) };
            std::thread::scope(|scope| {
                let sender = scope.spawn(|| self.send_msg(Op::P2p, send_code, dst, out_bytes));
                let received = self.recv_msg(Op::P2p, recv_code, src, in_bytes);
                let sent = sender.join().unwrap_or_else(|_| {
                    Err(CommError::Io {
                        op: name,
                        peer: self.global[dst],
                        source: io::Error::other("sender thread panicked"),
                    })
                });
                received.and(sent)
            })?;
            inn.finish(recv, name)
        })
    }

    fn all_to_all_v(
        &self,
        output: &mut Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<(), CommError> {
        let name = "all_to_all";
        self.run(Op::AllToAll, || {
            let kind = input.kind();
            let code = wire_kind(name, kind)?;
            tensor::check_same_kind(name, "output", kind, output.kind())?;
            let (in_rows, in_row) = rows(name, "input", input, input_splits, self.world)?;
            let (out_rows, out_row) = rows(name, "output", output, output_splits, self.world)?;
            if in_rows > 0 && out_rows > 0 && in_row != out_row {
                return Err(CommError::Shape {
                    op: name,
                    what: "elements per row (trailing dims) of output".into(),
                    expected: format!("{in_row} as in input {:?}", input.size()),
                    found: format!("{out_row} in output {:?}", output.size()),
                });
            }
            if input_splits[self.rank] != output_splits[self.rank] {
                return Err(CommError::Shape {
                    op: name,
                    what: format!("output_splits[{}] (this rank's rows to itself)", self.rank),
                    expected: format!("input_splits[{}] = {}", self.rank, input_splits[self.rank]),
                    found: format!("{}", output_splits[self.rank]),
                });
            }
            let row = in_row.max(out_row);
            let ranges = |splits: &[usize]| -> Vec<Range<usize>> {
                let mut start = 0;
                splits
                    .iter()
                    .map(|s| {
                        let r = start * row..(start + s) * row;
                        start += s;
                        r
                    })
                    .collect()
            };
            let inp = Staged::new(input, Device::Cpu, name)?;
            let mut out = Staged::new(output, Device::Cpu, name)?;
            let es = kind.elt_size_in_bytes();
            // SAFETY: contiguous CPU tensors, distinct storages by contract.
            let src = unsafe { tensor::bytes(&inp.t) };
            let dst = unsafe { tensor::bytes_mut(&mut out.t) };
            let in_ranges = ranges(input_splits);
            let sends: Vec<Option<&[u8]>> = in_ranges
                .iter()
                .map(|r| Some(&src[r.start * es..r.end * es]))
                .collect();
            let mut views = tensor::split_mut(dst, &ranges(output_splits), es);
            views[self.rank].copy_from_slice(sends[self.rank].expect("all Some"));
            let mut recvs: Vec<Option<&mut [u8]>> = views.into_iter().map(Some).collect();
            self.exchange(Op::AllToAll, code, &sends, &mut recvs)?;
            out.finish(output, name)
        })
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.run(Op::Barrier, || {
            // Dissemination barrier: after round k every rank has heard (transitively) from 2^k.
            let mut dist = 1;
            while dist < self.world {
                let dst = (self.rank + dist) % self.world;
                let src = (self.rank + self.world - dist) % self.world;
                self.send_msg(Op::Barrier, 0, dst, &[])?;
                self.recv_msg(Op::Barrier, 0, src, &mut [])?;
                dist *= 2;
            }
            Ok(())
        })
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn Communicator>>, CommError> {
        let invalid = |reason: String| CommError::InvalidGroup {
            ranks: ranks.to_vec(),
            reason,
        };
        if ranks.is_empty() {
            return Err(invalid("a group needs at least one rank".into()));
        }
        if let Some(r) = ranks.iter().find(|r| **r >= self.world) {
            return Err(invalid(format!(
                "rank {r} is outside the parent group of {}",
                self.world
            )));
        }
        let mut seen = ranks.to_vec();
        seen.sort_unstable();
        if seen.windows(2).any(|w| w[0] == w[1]) {
            return Err(invalid("ranks repeat".into()));
        }
        let Some(group_rank) = ranks.iter().position(|r| *r == self.rank) else {
            return Ok(None);
        };
        let k = {
            let mut counts = lock(&self.group_counts);
            let c = counts.entry(ranks.to_vec()).or_insert(0);
            *c += 1;
            *c - 1
        };
        let list = ranks
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join("-");
        let prefix = format!("{}/group[{list}]#{k}", self.prefix);
        let global = ranks.iter().map(|r| self.global[*r]).collect();
        let group = CpuCommunicator::connect(
            Arc::clone(&self.store),
            Arc::clone(&self.watch),
            prefix,
            group_rank,
            global,
            self.opts.clone(),
        )?;
        Ok(Some(Box::new(group)))
    }

    fn abort(&self, message: &str) {
        let me = self.global[self.rank];
        *lock(&self.aborted) = Some(message.to_string());
        // Post first, then cut the connections: peers that see the cut find the reason posted.
        let _ = self.store.set_error(me, message);
        for s in &self.sockets {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Validates splits against dim 0 and returns (rows, elements per row).
fn rows(
    op: &'static str,
    what: &str,
    t: &Tensor,
    splits: &[usize],
    world: usize,
) -> Result<(usize, usize), CommError> {
    if splits.len() != world {
        return Err(CommError::Shape {
            op,
            what: format!("{what} splits"),
            expected: format!("{world} entries (one per rank)"),
            found: format!("{} entries", splits.len()),
        });
    }
    if t.dim() == 0 {
        return Err(CommError::Shape {
            op,
            what: format!("{what} rank"),
            expected: "at least one dimension".into(),
            found: "a scalar".into(),
        });
    }
    let n = t.size()[0] as usize;
    let total: usize = splits.iter().sum();
    if total != n {
        return Err(CommError::Shape {
            op,
            what: format!("sum of {what} splits {splits:?}"),
            expected: format!("dim 0 of {what} = {n}"),
            found: format!("{total}"),
        });
    }
    let row = t.numel().checked_div(n).unwrap_or(0);
    Ok((n, row))
}

impl Drop for CpuCommunicator {
    fn drop(&mut self) {
        self.watch.unregister(self.hook);
    }
}

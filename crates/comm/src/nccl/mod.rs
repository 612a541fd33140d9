//! The NCCL backend: collectives on contiguous CUDA tensors of one GPU per rank.
//!
//! Raw `data_ptr()`s go straight to NCCL on the legacy default (null) stream, which orders them
//! with libtorch's default-stream work on the same device: no extra synchronisation is needed
//! between a libtorch op and a collective, in either direction. After
//! [`Communicator::use_own_stream`] they go to a non-blocking stream of the communicator's own
//! instead, ordered after the default stream's queued work by an event; the blocking calls then
//! make the default stream wait for them, and the `_async` ones leave that to their [`Pending`].
//! Every collective of a communicator stays on one stream, in issue order (NCCL needs the same
//! order on every rank). The NCCL unique id travels from group rank 0 through the store.
//!
//! Failure: when any rank posts a failure, the watcher aborts the NCCL communicator
//! (`ncclCommAbort`, which NCCL documents as the way to release kernels stuck on a dead peer),
//! and later calls return [`CommError::PeerFailed`].

mod library;

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::result as dresult;
use cudarc::driver::sys as dsys;
use cudarc::driver::CudaContext;
use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};
use tch::{Device, Kind, Tensor};
use verl_store::StoreClient;

pub use library::{NcclLibrary, NCCL_LIBRARY_VAR};

use crate::tensor::{self, Staged};
use crate::watch::Watch;
use crate::{Backend, CommError, Communicator, Pending, ReduceOp};

const BACKEND: &str = "nccl";

#[derive(Clone, Debug)]
pub struct NcclOptions {
    /// CUDA device ordinal of this rank (usually `LOCAL_RANK`).
    pub device: usize,
    /// Deadline for the rendezvous.
    pub timeout: Duration,
    /// Use this `libnccl.so*` instead of searching ([`NcclLibrary::search_paths`]).
    pub library: Option<PathBuf>,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            device: 0,
            timeout: Duration::from_secs(300),
            library: None,
        }
    }
}

/// Owns one `ncclComm_t`; destroyed on drop, or aborted by the failure watcher.
struct Handle {
    lib: Arc<NcclLibrary>,
    comm: ncclComm_t,
    /// Set once the communicator is destroyed or aborted; guards against a second free.
    dead: AtomicBool,
}

// SAFETY: an NCCL communicator may be used from any thread; calls are serialised by `op_lock` and
// its release is guarded by `dead`.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

impl Handle {
    fn abort(&self) {
        if !self.dead.swap(true, Ordering::SeqCst) {
            // SAFETY: `comm` is live (not yet destroyed or aborted, per `dead`).
            unsafe { (self.lib.api.comm_abort)(self.comm) };
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        if !self.dead.swap(true, Ordering::SeqCst) {
            // SAFETY: as in `abort`.
            unsafe { (self.lib.api.comm_destroy)(self.comm) };
        }
    }
}

/// The NCCL backend of [`Communicator`].
pub struct NcclCommunicator {
    rank: usize,
    world: usize,
    global: Vec<usize>,
    prefix: String,
    store: Arc<StoreClient>,
    watch: Arc<Watch>,
    hook: u64,
    ctx: Arc<CudaContext>,
    device: usize,
    handle: Arc<Handle>,
    op_lock: Mutex<()>,
    timeout: Duration,
    group_counts: Mutex<HashMap<Vec<usize>, usize>>,
    aborted: Mutex<Option<String>>,
    /// The stream collectives run on once [`Communicator::use_own_stream`] was called.
    own: std::sync::OnceLock<OwnStream>,
}

/// Checks that the NVIDIA driver can be loaded and `device` exists, without letting cudarc panic.
pub fn cuda_context(device: usize) -> Result<Arc<CudaContext>, CommError> {
    // SAFETY: only probes whether the driver library can be opened.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CommError::CudaUnavailable {
            reason: "the NVIDIA driver library (libcuda.so.1) cannot be loaded".into(),
        });
    }
    let count = CudaContext::device_count().map_err(|e| CommError::CudaUnavailable {
        reason: format!("cuInit/cuDeviceGetCount failed: {e:?}"),
    })?;
    if device >= count.max(0) as usize {
        return Err(CommError::CudaUnavailable {
            reason: format!("device {device} requested, {count} visible"),
        });
    }
    CudaContext::new(device).map_err(|e| CommError::CudaUnavailable {
        reason: format!("cannot open the primary context of device {device}: {e:?}"),
    })
}

impl NcclCommunicator {
    /// The world communicator, rendezvousing on `store` under `verl-comm/nccl/world`.
    pub fn new(
        store: Arc<StoreClient>,
        rank: usize,
        world_size: usize,
        opts: NcclOptions,
    ) -> Result<NcclCommunicator, CommError> {
        Self::with_prefix(store, "verl-comm/nccl/world", rank, world_size, opts)
    }

    /// As [`NcclCommunicator::new`] under a prefix of the caller's (unique per communicator on
    /// this store), so that several independent world communicators can share one store.
    pub fn with_prefix(
        store: Arc<StoreClient>,
        prefix: &str,
        rank: usize,
        world_size: usize,
        opts: NcclOptions,
    ) -> Result<NcclCommunicator, CommError> {
        if rank >= world_size {
            return Err(CommError::InvalidRank {
                op: "rendezvous",
                rank,
                world_size,
            });
        }
        let lib = match &opts.library {
            Some(p) => Arc::new(NcclLibrary::load_from(std::slice::from_ref(p))?),
            None => NcclLibrary::get()?,
        };
        let ctx = cuda_context(opts.device)?;
        let watch = Watch::start(&store, opts.timeout)?;
        Self::init(
            store,
            watch,
            lib,
            ctx,
            prefix.to_string(),
            rank,
            (0..world_size).collect(),
            opts.timeout,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn init(
        store: Arc<StoreClient>,
        watch: Arc<Watch>,
        lib: Arc<NcclLibrary>,
        ctx: Arc<CudaContext>,
        prefix: String,
        rank: usize,
        global: Vec<usize>,
        timeout: Duration,
    ) -> Result<NcclCommunicator, CommError> {
        let world = global.len();
        store.barrier(&format!("{prefix}/rendezvous"), rank, world, timeout)?;
        let key = format!("{prefix}/nccl_unique_id");
        let id = if rank == 0 {
            let mut id = ncclUniqueId { internal: [0; 128] };
            // SAFETY: `id` is a valid out-pointer.
            lib.check("ncclGetUniqueId", unsafe {
                (lib.api.get_unique_id)(&mut id)
            })?;
            let bytes: Vec<u8> = id.internal.iter().map(|c| *c as u8).collect();
            store.set(&key, &bytes)?;
            id
        } else {
            let bytes = store.get(&key, timeout)?;
            if bytes.len() != 128 {
                return Err(CommError::Shape {
                    op: "rendezvous",
                    what: format!("store key `{key}`"),
                    expected: "128 bytes (an ncclUniqueId)".into(),
                    found: format!("{} bytes", bytes.len()),
                });
            }
            let mut id = ncclUniqueId { internal: [0; 128] };
            for (d, s) in id.internal.iter_mut().zip(&bytes) {
                *d = *s as _;
            }
            id
        };
        ctx.bind_to_thread()
            .map_err(|e| CommError::CudaUnavailable {
                reason: format!("cannot make device {} current: {e:?}", ctx.ordinal()),
            })?;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the id is the group's.
        let code =
            unsafe { (lib.api.comm_init_rank)(&mut comm, world as c_int, id, rank as c_int) };
        lib.check("ncclCommInitRank", code)?;
        let handle = Arc::new(Handle {
            lib,
            comm,
            dead: AtomicBool::new(false),
        });
        let for_hook = Arc::clone(&handle);
        let hook = watch.register(Box::new(move || for_hook.abort()));
        let device = ctx.ordinal();
        Ok(NcclCommunicator {
            rank,
            world,
            global,
            prefix,
            store,
            watch,
            hook,
            ctx,
            device,
            handle,
            op_lock: Mutex::new(()),
            timeout,
            group_counts: Mutex::new(HashMap::new()),
            aborted: Mutex::new(None),
            own: std::sync::OnceLock::new(),
        })
    }

    /// The CUDA device this communicator works on.
    pub fn device(&self) -> Device {
        Device::Cuda(self.device)
    }

    /// The loaded NCCL library.
    pub fn library(&self) -> &NcclLibrary {
        &self.handle.lib
    }

    /// Waits for all work queued on this device (collectives included) and reports an
    /// asynchronous NCCL error if one occurred.
    pub fn synchronize(&self) -> Result<(), CommError> {
        self.ctx
            .synchronize()
            .map_err(|e| CommError::CudaUnavailable {
                reason: format!("synchronize device {}: {e:?}", self.device),
            })?;
        self.enqueue("ncclCommGetAsyncError", |api, comm, _| {
            let mut async_err: c_int = 0;
            // SAFETY: valid out-pointer, live comm.
            let code = unsafe { (api.comm_get_async_error)(comm, &mut async_err) };
            if code != 0 {
                code
            } else {
                async_err
            }
        })
    }

    fn stage(&self, op: &'static str, t: &Tensor) -> Result<Staged, CommError> {
        if t.device() != self.device() {
            return Err(CommError::WrongDevice {
                op,
                expected: format!("{:?}", self.device()),
                found: format!("{:?}", t.device()),
            });
        }
        Staged::new(t, self.device(), op)
    }

    /// Runs NCCL calls for one operation: refuses on a broken group, makes the device current,
    /// serialises with other calls on this communicator, and posts a failure on error. `f` gets
    /// the stream to queue on: the legacy default stream, or the communicator's own stream
    /// ([`Communicator::use_own_stream`]), which first waits for the default stream's queued
    /// work; the default stream then waits for the call.
    fn enqueue(
        &self,
        op: &'static str,
        f: impl FnOnce(&library::Api, ncclComm_t, cudaStream_t) -> c_int,
    ) -> Result<(), CommError> {
        self.enqueue_on(op, f, false).map(|_| ())
    }

    /// [`NcclCommunicator::enqueue`]; with `keep_running` and the own stream, the default stream
    /// does not wait: an event recorded after the call is returned instead.
    fn enqueue_on(
        &self,
        op: &'static str,
        f: impl FnOnce(&library::Api, ncclComm_t, cudaStream_t) -> c_int,
        keep_running: bool,
    ) -> Result<Option<dsys::CUevent>, CommError> {
        if let Some(message) = self
            .aborted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Err(CommError::Aborted {
                rank: self.global[self.rank],
                message,
            });
        }
        let _guard = self.op_lock.lock().unwrap_or_else(|e| e.into_inner());
        if self.handle.dead.load(Ordering::SeqCst) {
            let (rank, message) = self
                .watch
                .failure()
                .unwrap_or((self.global[self.rank], "communicator already closed".into()));
            return Err(CommError::PeerFailed { rank, message });
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| CommError::CudaUnavailable {
                reason: format!("cannot make device {} current: {e:?}", self.device),
            })?;
        let own = self.own.get().map(|s| s.stream);
        if let Some(s) = own {
            order_after(s, dresult::stream::null())?;
        }
        let stream = own.unwrap_or(dresult::stream::null()) as cudaStream_t;
        let code = f(&self.handle.lib.api, self.handle.comm, stream);
        let res = self.handle.lib.check(op, code);
        if let Err(e) = &res {
            let me = self.global[self.rank];
            let _ = self.store.set_error(me, &format!("{op} on rank {me}: {e}"));
        }
        res?;
        match own {
            None => Ok(None),
            Some(s) if keep_running => {
                let ev = dresult::event::create(dsys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|e| cuda_error("cuEventCreate", e))?;
                // SAFETY: a live event and the communicator's live stream.
                if let Err(e) = unsafe { dresult::event::record(ev, s) } {
                    // SAFETY: created above, destroyed once.
                    let _ = unsafe { dresult::event::destroy(ev) };
                    return Err(cuda_error("cuEventRecord", e));
                }
                Ok(Some(ev))
            }
            Some(s) => {
                order_after(dresult::stream::null(), s)?;
                Ok(None)
            }
        }
    }

    /// Checks and queues an all-gather (see [`Communicator::all_gather_into`]).
    fn all_gather_staged(
        &self,
        output: &Tensor,
        input: &Tensor,
        keep_running: bool,
    ) -> Result<(Staged, Staged, Option<dsys::CUevent>), CommError> {
        let name = "ncclAllGather";
        let dt = dtype(name, input.kind(), false)?;
        tensor::check_same_kind(name, "output", input.kind(), output.kind())?;
        let n = input.numel();
        if output.numel() != n * self.world {
            return Err(CommError::Shape {
                op: name,
                what: "output element count".into(),
                expected: format!("{} (world size {} x input {n})", n * self.world, self.world),
                found: format!("{} (shape {:?})", output.numel(), output.size()),
            });
        }
        let inp = self.stage(name, input)?;
        let out = self.stage(name, output)?;
        let (src, dst) = (ptr(&inp.t), ptr(&out.t));
        let keep_running = keep_running && !out.copied();
        let ev = self.enqueue_on(
            name,
            |api, comm, stream| unsafe {
                // SAFETY: sizes checked above; both tensors live and contiguous on this device.
                (api.all_gather)(src, dst, n, dt, comm, stream)
            },
            keep_running,
        )?;
        Ok((inp, out, ev))
    }

    /// Checks and queues a reduce-scatter (see [`Communicator::reduce_scatter`]).
    fn reduce_scatter_staged(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
        keep_running: bool,
    ) -> Result<(Staged, Staged, Option<dsys::CUevent>), CommError> {
        let name = "ncclReduceScatter";
        let dt = dtype(name, input.kind(), true)?;
        tensor::check_same_kind(name, "output", input.kind(), output.kind())?;
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
        let inp = self.stage(name, input)?;
        let out = self.stage(name, output)?;
        let (src, dst) = (ptr(&inp.t), ptr(&out.t));
        let keep_running = keep_running && !out.copied();
        let ev = self.enqueue_on(
            name,
            |api, comm, stream| unsafe {
                // SAFETY: sizes checked above.
                (api.reduce_scatter)(src, dst, n, dt, red_op(op), comm, stream)
            },
            keep_running,
        )?;
        Ok((inp, out, ev))
    }

    /// The `_async` collectives' result: a [`Pending`] holding the event and both tensors, or a
    /// completed one where the call ran on the default stream (or staged its output).
    fn pending(
        &self,
        name: &'static str,
        (inp, out, ev): (Staged, Staged, Option<dsys::CUevent>),
        output: &Tensor,
    ) -> Result<Pending, CommError> {
        match ev {
            Some(ev) => Ok(Pending::on_device(ev, self.ctx.clone(), vec![inp.t, out.t])),
            None => {
                out.finish(&mut output.shallow_clone(), name)?;
                Ok(Pending::done())
            }
        }
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

fn dtype(op: &'static str, kind: Kind, reduction: bool) -> Result<u32, CommError> {
    use ncclDataType_t as D;
    let d = match kind {
        Kind::Float => D::ncclFloat32,
        Kind::Double => D::ncclFloat64,
        Kind::Half => D::ncclFloat16,
        Kind::BFloat16 => D::ncclBfloat16,
        Kind::Int64 => D::ncclInt64,
        Kind::Int => D::ncclInt32,
        Kind::Int8 => D::ncclInt8,
        Kind::Uint8 => D::ncclUint8,
        // Moved as bytes; a sum of bools has no NCCL meaning.
        Kind::Bool if !reduction => D::ncclUint8,
        _ => {
            return Err(CommError::UnsupportedDtype {
                op,
                backend: BACKEND,
                kind: format!("{kind:?}"),
                for_reduction: reduction,
            })
        }
    };
    Ok(d as u32)
}

fn red_op(op: ReduceOp) -> u32 {
    (match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
    }) as u32
}

fn ptr(t: &Tensor) -> *mut c_void {
    t.data_ptr()
}

/// `ptr + elements * elt_size`, for slices of a contiguous tensor.
fn offset(t: &Tensor, elements: usize) -> *mut c_void {
    // SAFETY: callers stay within the tensor's storage (offsets derived from its splits).
    unsafe { (t.data_ptr() as *mut u8).add(elements * t.kind().elt_size_in_bytes()) as *mut c_void }
}

/// Makes `waiter` wait (on the device) for the work queued so far on `source`.
fn order_after(waiter: dsys::CUstream, source: dsys::CUstream) -> Result<(), CommError> {
    let ev = dresult::event::create(dsys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        .map_err(|e| cuda_error("cuEventCreate", e))?;
    // SAFETY: a live event and live streams; the event is destroyed once, after the wait was
    // queued (the driver keeps it until the wait is done).
    let res = unsafe {
        dresult::event::record(ev, source)
            .and_then(|()| {
                dresult::stream::wait_event(
                    waiter,
                    ev,
                    dsys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            })
            .map_err(|e| cuda_error("cuEventRecord / cuStreamWaitEvent", e))
    };
    // SAFETY: see above.
    let _ = unsafe { dresult::event::destroy(ev) };
    res
}

fn cuda_error(what: &str, e: dresult::DriverError) -> CommError {
    CommError::CudaUnavailable {
        reason: format!("{what}: {e:?}"),
    }
}

/// A communicator's own stream ([`Communicator::use_own_stream`]), destroyed with it.
struct OwnStream {
    stream: dsys::CUstream,
}

// SAFETY: a CUDA stream handle may be used from any thread.
unsafe impl Send for OwnStream {}
unsafe impl Sync for OwnStream {}

impl Drop for OwnStream {
    fn drop(&mut self) {
        // SAFETY: the communicator's stream, destroyed once, after its work.
        unsafe {
            let _ = dresult::stream::synchronize(self.stream);
            let _ = dresult::stream::destroy(self.stream);
        }
    }
}

impl Communicator for NcclCommunicator {
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
        Backend::Nccl
    }

    fn all_reduce(&self, t: &mut Tensor, op: ReduceOp) -> Result<(), CommError> {
        let name = "ncclAllReduce";
        let dt = dtype(name, t.kind(), true)?;
        let st = self.stage(name, t)?;
        let p = ptr(&st.t);
        self.enqueue(name, |api, comm, stream| unsafe {
            // SAFETY: `p` addresses `numel` elements of a live contiguous CUDA tensor.
            (api.all_reduce)(p, p, st.t.numel(), dt, red_op(op), comm, stream)
        })?;
        st.finish(t, name)
    }

    fn all_gather_into(&self, output: &mut Tensor, input: &Tensor) -> Result<(), CommError> {
        let (_inp, out, _) = self.all_gather_staged(output, input, false)?;
        out.finish(output, "ncclAllGather")
    }

    fn reduce_scatter(
        &self,
        output: &mut Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let (_inp, out, _) = self.reduce_scatter_staged(output, input, op, false)?;
        out.finish(output, "ncclReduceScatter")
    }

    fn use_own_stream(&self) -> Result<bool, CommError> {
        let _guard = self.op_lock.lock().unwrap_or_else(|e| e.into_inner());
        if self.own.get().is_some() {
            return Ok(true);
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error("make the device current", e))?;
        // Non-blocking: no implicit synchronisation with the legacy default stream (libtorch's),
        // only the events `enqueue_on` records.
        let stream = dresult::stream::create(dresult::stream::StreamKind::NonBlocking)
            .map_err(|e| cuda_error("cuStreamCreate", e))?;
        let _ = self.own.set(OwnStream { stream });
        Ok(true)
    }

    fn all_gather_into_async(&self, output: &Tensor, input: &Tensor) -> Result<Pending, CommError> {
        let staged = self.all_gather_staged(output, input, true)?;
        self.pending("ncclAllGather", staged, output)
    }

    fn reduce_scatter_async(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<Pending, CommError> {
        let staged = self.reduce_scatter_staged(output, input, op, true)?;
        self.pending("ncclReduceScatter", staged, output)
    }

    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), CommError> {
        let name = "ncclBroadcast";
        self.check_rank(name, root)?;
        let dt = dtype(name, t.kind(), false)?;
        let st = self.stage(name, t)?;
        let p = ptr(&st.t);
        self.enqueue(name, |api, comm, stream| unsafe {
            // SAFETY: in-place broadcast over a live contiguous tensor.
            (api.broadcast)(p, p, st.t.numel(), dt, root as c_int, comm, stream)
        })?;
        st.finish(t, name)
    }

    fn send(&self, t: &Tensor, dst: usize) -> Result<(), CommError> {
        let name = "ncclSend";
        self.check_rank(name, dst)?;
        let dt = dtype(name, t.kind(), false)?;
        let st = self.stage(name, t)?;
        let p = ptr(&st.t);
        self.enqueue(name, |api, comm, stream| unsafe {
            // SAFETY: live contiguous tensor.
            (api.send)(p, st.t.numel(), dt, dst as c_int, comm, stream)
        })
    }

    fn recv(&self, t: &mut Tensor, src: usize) -> Result<(), CommError> {
        let name = "ncclRecv";
        self.check_rank(name, src)?;
        let dt = dtype(name, t.kind(), false)?;
        let st = self.stage(name, t)?;
        let p = ptr(&st.t);
        self.enqueue(name, |api, comm, stream| unsafe {
            // SAFETY: live contiguous tensor.
            (api.recv)(p, st.t.numel(), dt, src as c_int, comm, stream)
        })?;
        st.finish(t, name)
    }

    fn send_recv(
        &self,
        send: &Tensor,
        dst: usize,
        recv: &mut Tensor,
        src: usize,
    ) -> Result<(), CommError> {
        let name = "ncclSend/ncclRecv";
        self.check_rank(name, dst)?;
        self.check_rank(name, src)?;
        let sdt = dtype(name, send.kind(), false)?;
        let rdt = dtype(name, recv.kind(), false)?;
        let out = self.stage(name, send)?;
        let inn = self.stage(name, recv)?;
        let (sp, rp) = (ptr(&out.t), ptr(&inn.t));
        let (sn, rn) = (out.t.numel(), inn.t.numel());
        self.enqueue(name, |api, comm, stream| unsafe {
            // SAFETY: live contiguous tensors; the group makes the pair one fused operation.
            let mut code = (api.group_start)();
            if code == 0 {
                code = (api.send)(sp, sn, sdt, dst as c_int, comm, stream);
                let c2 = (api.recv)(rp, rn, rdt, src as c_int, comm, stream);
                let c3 = (api.group_end)();
                code = [code, c2, c3].into_iter().find(|c| *c != 0).unwrap_or(0);
            }
            code
        })?;
        inn.finish(recv, name)
    }

    fn all_to_all_v(
        &self,
        output: &mut Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<(), CommError> {
        let name = "all_to_all (ncclSend/ncclRecv)";
        let dt = dtype(name, input.kind(), false)?;
        tensor::check_same_kind(name, "output", input.kind(), output.kind())?;
        let row_of = |t: &Tensor, splits: &[usize], what: &str| -> Result<usize, CommError> {
            let n = t.size().first().copied().unwrap_or(0) as usize;
            if splits.len() != self.world || t.dim() == 0 || splits.iter().sum::<usize>() != n {
                return Err(CommError::Shape {
                    op: name,
                    what: format!("{what} splits {splits:?}"),
                    expected: format!("{} entries summing to dim 0", self.world),
                    found: format!("shape {:?}", t.size()),
                });
            }
            Ok(t.numel().checked_div(n).unwrap_or(0))
        };
        let in_row = row_of(input, input_splits, "input")?;
        let out_row = row_of(output, output_splits, "output")?;
        if in_row != 0 && out_row != 0 && in_row != out_row {
            return Err(CommError::Shape {
                op: name,
                what: "elements per row of output".into(),
                expected: format!("{in_row}"),
                found: format!("{out_row}"),
            });
        }
        let row = in_row.max(out_row);
        let inp = self.stage(name, input)?;
        let out = self.stage(name, output)?;
        let offsets = |splits: &[usize]| -> Vec<usize> {
            splits
                .iter()
                .scan(0, |acc, s| {
                    let o = *acc;
                    *acc += s;
                    Some(o)
                })
                .collect()
        };
        let (in_off, out_off) = (offsets(input_splits), offsets(output_splits));
        self.enqueue(name, |api, comm, stream| unsafe {
            // SAFETY: offsets and counts come from splits validated against the shapes.
            let mut code = (api.group_start)();
            if code != 0 {
                return code;
            }
            for j in 0..self.world {
                let c = (api.send)(
                    offset(&inp.t, in_off[j] * row),
                    input_splits[j] * row,
                    dt,
                    j as c_int,
                    comm,
                    stream,
                );
                let d = (api.recv)(
                    offset(&out.t, out_off[j] * row),
                    output_splits[j] * row,
                    dt,
                    j as c_int,
                    comm,
                    stream,
                );
                if code == 0 {
                    code = if c != 0 { c } else { d };
                }
            }
            let end = (api.group_end)();
            if code == 0 {
                end
            } else {
                code
            }
        })?;
        out.finish(output, name)
    }

    fn barrier(&self) -> Result<(), CommError> {
        let mut t = Tensor::f_zeros([1], (Kind::Int, self.device()))
            .map_err(crate::error::torch("barrier"))?;
        self.all_reduce(&mut t, ReduceOp::Sum)?;
        self.synchronize()
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn Communicator>>, CommError> {
        let invalid = |reason: String| CommError::InvalidGroup {
            ranks: ranks.to_vec(),
            reason,
        };
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        if ranks.is_empty()
            || sorted.windows(2).any(|w| w[0] == w[1])
            || sorted.last().is_some_and(|r| *r >= self.world)
        {
            return Err(invalid(format!(
                "needs distinct ranks below the parent group size {}",
                self.world
            )));
        }
        let Some(group_rank) = ranks.iter().position(|r| *r == self.rank) else {
            return Ok(None);
        };
        let k = {
            let mut counts = self.group_counts.lock().unwrap_or_else(|e| e.into_inner());
            let c = counts.entry(ranks.to_vec()).or_insert(0);
            *c += 1;
            *c - 1
        };
        let list = ranks
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join("-");
        let group = NcclCommunicator::init(
            Arc::clone(&self.store),
            Arc::clone(&self.watch),
            Arc::clone(&self.handle.lib),
            Arc::clone(&self.ctx),
            format!("{}/group[{list}]#{k}", self.prefix),
            group_rank,
            ranks.iter().map(|r| self.global[*r]).collect(),
            self.timeout,
        )?;
        Ok(Some(Box::new(group)))
    }

    fn abort(&self, message: &str) {
        let me = self.global[self.rank];
        *self.aborted.lock().unwrap_or_else(|e| e.into_inner()) = Some(message.to_string());
        let _ = self.store.set_error(me, message);
        self.handle.abort();
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        self.watch.unregister(self.hook);
    }
}

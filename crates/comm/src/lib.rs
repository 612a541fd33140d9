//! Collective communication between the ranks of an SPMD job, over tch tensors: one
//! [`Communicator`] trait with a CPU backend (TCP full mesh, bit-deterministic reductions in rank
//! order, so multi-rank parity tests run in CI) and an NCCL backend for CUDA tensors.
//!
//! It owns the data path between ranks and the failure semantics (one failing rank ends all
//! ranks with its error, no hangs). It must not own rendezvous metadata (that is `verl-store`)
//! or know anything about models, parameters or parallel layouts (that is the backends').

mod cpu;
mod error;
pub mod nccl;
mod pending;
mod tensor;
mod watch;

use std::sync::Arc;
use std::time::Duration;

pub use cpu::{CpuCommunicator, CpuOptions};
pub use error::CommError;
pub use nccl::{NcclCommunicator, NcclLibrary, NcclOptions};
pub use pending::Pending;
pub use verl_store::{DistEnv, StoreClient, StoreError, StoreServer, EXTERNAL_STORE_VAR};

use tch::Tensor;

/// How `all_reduce` and `reduce_scatter` combine the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the group size (truncating for integer dtypes).
    Avg,
    Max,
    Min,
}

/// Which implementation is behind a [`Communicator`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    Cpu,
    Nccl,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Nccl => "nccl",
        }
    }
}

/// A group of ranks that run the same sequence of collectives (SPMD).
///
/// Every member must call every collective of the group in the same order with consistent
/// arguments; a rank that fails (an `Err` here, [`Communicator::abort`], or a crash) makes the
/// pending and later collectives of every rank fail with [`CommError::PeerFailed`] naming it.
///
/// Layout conventions: "flat" means the tensor's elements in row-major order, whatever its shape.
/// Tensors need not be contiguous (they are staged), but must be on the backend's device (CPU
/// backend: any device, staged through host memory; NCCL: the communicator's GPU).
pub trait Communicator: Send + Sync {
    /// This rank's index in the group, `0..world_size()`.
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// The world (global) rank of each group member, indexed by group rank.
    fn global_ranks(&self) -> &[usize];
    fn backend(&self) -> Backend;

    /// Reduces `tensor` over the group, in place, on every rank.
    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), CommError>;

    /// Gathers every rank's `input` (same shape and dtype on all ranks) into `output`, rank-major:
    /// `output` holds `world_size * input.numel()` elements, rank `r`'s block at `r * numel`.
    fn all_gather_into(&self, output: &mut Tensor, input: &Tensor) -> Result<(), CommError>;

    /// Every rank's `input`, indexed by group rank.
    fn all_gather(&self, input: &Tensor) -> Result<Vec<Tensor>, CommError> {
        let op = "all_gather";
        let w = self.world_size() as i64;
        let mut flat = Tensor::f_empty([w * input.numel() as i64], (input.kind(), input.device()))
            .map_err(error::torch(op))?;
        self.all_gather_into(&mut flat, input)?;
        let size = input.size();
        flat.f_chunk(w, 0)
            .map_err(error::torch(op))?
            .into_iter()
            .map(|c| c.f_view(size.as_slice()).map_err(error::torch(op)))
            .collect()
    }

    /// Reduces `input` (`world_size * output.numel()` elements) over the group and leaves block
    /// `rank` of the result (flat, rank-major) in `output`.
    fn reduce_scatter(
        &self,
        output: &mut Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<(), CommError>;

    /// Routes this communicator's collectives through a device stream of its own, from now on,
    /// so that the `_async` collectives can run while compute queued on the default stream does
    /// (every collective is still ordered after the default-stream work queued before it, and the
    /// blocking ones before the work queued after them). Returns whether it did; backends without
    /// device streams return `false` and their `_async` collectives complete before returning.
    fn use_own_stream(&self) -> Result<bool, CommError> {
        Ok(false)
    }

    /// [`Communicator::all_gather_into`] that may still be running when it returns: `output`
    /// must not be read, nor `input` written, before the [`Pending`] is waited for (see there).
    fn all_gather_into_async(&self, output: &Tensor, input: &Tensor) -> Result<Pending, CommError> {
        self.all_gather_into(&mut output.shallow_clone(), input)?;
        Ok(Pending::done())
    }

    /// [`Communicator::reduce_scatter`] that may still be running when it returns, as
    /// [`Communicator::all_gather_into_async`].
    fn reduce_scatter_async(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<Pending, CommError> {
        self.reduce_scatter(&mut output.shallow_clone(), input, op)?;
        Ok(Pending::done())
    }

    /// Copies `root`'s `tensor` into `tensor` on every rank.
    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<(), CommError>;

    /// Sends `tensor` to group rank `dst`, which must call [`Communicator::recv`] with a tensor of
    /// the same dtype and element count. May block until `dst` receives.
    fn send(&self, tensor: &Tensor, dst: usize) -> Result<(), CommError>;
    fn recv(&self, tensor: &mut Tensor, src: usize) -> Result<(), CommError>;

    /// Sends to `dst` and receives from `src` at once: the deadlock-free form of the exchange of
    /// pipeline stages (both neighbours sending before receiving).
    fn send_recv(
        &self,
        send: &Tensor,
        dst: usize,
        recv: &mut Tensor,
        src: usize,
    ) -> Result<(), CommError>;

    /// All-to-all with unequal splits along dim 0: `input_splits[j]` rows of `input` go to rank
    /// `j`, `output_splits[j]` rows of `output` come from rank `j`, in rank order. Rows are the
    /// trailing dims and must have the same element count in `input` and `output`.
    fn all_to_all_v(
        &self,
        output: &mut Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<(), CommError>;

    /// All-to-all with equal splits: dim 0 of `input` and `output` is `world_size * k`; block `j`
    /// of `input` goes to rank `j`, block `j` of `output` comes from rank `j`.
    fn all_to_all(&self, output: &mut Tensor, input: &Tensor) -> Result<(), CommError> {
        let op = "all_to_all";
        let w = self.world_size();
        let rows = |t: &Tensor, what: &str| -> Result<usize, CommError> {
            let n = t.size().first().copied().unwrap_or(0) as usize;
            if t.dim() == 0 || n % w != 0 {
                return Err(CommError::Shape {
                    op,
                    what: format!("dim 0 of {what}"),
                    expected: format!("a multiple of the group size {w}"),
                    found: format!("shape {:?}", t.size()),
                });
            }
            Ok(n / w)
        };
        let (i, o) = (rows(input, "input")?, rows(output, "output")?);
        self.all_to_all_v(output, input, &vec![o; w], &vec![i; w])
    }

    /// Returns when every member has entered the barrier.
    fn barrier(&self) -> Result<(), CommError>;

    /// A communicator over the group ranks `ranks` (in that order: member `i` gets group rank
    /// `i`), with its own connections and rendezvous prefix. Only the members need to call it,
    /// each with the same list; a non-member gets `Ok(None)`. Creating the same list again makes
    /// a new, independent group.
    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn Communicator>>, CommError>;

    /// Declares this rank failed: posts `message` through the store so every other rank's
    /// collectives stop with [`CommError::PeerFailed`], and makes this communicator unusable.
    fn abort(&self, message: &str);
}

/// A joined SPMD job: the store (and its server on rank 0), the environment and the world
/// communicator. Keep it alive for the whole job; dropping it on rank 0 stops the store.
pub struct Dist {
    pub env: DistEnv,
    pub store: Arc<StoreClient>,
    pub server: Option<StoreServer>,
    pub comm: Box<dyn Communicator>,
}

/// Joins the job described by the torchrun environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
/// `MASTER_ADDR`, `MASTER_PORT`) with the given backend. NCCL uses GPU `LOCAL_RANK`.
pub fn init_from_env(backend: Backend, timeout: Duration) -> Result<Dist, CommError> {
    let env = DistEnv::from_env()?;
    let (server, store) = env.join(timeout)?;
    let store = Arc::new(store);
    let comm: Box<dyn Communicator> = match backend {
        Backend::Cpu => Box::new(CpuCommunicator::new(
            Arc::clone(&store),
            env.rank,
            env.world_size,
            CpuOptions {
                timeout,
                ..CpuOptions::default()
            },
        )?),
        Backend::Nccl => Box::new(NcclCommunicator::new(
            Arc::clone(&store),
            env.rank,
            env.world_size,
            NcclOptions {
                device: env.local_rank,
                timeout,
                ..NcclOptions::default()
            },
        )?),
    };
    Ok(Dist {
        env,
        store,
        server,
        comm,
    })
}

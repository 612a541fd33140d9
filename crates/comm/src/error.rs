use std::path::PathBuf;
use std::time::Duration;

use verl_store::StoreError;

/// Everything a collective can fail with. Ranks are global ranks (the world's numbering) even
/// inside a sub-group, so a message means the same thing on every rank.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// Another rank failed (posted through the store's failure broadcast, or lost): this rank
    /// stopped instead of waiting for it.
    #[error("rank {rank} failed: {message}")]
    PeerFailed { rank: usize, message: String },

    #[error(transparent)]
    Store(StoreError),

    #[error("{op}: connection to rank {peer} failed: {source}")]
    Io {
        op: &'static str,
        peer: usize,
        #[source]
        source: std::io::Error,
    },

    #[error("{op}: rank {peer} sent nothing for {}s (op timeout)", .after.as_secs_f64())]
    Timeout {
        op: &'static str,
        peer: usize,
        after: Duration,
    },

    /// Two ranks called different collectives, or the same one with different sizes.
    #[error(
        "{op}: rank {peer} sent {found}, expected {expected} (ranks called mismatched collectives)"
    )]
    Mismatch {
        op: &'static str,
        peer: usize,
        expected: String,
        found: String,
    },

    /// An argument is inconsistent with the others or with the group (shapes, split sizes).
    #[error("{op}: {what}: expected {expected}, found {found}")]
    Shape {
        op: &'static str,
        what: String,
        expected: String,
        found: String,
    },

    #[error("{op}: dtype {kind} is not supported by the {backend} backend{}", if *.for_reduction { " for reductions" } else { "" })]
    UnsupportedDtype {
        op: &'static str,
        backend: &'static str,
        kind: String,
        for_reduction: bool,
    },

    #[error("{op}: rank {rank} is outside the group of {world_size}")]
    InvalidRank {
        op: &'static str,
        rank: usize,
        world_size: usize,
    },

    #[error("new_group({ranks:?}): {reason}")]
    InvalidGroup { ranks: Vec<usize>, reason: String },

    #[error("{op}: tensor on {found}, but this communicator works on {expected}")]
    WrongDevice {
        op: &'static str,
        expected: String,
        found: String,
    },

    #[error("{op}: libtorch: {source}")]
    Torch {
        op: &'static str,
        #[source]
        source: tch::TchError,
    },

    /// No usable NCCL library: every place looked at is listed, with what was found there.
    #[error("NCCL is unavailable: {reason}; searched: {}", .searched.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "))]
    NcclUnavailable {
        searched: Vec<PathBuf>,
        reason: String,
    },

    #[error("CUDA is unavailable: {reason}")]
    CudaUnavailable { reason: String },

    #[error("{op}: NCCL error {code} ({message})")]
    Nccl {
        op: &'static str,
        code: i32,
        message: String,
    },

    /// This communicator was aborted locally with [`crate::Communicator::abort`].
    #[error("communicator aborted by this rank ({rank}): {message}")]
    Aborted { rank: usize, message: String },
}

impl From<StoreError> for CommError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::RankFailed { rank, message } => CommError::PeerFailed { rank, message },
            other => CommError::Store(other),
        }
    }
}

pub(crate) fn torch(op: &'static str) -> impl FnOnce(tch::TchError) -> CommError {
    move |source| CommError::Torch { op, source }
}

//! The host's own collectives over the rendezvous store.
//!
//! The host never links libtorch, so it cannot use the backend's communicator; what it needs
//! across ranks is small (a step's metric inputs, validation rows, a few sums for whitening and
//! the KL controller), and the TCP store carries that fine. Every collective is keyed by a round
//! counter that all ranks advance in lockstep, so calls must happen in the same order on every
//! rank (as with any collective). Keys of a finished round are deleted by the last rank to read
//! them, so a long run does not grow the store.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use verl_algos::CrossRankSum;
use verl_store::{StoreClient, StoreError};

/// Key prefix of the host's collectives; backends use their own prefixes on the same store.
const PREFIX: &str = "verl/host";

/// What went wrong in a host collective.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    #[error("rank {rank} of {world_size}: host collective `{op}` (round {round}): {source}")]
    Store {
        rank: usize,
        world_size: usize,
        op: &'static str,
        round: u64,
        #[source]
        source: Box<StoreError>,
    },
    #[error("rank {rank} of {world_size}: host collective `{op}` (round {round}): rank {from} sent {found}, expected {expected}")]
    Payload {
        rank: usize,
        world_size: usize,
        op: &'static str,
        round: u64,
        from: usize,
        expected: String,
        found: String,
    },
}

impl DistError {
    /// The store error underneath, when there is one (a peer's failure broadcast, say).
    pub fn store_error(&self) -> Option<&StoreError> {
        match self {
            DistError::Store { source, .. } => Some(source.as_ref()),
            DistError::Payload { .. } => None,
        }
    }
}

/// How [`HostGroup::all_reduce_f64`] combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
}

/// This process's membership in an SPMD job, with collectives over the store.
pub struct HostGroup {
    client: Arc<StoreClient>,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    round: AtomicU64,
    /// Per rank: whether it holds its own slice of the data. Model-parallel peers (tensor or
    /// pipeline ranks of one data-parallel replica) hold copies; only one of them counts.
    data_ranks: std::sync::RwLock<Option<Vec<bool>>>,
}

impl std::fmt::Debug for HostGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("store", &self.client.server_addr())
            .finish()
    }
}

impl HostGroup {
    /// `client` must be connected as `rank`; `timeout` bounds how long a collective waits for
    /// the slowest rank (a failed rank ends the wait at once through the failure broadcast).
    pub fn new(
        client: Arc<StoreClient>,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Self {
        HostGroup {
            client,
            rank,
            world_size: world_size.max(1),
            timeout,
            round: AtomicU64::new(0),
            data_ranks: std::sync::RwLock::new(None),
        }
    }

    /// Declares which ranks hold distinct data (`mask[r]`), the others being model-parallel
    /// copies of one of them. From then on every gather returns only those ranks' parts (in
    /// rank order) and every reduction counts each data slice once, so batch-wide statistics
    /// equal a pure data-parallel run's. Barriers still wait for every rank. Every rank must
    /// declare the same mask, with at least one rank set.
    pub fn set_data_ranks(&self, mask: Vec<bool>) -> Result<(), DistError> {
        if mask.len() != self.world_size || !mask.iter().any(|&m| m) {
            return Err(DistError::Payload {
                rank: self.rank,
                world_size: self.world_size,
                op: "set_data_ranks",
                round: self.round.load(Ordering::Relaxed),
                from: self.rank,
                expected: format!("{} flags with at least one set", self.world_size),
                found: format!("{mask:?}"),
            });
        }
        *self.data_ranks.write().unwrap_or_else(|e| e.into_inner()) = if mask.iter().all(|&m| m) {
            None
        } else {
            Some(mask)
        };
        Ok(())
    }

    /// Whether this rank's data counts in gathers and reductions (see [`Self::set_data_ranks`]).
    pub fn holds_data(&self) -> bool {
        self.data_ranks
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_none_or(|m| m[self.rank])
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    pub fn client(&self) -> &StoreClient {
        &self.client
    }

    fn store_err(&self, op: &'static str, round: u64) -> impl FnOnce(StoreError) -> DistError {
        let (rank, world_size) = (self.rank, self.world_size);
        move |source| DistError::Store {
            rank,
            world_size,
            op,
            round,
            source: Box::new(source),
        }
    }

    /// Waits until every rank has reached barrier `name` (names may repeat: rounds are counted).
    pub fn barrier(&self, name: &str) -> Result<(), DistError> {
        let round = self.round.load(Ordering::Relaxed);
        self.client
            .barrier(
                &format!("{PREFIX}/barrier/{name}"),
                self.rank,
                self.world_size,
                self.timeout,
            )
            .map_err(self.store_err("barrier", round))
    }

    /// Every rank's `payload`, in rank order, on every rank.
    pub fn all_gather_bytes(&self, payload: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        self.all_gather_bytes_op("all_gather", payload)
    }

    fn all_gather_bytes_op(
        &self,
        op: &'static str,
        payload: &[u8],
    ) -> Result<Vec<Vec<u8>>, DistError> {
        let round = self.round.fetch_add(1, Ordering::Relaxed);
        let err = |r| self.store_err(op, r);
        let key = |rank: usize| format!("{PREFIX}/{round}/{rank}");
        self.client
            .set(&key(self.rank), payload)
            .map_err(err(round))?;
        let mut out = Vec::with_capacity(self.world_size);
        for r in 0..self.world_size {
            if r == self.rank {
                out.push(payload.to_vec());
            } else {
                out.push(self.client.get(&key(r), self.timeout).map_err(err(round))?);
            }
        }
        // The last rank to finish reading removes the round's keys.
        let done = self
            .client
            .add(&format!("{PREFIX}/{round}/done"), 1)
            .map_err(err(round))?;
        if done as usize == self.world_size {
            for r in 0..self.world_size {
                self.client.delete(&key(r)).map_err(err(round))?;
            }
            self.client
                .delete(&format!("{PREFIX}/{round}/done"))
                .map_err(err(round))?;
        }
        if let Some(mask) = self
            .data_ranks
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            out = out
                .into_iter()
                .zip(mask)
                .filter(|(_, &m)| m)
                .map(|(p, _)| p)
                .collect();
        }
        Ok(out)
    }

    /// Every rank's `value`, in rank order, on every rank (JSON on the wire).
    pub fn all_gather_json<T: Serialize + DeserializeOwned>(
        &self,
        value: &T,
    ) -> Result<Vec<T>, DistError> {
        let round = self.round.load(Ordering::Relaxed);
        let bytes = serde_json::to_vec(value).map_err(|e| DistError::Payload {
            rank: self.rank,
            world_size: self.world_size,
            op: "all_gather_json",
            round,
            from: self.rank,
            expected: "a JSON-serialisable value".into(),
            found: e.to_string(),
        })?;
        let parts = self.all_gather_bytes_op("all_gather_json", &bytes)?;
        parts
            .iter()
            .enumerate()
            .map(|(from, p)| {
                serde_json::from_slice(p).map_err(|e| DistError::Payload {
                    rank: self.rank,
                    world_size: self.world_size,
                    op: "all_gather_json",
                    round,
                    from,
                    expected: std::any::type_name::<T>().to_string(),
                    found: format!("JSON that does not decode ({e})"),
                })
            })
            .collect()
    }

    /// Every rank's `values` (bit-exact), in rank order, on every rank; lengths may differ.
    pub fn all_gather_f64(&self, values: &[f64]) -> Result<Vec<Vec<f64>>, DistError> {
        let round = self.round.load(Ordering::Relaxed);
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let parts = self.all_gather_bytes_op("all_gather_f64", &bytes)?;
        parts
            .into_iter()
            .enumerate()
            .map(|(from, p)| {
                if p.len() % 8 != 0 {
                    return Err(DistError::Payload {
                        rank: self.rank,
                        world_size: self.world_size,
                        op: "all_gather_f64",
                        round,
                        from,
                        expected: "a multiple of 8 bytes".into(),
                        found: format!("{} bytes", p.len()),
                    });
                }
                Ok(p.chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().expect("8-byte chunk")))
                    .collect())
            })
            .collect()
    }

    /// Replaces each element of `values` by its `op` over ranks. Sums add in rank order, so
    /// every rank gets the same bits.
    pub fn all_reduce_f64(&self, values: &mut [f64], op: ReduceOp) -> Result<(), DistError> {
        let round = self.round.load(Ordering::Relaxed);
        let parts = self.all_gather_f64(values)?;
        for (from, p) in parts.iter().enumerate() {
            if p.len() != values.len() {
                return Err(DistError::Payload {
                    rank: self.rank,
                    world_size: self.world_size,
                    op: "all_reduce_f64",
                    round,
                    from,
                    expected: format!("{} values", values.len()),
                    found: format!("{} values", p.len()),
                });
            }
        }
        for (i, v) in values.iter_mut().enumerate() {
            let mut acc = parts[0][i];
            for p in &parts[1..] {
                acc = match op {
                    ReduceOp::Sum => acc + p[i],
                    ReduceOp::Max => acc.max(p[i]),
                    ReduceOp::Min => acc.min(p[i]),
                };
            }
            *v = acc;
        }
        Ok(())
    }
}

/// Lets `verl_algos`' `*_across` functions reduce over the job's ranks.
impl CrossRankSum for &HostGroup {
    fn sum_in_place(&mut self, values: &mut [f64]) -> Result<(), String> {
        self.all_reduce_f64(values, ReduceOp::Sum)
            .map_err(|e| e.to_string())
    }

    fn max_in_place(&mut self, values: &mut [f64]) -> Result<(), String> {
        self.all_reduce_f64(values, ReduceOp::Max)
            .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use verl_store::StoreServer;

    fn group_of(world: usize) -> (StoreServer, Vec<HostGroup>) {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let addr = server.connect_addr();
        let groups = (0..world)
            .map(|r| {
                let c = StoreClient::connect_as(addr, r, Duration::from_secs(5)).unwrap();
                HostGroup::new(Arc::new(c), r, world, Duration::from_secs(10))
            })
            .collect();
        (server, groups)
    }

    fn on_all<T: Send>(groups: &[HostGroup], f: impl Fn(&HostGroup) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            let hs: Vec<_> = groups.iter().map(|g| s.spawn(|| f(g))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn all_gather_returns_every_rank_in_order_and_cleans_up() {
        let (_server, groups) = group_of(3);
        let out = on_all(&groups, |g| {
            let a = g.all_gather_json(&format!("r{}", g.rank())).unwrap();
            let b = g.all_gather_f64(&vec![g.rank() as f64; g.rank()]).unwrap();
            (a, b)
        });
        for (a, b) in out {
            assert_eq!(a, vec!["r0", "r1", "r2"]);
            assert_eq!(b, vec![vec![], vec![1.0], vec![2.0, 2.0]]);
        }
        // Both rounds' keys are gone once every rank has read them.
        let c = groups[0].client();
        for round in 0..2 {
            for r in 0..3 {
                assert_eq!(c.try_get(&format!("{PREFIX}/{round}/{r}")).unwrap(), None);
            }
            assert_eq!(c.try_get(&format!("{PREFIX}/{round}/done")).unwrap(), None);
        }
    }

    #[test]
    fn all_reduce_sums_maxes_and_mins_identically_on_every_rank() {
        let (_server, groups) = group_of(2);
        let out = on_all(&groups, |g| {
            let x = g.rank() as f64;
            let mut s = [0.1 + x, 10.0 * x];
            g.all_reduce_f64(&mut s, ReduceOp::Sum).unwrap();
            let mut m = [x, -x];
            g.all_reduce_f64(&mut m, ReduceOp::Max).unwrap();
            let mut n = [x, -x];
            g.all_reduce_f64(&mut n, ReduceOp::Min).unwrap();
            let mut via_trait = [x + 1.0];
            (&*g).sum_in_place(&mut via_trait).unwrap();
            (s, m, n, via_trait)
        });
        assert_eq!(out[0], out[1]);
        let (s, m, n, t) = out[0];
        assert_eq!(s, [0.1 + 1.1, 10.0]);
        assert_eq!(m, [1.0, 0.0]);
        assert_eq!(n, [0.0, -1.0]);
        assert_eq!(t, [3.0]);
    }

    #[test]
    fn mismatched_lengths_name_the_rank_and_sizes() {
        let (_server, groups) = group_of(2);
        let out = on_all(&groups, |g| {
            let mut v = vec![1.0; g.rank() + 1];
            g.all_reduce_f64(&mut v, ReduceOp::Sum)
                .unwrap_err()
                .to_string()
        });
        assert!(
            out[0].contains("rank 1 sent 2 values, expected 1 values"),
            "{}",
            out[0]
        );
    }

    #[test]
    fn a_failed_peer_ends_a_collective_with_its_error() {
        let (_server, groups) = group_of(2);
        let out = on_all(&groups, |g| {
            if g.rank() == 1 {
                g.client().set_error(1, "boom at step 2").unwrap();
                return String::new();
            }
            g.all_gather_json(&1u32).unwrap_err().to_string()
        });
        assert!(
            out[0].contains("rank 1 failed: boom at step 2"),
            "{}",
            out[0]
        );
    }
}

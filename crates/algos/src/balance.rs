//! Sequence-length balancing (verl `verl/utils/seqlen_balancing.py`, used by `trainer.balance_batch`):
//! split a batch's rows over data-parallel ranks so each rank gets a similar attention workload.
//!
//! [`balance_batch`] is verl's `RayPPOTrainer._balance_batch`: per-row workloads from [`calculate_workload`],
//! equal-size Karmarkar–Karp partitions ([`get_seqlen_balanced_partitions`]) or, when samples of one prompt
//! must stay on one rank, group partitions ([`get_group_balanced_partitions`]), then the within-rank row
//! order and the `global_seqlen/*` metrics ([`log_seqlen_unbalance`]).
//!
//! Partitions are identical to verl's for every input, ties included: [`karmarkar_karp`] compares sets and
//! states exactly as verl's `Set.__lt__` / `State.__lt__` do, and keeps its states in a heap that sifts
//! like Python's `heapq`. Sums are exact (verl adds Python ints); the metrics are `f64`, exact while the
//! batch holds fewer than 2^53 tokens.

mod heapq;

use std::cmp::Ordering;

use crate::error::{AlgoError, Result};
use crate::groups::Groups;
use heapq::HeapQ;

/// The metric prefix `_balance_batch` logs under (`global_seqlen/min`, …).
pub const GLOBAL_SEQLEN_PREFIX: &str = "global_seqlen";

/// verl's per-sequence workload estimate, `24576·s + s²` (dense-transformer FLOPs of a 7B model, hidden
/// size 4096, up to a constant factor).
///
/// verl computes it on an int64 tensor, which wraps on overflow; so does this (only past s ≈ 3.04e9).
pub fn calculate_workload(seqlen: i64) -> i64 {
    const LINEAR: i64 = 24576;
    LINEAR
        .wrapping_mul(seqlen)
        .wrapping_add(seqlen.wrapping_mul(seqlen))
}

/// One subset of a partial partition (verl's `Set`): `(index, value)` items in insertion order.
#[derive(Debug, Clone, Default)]
struct Subset {
    sum: i128,
    items: Vec<(usize, i64)>,
}

impl Subset {
    /// verl's `Set.__lt__` as a total order: by sum, then item count, then the item list lexicographically.
    fn py_cmp(&self, other: &Self) -> Ordering {
        self.sum
            .cmp(&other.sum)
            .then(self.items.len().cmp(&other.items.len()))
            .then_with(|| self.items.cmp(&other.items))
    }

    fn absorb(&mut self, other: Subset) {
        self.sum += other.sum;
        self.items.extend(other.items);
    }
}

/// A partial k-way partition (verl's `State`), its subsets kept in decreasing [`Subset::py_cmp`] order.
#[derive(Debug)]
struct State {
    subsets: Vec<Subset>,
}

impl State {
    /// One `(value, index)` item per subset, the remaining subsets empty.
    fn new(items: &[(i64, usize)], k: usize) -> Self {
        let mut subsets = vec![Subset::default(); k];
        for (subset, &(value, index)) in subsets.iter_mut().zip(items) {
            subset.sum = i128::from(value);
            subset.items.push((index, value));
        }
        let mut state = Self { subsets };
        state.sort_decreasing();
        state
    }

    /// Python's `sorted(..., reverse=True)`: stable, so equal subsets keep their order.
    fn sort_decreasing(&mut self) {
        self.subsets.sort_by(|a, b| b.py_cmp(a));
    }

    fn spread(&self) -> i128 {
        self.subsets[0].sum - self.subsets[self.subsets.len() - 1].sum
    }

    /// Differencing: the largest subset takes the other state's smallest, and so on.
    fn merge(&mut self, other: State) {
        for (mine, theirs) in self.subsets.iter_mut().zip(other.subsets.into_iter().rev()) {
            mine.absorb(theirs);
        }
        self.sort_decreasing();
    }

    /// verl's `State.__lt__` (the heap's "less"): the larger spread pops first, then the larger first
    /// subset.
    fn pops_before(a: &State, b: &State) -> bool {
        let (spread_a, spread_b) = (a.spread(), b.spread());
        if spread_a != spread_b {
            return spread_a > spread_b;
        }
        a.subsets[0].py_cmp(&b.subsets[0]) == Ordering::Greater
    }

    fn into_partitions(self) -> Vec<Vec<usize>> {
        self.subsets
            .into_iter()
            .map(|s| s.items.into_iter().map(|(index, _)| index).collect())
            .collect()
    }
}

fn check_k(key: &'static str, k: usize) -> Result<()> {
    if k == 0 {
        return Err(AlgoError::InvalidParam {
            key,
            found: "0".into(),
            expected: "at least 1 partition",
        });
    }
    Ok(())
}

/// verl's `karmarkar_karp`: the Largest Differencing Method, splitting `values` into `k` partitions of
/// balanced sums (of `values.len() / k` items each when `equal_size`).
///
/// Returns item indices per partition, partitions in decreasing order of sum and indices in the order the
/// differencing added them, exactly as verl returns them. With fewer values than `k` (and `!equal_size`)
/// some partitions are empty, and negative values can leave one empty too.
pub fn karmarkar_karp(values: &[i64], k: usize, equal_size: bool) -> Result<Vec<Vec<usize>>> {
    const OP: &str = "karmarkar_karp";
    check_k("k_partitions", k)?;
    if values.is_empty() {
        return Err(AlgoError::TooFewItems {
            op: OP,
            what: "values",
            found: 0,
            needed: 1,
            k,
        });
    }
    if equal_size && values.len() % k != 0 {
        return Err(AlgoError::NotDivisible {
            op: OP,
            what: "values",
            found: values.len(),
            k,
            hint: "equal_size needs a multiple of k",
        });
    }

    // (value, index) pairs are distinct, so any sort gives Python's `sorted` order.
    let mut sorted: Vec<(i64, usize)> = values.iter().copied().zip(0..).collect();
    sorted.sort_unstable();
    let chunk = if equal_size { k } else { 1 };
    let mut heap = HeapQ::new(State::pops_before);
    for items in sorted.chunks(chunk) {
        heap.push(State::new(items, k));
    }
    // verl: `while len(heap) > 1: pop two, merge, push`, then the one state left is the answer.
    let last = loop {
        let mut first = heap
            .pop()
            .expect("one state per value chunk, and values is not empty");
        let Some(second) = heap.pop() else {
            break first;
        };
        first.merge(second);
        heap.push(first);
    };
    Ok(last.into_partitions())
}

/// verl's `get_seqlen_balanced_partitions`: [`karmarkar_karp`], then each partition's indices sorted.
///
/// verl's assertions are errors here: fewer values than `k`, `equal_size` with a count `k` does not divide,
/// and an empty partition (reachable only with negative values).
pub fn get_seqlen_balanced_partitions(
    values: &[i64],
    k: usize,
    equal_size: bool,
) -> Result<Vec<Vec<usize>>> {
    const OP: &str = "get_seqlen_balanced_partitions";
    check_k("k_partitions", k)?;
    if values.len() < k {
        return Err(AlgoError::TooFewItems {
            op: OP,
            what: "values",
            found: values.len(),
            needed: k,
            k,
        });
    }
    let mut partitions = karmarkar_karp(values, k, equal_size)?;
    for (index, partition) in partitions.iter_mut().enumerate() {
        if partition.is_empty() {
            return Err(AlgoError::EmptyPartition { op: OP, index, k });
        }
        partition.sort_unstable();
    }
    debug_assert_eq!(partitions.iter().map(Vec::len).sum::<usize>(), values.len());
    Ok(partitions)
}

/// verl's `get_group_balanced_partitions`: `k` partitions that keep each group of samples together.
///
/// A group is a run of equal consecutive `group_ids` (verl's `uid`, contiguous after the rollout repeats
/// each prompt `n` times; a uid that reappears later starts a new group). A group's workload is the sum of
/// its samples' [`calculate_workload`]; groups are split by equal-size Karmarkar–Karp, so each partition
/// gets the same number of groups. Returns sample indices per partition, sorted.
pub fn get_group_balanced_partitions<G: PartialEq>(
    seqlens: &[i64],
    group_ids: &[G],
    k: usize,
) -> Result<Vec<Vec<usize>>> {
    const OP: &str = "get_group_balanced_partitions";
    if group_ids.len() != seqlens.len() {
        return Err(AlgoError::LengthMismatch {
            op: OP,
            input: "uid_list",
            reference: "seqlen_list",
            expected: seqlens.len(),
            found: group_ids.len(),
        });
    }
    let mut starts: Vec<usize> = (0..group_ids.len())
        .filter(|&i| i == 0 || group_ids[i] != group_ids[i - 1])
        .collect();
    if starts.len() < k {
        return Err(AlgoError::TooFewItems {
            op: OP,
            what: "uid groups",
            found: starts.len(),
            needed: k,
            k,
        });
    }
    starts.push(group_ids.len());
    let groups: Vec<std::ops::Range<usize>> = starts.windows(2).map(|w| w[0]..w[1]).collect();
    let workloads = groups
        .iter()
        .map(|rows| {
            seqlens[rows.clone()]
                .iter()
                .try_fold(0i64, |sum, &s| sum.checked_add(calculate_workload(s)))
                .ok_or_else(|| AlgoError::Overflow {
                    op: OP,
                    what: format!("the workload of the group of rows {rows:?}"),
                })
        })
        .collect::<Result<Vec<i64>>>()?;
    let group_partitions = get_seqlen_balanced_partitions(&workloads, k, true)?;
    Ok(group_partitions
        .into_iter()
        .map(|partition| {
            let mut rows: Vec<usize> = partition
                .into_iter()
                .flat_map(|g| groups[g].clone())
                .collect();
            rows.sort_unstable();
            rows
        })
        .collect())
}

/// verl's `log_seqlen_unbalance`: how unbalanced the batch was before and after partitioning, as
/// `{prefix}/min`, `/max`, `/minmax_diff` (token sums of consecutive chunks of `len / k` rows in the
/// original order — the split the ranks would get without balancing), `/balanced_min`, `/balanced_max`
/// (token sums of the `partitions`) and `/mean` (total tokens / k).
///
/// When `k` does not divide the row count, the short last chunk counts too, as in verl.
pub fn log_seqlen_unbalance(
    seqlens: &[i64],
    partitions: &[Vec<usize>],
    prefix: &str,
) -> Result<Vec<(String, f64)>> {
    const OP: &str = "log_seqlen_unbalance";
    let k = partitions.len();
    check_k("partitions", k)?;
    let chunk = seqlens.len() / k;
    if chunk == 0 {
        return Err(AlgoError::TooFewItems {
            op: OP,
            what: "sequence lengths",
            found: seqlens.len(),
            needed: k,
            k,
        });
    }
    let sum = |rows: &[i64]| rows.iter().map(|&s| i128::from(s)).sum::<i128>();
    let unbalanced: Vec<i128> = seqlens.chunks(chunk).map(sum).collect();
    let balanced = partitions
        .iter()
        .map(|partition| {
            partition.iter().try_fold(0i128, |acc, &i| {
                let s = seqlens.get(i).ok_or(AlgoError::IndexOutOfRange {
                    op: OP,
                    input: "partitions",
                    index: i,
                    len: seqlens.len(),
                })?;
                Ok(acc + i128::from(*s))
            })
        })
        .collect::<Result<Vec<i128>>>()?;

    let min_max = |sums: &[i128]| {
        let min = *sums.iter().min().expect("at least one chunk");
        let max = *sums.iter().max().expect("at least one chunk");
        (min, max)
    };
    let (min, max) = min_max(&unbalanced);
    let (balanced_min, balanced_max) = min_max(&balanced);
    let total: i128 = unbalanced.iter().sum();
    // `as f64` rounds to nearest, as Python's int → float does.
    Ok([
        ("min", min as f64),
        ("max", max as f64),
        ("minmax_diff", (max - min) as f64),
        ("balanced_min", balanced_min as f64),
        ("balanced_max", balanced_max as f64),
        ("mean", total as f64 / k as f64),
    ]
    .into_iter()
    .map(|(name, value)| (format!("{prefix}/{name}"), value))
    .collect())
}

/// The result of [`balance_batch`].
#[derive(Debug, Clone, PartialEq)]
pub struct BalancedBatch {
    /// Row indices per data-parallel rank, in the order the rank receives them.
    pub ranks: Vec<Vec<usize>>,
    /// `global_seqlen/*` metrics (see [`log_seqlen_unbalance`]), in verl's order.
    pub metrics: Vec<(String, f64)>,
}

impl BalancedBatch {
    /// The batch's new row order (verl's `global_idx`): rank 0's rows, then rank 1's, …, so an even split
    /// of the reordered batch hands each rank its partition.
    pub fn row_order(&self) -> Vec<usize> {
        self.ranks.concat()
    }
}

/// verl's `RayPPOTrainer._balance_batch` (with `keep_minibatch=False`): which rows each of `dp_size` ranks
/// gets, in which order, from the rows' token counts (`attention_mask.sum(-1)`).
///
/// Without `prefix_groups`, rows are split by equal-size Karmarkar–Karp on their workloads, and each
/// rank's rows are sorted by (workload, row) and laid out zigzag — even positions ascending, then odd
/// positions descending — so the lightest rows sit at both ends, which shortens pipeline bubbles.
/// With `prefix_groups` (verl's `use_prefix_grouper`, keyed by `uid`), samples of one prompt stay on one
/// rank ([`get_group_balanced_partitions`]) and each rank keeps its rows in batch order; the number of
/// distinct prompts must then be a multiple of `dp_size`.
pub fn balance_batch(
    seqlens: &[i64],
    dp_size: usize,
    prefix_groups: Option<&Groups>,
) -> Result<BalancedBatch> {
    const OP: &str = "balance_batch";
    check_k("dp_size", dp_size)?;
    let ranks = match prefix_groups {
        Some(groups) => {
            if groups.num_rows() != seqlens.len() {
                return Err(AlgoError::LengthMismatch {
                    op: OP,
                    input: "uid",
                    reference: "attention_mask",
                    expected: seqlens.len(),
                    found: groups.num_rows(),
                });
            }
            if groups.num_groups() % dp_size != 0 {
                return Err(AlgoError::NotDivisible {
                    op: OP,
                    what: "distinct uids",
                    found: groups.num_groups(),
                    k: dp_size,
                    hint: "make the batch size a multiple of dp_size × rollout.n",
                });
            }
            let group_ids: Vec<usize> =
                (0..groups.num_rows()).map(|r| groups.group_of(r)).collect();
            get_group_balanced_partitions(seqlens, &group_ids, dp_size)?
        }
        None => {
            let workloads: Vec<i64> = seqlens.iter().map(|&s| calculate_workload(s)).collect();
            let mut ranks = get_seqlen_balanced_partitions(&workloads, dp_size, true)?;
            for rows in &mut ranks {
                rows.sort_by_key(|&r| (workloads[r], r));
                *rows = zigzag(rows);
            }
            ranks
        }
    };
    let metrics = log_seqlen_unbalance(seqlens, &ranks, GLOBAL_SEQLEN_PREFIX)?;
    Ok(BalancedBatch { ranks, metrics })
}

/// `sorted[::2] + sorted[1::2][::-1]`.
fn zigzag(sorted: &[usize]) -> Vec<usize> {
    let odd: Vec<usize> = sorted.iter().copied().skip(1).step_by(2).collect();
    sorted
        .iter()
        .copied()
        .step_by(2)
        .chain(odd.into_iter().rev())
        .collect()
}

#[cfg(test)]
mod tests;

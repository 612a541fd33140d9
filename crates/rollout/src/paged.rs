//! The paged engine: a block-pool KV cache, prompts shared by their samples, and a scheduler that
//! keeps the decode batch full.
//!
//! Every sequence (prompt `i`, sample `j`) owns a block table. Admission prefills a prompt once;
//! its other fresh samples fork the table (the prompt's blocks gain references) and draw their
//! first token from the same logits. The partially filled last prompt block is copied by each
//! sample before it writes there (copy-on-write); full prompt blocks are never written, so a
//! sample readmitted later rejoins them while any sibling still holds them and recomputes only
//! its own tail.
//!
//! Each decode step runs every running sequence one token; finished sequences release their
//! blocks at once and waiting ones are admitted in their place (continuous batching), within the
//! KV budget, `max_num_seqs` and `max_prefill_tokens`. When a step needs more blocks than are
//! free, the most recently admitted sequences are preempted: their blocks are released and they
//! go back to the front of the queue, to be recomputed (prompt + tokens so far) on readmission.
//! A sequence's tokens depend only on its own stream `(key, step)`, so none of this changes
//! outputs.
//!
//! Host/device traffic per forward: one non-blocking upload of the index data, one of the
//! uniforms, and one download of the sampled ids (+ log-probs), which the scheduler needs to see
//! finished sequences. Eager steps wait for it at once. A graphed decode step queues the download
//! (to pinned memory, with an event after it) and the next step is queued from its tokens on the
//! device before the host records them (async scheduling, as vLLM's), unless something needs the
//! tokens first (an admission, a preemption, a graph not captured yet): the device then never
//! waits for the host between decode steps. A row whose token turns out to be EOS has decoded
//! once more by then; that token is dropped, and its blocks go back to the pool behind the step
//! in stream order.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use tch::{Device, Kind, Tensor};
use verl_nn::Transformer;

use crate::block_pool::{BlockPool, TRASH_BLOCK};
use crate::engine::{Job, Outputs};
use crate::error::{Result, RolloutError};
use crate::graphs::DecodeGraphs;
use crate::paged_attn::{self, HostBatch, KvPool};
use crate::params::{EngineConfig, FinishReason, Generation, GenerationStats};
use crate::rng;
use crate::turns::{Resume, TurnDriver, TurnEnd};

/// Shortest `max_new_tokens` for which the first decode step's graph is captured ahead (during
/// the prefill): a capture costs the host about as much as a few eager steps.
const PRECAPTURE_MIN_TOKENS: usize = 16;

pub(crate) fn run(
    model: &Transformer,
    job: &Job,
    config: &EngineConfig,
) -> Result<(Generation, GenerationStats)> {
    run_with(model, job, config, None)
}

/// [`run`] of a multi-turn job: sequences that stop wait for `driver`'s answers.
pub(crate) fn run_turns(
    model: &Transformer,
    job: &Job,
    config: &EngineConfig,
    driver: &mut dyn TurnDriver,
) -> Result<(Generation, GenerationStats)> {
    run_with(model, job, config, Some(driver))
}

fn run_with(
    model: &Transformer,
    job: &Job,
    config: &EngineConfig,
    driver: Option<&mut dyn TurnDriver>,
) -> Result<(Generation, GenerationStats)> {
    check_config(config)?;
    let mut stats = job.new_stats();
    let mut out = job.outputs();
    if job.params.max_new_tokens > 0 {
        tch::no_grad(|| -> Result<()> {
            // Fewer, larger GEMMs per decode step; the copies go when the call ends.
            let _fused = if config.fuse_weights && matches!(model.device(), Device::Cuda(_)) {
                Some(model.fuse_decode_weights()?)
            } else {
                None
            };
            let mut engine = Engine::new(model, job, config)?;
            engine.run(&mut out, &mut stats, driver)
            // The engine (and with it the KV pool) is dropped here: nothing stays on the device.
        })?;
    }
    job.finish(out, stats, model.device())
}

fn check_config(c: &EngineConfig) -> Result<()> {
    if c.block_size == 0 {
        return Err(RolloutError::input("EngineConfig.block_size", ">= 1", "0"));
    }
    if c.max_prefill_tokens == 0 {
        return Err(RolloutError::input(
            "EngineConfig.max_prefill_tokens",
            ">= 1",
            "0",
        ));
    }
    if c.max_num_seqs == Some(0) {
        return Err(RolloutError::input(
            "EngineConfig.max_num_seqs",
            ">= 1 (or None)",
            "Some(0)",
        ));
    }
    Ok(())
}

/// Downloads sampled tokens (and their log-probs) in one transfer.
pub(crate) fn fetch_samples(
    tokens: &Tensor,
    lp: Option<&Tensor>,
) -> Result<(Vec<i64>, Option<Vec<f32>>)> {
    match lp {
        None => Ok((
            Vec::<i64>::try_from(&tokens.f_to_device(Device::Cpu)?)?,
            None,
        )),
        Some(lp) => {
            // Token ids (< 2^53) and fp32 log-probs are both exact in f64.
            let both = Tensor::f_stack(
                &[tokens.f_to_kind(Kind::Double)?, lp.f_to_kind(Kind::Double)?],
                0,
            )?
            .f_to_device(Device::Cpu)?;
            let v = Vec::<f64>::try_from(&both.f_flatten(0, -1)?)?;
            let r = v.len() / 2;
            Ok((
                v[..r].iter().map(|&x| x as i64).collect(),
                Some(v[r..].iter().map(|&x| x as f32).collect()),
            ))
        }
    }
}

#[derive(Debug)]
struct Seq {
    /// Output row (`group * per_prompt + sample`).
    row: usize,
    group: usize,
    key: u64,
    out: Vec<i64>,
    table: Vec<u32>,
    /// Positions whose keys/values are in the pool.
    cached: usize,
    /// Whether `table` starts with the group's shared full prompt blocks.
    holds_prompt: bool,
    /// Stopped (EOS or length); a token a step already queued for it is dropped.
    finished: bool,
    /// Multi-turn: stopped at the end of a turn, waiting for the caller (holding its KV unless
    /// evicted).
    paused: bool,
    /// Multi-turn: where the current turn's tokens start in `out`.
    turn_start: usize,
    /// Multi-turn: bumped at every resume, so a token a step queued before it is dropped.
    epoch: u32,
}

/// A decode step whose sampled tokens are still on their way to the host (async scheduling): the
/// next step can be queued from them on the device while the host records them.
struct Inflight {
    /// The step's sequences, in row order, and their epochs when it was queued.
    seqs: Vec<usize>,
    epochs: Vec<u32>,
    /// Its sampled tokens on the device (a graph's static output: read before that graph's next
    /// replay, which the stream order guarantees for a step queued after this one).
    tokens: Tensor,
    /// Pinned host copies, queued right after the step, and the event after them.
    host_tokens: Tensor,
    host_lp: Option<Tensor>,
    event: verl_torch_ext::CudaEvent,
}

#[derive(Debug)]
struct Group {
    tokens: Vec<i64>,
    /// The full blocks of the prompt, valid while `holders > 0`.
    prompt_blocks: Vec<u32>,
    holders: usize,
    /// The prompt went through the model at least once (later prefills are recomputation).
    prefilled: bool,
}

/// How an admitted sequence gets its KV.
#[derive(Debug, Clone, Copy)]
enum Admit {
    /// Computes positions `past..` (past = 0: from scratch; past > 0: after the group's shared
    /// full prompt blocks).
    Extend { past: usize },
    /// Shares every block of `leader` (a fresh sample prefilled this round) and its logits.
    Fork { leader: usize },
    /// A multi-turn sequence that kept its blocks: computes the positions after `past` (what
    /// the caller appended) into its own table.
    Resume { past: usize },
}

struct Engine<'a> {
    model: &'a Transformer,
    job: &'a Job,
    bs: usize,
    max_seqs: usize,
    max_prefill: usize,
    pool: BlockPool,
    kv: KvPool,
    seqs: Vec<Seq>,
    groups: Vec<Group>,
    waiting: VecDeque<usize>,
    /// In admission order (the last one is preempted first).
    running: Vec<usize>,
    first_token_at: Option<Instant>,
    /// Rows of the first decode step, whose graph is captured while the device runs the
    /// prefill ([`DecodeGraphs::precapture`]); taken at the first prefill.
    precapture: Option<usize>,
    /// Decode CUDA graphs (CUDA, dense models, `EngineConfig::cuda_graphs`); they hold `kv`'s
    /// addresses and are dropped with it.
    graphs: Option<DecodeGraphs>,
    /// The last graphed decode step, not yet recorded on the host (see [`Inflight`]).
    inflight: Option<Inflight>,
    /// Async scheduling: a graphed decode step is queued before the host has recorded the step
    /// before it ([`EngineConfig::async_decode`]).
    overlap: bool,
    /// Multi-turn: turns ended since the driver was last called, and how many sequences wait
    /// for it.
    ended: Vec<TurnEnd>,
    paused: usize,
}

impl<'a> Engine<'a> {
    fn new(model: &'a Transformer, job: &'a Job, config: &EngineConfig) -> Result<Engine<'a>> {
        let bs = config.block_size;
        let m = job.params.max_new_tokens;
        let ids = Vec::<i64>::try_from(&job.prompts.f_flatten(0, -1)?.f_to_device(Device::Cpu)?)?;
        let mask = Vec::<i64>::try_from(&job.mask.f_flatten(0, -1)?.f_to_device(Device::Cpu)?)?;
        let p = job.p as usize;
        let groups: Vec<Group> = (0..job.b)
            .map(|i| Group {
                tokens: (0..p)
                    .filter(|&k| mask[i * p + k] != 0)
                    .map(|k| ids[i * p + k])
                    .collect(),
                prompt_blocks: Vec::new(),
                holders: 0,
                prefilled: false,
            })
            .collect();
        let longest = groups.iter().map(|g| g.tokens.len()).max().unwrap_or(0);
        let one_seq = (longest + m).div_ceil(bs);
        // Everything at once: shared full prompt blocks once per prompt, the rest per sample.
        let all_at_once: usize = groups
            .iter()
            .map(|g| {
                let full = g.tokens.len() / bs;
                full + job.per_prompt * ((g.tokens.len() + m).div_ceil(bs) - full)
            })
            .sum();
        let usable = match config.kv_cache_tokens {
            Some(tokens) => {
                let blocks = tokens / bs;
                if blocks < one_seq {
                    return Err(RolloutError::input(
                        "EngineConfig.kv_cache_tokens",
                        format!(
                            "room for the longest prompt plus max_new_tokens ({longest} + {m} \
                             tokens = {one_seq} blocks of {bs})"
                        ),
                        format!("{tokens} tokens ({blocks} blocks)"),
                    ));
                }
                blocks
            }
            None => all_at_once,
        };
        let seqs: Vec<Seq> = (0..job.rows())
            .map(|r| Seq {
                row: r,
                group: r / job.per_prompt,
                key: job.row_key(r),
                out: Vec::with_capacity(m),
                table: Vec::new(),
                cached: 0,
                holds_prompt: false,
                finished: false,
                paused: false,
                turn_start: 0,
                epoch: 0,
            })
            .collect();
        Ok(Engine {
            model,
            job,
            bs,
            max_seqs: config.max_num_seqs.unwrap_or(usize::MAX),
            max_prefill: config.max_prefill_tokens,
            pool: BlockPool::new(usable + 1),
            kv: KvPool::new(model, usable + 1, bs, config.paged_attention_kernel)?,
            waiting: (0..seqs.len()).collect(),
            seqs,
            groups,
            running: Vec::new(),
            first_token_at: None,
            // Every sequence decodes at once when the pool holds them all (and the batch
            // limit allows): the first decode step's graph can be captured during the prefill.
            // Without `precapture_decode_graph`, at the bucket's second use, like the others.
            precapture: (usable >= all_at_once
                && m >= PRECAPTURE_MIN_TOKENS
                && config.precapture_decode_graph)
                .then(|| config.max_num_seqs.unwrap_or(usize::MAX).min(job.rows())),
            inflight: None,
            overlap: config.async_decode,
            ended: Vec::new(),
            paused: 0,
            // A tensor-parallel shard decodes eagerly: its collectives run outside the graph's
            // stream capture.
            graphs: if model.tp_size() > 1 {
                None
            } else {
                DecodeGraphs::new(
                    model,
                    config,
                    config.max_num_seqs.unwrap_or(job.rows()).min(job.rows()),
                    one_seq,
                )
            },
        })
    }

    fn run(
        &mut self,
        out: &mut Outputs,
        stats: &mut GenerationStats,
        mut driver: Option<&mut dyn TurnDriver>,
    ) -> Result<()> {
        stats.kv_blocks = self.pool.usable();
        loop {
            if !self.waiting.is_empty() {
                // Admission plans with every sampled token recorded.
                self.flush(out)?;
            }
            while !self.waiting.is_empty() && self.admit(out, stats)? {}
            if self.running.is_empty() {
                self.flush(out)?;
                if let Some(d) = driver.as_deref_mut() {
                    if self.waiting.is_empty() {
                        if self.paused == 0 && self.ended.is_empty() {
                            break;
                        }
                        // Nothing runs: the driver answers at least one waiting sequence.
                        let idle = self.paused > 0;
                        let t0 = Instant::now();
                        let answers = d.turns(std::mem::take(&mut self.ended), idle)?;
                        stats.driver_secs += t0.elapsed().as_secs_f64();
                        if idle {
                            stats.idle_secs += t0.elapsed().as_secs_f64();
                            if answers.is_empty() {
                                return Err(RolloutError::input(
                                    "multi-turn driver",
                                    "an answer for at least one waiting sequence when the engine \
                                     has nothing else to run",
                                    format!("none for {} waiting sequences", self.paused),
                                ));
                            }
                        }
                        self.answer(answers, out, stats)?;
                        continue;
                    }
                }
                if let Some(&s) = self.waiting.front() {
                    if self.evict_waiting(stats) {
                        continue;
                    }
                    return Err(RolloutError::input(
                        "paged scheduler",
                        "room to admit a sequence into an empty batch",
                        format!(
                            "sequence {s} waiting with {} of {} KV blocks free",
                            self.pool.num_free(),
                            self.pool.usable()
                        ),
                    ));
                }
                break;
            }
            stats.max_running = stats.max_running.max(self.running.len());
            self.decode_step(out, stats)?;
            if let Some(d) = driver.as_deref_mut() {
                // Answers that are ready join the batch at the next admission.
                if !self.ended.is_empty() || self.paused > 0 {
                    let t0 = Instant::now();
                    let answers = d.turns(std::mem::take(&mut self.ended), false)?;
                    stats.driver_secs += t0.elapsed().as_secs_f64();
                    self.answer(answers, out, stats)?;
                }
            }
        }
        self.flush(out)?;
        // Every table was released exactly once per reference: a leak or a double release
        // would show here (and corrupt a longer run's sharing), so every call checks it.
        let held = self.pool.used();
        let holders: usize = self.groups.iter().map(|g| g.holders).sum();
        if held != 0 || holders != 0 {
            return Err(RolloutError::input(
                "paged scheduler at the end of the call",
                "every KV block released",
                format!("{held} blocks still held, {holders} prompt holders"),
            ));
        }
        stats.peak_kv_blocks = self.pool.peak_used();
        if let Some(g) = &self.graphs {
            stats.cuda_graphs = g.captured;
            stats.cuda_graph_capture_secs = g.capture_secs;
            stats.cuda_graph_steps = g.replays;
        }
        if let Some(t) = self.first_token_at {
            stats.decode_secs = t.elapsed().as_secs_f64();
        }
        if let Some(r) = verl_nn::profile::take_report() {
            tracing::info!("generation phases (VERL_PROFILE):\n{r}");
        }
        Ok(())
    }

    fn seq_len(&self, s: usize) -> usize {
        self.groups[self.seqs[s].group].tokens.len() + self.seqs[s].out.len()
    }

    /// Tokens of sequence `s` (prompt, then response) from absolute position `from` on.
    fn token_range(&self, s: usize, from: usize) -> Vec<i64> {
        let seq = &self.seqs[s];
        let prompt = &self.groups[seq.group].tokens;
        prompt
            .iter()
            .chain(seq.out.iter())
            .skip(from)
            .copied()
            .collect()
    }

    /// Blocks the running sequences need for their next decode token (new blocks and copies of
    /// shared blocks they are about to write), counting a shared block's last writer as owner.
    fn decode_needs(&self) -> usize {
        self.decode_needs_of(&self.running)
    }

    /// [`Engine::decode_needs`] of the sequences `rows`.
    fn decode_needs_of(&self, rows: &[usize]) -> usize {
        let mut refs: HashMap<u32, u32> = HashMap::new();
        let mut need = 0;
        for &s in rows {
            let seq = &self.seqs[s];
            let bi = seq.cached / self.bs;
            match seq.table.get(bi) {
                None => need += 1,
                Some(&b) => {
                    let r = refs.entry(b).or_insert_with(|| self.pool.refcount(b));
                    if *r > 1 {
                        *r -= 1;
                        need += 1;
                    }
                }
            }
        }
        need
    }

    /// One admission round: takes waiting sequences in order while they fit, computes their KV
    /// in one forward and samples their next token. Returns whether anything was admitted.
    fn admit(&mut self, out: &mut Outputs, stats: &mut GenerationStats) -> Result<bool> {
        let bs = self.bs;
        // Keep the running sequences' next step covered, so admission never forces a preemption.
        let mut free = self.pool.num_free().saturating_sub(self.decode_needs());
        let mut plan: Vec<(usize, Admit)> = Vec::new();
        let mut leaders: HashMap<usize, (usize, bool)> = HashMap::new();
        let (mut rows, mut width) = (0usize, 0usize);
        for &s in &self.waiting {
            if self.running.len() + plan.len() >= self.max_seqs {
                break;
            }
            let seq = &self.seqs[s];
            let group = &self.groups[seq.group];
            let (p, gen) = (group.tokens.len(), seq.out.len());
            let full = p / bs;
            // A sibling already holds the prompt's full blocks, or computes them this round.
            let shared = group.holders > 0 || leaders.contains_key(&seq.group);
            // At least the last token is recomputed: its logits give the next token.
            let reuse = if p + gen > full * bs {
                full
            } else {
                full.saturating_sub(1)
            };
            let (admit, need, t) = match leaders.get(&seq.group) {
                // A multi-turn sequence resuming with its KV: only what was appended.
                _ if !seq.table.is_empty() => {
                    let past = seq.cached;
                    let cow = seq
                        .table
                        .get(past / bs)
                        .is_some_and(|&b| self.pool.refcount(b) > 1);
                    (
                        Admit::Resume { past },
                        (p + gen + 1).div_ceil(bs).saturating_sub(seq.table.len())
                            + usize::from(cow),
                        p + gen - past,
                    )
                }
                Some(&(leader, true)) if gen == 0 => (Admit::Fork { leader }, 1, 0),
                _ if shared && reuse > 0 => (
                    Admit::Extend { past: reuse * bs },
                    (p + gen + 1).div_ceil(bs) - reuse,
                    p + gen - reuse * bs,
                ),
                _ => (
                    Admit::Extend { past: 0 },
                    (p + gen + 1).div_ceil(bs),
                    p + gen,
                ),
            };
            if need > free {
                break;
            }
            if t > 0 {
                let w = width.max(t);
                if rows > 0 && (rows + 1) * w > self.max_prefill {
                    break;
                }
                rows += 1;
                width = w;
            }
            free -= need;
            if let Admit::Extend { past: 0 } = admit {
                leaders.entry(seq.group).or_insert((s, gen == 0));
            }
            plan.push((s, admit));
        }
        if plan.is_empty() {
            return Ok(false);
        }
        self.waiting.drain(..plan.len());
        let mut timer = verl_nn::profile::start(self.model.device());

        // Block tables for the sequences that compute, then one forward for all of them.
        let mut extend: Vec<(usize, usize)> = Vec::new();
        let mut extend_row: HashMap<usize, usize> = HashMap::new();
        let (mut cow_src, mut cow_dst) = (Vec::new(), Vec::new());
        for &(s, admit) in &plan {
            if let Admit::Resume { past } = admit {
                let len = self.seq_len(s);
                let bi = past / bs;
                if let Some(b) = self.seqs[s].table.get(bi).copied() {
                    if self.pool.refcount(b) > 1 {
                        let fresh = self.pool.alloc()?;
                        self.pool.release(b);
                        self.seqs[s].table[bi] = fresh;
                        cow_src.push(b);
                        cow_dst.push(fresh);
                    }
                }
                while self.seqs[s].table.len() * bs < len {
                    let b = self.pool.alloc()?;
                    self.seqs[s].table.push(b);
                }
                stats.appended_tokens += len - past;
                extend_row.insert(s, extend.len());
                extend.push((s, past));
                continue;
            }
            let Admit::Extend { past } = admit else {
                continue;
            };
            let len = self.seq_len(s);
            let g = self.seqs[s].group;
            let mut table = Vec::with_capacity(len.div_ceil(bs) + 1);
            if past > 0 {
                let shared = self.groups[g]
                    .prompt_blocks
                    .get(..past / bs)
                    .ok_or_else(|| {
                        RolloutError::input(
                            format!("paged scheduler, prompt {g}"),
                            format!("{} shared prompt blocks", past / bs),
                            format!("{}", self.groups[g].prompt_blocks.len()),
                        )
                    })?;
                for &b in shared {
                    self.pool.share(b);
                    table.push(b);
                }
            }
            while table.len() * bs < len {
                table.push(self.pool.alloc()?);
            }
            let group = &mut self.groups[g];
            if group.holders == 0 {
                group.prompt_blocks = table[..group.tokens.len() / bs].to_vec();
            }
            group.holders += 1;
            if group.prefilled || past > 0 || len > group.tokens.len() {
                stats.recomputed_tokens += len - past;
            }
            group.prefilled = true;
            let seq = &mut self.seqs[s];
            seq.holds_prompt = true;
            seq.table = table;
            extend_row.insert(s, extend.len());
            extend.push((s, past));
        }
        self.kv.copy_blocks(&cow_src, &cow_dst)?;
        let nb = extend
            .iter()
            .map(|&(s, _)| self.seqs[s].table.len())
            .max()
            .unwrap_or(0);
        debug_assert_eq!(rows, extend.len(), "planned prefill rows");
        let mut batch = HostBatch::new(rows, width, nb);
        batch.table.fill(TRASH_BLOCK as i64);
        for (r, &(s, past)) in extend.iter().enumerate() {
            let tokens = self.token_range(s, past);
            batch.set_row(r, &tokens, past, &self.seqs[s].table, bs);
            self.seqs[s].cached = self.seq_len(s);
        }
        let logits = paged_attn::forward(self.model, &self.kv, &batch)?;
        stats.prefill_steps += 1;
        // The device runs the prefill just queued while the host captures.
        if let (Some(rows), Some(graphs)) = (self.precapture.take(), self.graphs.as_mut()) {
            graphs.precapture(self.model, &self.kv, rows, &self.job.sampler)?;
        }

        // Forks share their leader's blocks and logits row.
        let mut pick = Vec::with_capacity(plan.len());
        for &(s, admit) in &plan {
            match admit {
                Admit::Extend { .. } | Admit::Resume { .. } => pick.push(extend_row[&s] as i64),
                Admit::Fork { leader } => {
                    let table = self.seqs[leader].table.clone();
                    for &b in &table {
                        self.pool.share(b);
                    }
                    let cached = self.seqs[leader].cached;
                    let seq = &mut self.seqs[s];
                    seq.table = table;
                    seq.cached = cached;
                    seq.holds_prompt = true;
                    self.groups[seq.group].holders += 1;
                    pick.push(extend_row[&leader] as i64);
                }
            }
        }
        let identity = pick.iter().enumerate().all(|(i, &r)| i as i64 == r);
        let logits = if identity {
            logits
        } else {
            logits.f_index_select(0, &paged_attn::upload_i64(&pick, self.model.device())?)?
        };
        let admitted: Vec<usize> = plan.iter().map(|&(s, _)| s).collect();
        self.running.extend_from_slice(&admitted);
        verl_nn::profile::lap(&mut timer, "prefill/forward");
        self.sample(&admitted, &logits, out, "prefill")?;
        if self.first_token_at.is_none() {
            stats.prefill_secs = self.job.start.elapsed().as_secs_f64();
            self.first_token_at = Some(Instant::now());
        }
        Ok(true)
    }

    /// The sampling uniforms of `seqs` (`None` when greedy): each sequence's own stream at its
    /// next position.
    fn uniforms(&self, seqs: &[usize]) -> Option<Vec<f32>> {
        self.uniforms_ahead(seqs, 0)
    }

    /// [`Engine::uniforms`] when each of `seqs` has `ahead` sampled tokens not yet recorded.
    fn uniforms_ahead(&self, seqs: &[usize], ahead: usize) -> Option<Vec<f32>> {
        if self.job.sampler.is_greedy() {
            return None;
        }
        Some(
            seqs.iter()
                .map(|&s| {
                    let seq = &self.seqs[s];
                    rng::uniform(seq.key, (seq.out.len() + ahead) as u64) as f32
                })
                .collect(),
        )
    }

    /// Samples the next token of each of `seqs` (rows of `logits`), records it, and retires the
    /// sequences that finished.
    fn sample(
        &mut self,
        seqs: &[usize],
        logits: &Tensor,
        out: &mut Outputs,
        phase: &'static str,
    ) -> Result<()> {
        let mut timer = verl_nn::profile::start(self.model.device());
        let uniforms = match self.uniforms(seqs) {
            Some(u) => Some(paged_attn::upload_f32(&u, self.model.device())?),
            None => None,
        };
        let (tokens, lp) = self.job.sampler.sample(logits, uniforms.as_ref())?;
        verl_nn::profile::lap(
            &mut timer,
            if phase == "decode" {
                "decode/sample"
            } else {
                "prefill/sample"
            },
        );
        self.record(seqs, &tokens, lp.as_ref(), out, phase)
    }

    /// Downloads the sampled `tokens` (and log-probs) of `seqs`, records them, and retires the
    /// sequences that finished.
    fn record(
        &mut self,
        seqs: &[usize],
        tokens: &Tensor,
        lp: Option<&Tensor>,
        out: &mut Outputs,
        phase: &'static str,
    ) -> Result<()> {
        let mut timer = verl_nn::profile::start(self.model.device());
        let (tokens, lps) = fetch_samples(tokens, lp)?;
        self.record_host(seqs, None, &tokens, lps.as_deref(), out);
        verl_nn::profile::lap(
            &mut timer,
            if phase == "decode" {
                "decode/fetch_bookkeeping"
            } else {
                "prefill/fetch_bookkeeping"
            },
        );
        Ok(())
    }

    /// Records the sampled `tokens` (and log-probs) of `seqs` and retires the sequences that
    /// finished; a token of a sequence already finished (queued one step ahead) is dropped.
    fn record_host(
        &mut self,
        seqs: &[usize],
        epochs: Option<&[u32]>,
        tokens: &[i64],
        lps: Option<&[f32]>,
        out: &mut Outputs,
    ) {
        let params = &self.job.params;
        let m = params.max_new_tokens;
        let turns = self.job.turns;
        let mut done = Vec::new();
        let mut paused = Vec::new();
        for (k, &s) in seqs.iter().enumerate() {
            let seq = &mut self.seqs[s];
            // Stopped, or resumed since the step was queued: the token is not the sequence's.
            if seq.finished || epochs.is_some_and(|e| e[k] != seq.epoch) {
                continue;
            }
            let tok = tokens[k];
            let t = seq.out.len();
            seq.out.push(tok);
            out.tokens[seq.row * m + t] = tok;
            if let Some(lps) = &lps {
                out.log_probs[seq.row * m + t] = lps[k];
            }
            if let Some(sampled) = out.sampled.as_mut() {
                sampled[seq.row * m + t] = true;
            }
            out.lengths[seq.row] = t + 1;
            let stop = !params.ignore_eos && params.eos_token_ids.contains(&tok);
            if !stop && t + 1 < m {
                continue;
            }
            out.finish[seq.row] = if stop {
                FinishReason::Stop
            } else {
                FinishReason::Length
            };
            seq.finished = true;
            // A turn that stops with room left waits for the caller.
            let waits = turns && t + 1 < m;
            if turns {
                self.ended.push(TurnEnd {
                    row: seq.row,
                    tokens: seq.out[seq.turn_start..].to_vec(),
                    finish: out.finish[seq.row],
                    waits,
                    response_len: t + 1,
                });
            }
            if waits {
                seq.paused = true;
                paused.push(s);
            } else {
                done.push(s);
            }
        }
        self.paused += paused.len();
        if !done.is_empty() || !paused.is_empty() {
            for &s in &done {
                self.release(s);
            }
            self.running
                .retain(|s| !done.contains(s) && !paused.contains(s));
        }
    }

    /// Waits for the in-flight step's tokens (their copy was queued right after it) and records
    /// them.
    fn flush(&mut self, out: &mut Outputs) -> Result<()> {
        let Some(f) = self.inflight.take() else {
            return Ok(());
        };
        let mut timer = verl_nn::profile::start(self.model.device());
        f.event.synchronize()?;
        let tokens = Vec::<i64>::try_from(&f.host_tokens)?;
        let lps = match &f.host_lp {
            Some(t) => Some(Vec::<f32>::try_from(t)?),
            None => None,
        };
        self.record_host(&f.seqs, Some(&f.epochs), &tokens, lps.as_deref(), out);
        verl_nn::profile::lap(&mut timer, "decode/fetch_bookkeeping");
        Ok(())
    }

    /// Queues the copy of a graphed step's sampled tokens (and log-probs) to pinned host memory
    /// and an event after it.
    fn start_fetch(
        &self,
        seqs: Vec<usize>,
        tokens: Tensor,
        lp: Option<Tensor>,
    ) -> Result<Inflight> {
        let dev = self.model.device();
        let Device::Cuda(index) = dev else {
            return Err(RolloutError::input(
                "async decode",
                "a CUDA device",
                format!("{dev:?}"),
            ));
        };
        let pinned = |t: &Tensor| -> Result<Tensor> {
            let host =
                Tensor::f_empty(t.size(), (t.kind(), Device::Cpu))?.f_internal_pin_memory(dev)?;
            verl_torch_ext::copy_nonblocking(&host, t)?;
            Ok(host)
        };
        let host_tokens = pinned(&tokens)?;
        let host_lp = lp.as_ref().map(pinned).transpose()?;
        Ok(Inflight {
            epochs: seqs.iter().map(|&s| self.seqs[s].epoch).collect(),
            seqs,
            tokens,
            host_tokens,
            host_lp,
            event: verl_torch_ext::CudaEvent::record(index)?,
        })
    }

    /// Allocates the blocks `rows` write next (a fresh block, or a private copy of a shared one)
    /// and queues the copies.
    fn grow_tables(&mut self, rows: &[usize]) -> Result<()> {
        let bs = self.bs;
        let (mut cow_src, mut cow_dst) = (Vec::new(), Vec::new());
        for &s in rows {
            let bi = self.seqs[s].cached / bs;
            match self.seqs[s].table.get(bi).copied() {
                None => {
                    let b = self.pool.alloc()?;
                    self.seqs[s].table.push(b);
                }
                Some(b) if self.pool.refcount(b) > 1 => {
                    let fresh = self.pool.alloc()?;
                    self.pool.release(b);
                    self.seqs[s].table[bi] = fresh;
                    cow_src.push(b);
                    cow_dst.push(fresh);
                }
                Some(_) => {}
            }
        }
        self.kv.copy_blocks(&cow_src, &cow_dst)
    }

    /// Queues the next decode step from the in-flight step's tokens on the device, before the
    /// host has recorded them, when nothing needs them first: no sequence waits for admission,
    /// no preemption is needed and the step's graph is captured. A sequence that the in-flight
    /// token ends by EOS decodes once more (that token is dropped); one it ends by length does
    /// not. Returns the new in-flight step, or `None` to record first and step as usual.
    fn overlapped_step(
        &mut self,
        f: &Inflight,
        stats: &mut GenerationStats,
    ) -> Result<Option<Inflight>> {
        if !self.overlap || !self.waiting.is_empty() {
            return Ok(None);
        }
        let Some(graphs) = self.graphs.as_ref() else {
            return Ok(None);
        };
        let m = self.job.params.max_new_tokens;
        let rows: Vec<usize> = f
            .seqs
            .iter()
            .copied()
            .filter(|&s| !self.seqs[s].finished && self.seqs[s].out.len() + 1 < m)
            .collect();
        if rows.is_empty() || self.decode_needs_of(&rows) > self.pool.num_free() {
            return Ok(None);
        }
        let nb = rows
            .iter()
            .map(|&s| {
                let seq = &self.seqs[s];
                seq.table.len().max(seq.cached / self.bs + 1)
            })
            .max()
            .unwrap_or(0);
        if !graphs.ready(rows.len(), nb, self.kv.kernel) {
            return Ok(None);
        }
        let mut timer = verl_nn::profile::start(self.model.device());
        self.grow_tables(&rows)?;
        let mut batch = HostBatch::new(rows.len(), 1, nb);
        batch.table.fill(TRASH_BLOCK as i64);
        for (r, &s) in rows.iter().enumerate() {
            let seq = &self.seqs[s];
            // The token itself comes from the device.
            batch.set_row(r, &[0], seq.cached, &seq.table, self.bs);
        }
        let identity = rows.len() <= f.seqs.len() && rows.iter().zip(&f.seqs).all(|(a, b)| a == b);
        let src = if identity {
            None
        } else {
            let pos: HashMap<usize, i64> = f
                .seqs
                .iter()
                .enumerate()
                .map(|(i, &s)| (s, i as i64))
                .collect();
            let idx: Vec<i64> = rows.iter().map(|s| pos[s]).collect();
            Some(paged_attn::upload_i64(&idx, self.model.device())?)
        };
        let uniforms = self.uniforms_ahead(&rows, 1);
        verl_nn::profile::lap(&mut timer, "decode/host_batch");
        let graphs = self.graphs.as_mut().expect("checked above");
        let Some((tokens, lp)) = graphs.decode(
            self.model,
            &self.kv,
            &batch,
            &self.job.sampler,
            uniforms.as_deref(),
            Some((&f.tokens, src.as_ref())),
        )?
        else {
            return Ok(None);
        };
        stats.decode_steps += 1;
        stats.overlapped_steps += 1;
        stats.decode_tokens += rows.len();
        for &s in &rows {
            self.seqs[s].cached += 1;
        }
        let next = self.start_fetch(rows, tokens, lp)?;
        verl_nn::profile::lap(&mut timer, "decode/graph_forward_sample");
        Ok(Some(next))
    }

    /// Applies the multi-turn driver's answers: appended tokens put a waiting sequence back in
    /// the queue (with its KV, when kept), a finish releases it.
    fn answer(
        &mut self,
        answers: Vec<Resume>,
        out: &mut Outputs,
        stats: &mut GenerationStats,
    ) -> Result<()> {
        let m = self.job.params.max_new_tokens;
        for a in answers {
            let row = match &a {
                Resume::Continue { row, .. } | Resume::Finish { row } => *row,
            };
            // Sequences are indexed by their output row.
            let waiting = self.seqs.get(row).is_some_and(|q| q.paused);
            if !waiting {
                return Err(RolloutError::input(
                    "multi-turn driver answer",
                    "a row that waits for an answer",
                    format!("row {row}, which does not wait"),
                ));
            }
            match a {
                Resume::Finish { .. } => {
                    self.seqs[row].paused = false;
                    self.paused -= 1;
                    self.release(row);
                }
                Resume::Continue { tokens, .. } => {
                    let len = self.seqs[row].out.len();
                    if tokens.is_empty() || len + tokens.len() >= m {
                        return Err(RolloutError::input(
                            format!("multi-turn driver answer for row {row}"),
                            format!(
                                "1 or more appended tokens leaving room to sample (response \
                                 {len} of {m} positions used)"
                            ),
                            format!("{} tokens", tokens.len()),
                        ));
                    }
                    for (i, &tok) in tokens.iter().enumerate() {
                        out.tokens[row * m + len + i] = tok;
                    }
                    out.lengths[row] = len + tokens.len();
                    let seq = &mut self.seqs[row];
                    seq.out.extend_from_slice(&tokens);
                    seq.turn_start = seq.out.len();
                    seq.paused = false;
                    seq.finished = false;
                    // A token a step in flight holds for it belongs to the stopped turn.
                    seq.epoch += 1;
                    self.paused -= 1;
                    stats.turns += 1;
                    self.waiting.push_back(row);
                }
            }
        }
        Ok(())
    }

    /// Releases the KV of one sequence waiting for the caller (or waiting to resume), the one
    /// holding the most blocks; it is recomputed when the sequence runs again. Returns whether
    /// any was held.
    fn evict_waiting(&mut self, stats: &mut GenerationStats) -> bool {
        let running: std::collections::HashSet<usize> = self.running.iter().copied().collect();
        let victim = (0..self.seqs.len())
            .filter(|&s| !running.contains(&s) && !self.seqs[s].table.is_empty())
            .max_by_key(|&s| self.seqs[s].table.len());
        match victim {
            Some(s) => {
                self.release(s);
                stats.evicted_waiting += 1;
                true
            }
            None => false,
        }
    }

    /// Returns a sequence's blocks to the pool.
    fn release(&mut self, s: usize) {
        let seq = &mut self.seqs[s];
        for &b in &seq.table {
            self.pool.release(b);
        }
        seq.table.clear();
        seq.cached = 0;
        if std::mem::take(&mut seq.holds_prompt) {
            let g = &mut self.groups[seq.group];
            g.holders -= 1;
            if g.holders == 0 {
                g.prompt_blocks.clear();
            }
        }
    }

    fn decode_step(&mut self, out: &mut Outputs, stats: &mut GenerationStats) -> Result<()> {
        if let Some(f) = self.inflight.take() {
            let next = self.overlapped_step(&f, stats)?;
            self.inflight = Some(f);
            self.flush(out)?;
            if next.is_some() {
                self.inflight = next;
                return Ok(());
            }
        }
        let mut timer = verl_nn::profile::start(self.model.device());
        while self.decode_needs() > self.pool.num_free() {
            // Sequences waiting for the caller give up their KV before running ones do.
            if self.job.turns && self.evict_waiting(stats) {
                continue;
            }
            let victim = self.running.pop().ok_or_else(|| {
                RolloutError::input(
                    "paged scheduler",
                    "a running sequence to preempt",
                    "none left",
                )
            })?;
            self.release(victim);
            self.waiting.push_front(victim);
            stats.preemptions += 1;
        }
        if self.running.is_empty() {
            return Ok(());
        }
        let bs = self.bs;
        let running = self.running.clone();
        self.grow_tables(&running)?;
        let nb = self
            .running
            .iter()
            .map(|&s| self.seqs[s].table.len())
            .max()
            .unwrap_or(0);
        let mut batch = HostBatch::new(self.running.len(), 1, nb);
        batch.table.fill(TRASH_BLOCK as i64);
        for (r, &s) in self.running.iter().enumerate() {
            let seq = &self.seqs[s];
            let last = *seq.out.last().ok_or_else(|| {
                RolloutError::input(
                    "paged scheduler",
                    "a sampled token before decoding",
                    format!("sequence {s} with none"),
                )
            })?;
            batch.set_row(r, &[last], seq.cached, &seq.table, bs);
        }
        verl_nn::profile::lap(&mut timer, "decode/host_batch");
        let uniforms = self.uniforms(&running);
        let graphed = match self.graphs.as_mut() {
            Some(g) => g.decode(
                self.model,
                &self.kv,
                &batch,
                &self.job.sampler,
                uniforms.as_deref(),
                None,
            )?,
            None => None,
        };
        stats.decode_steps += 1;
        stats.decode_tokens += running.len();
        for &s in &running {
            self.seqs[s].cached += 1;
        }
        match graphed {
            Some((tokens, lp)) if self.overlap => {
                // Recorded by the next step, which may be queued before it (async scheduling).
                self.inflight = Some(self.start_fetch(running, tokens, lp)?);
                verl_nn::profile::lap(&mut timer, "decode/graph_forward_sample");
                Ok(())
            }
            Some((tokens, lp)) => {
                verl_nn::profile::lap(&mut timer, "decode/graph_forward_sample");
                self.record(&running, &tokens, lp.as_ref(), out, "decode")
            }
            None => {
                let logits = paged_attn::forward(self.model, &self.kv, &batch)?;
                verl_nn::profile::lap(&mut timer, "decode/forward");
                self.sample(&running, &logits, out, "decode")
            }
        }
    }
}

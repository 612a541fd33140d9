//! Row layouts of a micro-batch (verl's `use_remove_padding`) and the map from hidden states to the
//! response tokens they predict, so that only those states go through the LM head.
//!
//! A batch row is `left-padded prompt ‖ right-padded response`: its real tokens sit in one span
//! `[first, last]` of the `P + R` columns. [`Padding::Keep`] runs the micro-batch as it is (minus the
//! prompt columns that are padding in every row, see [`Sequences::select`]) and reads every response
//! position. [`Padding::Remove`] shifts each row left by its own padding, so a micro-batch is only as
//! long as its longest real row, and reads the positions of real response tokens only; the other
//! positions of its per-token outputs are 0, as verl's unpadded path writes them.
//!
//! [`Padding::SharedPrompt`] (verl's `actor.use_prefix_grouper`) also drops the padding and
//! packs the micro-batch into one token stream where rows with the same prompt (a GRPO group's
//! samples) share it: the prompt's tokens appear once, so the projections and MLPs run over them
//! once, and attention runs per row over the shared prompt's keys/values and the row's own
//! response ([`verl_nn::AttentionRows`]).
//!
//! All layouts give the same values at real tokens: position ids are carried over from the full
//! row, attention keeps its causal order, and padded keys are masked either way.

use std::collections::HashMap;

use tch::{Kind, Tensor};

use verl_nn::{AttentionRows, Transformer};

use verl_backend_kit::config::MicroBatching;
use verl_backend_kit::data::{
    budget_too_small, chunks, index_tensor, pack_longest_first, upload_i64, HostRows, Sequences,
};
use verl_backend_kit::error::{BackendError, Result, TorchContext};

/// Whether a micro-batch keeps its padding (`use_remove_padding: false`) or drops it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Padding {
    Keep,
    Remove,
    /// Padding removed and prompts shared within the micro-batch (`actor.use_prefix_grouper`).
    SharedPrompt,
}

impl Padding {
    /// `use_remove_padding` and `use_prefix_grouper` (which drops the padding whatever the first
    /// says).
    pub fn from_flags(remove: bool, share_prompts: bool) -> Padding {
        match (remove, share_prompts) {
            (_, true) => Padding::SharedPrompt,
            (true, false) => Padding::Remove,
            (false, false) => Padding::Keep,
        }
    }

    pub fn from_flag(remove: bool) -> Padding {
        Self::from_flags(remove, false)
    }

    /// Micro-batches of a forward-only pass over `seqs`, whose results are per row so the
    /// grouping is free: with shared prompts a group's rows stay together
    /// ([`prompt_group_micro_batches`]), otherwise rows are grouped by length
    /// ([`length_sorted_micro_batches`]).
    pub fn forward_micro_batches(
        self,
        seqs: &Sequences,
        mode: MicroBatching,
        budget_key: &str,
    ) -> Result<Vec<Vec<usize>>> {
        let lengths = seqs.row_lengths()?;
        match self {
            Padding::SharedPrompt => {
                let rows: Vec<usize> = (0..lengths.len()).collect();
                let groups = PromptGroups::of(seqs)?;
                prompt_group_micro_batches(&rows, &groups, &lengths, mode, budget_key)
            }
            Padding::Keep | Padding::Remove => {
                length_sorted_micro_batches(&lengths, mode, budget_key)
            }
        }
    }
}

/// One micro-batch as the model sees it, and which of its hidden states predict which response
/// tokens.
pub struct RowLayout {
    /// int64 `[rows, L]`.
    pub input_ids: Tensor,
    /// int64 `[rows, L]`, 1 on real tokens.
    pub attention_mask: Tensor,
    /// int64 `[rows, L]`, the full rows' position ids.
    pub position_ids: Tensor,
    /// int64 `[N]`: flat indices into `[rows * L]` of the states that predict the selected tokens.
    pub predictors: Tensor,
    /// int64 `[N]`: flat indices into `[rows * R]` of the selected response tokens.
    pub slots: Tensor,
    /// int64 `[N]`: the selected response token ids.
    pub targets: Tensor,
    /// f32 `[rows, R]`.
    pub response_mask: Tensor,
    pub rows: i64,
    pub response_len: i64,
    /// Every row's real tokens come first (padding only at the end): causal attention alone keeps
    /// real tokens from seeing padding, so the model needs no mask ([`RowLayout::model_mask`]).
    pub prefix_aligned: bool,
    /// [`Padding::SharedPrompt`]: `input_ids` is one `[1, N]` stream attended through these rows.
    pub attention_rows: Option<AttentionRows>,
}

impl RowLayout {
    /// The attention mask the model needs: none for a prefix-aligned layout (plain causal
    /// attention, flash attention on CUDA, gives the same values at real tokens), else the
    /// layout's mask.
    pub fn model_mask(&self) -> Option<&Tensor> {
        (!self.prefix_aligned).then_some(&self.attention_mask)
    }

    /// The rows `idx` of `seqs` laid out for `padding`.
    pub fn new(seqs: &Sequences, idx: &[usize], padding: Padding) -> Result<RowLayout> {
        let device = seqs.input_ids.device();
        let index = index_tensor(idx, device)?;
        match padding {
            Padding::Keep => Self::keep(seqs, &index),
            Padding::Remove => Self::remove(seqs, idx, &index),
            Padding::SharedPrompt => Self::shared(seqs, idx, &index),
        }
    }

    /// Final hidden states of the layout's forward (`[rows, L, H]`, or `[1, N, H]` for a
    /// shared-prompt stream).
    pub fn forward_hidden(&self, model: &Transformer) -> verl_nn::Result<Tensor> {
        match &self.attention_rows {
            Some(rows) => model.forward_hidden_rows(&self.input_ids, &self.position_ids, rows),
            None => model.forward_hidden(
                &self.input_ids,
                self.model_mask(),
                Some(&self.position_ids),
                None,
            ),
        }
    }

    fn shared(seqs: &Sequences, idx: &[usize], index: &Tensor) -> Result<RowLayout> {
        let device = seqs.input_ids.device();
        let pick = |t: &Tensor| t.f_index_select(0, index).ctx("select micro-batch rows");
        let (p, r) = (seqs.prompt_len, seqs.response_len);
        let total = (p + r) as usize;
        let response_mask = pick(&seqs.response_mask)?;
        let rows = response_mask.size()[0];
        let host = seqs.host()?;
        let ids = HostRows::rows(&host.ids, total, idx);
        let mask = HostRows::rows(&host.mask, total, idx);
        let pos = HostRows::rows(&host.pos, total, idx);
        let resp = HostRows::rows(&host.selected, r as usize, idx);
        let (p, r) = (p as usize, r as usize);
        let mut stream = Stream::default();
        // Prompt key -> (stream offset of its tokens, their count, the row whose attention row
        // gives them their outputs).
        let mut groups: HashMap<Vec<i64>, (usize, usize, usize)> = HashMap::new();
        // Per row: its group, its response's stream offset and length.
        let mut row_parts: Vec<((usize, usize, usize), usize, usize)> = Vec::new();
        for i in 0..rows as usize {
            let row = |v: &[i64]| -> Vec<i64> { v[i * total..(i + 1) * total].to_vec() };
            let (m, ids, pos) = (row(&mask), row(&ids), row(&pos));
            let first = m.iter().position(|&x| x != 0).unwrap_or(0);
            let last = m.iter().rposition(|&x| x != 0).map_or(0, |k| k + 1);
            // Each row's span as in `Remove`: from its first real token (at most the last prompt
            // column, which predicts the first response token) through its last real token, and
            // far enough to hold the predictor of its last selected response token.
            let start = first.min(p - 1);
            let needed = resp[i * r..(i + 1) * r]
                .iter()
                .rposition(|&x| x != 0)
                .unwrap_or(0);
            let resp_len = last.saturating_sub(p).max(needed);
            let mut key = ids[start..p].to_vec();
            key.extend_from_slice(&pos[start..p]);
            let group = *groups.entry(key).or_insert_with(|| {
                let at = stream.push(&ids[start..p], &pos[start..p]);
                (at, p - start, i)
            });
            let at = stream.push(&ids[p..p + resp_len], &pos[p..p + resp_len]);
            row_parts.push((group, at, resp_len));
        }
        let len = row_parts
            .iter()
            .map(|((_, plen, _), _, rl)| plen + rl)
            .max()
            .unwrap_or(1);
        let n = stream.ids.len();
        let mut gather = Vec::with_capacity(rows as usize * len);
        let mut scatter = vec![0i64; n];
        let (mut predictors, mut slots) = (Vec::new(), Vec::new());
        for (i, &((p_at, plen, owner), at, rl)) in row_parts.iter().enumerate() {
            gather.extend((p_at..p_at + plen).map(|k| k as i64));
            gather.extend((at..at + rl).map(|k| k as i64));
            gather.extend(std::iter::repeat_n(0, len - plen - rl));
            if owner == i {
                for k in 0..plen {
                    scatter[p_at + k] = (i * len + k) as i64;
                }
            }
            for j in 0..rl {
                scatter[at + j] = (i * len + plen + j) as i64;
            }
            for j in 0..r {
                if resp[i * r + j] != 0 {
                    predictors.push(if j == 0 { p_at + plen - 1 } else { at + j - 1 } as i64);
                    slots.push((i * r + j) as i64);
                }
            }
        }
        let on_device = |v: &[i64], what: &str| upload_i64(v, device, what);
        let stream_row = |v: &[i64], what: &str| on_device(v, what)?.f_view([1, -1]).ctx(what);
        let slots = on_device(&slots, "response slots")?;
        let targets = pick(&seqs.responses)?
            .f_reshape([-1])
            .and_then(|t| t.f_index_select(0, &slots))
            .ctx("response targets")?;
        let attention_rows = AttentionRows::from_host(&gather, &scatter, rows, len as i64, device)?;
        Ok(RowLayout {
            input_ids: stream_row(&stream.ids, "stream ids")?,
            attention_mask: Tensor::f_ones([1, n as i64], (Kind::Int64, device))
                .ctx("stream mask")?,
            position_ids: stream_row(&stream.pos, "stream positions")?,
            predictors: on_device(&predictors, "response predictor indices")?,
            slots,
            targets,
            response_mask,
            rows,
            response_len: r as i64,
            prefix_aligned: true,
            attention_rows: Some(attention_rows),
        })
    }

    fn keep(seqs: &Sequences, index: &Tensor) -> Result<RowLayout> {
        let sub = seqs.select(index)?;
        let device = sub.input_ids.device();
        let (rows, r) = (sub.rows() as i64, sub.response_len);
        let l = sub.prompt_len + r;
        let opts = (Kind::Int64, device);
        // predictors[i, j] = i·L + (P' - 1 + j)
        let predictors = Tensor::f_arange(rows, opts)
            .and_then(|t| t.f_mul_scalar(l))
            .and_then(|t| t.f_view([rows, 1]))
            .and_then(|t| {
                t.f_add(
                    &Tensor::f_arange(r, opts)?
                        .f_add_scalar(sub.prompt_len - 1)?
                        .f_view([1, r])?,
                )
            })
            .and_then(|t| t.f_reshape([-1]))
            .ctx("response predictor indices")?;
        let slots = Tensor::f_arange(rows * r, opts).ctx("response slots")?;
        let targets = sub.responses.f_reshape([-1]).ctx("response targets")?;
        Ok(RowLayout {
            input_ids: sub.input_ids,
            attention_mask: sub.attention_mask,
            position_ids: sub.position_ids,
            predictors,
            slots,
            targets,
            response_mask: sub.response_mask,
            rows,
            response_len: r,
            prefix_aligned: false,
            attention_rows: None,
        })
    }

    fn remove(seqs: &Sequences, idx: &[usize], index: &Tensor) -> Result<RowLayout> {
        let device = seqs.input_ids.device();
        let pick = |t: &Tensor| t.f_index_select(0, index).ctx("select micro-batch rows");
        let (p, r) = (seqs.prompt_len, seqs.response_len);
        let total = p + r;
        let response_mask = pick(&seqs.response_mask)?;
        let rows = response_mask.size()[0];
        let host = seqs.host()?;
        let host_mask = HostRows::rows(&host.mask, total as usize, idx);
        let host_resp = HostRows::rows(&host.selected, r as usize, idx);
        // Each row's span [start, end): from its first real token (at most the last prompt column,
        // which predicts the first response token) through its last real token.
        let mut starts = Vec::with_capacity(rows as usize);
        let mut len = 1i64;
        for i in 0..rows as usize {
            let row = &host_mask[i * total as usize..(i + 1) * total as usize];
            let first = row.iter().position(|&m| m != 0).unwrap_or(0) as i64;
            let last = row
                .iter()
                .rposition(|&m| m != 0)
                .map_or(0, |k| k as i64 + 1);
            let start = first.min(p - 1);
            starts.push(start);
            len = len.max(last - start);
        }
        let opts = (Kind::Int64, device);
        let start_t = upload_i64(&starts, device, "row starts")?
            .f_view([rows, 1])
            .ctx("row starts")?;
        let raw_cols = Tensor::f_arange(len, opts)
            .and_then(|t| t.f_view([1, len]))
            .and_then(|t| t.f_add(&start_t))
            .ctx("row columns")?;
        let in_range = raw_cols.f_lt(total).ctx("row columns")?;
        let cols = raw_cols.f_clamp_max(total - 1).ctx("row columns")?;
        let gather = |t: &Tensor| pick(t)?.f_gather(1, &cols, false).ctx("shift rows");
        let input_ids = gather(&seqs.input_ids)?;
        let attention_mask = gather(&seqs.attention_mask)?
            .f_mul(&in_range)
            .ctx("shifted mask")?;
        let position_ids = gather(&seqs.position_ids)?;
        let (mut predictors, mut slots) = (Vec::new(), Vec::new());
        for (i, &start) in starts.iter().enumerate() {
            for j in 0..r {
                if host_resp[i * r as usize + j as usize] != 0 {
                    predictors.push(i as i64 * len + (p + j - 1 - start));
                    slots.push(i as i64 * r + j);
                }
            }
        }
        let on_device = |v: &[i64], what: &str| upload_i64(v, device, what);
        let slots = on_device(&slots, "response slots")?;
        let targets = pick(&seqs.responses)?
            .f_reshape([-1])
            .and_then(|t| t.f_index_select(0, &slots))
            .ctx("response targets")?;
        Ok(RowLayout {
            input_ids,
            attention_mask,
            position_ids,
            predictors: on_device(&predictors, "response predictor indices")?,
            slots,
            targets,
            response_mask,
            rows,
            response_len: r,
            prefix_aligned: true,
            attention_rows: None,
        })
    }

    /// Positions the model runs over (`rows × L`).
    pub fn positions(&self) -> i64 {
        let s = self.input_ids.size();
        s[0] * s[1]
    }

    /// Selected tokens (`N`).
    pub fn selected(&self) -> i64 {
        self.predictors.size()[0]
    }

    /// The states of model output `out` (`[rows, L, ...]`) that predict the selected tokens:
    /// `[N, ...]`.
    pub fn gather(&self, out: &Tensor) -> Result<Tensor> {
        let s = out.size();
        let want = self.input_ids.size();
        if s.len() < 2 || s[..2] != want[..] {
            return Err(BackendError::Api(verl_plugin_api::Error::failed(format!(
                "model output has shape {s:?}, expected [{}, {}, ..] (the micro-batch layout)",
                want[0], want[1]
            ))));
        }
        let mut flat = vec![s[0] * s[1]];
        flat.extend_from_slice(&s[2..]);
        out.f_reshape(flat.as_slice())
            .and_then(|t| t.f_index_select(0, &self.predictors))
            .ctx("gather response predictors")
    }

    /// `[N]` values of the selected tokens placed into `[rows, R]` fp32, 0 elsewhere;
    /// differentiable with respect to `values`.
    pub fn scatter(&self, values: &Tensor) -> std::result::Result<Tensor, tch::TchError> {
        let values = values.f_to_kind(Kind::Float)?;
        Tensor::f_zeros(
            [self.rows * self.response_len],
            (Kind::Float, values.device()),
        )?
        .f_index_copy(0, &self.slots, &values)?
        .f_view([self.rows, self.response_len])
    }
}

/// Which rows of a batch share a prompt (the same tokens at the same positions over the prompt's
/// span, the key [`RowLayout`]'s shared layout uses), and each prompt's span length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptGroups {
    /// Per row: its group, numbered by first appearance.
    pub group: Vec<usize>,
    /// Per row: the tokens its prompt adds to a shared stream (the span from its first real
    /// prompt token, at least the last prompt column).
    pub prompt_len: Vec<i64>,
}

impl PromptGroups {
    pub fn of(seqs: &Sequences) -> Result<PromptGroups> {
        let p = seqs.prompt_len as usize;
        let total = p + seqs.response_len as usize;
        let host = seqs.host()?;
        let (ids, mask, pos) = (&host.ids, &host.mask, &host.pos);
        let mut keys: HashMap<Vec<i64>, usize> = HashMap::new();
        let (mut group, mut prompt_len) = (Vec::new(), Vec::new());
        for i in 0..seqs.rows() {
            let span = i * total..i * total + p;
            let start = mask[span.clone()]
                .iter()
                .position(|&m| m != 0)
                .unwrap_or(p - 1);
            let mut key = ids[span.clone()][start..].to_vec();
            key.extend_from_slice(&pos[span][start..]);
            let next = keys.len();
            group.push(*keys.entry(key).or_insert(next));
            prompt_len.push((p - start) as i64);
        }
        Ok(PromptGroups { group, prompt_len })
    }
}

/// Micro-batches of `rows` that keep each prompt group's rows together, so their prompt is shared
/// ([`Padding::SharedPrompt`]). `Rows(n)`: `rows` cut in order, `n` each (a group's rows sit
/// together in a GRPO batch). `Tokens(budget)`: each group's rows (split into consecutive parts
/// only where the group alone exceeds the budget) weigh the tokens of their shared stream, the
/// prompt once plus each row's response, and are packed longest-first into the fewest
/// micro-batches that keep every one under `budget`. Each micro-batch lists its rows in increasing
/// order.
pub fn prompt_group_micro_batches(
    rows: &[usize],
    groups: &PromptGroups,
    lengths: &[i64],
    mode: MicroBatching,
    budget_key: &str,
) -> Result<Vec<Vec<usize>>> {
    let budget = match mode {
        MicroBatching::Rows(n) => return Ok(chunks(rows, n)),
        MicroBatching::Tokens(b) => b as i64,
    };
    if let Some(&r) = rows.iter().find(|&&r| lengths[r] > budget) {
        return Err(budget_too_small(budget_key, budget, r, lengths[r]));
    }
    // Items: (stream tokens, rows), a group's rows in batch order.
    let mut by_group: Vec<(usize, Vec<usize>)> = Vec::new();
    for &r in rows {
        let g = groups.group[r];
        match by_group.iter_mut().find(|(k, _)| *k == g) {
            Some((_, v)) => v.push(r),
            None => by_group.push((g, vec![r])),
        }
    }
    let mut items: Vec<(i64, Vec<usize>)> = Vec::new();
    for (_, members) in by_group {
        let prompt = groups.prompt_len[members[0]];
        let mut cur: (i64, Vec<usize>) = (prompt, Vec::new());
        for r in members {
            let add = (lengths[r] - prompt).max(0);
            if !cur.1.is_empty() && cur.0 + add > budget {
                items.push(std::mem::replace(&mut cur, (prompt, Vec::new())));
            }
            cur.0 += add;
            cur.1.push(r);
        }
        items.push(cur);
    }
    items.sort_by_key(|(cost, v)| (std::cmp::Reverse(*cost), v[0]));
    Ok(pack_longest_first(&items, budget))
}

/// The token stream of a [`Padding::SharedPrompt`] layout under construction.
#[derive(Default)]
struct Stream {
    ids: Vec<i64>,
    pos: Vec<i64>,
}

impl Stream {
    /// Appends tokens; returns the stream offset of the first.
    fn push(&mut self, ids: &[i64], pos: &[i64]) -> usize {
        let at = self.ids.len();
        self.ids.extend_from_slice(ids);
        self.pos.extend_from_slice(pos);
        at
    }
}

/// Micro-batches of a forward-only pass, whose results are per row so the grouping is free: rows
/// sorted by length (longest first) and cut in order, so rows of similar length share a
/// micro-batch and an unpadded micro-batch wastes little on its longest row. `Rows(n)`: `n` rows
/// each; `Tokens(budget)`: as many rows as fit under `budget` real tokens. Each micro-batch lists its
/// rows in increasing order.
pub fn length_sorted_micro_batches(
    lengths: &[i64],
    mode: MicroBatching,
    budget_key: &str,
) -> Result<Vec<Vec<usize>>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&r| (std::cmp::Reverse(lengths[r]), r));
    let mut parts = match mode {
        MicroBatching::Rows(n) => chunks(&order, n),
        MicroBatching::Tokens(budget) => {
            let budget = budget as i64;
            let mut parts: Vec<Vec<usize>> = Vec::new();
            let mut load = 0i64;
            for &r in &order {
                if lengths[r] > budget {
                    return Err(budget_too_small(budget_key, budget, r, lengths[r]));
                }
                match parts.last_mut() {
                    Some(p) if load + lengths[r] <= budget => {
                        p.push(r);
                        load += lengths[r];
                    }
                    _ => {
                        parts.push(vec![r]);
                        load = lengths[r];
                    }
                }
            }
            parts
        }
    };
    for p in &mut parts {
        p.sort_unstable();
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_groups_stay_together_under_a_token_budget() {
        // Groups: rows 0-3 (prompt 4), 4-5 (prompt 2), 6 (prompt 3), 7-9 (prompt 5).
        let groups = PromptGroups {
            group: vec![0, 0, 0, 0, 1, 1, 2, 3, 3, 3],
            prompt_len: vec![4, 4, 4, 4, 2, 2, 3, 5, 5, 5],
        };
        let lengths = vec![7, 9, 5, 8, 6, 3, 10, 9, 8, 12];
        let stream = |part: &[usize]| -> i64 {
            let mut seen = Vec::new();
            let mut cost = 0;
            for &r in part {
                if !seen.contains(&groups.group[r]) {
                    seen.push(groups.group[r]);
                    cost += groups.prompt_len[r];
                }
                cost += lengths[r] - groups.prompt_len[r];
            }
            cost
        };
        let rows: Vec<usize> = (0..10).collect();
        for budget in [12, 16, 20, 40, 100] {
            let parts = prompt_group_micro_batches(
                &rows,
                &groups,
                &lengths,
                MicroBatching::Tokens(budget),
                "k",
            )
            .unwrap();
            let mut seen: Vec<usize> = parts.iter().flatten().copied().collect();
            seen.sort_unstable();
            assert_eq!(seen, rows, "budget {budget}: {parts:?}");
            for p in &parts {
                assert!(stream(p) <= budget as i64, "budget {budget}: {parts:?}");
                assert!(p.windows(2).all(|w| w[0] < w[1]));
            }
            // A group whose stream fits the budget is never split.
            for (g, size) in [(0, 17), (1, 7), (2, 10), (3, 19)] {
                if size <= budget as i64 {
                    let holders = parts
                        .iter()
                        .filter(|p| p.iter().any(|&r| groups.group[r] == g))
                        .count();
                    assert_eq!(holders, 1, "budget {budget}: group {g} split: {parts:?}");
                }
            }
        }
        // One micro-batch when everything fits; the whole stream is cheaper than the rows.
        let parts =
            prompt_group_micro_batches(&rows, &groups, &lengths, MicroBatching::Tokens(100), "k")
                .unwrap();
        assert_eq!(parts.len(), 1);
        assert!(stream(&parts[0]) < lengths.iter().sum::<i64>());
        let e = prompt_group_micro_batches(
            &rows,
            &groups,
            &lengths,
            MicroBatching::Tokens(11),
            "x.max_token_len",
        )
        .unwrap_err();
        assert!(e.to_string().contains("x.max_token_len"), "{e}");
        assert_eq!(
            prompt_group_micro_batches(&[4, 5, 6], &groups, &lengths, MicroBatching::Rows(2), "k")
                .unwrap(),
            vec![vec![4, 5], vec![6]]
        );
    }

    #[test]
    fn length_sorted_groups_cover_every_row_under_the_budget() {
        let lengths = vec![5, 9, 3, 7, 2, 8, 4];
        let parts = length_sorted_micro_batches(&lengths, MicroBatching::Tokens(12), "k").unwrap();
        let mut seen: Vec<usize> = parts.iter().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..7).collect::<Vec<_>>());
        for p in &parts {
            assert!(
                p.iter().map(|&r| lengths[r]).sum::<i64>() <= 12,
                "{parts:?}"
            );
        }
        let parts = length_sorted_micro_batches(&lengths, MicroBatching::Rows(3), "k").unwrap();
        assert_eq!(parts, vec![vec![1, 3, 5], vec![0, 2, 6], vec![4]]);
        let e = length_sorted_micro_batches(&lengths, MicroBatching::Tokens(8), "x.max_token_len")
            .unwrap_err();
        assert!(e.to_string().contains("x.max_token_len"), "{e}");
    }
}

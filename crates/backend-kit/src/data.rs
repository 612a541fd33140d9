//! Batch columns → device tensors, the (prompt ‖ response) sequence the model sees, and the
//! row partitions of micro-batching (fixed row counts or a token budget, verl's dynamic batch size).

use tch::{Device, Kind, Tensor};
use verl_plugin_api::{col, Batch};

use crate::config::MicroBatching;
use crate::error::{BackendError, Result, TorchContext};

/// A tensor column of the batch on `device` (uploaded before the call queues any work:
/// [`verl_torch_ext::upload_slice_blocking`]).
pub fn column<T: verl_plugin_api::Element + tch::kind::Element>(
    batch: &Batch,
    call: &'static str,
    name: &str,
    device: Device,
) -> Result<Tensor> {
    let t = batch.tensor_in::<T>(call, name)?;
    let shape: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
    verl_torch_ext::upload_slice_blocking(&t.data, &shape, device)
        .ctx(&format!("{call}: column `{name}` to {device:?}"))
}

/// `[rows, len]` f32 data of a tensor, row-major, for a batch column.
pub fn to_f32_vec(t: &Tensor, what: &str) -> Result<Vec<f32>> {
    to_host(t, Kind::Float, what)
}

/// A tensor's values on the host as `kind`, row-major (a download waits for the queued kernels).
fn to_host<T: tch::kind::Element + Copy>(t: &Tensor, kind: Kind, what: &str) -> Result<Vec<T>> {
    let flat = t
        .f_to_device(Device::Cpu)
        .and_then(|x| x.f_to_kind(kind))
        .and_then(|x| x.f_contiguous())
        .and_then(|x| x.f_view([-1]))
        .ctx(what)?;
    Vec::<T>::try_from(&flat).ctx(what)
}

/// `v` as an int64 tensor on `device`, without synchronising a GPU's stream
/// ([`verl_torch_ext::upload_slice`]): the host can lay out the next micro-batch while the
/// device runs this one.
pub fn upload_i64(v: &[i64], device: Device, what: &str) -> Result<Tensor> {
    verl_torch_ext::upload_slice(v, &[v.len() as i64], device).ctx(what)
}

/// The model's view of a batch: `input_ids = prompts ‖ responses`, the attention mask, verl's
/// position ids (`cumsum(mask) - 1`, clamped at 0) and the response part on its own.
pub struct Sequences {
    pub input_ids: Tensor,
    pub attention_mask: Tensor,
    pub position_ids: Tensor,
    pub responses: Tensor,
    /// f32 `[rows, response_length]`.
    pub response_mask: Tensor,
    pub prompt_len: i64,
    pub response_len: i64,
    /// Host copies of the index data, downloaded once (see [`Sequences::host`]).
    host: std::cell::OnceCell<HostRows>,
}

/// Host copies of a [`Sequences`]' index data, row-major: the micro-batch layouts are built from
/// these, so laying out a micro-batch reads nothing back from the device (a download waits for
/// every queued kernel).
#[derive(Debug)]
pub struct HostRows {
    /// `[rows, P + R]` token ids, attention mask (0/1) and position ids.
    pub ids: Vec<i64>,
    pub mask: Vec<i64>,
    pub pos: Vec<i64>,
    /// `[rows, R]`: 1 where the response mask selects a token.
    pub selected: Vec<i64>,
}

impl HostRows {
    /// Rows `idx` of `data` (`width` values per row), concatenated.
    pub fn rows(data: &[i64], width: usize, idx: &[usize]) -> Vec<i64> {
        let mut out = Vec::with_capacity(idx.len() * width);
        for &i in idx {
            out.extend_from_slice(&data[i * width..(i + 1) * width]);
        }
        out
    }
}

impl Sequences {
    pub fn from_batch(batch: &Batch, call: &'static str, device: Device) -> Result<Sequences> {
        let prompts = column::<i64>(batch, call, col::PROMPTS, device)?;
        let prompt_mask = column::<i64>(batch, call, col::PROMPT_MASK, device)?;
        let responses = column::<i64>(batch, call, col::RESPONSES, device)?;
        let response_mask = column::<i64>(batch, call, col::RESPONSE_MASK, device)?;
        let prompt_len = prompts.size()[1];
        let response_len = responses.size()[1];
        if prompt_len == 0 {
            return Err(BackendError::Input {
                call,
                column: col::PROMPTS.into(),
                expected: "at least one prompt token column (the first response token is predicted from it)".into(),
                found: "prompt_length 0".into(),
            });
        }
        let input_ids = Tensor::f_cat(&[&prompts, &responses], 1).ctx("cat prompts/responses")?;
        let attention_mask = Tensor::f_cat(&[&prompt_mask, &response_mask], 1).ctx("cat masks")?;
        let attention_mask = attention_mask
            .f_ne(0)
            .and_then(|m| m.f_to_kind(Kind::Int64))
            .ctx("mask")?;
        let position_ids = position_ids(&attention_mask)?;
        let response_mask = response_mask
            .f_ne(0)
            .and_then(|m| m.f_to_kind(Kind::Float))
            .ctx("response mask")?;
        // The tokens the losses count (rollout-correction rejection), a subset of the response.
        let response_mask = match batch.contains(col::LOSS_MASK) {
            false => response_mask,
            true => {
                let loss = column::<i64>(batch, call, col::LOSS_MASK, device)?
                    .f_ne(0)
                    .and_then(|m| m.f_to_kind(Kind::Float))
                    .ctx("loss mask")?;
                if loss.size() != response_mask.size() {
                    return Err(BackendError::Input {
                        call,
                        column: col::LOSS_MASK.into(),
                        expected: format!("the shape of response_mask {:?}", response_mask.size()),
                        found: format!("{:?}", loss.size()),
                    });
                }
                let outside = loss
                    .f_gt_tensor(&response_mask)
                    .and_then(|m| m.f_any())
                    .and_then(|m| m.f_int64_value(&[]))
                    .ctx("loss mask")?;
                if outside != 0 {
                    return Err(BackendError::Input {
                        call,
                        column: col::LOSS_MASK.into(),
                        expected: "a subset of response_mask".into(),
                        found: "a 1 where response_mask is 0".into(),
                    });
                }
                loss
            }
        };
        Ok(Sequences {
            input_ids,
            attention_mask,
            position_ids,
            responses,
            response_mask,
            prompt_len,
            response_len,
            host: Default::default(),
        })
    }

    /// Host copies of the index data, downloaded at the first call (one download per tensor).
    pub fn host(&self) -> Result<&HostRows> {
        if let Some(h) = self.host.get() {
            return Ok(h);
        }
        let selected = self
            .response_mask
            .f_ne(0)
            .and_then(|m| m.f_to_kind(Kind::Int64))
            .ctx("response mask")?;
        let h = HostRows {
            ids: to_host(&self.input_ids, Kind::Int64, "input ids")?,
            mask: to_host(&self.attention_mask, Kind::Int64, "attention mask")?,
            pos: to_host(&self.position_ids, Kind::Int64, "position ids")?,
            selected: to_host(&selected, Kind::Int64, "response mask")?,
        };
        Ok(self.host.get_or_init(|| h))
    }

    pub fn rows(&self) -> usize {
        self.input_ids.size()[0] as usize
    }

    /// Real tokens per row (prompt + response), the quantity a token budget counts.
    pub fn row_lengths(&self) -> Result<Vec<i64>> {
        let lens = self
            .attention_mask
            .f_sum_dim_intlist(1, false, Kind::Int64)
            .and_then(|x| x.f_to_device(Device::Cpu))
            .ctx("row lengths")?;
        Vec::<i64>::try_from(&lens).ctx("row lengths")
    }

    /// The rows `idx` (in that order), without the leading prompt columns that are padding in every
    /// one of them: prompts are left-padded to the batch's longest, and a micro-batch of short
    /// prompts need not run the model over that padding. Position ids were taken on the full mask,
    /// so they are unchanged, and masked keys contribute nothing to attention.
    pub fn select(&self, idx: &Tensor) -> Result<Sequences> {
        let pick = |t: &Tensor| t.f_index_select(0, idx).ctx("select micro-batch rows");
        let mask = pick(&self.attention_mask)?;
        let any_real = mask
            .f_narrow(1, 0, self.prompt_len)
            .and_then(|m| m.f_ne(0))
            .and_then(|m| m.f_any_dim(0, false))
            .and_then(|m| m.f_to_device(Device::Cpu))
            .ctx("leading padding")?;
        let any_real = Vec::<bool>::try_from(&any_real).ctx("leading padding")?;
        // Keep at least one prompt column: it predicts the first response token.
        let trim = any_real
            .iter()
            .position(|&b| b)
            .unwrap_or(any_real.len())
            .min(self.prompt_len as usize - 1) as i64;
        let total = self.prompt_len + self.response_len;
        let cut = |t: Tensor| {
            t.f_narrow(1, trim, total - trim)
                .ctx("trim leading padding")
        };
        Ok(Sequences {
            input_ids: cut(pick(&self.input_ids)?)?,
            attention_mask: cut(mask)?,
            position_ids: cut(pick(&self.position_ids)?)?,
            responses: pick(&self.responses)?,
            response_mask: pick(&self.response_mask)?,
            prompt_len: self.prompt_len - trim,
            response_len: self.response_len,
            host: Default::default(),
        })
    }

    /// `n` zero fp32 `[rows, R]` buffers for per-token outputs (log-probs, entropy, values) that
    /// micro-batches fill in.
    pub fn output_buffers(&self, n: usize) -> Result<Vec<Tensor>> {
        let device = self.input_ids.device();
        (0..n)
            .map(|_| {
                Tensor::f_zeros(
                    [self.rows() as i64, self.response_len],
                    (Kind::Float, device),
                )
                .ctx("output buffer")
            })
            .collect()
    }

    /// The head output `[rows, T, ...]` narrowed to the positions that predict response tokens
    /// (`P - 1 .. P + R - 1`): verl's `logits[:, -R-1:-1]`.
    pub fn response_slice(&self, out: &Tensor) -> Result<Tensor> {
        out.f_narrow(1, self.prompt_len - 1, self.response_len)
            .ctx("narrow to response positions")
    }
}

pub fn position_ids(mask: &Tensor) -> Result<Tensor> {
    mask.f_cumsum(1, Kind::Int64)
        .and_then(|x| x.f_sub_scalar(1))
        .and_then(|x| x.f_clamp_min(0))
        .ctx("position ids")
}

/// Row indices on `device`, for `index_select`.
pub fn index_tensor(rows: &[usize], device: Device) -> Result<Tensor> {
    let v: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
    upload_i64(&v, device, "row index")
}

/// Consecutive chunks of at most `size` rows (verl's `DataProto.split`).
pub fn chunks(rows: &[usize], size: usize) -> Vec<Vec<usize>> {
    rows.chunks(size.max(1)).map(|c| c.to_vec()).collect()
}

/// Partitions `rows` into micro-batches.
///
/// With a token budget the number of micro-batches starts at `ceil(Σ len / budget)` and grows until
/// longest-processing-time packing fits every micro-batch under the budget; rows keep their relative
/// order inside a micro-batch, and callers scatter results back by row index.
pub fn micro_batches(
    rows: &[usize],
    lengths: &[i64],
    mode: MicroBatching,
    budget_key: &str,
) -> Result<Vec<Vec<usize>>> {
    match mode {
        MicroBatching::Rows(n) => Ok(chunks(rows, n)),
        MicroBatching::Tokens(budget) => {
            let budget = budget as i64;
            if let Some(&r) = rows.iter().find(|&&r| lengths[r] > budget) {
                return Err(budget_too_small(budget_key, budget, r, lengths[r]));
            }
            let mut order: Vec<usize> = rows.to_vec();
            order.sort_by_key(|&r| std::cmp::Reverse(lengths[r]));
            let items: Vec<(i64, Vec<usize>)> =
                order.into_iter().map(|r| (lengths[r], vec![r])).collect();
            Ok(pack_longest_first(&items, budget))
        }
    }
}

/// The error for a token budget below row `row`'s `len` tokens.
pub fn budget_too_small(budget_key: &str, budget: i64, row: usize, len: i64) -> BackendError {
    BackendError::config(
        budget_key,
        format!("a token budget of at least the longest sequence ({len} tokens, row {row})"),
        budget,
    )
}

/// Longest-processing-time packing of `items` (a cost and its rows, longest first) into the
/// fewest bins that keep every bin's cost under `budget`: the bin count starts at
/// `ceil(Σ cost / budget)` and grows until every bin fits (or each item has its own). Each bin
/// lists its rows in increasing order; bins are ordered by their first row.
pub fn pack_longest_first(items: &[(i64, Vec<usize>)], budget: i64) -> Vec<Vec<usize>> {
    let total: i64 = items.iter().map(|(c, _)| c).sum();
    let mut k = ((total + budget - 1) / budget).max(1) as usize;
    k = k.min(items.len().max(1));
    loop {
        let mut bins: Vec<(i64, Vec<usize>)> = vec![(0, Vec::new()); k];
        for (cost, members) in items {
            let b = bins
                .iter_mut()
                .min_by_key(|(load, _)| *load)
                .expect("k >= 1");
            b.0 += cost;
            b.1.extend(members);
        }
        if bins.iter().all(|(load, _)| *load <= budget) || k >= items.len() {
            let mut out: Vec<Vec<usize>> = bins
                .into_iter()
                .filter(|(_, v)| !v.is_empty())
                .map(|(_, mut v)| {
                    v.sort_unstable();
                    v
                })
                .collect();
            out.sort_by_key(|v| v[0]);
            return out;
        }
        k += 1;
    }
}

/// One micro-batch of an update; a `dummy` one repeats real rows with its loss multiplied by zero.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MicroBatch {
    pub rows: Vec<usize>,
    pub dummy: bool,
}

/// Brings `parts` to `target` micro-batches, so that every rank runs the same number of
/// forward-backward passes (each runs collectives). Splits the biggest multi-row micro-batch in
/// halves while that is possible (staying under any token budget), then pads with dummy passes.
pub fn equalize_micro_batches(parts: Vec<Vec<usize>>, target: usize) -> Vec<MicroBatch> {
    let mut parts = parts;
    while parts.len() < target {
        let Some((i, _)) = parts
            .iter()
            .enumerate()
            .filter(|(_, p)| p.len() >= 2)
            .max_by_key(|(i, p)| (p.len(), std::cmp::Reverse(*i)))
        else {
            break;
        };
        let half = parts[i].len() / 2;
        let tail = parts[i].split_off(half);
        parts.insert(i + 1, tail);
    }
    let mut out: Vec<MicroBatch> = parts
        .iter()
        .map(|rows| MicroBatch {
            rows: rows.clone(),
            dummy: false,
        })
        .collect();
    while out.len() < target {
        out.push(MicroBatch {
            rows: parts.first().cloned().unwrap_or_default(),
            dummy: true,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equalizing_splits_then_pads() {
        let parts = vec![vec![0, 1, 2, 3], vec![4]];
        let eq = equalize_micro_batches(parts.clone(), 2);
        assert_eq!(eq.iter().map(|m| m.rows.clone()).collect::<Vec<_>>(), parts);
        let eq = equalize_micro_batches(parts.clone(), 4);
        let rows: Vec<Vec<usize>> = eq.iter().map(|m| m.rows.clone()).collect();
        assert_eq!(rows, vec![vec![0], vec![1], vec![2, 3], vec![4]]);
        assert!(eq.iter().all(|m| !m.dummy));
        let eq = equalize_micro_batches(vec![vec![7]], 3);
        assert_eq!(eq.len(), 3);
        assert_eq!(
            (eq[1].dummy, eq[2].dummy, eq[2].rows.clone()),
            (true, true, vec![7])
        );
    }

    #[test]
    fn token_budget_packs_under_budget_and_covers_every_row() {
        let lengths = vec![5, 9, 3, 7, 2, 8, 4];
        let rows: Vec<usize> = (0..lengths.len()).collect();
        let parts = micro_batches(&rows, &lengths, MicroBatching::Tokens(12), "k").unwrap();
        let mut seen: Vec<usize> = parts.iter().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, rows);
        for p in &parts {
            assert!(
                p.iter().map(|&r| lengths[r]).sum::<i64>() <= 12,
                "{parts:?}"
            );
        }
        let e = micro_batches(
            &rows,
            &lengths,
            MicroBatching::Tokens(8),
            "actor.ppo_max_token_len_per_gpu",
        )
        .unwrap_err();
        assert!(e.to_string().contains("ppo_max_token_len_per_gpu"), "{e}");
    }

    #[test]
    fn fixed_rows_split_like_verl() {
        let rows: Vec<usize> = (0..7).collect();
        let parts = micro_batches(&rows, &[1; 7], MicroBatching::Rows(3), "k").unwrap();
        assert_eq!(parts, vec![vec![0, 1, 2], vec![3, 4, 5], vec![6]]);
    }
}

#[cfg(test)]
mod loss_mask_tests {
    use super::*;

    fn batch(loss: Option<&[i64]>) -> Batch {
        let mut b = Batch::new();
        b.insert_tensor(col::PROMPTS, &[2, 2], &[0i64, 5, 6, 7]);
        b.insert_tensor(col::PROMPT_MASK, &[2, 2], &[0i64, 1, 1, 1]);
        b.insert_tensor(col::RESPONSES, &[2, 3], &[1i64, 2, 0, 3, 4, 5]);
        b.insert_tensor(col::RESPONSE_MASK, &[2, 3], &[1i64, 1, 0, 1, 1, 1]);
        if let Some(l) = loss {
            b.insert_tensor(col::LOSS_MASK, &[2, 3], l);
        }
        b
    }

    #[test]
    fn the_loss_mask_narrows_what_the_losses_count_not_the_layout() {
        let plain = Sequences::from_batch(&batch(None), "t", Device::Cpu).unwrap();
        let narrowed =
            Sequences::from_batch(&batch(Some(&[1, 0, 0, 0, 0, 0])), "t", Device::Cpu).unwrap();
        let v = |t: &Tensor| Vec::<f32>::try_from(t.reshape([-1])).unwrap();
        assert_eq!(v(&plain.response_mask), [1., 1., 0., 1., 1., 1.]);
        assert_eq!(v(&narrowed.response_mask), [1., 0., 0., 0., 0., 0.]);
        // The tokens that exist (attention, lengths) are response_mask's.
        assert_eq!(
            plain.row_lengths().unwrap(),
            narrowed.row_lengths().unwrap()
        );
        assert!(plain.attention_mask.equal(&narrowed.attention_mask));
    }

    #[test]
    fn a_loss_mask_outside_the_response_is_refused() {
        let e = Sequences::from_batch(
            &batch(Some(&[1, 1, 1, 0, 0, 0])),
            "Actor.update",
            Device::Cpu,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("loss_mask") && e.contains("subset"), "{e}");
    }
}

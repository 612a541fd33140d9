//! Masked statistics, mirroring `verl/utils/torch_functional.py` (`masked_sum`, `masked_mean`, `masked_var`,
//! `masked_whiten`), and the cross-rank hook that keeps batch-wide statistics batch-wide when the batch is
//! sharded over data-parallel ranks.

use crate::error::{AlgoError, Result};
use crate::grid::Grid;

/// verl adds this to the mask count in `masked_mean` so an all-zero mask gives 0 instead of NaN.
pub const MASKED_MEAN_EPS: f64 = 1e-8;
/// verl adds this to the variance in `masked_whiten` before the reciprocal square root.
pub const WHITEN_VAR_EPS: f64 = 1e-8;

/// Sums partial statistics over all data-parallel ranks, in place.
///
/// verl computes batch-wide statistics (whitening, GPG's non-zero count, the KL metric) on the driver, over the
/// whole batch. When the host shards the batch over ranks, each rank computes partial sums and this hook adds
/// them up, so every rank sees the statistic of the whole batch. Every rank must call it the same number of
/// times with slices of the same length (it is a collective). Single-process callers pass [`LocalOnly`].
pub trait CrossRankSum {
    /// Replaces each element of `values` by its sum over ranks. The error text is reported as
    /// [`AlgoError::Collective`].
    fn sum_in_place(&mut self, values: &mut [f64]) -> std::result::Result<(), String>;

    /// Replaces each element of `values` by its maximum over ranks (batch maxima and, negated,
    /// minima). Reducers that only sum report that they cannot.
    fn max_in_place(&mut self, values: &mut [f64]) -> std::result::Result<(), String> {
        let _ = values;
        Err("this reducer has no cross-rank maximum".into())
    }
}

/// The whole batch is on this process: sums need no communication.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalOnly;

impl CrossRankSum for LocalOnly {
    fn sum_in_place(&mut self, _values: &mut [f64]) -> std::result::Result<(), String> {
        Ok(())
    }

    fn max_in_place(&mut self, _values: &mut [f64]) -> std::result::Result<(), String> {
        Ok(())
    }
}

pub(crate) fn reduce_max(
    reducer: &mut dyn CrossRankSum,
    op: &'static str,
    values: &mut [f64],
) -> Result<()> {
    reducer
        .max_in_place(values)
        .map_err(|message| AlgoError::Collective { op, message })
}

pub(crate) fn reduce(
    reducer: &mut dyn CrossRankSum,
    op: &'static str,
    values: &mut [f64],
) -> Result<()> {
    reducer
        .sum_in_place(values)
        .map_err(|message| AlgoError::Collective { op, message })
}

/// One element's contribution to a masked sum: verl zeroes values outside the mask *before* weighting, so a
/// NaN/inf in padding cannot leak into the sum.
#[inline]
fn masked_term(value: f64, mask: f64) -> f64 {
    if mask != 0.0 {
        value * mask
    } else {
        0.0
    }
}

/// `(Σ values·mask, Σ mask)` over the local batch.
fn local_sums(values: &Grid<f64>, mask: &Grid<f64>) -> (f64, f64) {
    let sum = values
        .as_slice()
        .iter()
        .zip(mask.as_slice())
        .map(|(&v, &m)| masked_term(v, m))
        .sum();
    let count = mask.as_slice().iter().sum();
    (sum, count)
}

/// Sum of `values` where `mask` is non-zero, weighted by `mask`. Mirrors verl `masked_sum(values, mask)`.
pub fn masked_sum(values: &Grid<f64>, mask: &Grid<f64>) -> Result<f64> {
    values.check_same_shape(mask, "masked_sum", "values", "mask")?;
    Ok(local_sums(values, mask).0)
}

/// Masked mean over every element: `Σ values·mask / (Σ mask + 1e-8)`. Mirrors verl `masked_mean(values, mask)`
/// with `axis=None`.
pub fn masked_mean(values: &Grid<f64>, mask: &Grid<f64>) -> Result<f64> {
    values.check_same_shape(mask, "masked_mean", "values", "mask")?;
    let (sum, count) = local_sums(values, mask);
    Ok(sum / (count + MASKED_MEAN_EPS))
}

/// Masked mean of each row (one value per response). Mirrors verl `masked_mean(values, mask, axis=-1)`.
pub fn masked_mean_per_row(values: &Grid<f64>, mask: &Grid<f64>) -> Result<Vec<f64>> {
    values.check_same_shape(mask, "masked_mean", "values", "mask")?;
    Ok(values
        .iter_rows()
        .zip(mask.iter_rows())
        .map(|(v, m)| {
            let sum: f64 = v.iter().zip(m).map(|(&v, &m)| masked_term(v, m)).sum();
            let count: f64 = m.iter().sum();
            sum / (count + MASKED_MEAN_EPS)
        })
        .collect())
}

/// Masked variance, Bessel-corrected when `unbiased` (verl's default). Mirrors verl `masked_var`.
///
/// Like verl, the unbiased form refuses a mask that selects zero or one element instead of returning
/// NaN/inf.
pub fn masked_var(values: &Grid<f64>, mask: &Grid<f64>, unbiased: bool) -> Result<f64> {
    values.check_same_shape(mask, "masked_var", "values", "mask")?;
    mean_and_var(values, mask, unbiased, "masked_var", &mut LocalOnly).map(|(_, var)| var)
}

/// Whitens `values` with the masked mean and unbiased masked variance of the whole batch:
/// `(values − mean) / sqrt(var + 1e-8)`, plus `mean` again when `shift_mean` is false.
/// Every element is transformed, including masked-out ones (callers multiply by the mask where verl does).
/// Mirrors verl `masked_whiten(values, mask, shift_mean)`.
pub fn masked_whiten(values: &Grid<f64>, mask: &Grid<f64>, shift_mean: bool) -> Result<Grid<f64>> {
    masked_whiten_across(values, mask, shift_mean, &mut LocalOnly)
}

/// [`masked_whiten`] over a batch sharded across ranks: mean and variance are those of the whole batch.
pub fn masked_whiten_across(
    values: &Grid<f64>,
    mask: &Grid<f64>,
    shift_mean: bool,
    reducer: &mut dyn CrossRankSum,
) -> Result<Grid<f64>> {
    values.check_same_shape(mask, "masked_whiten", "values", "mask")?;
    let (mean, var) = mean_and_var(values, mask, true, "masked_whiten", reducer)?;
    let inv_std = 1.0 / (var + WHITEN_VAR_EPS).sqrt();
    let shift = if shift_mean { 0.0 } else { mean };
    Ok(values.map(|&v| (v - mean) * inv_std + shift))
}

/// verl's two-pass masked mean and variance; the passes are separate reductions so that the variance is
/// centred on the batch-wide mean, as it is in verl.
fn mean_and_var(
    values: &Grid<f64>,
    mask: &Grid<f64>,
    unbiased: bool,
    op: &'static str,
    reducer: &mut dyn CrossRankSum,
) -> Result<(f64, f64)> {
    let (sum, count) = local_sums(values, mask);
    let mut first = [sum, count];
    reduce(reducer, op, &mut first)?;
    let [sum, count] = first;
    let mean = sum / (count + MASKED_MEAN_EPS);

    let centred: f64 = values
        .as_slice()
        .iter()
        .zip(mask.as_slice())
        .map(|(&v, &m)| masked_term((v - mean) * (v - mean), m))
        .sum();
    let mut second = [centred];
    reduce(reducer, op, &mut second)?;
    let mut var = second[0] / (count + MASKED_MEAN_EPS);

    if unbiased {
        if count == 0.0 {
            return Err(AlgoError::EmptyMask { op });
        }
        if count == 1.0 {
            return Err(AlgoError::SingleElementMask { op });
        }
        var *= count / (count - 1.0);
    }
    Ok((mean, var))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid(rows: &[&[f64]]) -> Grid<f64> {
        Grid::from_rows(rows).unwrap()
    }

    #[test]
    fn masked_mean_ignores_masked_out_values_even_nan() {
        let v = grid(&[&[1.0, 2.0, f64::NAN], &[3.0, f64::INFINITY, 5.0]]);
        let m = grid(&[&[1.0, 1.0, 0.0], &[1.0, 0.0, 1.0]]);
        let mean = masked_mean(&v, &m).unwrap();
        assert!((mean - 11.0 / 4.0).abs() < 1e-8, "{mean}");
        assert_eq!(masked_sum(&v, &m).unwrap(), 11.0);
    }

    #[test]
    fn masked_mean_of_an_empty_mask_is_zero_not_nan() {
        let v = grid(&[&[1.0, 2.0]]);
        let m = grid(&[&[0.0, 0.0]]);
        assert_eq!(masked_mean(&v, &m).unwrap(), 0.0);
        assert_eq!(masked_mean_per_row(&v, &m).unwrap(), vec![0.0]);
    }

    #[test]
    fn masked_mean_per_row_uses_each_rows_own_count() {
        let v = grid(&[&[2.0, 4.0, 100.0], &[1.0, 0.0, 0.0]]);
        let m = grid(&[&[1.0, 1.0, 0.0], &[1.0, 0.0, 0.0]]);
        let rows = masked_mean_per_row(&v, &m).unwrap();
        assert!(
            (rows[0] - 3.0).abs() < 1e-7 && (rows[1] - 1.0).abs() < 1e-7,
            "{rows:?}"
        );
    }

    #[test]
    fn masked_var_is_bessel_corrected_by_default() {
        // Selected values 1, 2, 3, 4: population variance 1.25, sample variance 5/3.
        let v = grid(&[&[1.0, 2.0, 9.0], &[3.0, 4.0, -9.0]]);
        let m = grid(&[&[1.0, 1.0, 0.0], &[1.0, 1.0, 0.0]]);
        let unbiased = masked_var(&v, &m, true).unwrap();
        let biased = masked_var(&v, &m, false).unwrap();
        assert!((unbiased - 5.0 / 3.0).abs() < 1e-7, "{unbiased}");
        assert!((biased - 1.25).abs() < 1e-7, "{biased}");
    }

    #[test]
    fn unbiased_var_refuses_masks_selecting_fewer_than_two_elements() {
        let v = grid(&[&[1.0, 2.0]]);
        assert_eq!(
            masked_var(&v, &grid(&[&[0.0, 0.0]]), true),
            Err(AlgoError::EmptyMask { op: "masked_var" })
        );
        assert_eq!(
            masked_var(&v, &grid(&[&[0.0, 1.0]]), true),
            Err(AlgoError::SingleElementMask { op: "masked_var" })
        );
        // The biased form is allowed; verl's `+1e-8` in the mean's denominator leaves a ~1e-16 residue.
        assert!(masked_var(&v, &grid(&[&[0.0, 1.0]]), false).unwrap() < 1e-12);
    }

    #[test]
    fn whiten_gives_zero_mean_unit_sample_variance_on_the_mask() {
        let v = grid(&[&[1.0, 2.0, 7.0], &[3.0, 4.0, 0.0]]);
        let m = grid(&[&[1.0, 1.0, 0.0], &[1.0, 1.0, 0.0]]);
        let w = masked_whiten(&v, &m, true).unwrap();
        // Not exactly 0: verl divides sums by `count + 1e-8`.
        assert!(masked_mean(&w, &m).unwrap().abs() < 1e-7);
        assert!((masked_var(&w, &m, true).unwrap() - 1.0).abs() < 1e-6);
        // Masked-out elements are transformed too, with the same affine map.
        let expected = (7.0 - 2.5) / (5.0f64 / 3.0 + 1e-8).sqrt();
        assert!((w[(0, 2)] - expected).abs() < 1e-6, "{}", w[(0, 2)]);
    }

    #[test]
    fn whiten_without_shift_mean_keeps_the_mean() {
        let v = grid(&[&[1.0, 2.0], &[3.0, 4.0]]);
        let m = Grid::filled(2, 2, 1.0);
        let w = masked_whiten(&v, &m, false).unwrap();
        assert!((masked_mean(&w, &m).unwrap() - 2.5).abs() < 1e-7);
    }

    #[test]
    fn whiten_reports_shape_mismatch_with_names() {
        let err =
            masked_whiten(&Grid::filled(2, 3, 0.0), &Grid::filled(3, 2, 1.0), true).unwrap_err();
        assert_eq!(
            err,
            AlgoError::ShapeMismatch {
                op: "masked_whiten",
                input: "mask",
                reference: "values",
                expected: (2, 3),
                found: (3, 2)
            }
        );
    }

    /// Two "ranks" simulated in one process: each whitens its half, the reducer adds the other half's partial
    /// sums, and the result equals whitening the concatenated batch.
    #[test]
    fn whiten_across_ranks_matches_whitening_the_whole_batch() {
        let whole = grid(&[
            &[1.0, 5.0, 0.0],
            &[2.0, -3.0, 4.0],
            &[0.5, 0.0, 0.0],
            &[7.0, 1.0, 2.0],
        ]);
        let mask = grid(&[
            &[1.0, 1.0, 0.0],
            &[1.0, 1.0, 1.0],
            &[1.0, 0.0, 0.0],
            &[1.0, 1.0, 1.0],
        ]);
        let expected = masked_whiten(&whole, &mask, true).unwrap();

        let top = |g: &Grid<f64>| Grid::new(2, 3, g.as_slice()[..6].to_vec()).unwrap();
        let bottom = |g: &Grid<f64>| Grid::new(2, 3, g.as_slice()[6..].to_vec()).unwrap();

        // Precompute the other rank's partials in the order the collective is called.
        struct Replay(Vec<Vec<f64>>);
        impl CrossRankSum for Replay {
            fn sum_in_place(&mut self, values: &mut [f64]) -> std::result::Result<(), String> {
                let other = self.0.remove(0);
                values.iter_mut().zip(other).for_each(|(v, o)| *v += o);
                Ok(())
            }
        }
        let (b_sum, b_cnt) = local_sums(&bottom(&whole), &bottom(&mask));
        let (t_sum, t_cnt) = local_sums(&top(&whole), &top(&mask));
        let mean = (t_sum + b_sum) / (t_cnt + b_cnt + MASKED_MEAN_EPS);
        let centred = |v: &Grid<f64>, m: &Grid<f64>| -> f64 {
            v.as_slice()
                .iter()
                .zip(m.as_slice())
                .map(|(&v, &m)| masked_term((v - mean).powi(2), m))
                .sum()
        };
        let mut replay = Replay(vec![
            vec![b_sum, b_cnt],
            vec![centred(&bottom(&whole), &bottom(&mask))],
        ]);
        let got = masked_whiten_across(&top(&whole), &top(&mask), true, &mut replay).unwrap();
        for (g, e) in got.as_slice().iter().zip(&expected.as_slice()[..6]) {
            assert!((g - e).abs() < 1e-12, "{g} vs {e}");
        }
    }

    #[test]
    fn a_failing_collective_is_reported_with_the_operation() {
        struct Broken;
        impl CrossRankSum for Broken {
            fn sum_in_place(&mut self, _: &mut [f64]) -> std::result::Result<(), String> {
                Err("peer 3 hung up".into())
            }
        }
        let g = Grid::filled(2, 2, 1.0);
        let err = masked_whiten_across(&g, &g, true, &mut Broken).unwrap_err();
        assert_eq!(
            err.to_string(),
            "masked_whiten: cross-rank reduction failed: peer 3 hung up"
        );
    }
}

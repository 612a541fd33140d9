//! Turning next-token logits into tokens: temperature, top-k, top-p, inverse-CDF draw.

use tch::{Kind, Tensor};

use crate::error::{Result, RolloutError};
use crate::params::SamplingParams;

/// The logits processing of one call, validated once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Sampler {
    greedy: bool,
    /// Divisor for the logits (1.0 when greedy with temperature 0).
    temperature: f64,
    top_k: Option<i64>,
    top_p: Option<f64>,
    log_probs: bool,
}

impl Sampler {
    pub fn new(p: &SamplingParams) -> Result<Sampler> {
        if !p.temperature.is_finite() || p.temperature < 0.0 {
            return Err(RolloutError::input(
                "SamplingParams.temperature",
                "a finite value >= 0",
                p.temperature.to_string(),
            ));
        }
        if !(p.top_p > 0.0 && p.top_p <= 1.0) {
            return Err(RolloutError::input(
                "SamplingParams.top_p",
                "a value in (0, 1]",
                p.top_p.to_string(),
            ));
        }
        Ok(Sampler {
            greedy: p.is_greedy(),
            temperature: if p.temperature > 0.0 {
                p.temperature
            } else {
                1.0
            },
            top_k: (p.top_k > 0).then_some(p.top_k),
            top_p: (p.top_p < 1.0).then_some(p.top_p),
            log_probs: p.return_log_probs,
        })
    }

    pub fn is_greedy(&self) -> bool {
        self.greedy
    }

    /// Whether `sample` on `device` runs the fused CUDA kernel ([`verl_torch_ext::sample_rows`]):
    /// no top-k/top-p filter and a CUDA device.
    pub fn uses_kernel(&self, device: tch::Device) -> bool {
        self.top_k.is_none()
            && self.top_p.is_none()
            && verl_torch_ext::row_kernels_available(device)
    }

    /// `logits`: `[R, V]` (any float kind); `uniforms`: float `[R]` in `[0, 1)` on the logits'
    /// device, one per row (unused when greedy). Returns int64 tokens `[R]` and, when asked,
    /// float32 log-probs `[R]` of those tokens under `log_softmax(logits / temperature)`.
    pub fn sample(
        &self,
        logits: &Tensor,
        uniforms: Option<&Tensor>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        if self.uses_kernel(logits.device()) {
            // One kernel: two passes over each row instead of a softmax, a cumsum, comparisons
            // and a log-softmax over [rows, vocab] fp32 tensors. Same inverse CDF in vocabulary
            // order (fp32 sums in another order: a draw within rounding of a boundary may take
            // the neighbouring token).
            let logits = logits.f_to_kind(Kind::Float)?.f_contiguous()?;
            let u = match (self.greedy, uniforms) {
                (true, _) => None,
                (false, Some(u)) => Some(u.f_to_kind(Kind::Float)?.f_contiguous()?),
                (false, None) => {
                    return Err(RolloutError::input(
                        "sampler uniforms",
                        "one per row",
                        "none",
                    ))
                }
            };
            return Ok(verl_torch_ext::sample_rows(
                &logits,
                u.as_ref(),
                self.temperature,
                self.log_probs,
            )?);
        }
        let logits = logits.f_to_kind(Kind::Float)?;
        let scaled = if self.temperature != 1.0 {
            logits.f_div_scalar(self.temperature)?
        } else {
            logits
        };
        let tokens = if self.greedy {
            scaled.f_argmax(-1, false)?
        } else {
            let u = uniforms
                .ok_or_else(|| RolloutError::input("sampler uniforms", "one per row", "none"))?;
            self.draw(&scaled, u)?
        };
        let lp = if self.log_probs {
            Some(
                scaled
                    .f_log_softmax(-1, Kind::Float)?
                    .f_gather(-1, &tokens.f_unsqueeze(-1)?, false)?
                    .f_squeeze_dim(-1)?,
            )
        } else {
            None
        };
        Ok((tokens, lp))
    }

    /// Top-k / top-p filtering on the sorted distribution, then the inverse CDF at `u`.
    fn draw(&self, scaled: &Tensor, u: &Tensor) -> Result<Tensor> {
        let vocab = scaled.size()[1];
        // Only top-p needs the tokens in probability order; topk returns its values sorted, so a
        // small k never pays for the full-vocabulary sort, and without any filter the inverse CDF
        // runs over the vocabulary as it is (any fixed order samples the same distribution).
        let (vals, idx) = match (self.top_k, self.top_p) {
            (Some(k), _) if k < vocab => scaled.f_topk(k, -1, true, true)?,
            (_, Some(_)) => scaled.f_sort(-1, true)?,
            _ => {
                let idx = Tensor::f_arange(vocab, (Kind::Int64, scaled.device()))?
                    .f_unsqueeze(0)?
                    .f_expand(scaled.size(), false)?;
                (scaled.shallow_clone(), idx)
            }
        };
        let mut probs = vals.f_softmax(-1, Kind::Float)?;
        if let Some(p) = self.top_p {
            // Drop a token when the tokens strictly more likely already reach top_p: what stays
            // is the smallest prefix with cumulative probability >= top_p (never empty).
            let before = probs.f_cumsum(-1, Kind::Float)?.f_sub(&probs)?;
            probs = probs.f_masked_fill(&before.f_ge(p)?, 0.0)?;
        }
        let cdf = probs.f_cumsum(-1, Kind::Float)?;
        let k = cdf.size()[1];
        let total = cdf.f_narrow(1, k - 1, 1)?;
        let target = u.f_to_kind(Kind::Float)?.f_unsqueeze(-1)?.f_mul(&total)?;
        let pos =
            cdf.f_le_tensor(&target)?
                .f_sum_dim_intlist([-1i64].as_slice(), false, Kind::Int64)?;
        // u * total can round up to total; the last token with mass is then the answer.
        let last_kept = probs
            .f_gt(0.0)?
            .f_sum_dim_intlist([-1i64].as_slice(), false, Kind::Int64)?
            .f_sub_scalar(1)?
            .f_clamp_min(0)?;
        let pos = pos.f_minimum(&last_kept)?;
        Ok(idx
            .f_gather(-1, &pos.f_unsqueeze(-1)?, false)?
            .f_squeeze_dim(-1)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(top_k: i64, top_p: f64) -> Sampler {
        Sampler::new(&SamplingParams {
            top_k,
            top_p,
            return_log_probs: true,
            ..SamplingParams::default()
        })
        .unwrap()
    }

    /// Logits of probabilities [0.2, 0.5, 0.3] (token order deliberately not sorted).
    fn logits(rows: i64) -> Tensor {
        Tensor::from_slice(&[0.2f32, 0.5, 0.3])
            .log()
            .unsqueeze(0)
            .repeat([rows, 1])
    }

    fn draw(s: &Sampler, us: &[f32]) -> Vec<i64> {
        let u = Tensor::from_slice(us);
        let (t, _) = s.sample(&logits(us.len() as i64), Some(&u)).unwrap();
        Vec::<i64>::try_from(&t).unwrap()
    }

    #[test]
    fn inverse_cdf_over_the_kept_tokens() {
        // No filter: vocabulary order, CDF [0.2, 0.7, 1.0].
        let s = sampler(-1, 1.0);
        assert_eq!(
            draw(&s, &[0.0, 0.19, 0.21, 0.69, 0.71, 0.999_999_9]),
            [0, 0, 1, 1, 2, 2]
        );
        // A filter that keeps everything sorts first: token 1 (0.5), token 2 (0.3), token 0 (0.2).
        let s = sampler(-1, 0.9999);
        assert_eq!(
            draw(&s, &[0.0, 0.49, 0.51, 0.79, 0.81, 0.999_999_9]),
            [1, 1, 2, 2, 0, 0]
        );
    }

    #[test]
    fn top_k_and_top_p_renormalise_the_kept_set() {
        // top-k 2 keeps {1: 0.5/0.8, 2: 0.3/0.8}.
        let s = sampler(2, 1.0);
        assert_eq!(draw(&s, &[0.0, 0.6, 0.63, 0.99]), [1, 1, 2, 2]);
        // top-p 0.7: 0.5 < 0.7, 0.5 + 0.3 >= 0.7 -> keeps {1, 2}; 0.8 would keep all three.
        let s = sampler(-1, 0.7);
        assert_eq!(draw(&s, &[0.0, 0.6, 0.63, 0.999]), [1, 1, 2, 2]);
        let s = sampler(-1, 0.81);
        assert_eq!(draw(&s, &[0.81]), [0]);
        // A tiny top-p keeps only the most likely token.
        let s = sampler(-1, 1e-6);
        assert_eq!(draw(&s, &[0.0, 0.5, 0.999]), [1, 1, 1]);
    }

    #[test]
    fn log_probs_are_of_the_unfiltered_tempered_distribution() {
        let s = Sampler::new(&SamplingParams {
            temperature: 0.5,
            top_k: 1,
            return_log_probs: true,
            ..SamplingParams::default()
        })
        .unwrap();
        let (t, lp) = s
            .sample(&logits(1), Some(&Tensor::from_slice(&[0.3f32])))
            .unwrap();
        assert_eq!(t.int64_value(&[0]), 1);
        // p^(1/T) renormalised: 0.25 / (0.04 + 0.25 + 0.09).
        let want = (0.25f64 / 0.38).ln();
        assert!((lp.unwrap().double_value(&[0]) - want).abs() < 1e-6);
    }

    #[test]
    fn invalid_params_name_the_field() {
        for (p, field) in [
            (
                SamplingParams {
                    temperature: -1.0,
                    ..SamplingParams::default()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..SamplingParams::default()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: f64::NAN,
                    ..SamplingParams::default()
                },
                "top_p",
            ),
        ] {
            let e = Sampler::new(&p).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
    }
}

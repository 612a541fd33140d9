//! verl's `trainer.log_val_generations`: which validation samples are logged (the same ones as verl picks, by
//! the same seeded NumPy shuffle) and the text TensorBoard shows for them.

use crate::numpy_random::RandomState;

/// The seed verl's trainer shuffles the validation samples with.
pub const VAL_GENERATIONS_SEED: u32 = 42;

/// The name the samples are logged under, in every tracker.
pub const VAL_GENERATIONS_KEY: &str = "val/generations";

/// One validation sample as verl logs it: the decoded prompt, the decoded response and its sequence score.
#[derive(Debug, Clone, PartialEq)]
pub struct ValGeneration {
    /// The prompt text.
    pub input: String,
    /// The response text.
    pub output: String,
    /// The response's score (the sum of its token-level rewards).
    pub score: f64,
}

impl ValGeneration {
    /// A sample of `input`, `output` and `score`.
    pub fn new(input: impl Into<String>, output: impl Into<String>, score: f64) -> Self {
        ValGeneration {
            input: input.into(),
            output: output.into(),
            score,
        }
    }
}

/// The `n` samples verl logs out of a validation pass: sorted by input text (code-point order, as Python
/// compares strings; ties keep their order), shuffled by `numpy.random.RandomState(42).shuffle`, the first `n`
/// kept. So the same inputs are logged at every validation, whatever order the samples arrived in.
pub fn select_val_generations(mut samples: Vec<ValGeneration>, n: usize) -> Vec<ValGeneration> {
    if n == 0 {
        return Vec::new();
    }
    // A stable sort: equal inputs keep their order, as in Python's `list.sort`. Byte order of UTF-8 is
    // code-point order.
    samples.sort_by(|a, b| a.input.cmp(&b.input));
    RandomState::new(VAL_GENERATIONS_SEED).shuffle(&mut samples);
    samples.truncate(n);
    samples
}

/// The Markdown verl's TensorBoard logger writes for one validation: a heading with the step, then per sample
/// its input, output and score (the score as Python prints a float).
pub(crate) fn tensorboard_text(step: u64, samples: &[ValGeneration]) -> String {
    let mut text = format!("**Generation Results - Step {step}**\n\n");
    for (i, s) in samples.iter().enumerate() {
        text.push_str(&format!("### Sample {}\n", i + 1));
        text.push_str(&format!("**Input:** {}\n\n", s.input));
        text.push_str(&format!("**Output:** {}\n\n", s.output));
        text.push_str(&format!("**Score:** {}\n\n", python_float_repr(s.score)));
        text.push_str("---\n\n");
    }
    text
}

/// `repr(float)` in Python: the shortest digits that read back to `v`, in fixed notation for decimal exponents
/// from -4 to 15 (always with a fractional part), else in scientific notation with a signed exponent of at
/// least two digits.
pub(crate) fn python_float_repr(v: f64) -> String {
    if v.is_nan() {
        return "nan".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf" } else { "-inf" }.into();
    }
    // Rust's `{:e}` prints the same shortest round-trip digits: `-1.2345e-7`.
    let sci = format!("{v:e}");
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` has an exponent");
    let exp: i32 = exp.parse().expect("`{:e}` has an integer exponent");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            let zeros = "0".repeat((-point) as usize);
            format!("{sign}0.{zeros}{digits}")
        } else if point as usize >= digits.len() {
            let zeros = "0".repeat(point as usize - digits.len());
            format!("{sign}{digits}{zeros}.0")
        } else {
            let (int, frac) = digits.split_at(point as usize);
            format!("{sign}{int}.{frac}")
        }
    } else {
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_repr_prints_them() {
        let cases = [
            (1.0, "1.0"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (-0.5, "-0.5"),
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (2.5e-5, "2.5e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (0.1 + 0.2, "0.30000000000000004"),
            (5e-324, "5e-324"),
            (f64::MAX, "1.7976931348623157e+308"),
            (12345.678, "12345.678"),
            (f64::NAN, "nan"),
            (f64::INFINITY, "inf"),
            (f64::NEG_INFINITY, "-inf"),
        ];
        for (v, want) in cases {
            assert_eq!(python_float_repr(v), want, "{v:?}");
        }
    }

    #[test]
    fn tensorboard_text_lists_each_sample_under_a_step_heading() {
        let text = tensorboard_text(
            3,
            &[
                ValGeneration::new("1+1=", "2", 1.0),
                ValGeneration::new("2+2=", "5", 0.0),
            ],
        );
        assert_eq!(
            text,
            "**Generation Results - Step 3**\n\n\
             ### Sample 1\n**Input:** 1+1=\n\n**Output:** 2\n\n**Score:** 1.0\n\n---\n\n\
             ### Sample 2\n**Input:** 2+2=\n\n**Output:** 5\n\n**Score:** 0.0\n\n---\n\n"
        );
    }

    #[test]
    fn nothing_is_selected_when_none_is_asked_for() {
        let samples = vec![ValGeneration::new("a", "b", 1.0)];
        assert!(select_val_generations(samples, 0).is_empty());
    }
}

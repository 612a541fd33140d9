//! DAPO math scorer (verl 0.9.1 `reward_score/math_dapo.py`): Minerva-style — the text after the
//! last `Answer:` is normalised with [`normalize_final_answer`] and compared to the normalised
//! ground truth, falling back to the raw last `\boxed{}` near the end when there is no `Answer:`
//! (see [`verify`]); in strict-box mode only the box counts. The score is +1.0 / -1.0, with `acc`
//! and `pred` alongside.

use std::sync::LazyLock;

use regex::{Captures, Regex};

use super::pystr::{py_isdigit, py_slice_from, py_strip, py_tail};

/// verl only looks at the tail of the solution (the longest MATH-500 answer has 159 chars).
pub const SOLUTION_CLIP_CHARS: usize = 300;
/// Strict-box mode looks at even less: this many chars before the end (or before the last pause
/// token).
pub const STRICT_BOX_WINDOW_CHARS: usize = 100;
/// What `pred` is when no `Answer:` line exists; it is normalised like any other answer.
pub const INVALID_ANSWER: &str = "[INVALID]";

// Python's `\s` also matches U+001C..U+001F, Rust's does not; spell the union out.
static ANSWER_RE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?i)Answer[\s\x1C-\x1F]*:[\s\x1C-\x1F]*([^\n]+)").unwrap());
static DOLLAR_MATH_RE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(.*?)(\$)(.*?)(\$)(.*)").unwrap());
static TEXT_RE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\\text\{(.*?)\}").unwrap());
static TEXTBF_RE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\\textbf\{(.*?)\}").unwrap());
static OVERLINE_RE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\\overline\{(.*?)\}").unwrap());
static BOXED_RE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\\boxed\{(.*)\}").unwrap());
static SHORT_FRAC_RE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"frac([^{])(.)").unwrap());
static SHORT_SQRT_RE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"sqrt([^{])").unwrap());

/// Applied in order with plain (non-overlapping, left-to-right) string replacement.
const SUBSTITUTIONS: &[(&str, &str)] = &[
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
];

/// Units and filler words deleted outright, in this order (order matters: "\\text{}" must come
/// after the longer `\text{..}` forms).
const REMOVED_EXPRESSIONS: &[&str] = &[
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    "\"",
    "\\dots",
];

fn replace_group(re: &Regex, s: &str, group: usize) -> String {
    re.replace_all(s, |c: &Captures| c[group].to_string())
        .into_owned()
}

/// Minerva's final-answer normalisation (Lewkowycz et al. 2022), as verl applies it.
pub fn normalize_final_answer(final_answer: &str) -> String {
    let mut s = final_answer.rsplit('=').next().unwrap_or("").to_string();
    for (before, after) in SUBSTITUTIONS {
        s = s.replace(before, after);
    }
    for expr in REMOVED_EXPRESSIONS {
        s = s.replace(expr, "");
    }

    s = DOLLAR_MATH_RE
        .replace_all(&s, |c: &Captures| format!("${}$", &c[3]))
        .into_owned();
    s = replace_group(&TEXT_RE, &s, 1);
    s = replace_group(&TEXTBF_RE, &s, 1);
    s = replace_group(&OVERLINE_RE, &s, 1);
    s = replace_group(&BOXED_RE, &s, 1);

    s = SHORT_FRAC_RE
        .replace_all(&s, |c: &Captures| format!("frac{{{}}}{{{}}}", &c[1], &c[2]))
        .into_owned();
    s = SHORT_SQRT_RE
        .replace_all(&s, |c: &Captures| format!("sqrt{{{}}}", &c[1]))
        .into_owned();
    s = s.replace('$', "");

    let without_commas = s.replace(',', "");
    if py_isdigit(&without_commas) {
        s = without_commas;
    }
    py_strip(&s).to_string()
}

/// math_dapo's own box extraction: only the brace form `\boxed{` counts (no `\fbox`, no
/// `\boxed `), and the result keeps its `\boxed{..}` wrapper.
pub fn last_boxed_only_string(string: &str) -> Option<&str> {
    let idx = string.rfind("\\boxed{")?;
    let mut open: i64 = 0;
    for (off, byte) in string.as_bytes()[idx..].iter().enumerate() {
        match byte {
            b'{' => open += 1,
            b'}' => {
                open -= 1;
                if open == 0 {
                    return Some(&string[idx..=idx + off]);
                }
            }
            _ => {}
        }
    }
    None
}

/// Content of a `\boxed{..}` produced by [`last_boxed_only_string`] (whose shape guarantees
/// verl's asserts hold).
fn remove_boxed(s: &str) -> &str {
    s.strip_prefix("\\boxed{")
        .and_then(|inner| inner.strip_suffix('}'))
        .unwrap_or(s)
}

/// Minerva check: (is_correct, normalised prediction).
pub fn is_correct_minerva(solution: &str, ground_truth: &str) -> (bool, String) {
    let extracted = ANSWER_RE
        .captures_iter(solution)
        .last()
        .map_or(INVALID_ANSWER, |c| c.get(1).map_or("", |m| m.as_str()));
    let pred = normalize_final_answer(extracted);
    let gt = normalize_final_answer(ground_truth);
    (pred == gt, pred)
}

/// Strict-box check: the raw boxed content must equal the raw ground truth. `pause_tokens_index`
/// moves the window to end at the last pause token; `pred` is None when no box is in the window.
pub fn is_correct_strict_box(
    solution: &str,
    ground_truth: &str,
    pause_tokens_index: Option<&[i64; 4]>,
) -> (bool, Option<String>) {
    let window = match pause_tokens_index {
        Some(idx) => py_slice_from(solution, idx[3] - STRICT_BOX_WINDOW_CHARS as i64),
        None => py_tail(solution, STRICT_BOX_WINDOW_CHARS),
    };
    let pred = last_boxed_only_string(window).map(remove_boxed);
    (pred == Some(ground_truth), pred.map(str::to_string))
}

/// Result of [`compute_score`]: verl's `{"score", "acc", "pred"}` dict.
#[derive(Debug, Clone, PartialEq)]
pub struct DapoScore {
    pub score: f64,
    pub acc: bool,
    /// Normalised Minerva prediction, or the raw boxed content when the box decided; None only
    /// when the strict-box check decided and found no box.
    pub pred: Option<String>,
}

/// verl 0.9.1's `verify`: strict-box only when asked; otherwise Minerva first, and when that finds
/// no usable `Answer:` (its normalised prediction is `[INVALID]`) the raw last `\boxed{}` in the
/// strict-box window decides instead, if there is one.
pub fn verify(
    solution: &str,
    ground_truth: &str,
    strict_box_verify: bool,
    pause_tokens_index: Option<&[i64; 4]>,
) -> (bool, Option<String>) {
    if strict_box_verify {
        return is_correct_strict_box(solution, ground_truth, pause_tokens_index);
    }
    let (correct, pred) = is_correct_minerva(solution, ground_truth);
    if pred != INVALID_ANSWER {
        return (correct, Some(pred));
    }
    match is_correct_strict_box(solution, ground_truth, pause_tokens_index) {
        (box_correct, Some(box_pred)) => (box_correct, Some(box_pred)),
        (_, None) => (correct, Some(pred)),
    }
}

pub fn compute_score(
    solution: &str,
    ground_truth: &str,
    strict_box_verify: bool,
    pause_tokens_index: Option<&[i64; 4]>,
) -> DapoScore {
    let solution = py_tail(solution, SOLUTION_CLIP_CHARS);
    let (acc, pred) = verify(
        solution,
        ground_truth,
        strict_box_verify,
        pause_tokens_index,
    );
    DapoScore {
        score: if acc { 1.0 } else { -1.0 },
        acc,
        pred,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score(s: &str, gt: &str) -> DapoScore {
        compute_score(s, gt, false, None)
    }

    #[test]
    fn boxed_answer_is_the_fallback_without_an_answer_line() {
        let r = score("so the result is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}");
        assert_eq!((r.score, r.pred.as_deref()), (1.0, Some("\\frac{1}{2}")));
        // The fallback compares raw strings, without normalisation.
        let r = score("\\boxed{\\frac12}", "\\frac{1}{2}");
        assert_eq!((r.score, r.pred.as_deref()), (-1.0, Some("\\frac12")));
        // An `Answer:` line takes precedence over a (correct) box.
        let r = score("\\boxed{5}\nAnswer: 6", "5");
        assert_eq!((r.score, r.pred.as_deref()), (-1.0, Some("6")));
        // ... unless it normalises to the invalid marker itself.
        let r = score("\\boxed{5}\nAnswer: [INVALID]", "5");
        assert_eq!((r.score, r.pred.as_deref()), (1.0, Some("5")));
        // Multiple boxes: the last one counts.
        assert!(score("\\boxed{1} no, \\boxed{2}", "2").acc);
        assert!(!score("\\boxed{1} no, \\boxed{2}", "1").acc);
    }

    #[test]
    fn no_answer_line_is_invalid() {
        let r = score("I think it is 5", "5");
        assert_eq!(r.score, -1.0);
        assert!(!r.acc);
        assert_eq!(r.pred.as_deref(), Some("[INVALID]"));
    }

    #[test]
    fn last_answer_line_wins_case_insensitive() {
        let r = score("Answer: 4\nanswer : 5\n", "5");
        assert_eq!((r.score, r.acc, r.pred.as_deref()), (1.0, true, Some("5")));
        // Whitespace after the colon may span lines; the value is the rest of that line.
        // Only the first `$..$` span survives; text after it is dropped.
        let r = score("ANSWER:\n\n  $\\frac{1}{2}$ ok", "\\frac12");
        assert_eq!(r.pred.as_deref(), Some("\\frac{1}{2}"));
        assert!(r.acc);
    }

    #[test]
    fn normalisation() {
        assert_eq!(normalize_final_answer("x = 1,000"), "1000");
        assert_eq!(normalize_final_answer("1,000.5"), "1,000.5");
        assert_eq!(normalize_final_answer("-1,000"), "-1,000");
        assert_eq!(
            normalize_final_answer("$\\boxed{\\frac{3}{4}}$"),
            "\\frac{3}{4}"
        );
        assert_eq!(normalize_final_answer("\\frac34"), "\\frac{3}{4}");
        assert_eq!(normalize_final_answer("\\sqrt2"), "\\sqrt{2}");
        assert_eq!(normalize_final_answer("10 \\text{ cm}"), "10");
        assert_eq!(normalize_final_answer("5 dollars"), "5");
        assert_eq!(normalize_final_answer("90^\\circ"), "90");
        assert_eq!(normalize_final_answer("\\textbf{B}"), "B");
        assert_eq!(normalize_final_answer("\\overline{AB}"), "AB");
        assert_eq!(normalize_final_answer("  7  "), "7");
        // "a " is deleted anywhere, which can eat parts of words.
        assert_eq!(normalize_final_answer("a banana"), "banana");
        assert_eq!(normalize_final_answer("the $x$ and $y$ tail"), "x");
    }

    #[test]
    fn fractions_are_not_decimals() {
        assert!(!score("Answer: 0.5", "\\frac12").acc);
        assert!(score("Answer: \\dfrac{1}{2}", "\\dfrac12").acc);
    }

    #[test]
    fn negative_and_comma_numbers() {
        assert!(score("Answer: -3", "-3").acc);
        assert!(!score("Answer: -3", "3").acc);
        assert!(score("Answer: 12,345", "12345").acc);
    }

    #[test]
    fn only_last_300_chars_are_read() {
        let s = format!("Answer: 5\n{}", "x".repeat(300));
        assert_eq!(score(&s, "5").pred.as_deref(), Some("[INVALID]"));
    }

    #[test]
    fn strict_box_mode() {
        let r = compute_score(
            "so \\boxed{1} then \\boxed{\\frac{1}{2}}",
            "\\frac{1}{2}",
            true,
            None,
        );
        assert_eq!((r.score, r.pred.as_deref()), (1.0, Some("\\frac{1}{2}")));
        // Raw comparison: no normalisation in strict mode.
        let r = compute_score("\\boxed{ 5}", "5", true, None);
        assert_eq!((r.score, r.pred.as_deref()), (-1.0, Some(" 5")));
        let r = compute_score("Answer: 5", "5", true, None);
        assert_eq!((r.score, r.acc, r.pred), (-1.0, false, None));
        // The box must be within the last 100 chars.
        let far = format!("\\boxed{{5}}{}", "x".repeat(100));
        assert_eq!(compute_score(&far, "5", true, None).pred, None);
        // A pause-token index anchors the window; Python's negative slice start wraps.
        let s = format!("\\boxed{{5}}{}", "x".repeat(100));
        assert!(compute_score(&s, "5", true, Some(&[0, 0, 0, 100])).acc);
        assert!(compute_score(&s, "5", true, Some(&[0, 0, 0, 50]))
            .pred
            .is_none());
    }
}

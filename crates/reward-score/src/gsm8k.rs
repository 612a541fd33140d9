//! GSM8K scorer (verl `reward_score/gsm8k.py`): the answer is the number after `#### ` (strict) or
//! the last number-like token anywhere (flexible), compared as a plain string to the ground truth.

use std::sync::LazyLock;

use regex::Regex;

use super::pystr::py_tail;
use super::Gsm8kMethod;

/// verl only searches the tail of long solutions, so an answer earlier than this is invisible.
pub const SOLUTION_CLIP_CHARS: usize = 300;

static STRICT_RE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"#### (-?[0-9.,]+)").unwrap());
static FLEXIBLE_RE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"-?[0-9.,]+").unwrap());

/// The extracted answer, or None when the solution has none.
pub fn extract_solution(solution: &str, method: Gsm8kMethod) -> Option<String> {
    let solution = py_tail(solution, SOLUTION_CLIP_CHARS);
    match method {
        Gsm8kMethod::Strict => STRICT_RE
            .captures_iter(solution)
            .last()
            .map(|c| c[1].replace([',', '$'], "")),
        Gsm8kMethod::Flexible => {
            let found: Vec<&str> = FLEXIBLE_RE
                .find_iter(solution)
                .map(|m| m.as_str())
                .collect();
            // verl walks the matches backwards to skip a bare "."; when every match is invalid its
            // loop variable is left on the first match, which is then used as the answer. Note the
            // flexible answer keeps its commas (only strict strips them).
            let last_valid = found.iter().rev().find(|a| !a.is_empty() && **a != ".");
            last_valid.or(found.first()).map(|a| a.to_string())
        }
    }
}

/// `score` when the extracted answer equals the ground truth, `format_score` when an answer was
/// found but differs, and 0.0 when none was found (verl returns a literal 0 there, not
/// `format_score`).
pub fn compute_score(
    solution: &str,
    ground_truth: &str,
    method: Gsm8kMethod,
    format_score: f64,
    score: f64,
) -> f64 {
    match extract_solution(solution, method) {
        None => 0.0,
        Some(answer) if answer == ground_truth => score,
        Some(_) => format_score,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Gsm8kMethod::{Flexible, Strict};

    fn strict(s: &str) -> Option<String> {
        extract_solution(s, Strict)
    }
    fn flex(s: &str) -> Option<String> {
        extract_solution(s, Flexible)
    }

    #[test]
    fn strict_takes_last_marker_and_strips_commas() {
        assert_eq!(strict("#### 1\n#### 2"), Some("2".into()));
        assert_eq!(strict("so #### 1,234"), Some("1234".into()));
        assert_eq!(strict("#### -7"), Some("-7".into()));
        assert_eq!(strict("#### 3.50."), Some("3.50.".into()));
        assert_eq!(strict("The answer is 5"), None);
        // No space after the marker, or a dollar sign before the number: no match.
        assert_eq!(strict("####5"), None);
        assert_eq!(strict("#### $5"), None);
        assert_eq!(strict("#### - 5"), None);
    }

    #[test]
    fn strict_only_sees_the_last_300_chars() {
        let long = format!("#### 42\n{}", "x".repeat(300));
        assert_eq!(strict(&long), None);
        let fits = format!("#### 42{}", "é".repeat(293));
        assert_eq!(strict(&fits), Some("42".into()));
    }

    #[test]
    fn flexible_takes_last_number_and_keeps_commas() {
        assert_eq!(
            flex("I have 3 apples and 1,000 pears."),
            Some("1,000".into())
        );
        assert_eq!(
            flex("I have 3 apples and 1,000 pears"),
            Some("1,000".into())
        );
        assert_eq!(flex("answer: -12."), Some("-12.".into()));
        assert_eq!(flex("no digits here"), None);
        // A lone comma is a "number" to the flexible pattern and is not skipped.
        assert_eq!(flex("5 apples, then"), Some(",".into()));
        // Only "." is skipped; when nothing else is left, the first match wins.
        assert_eq!(flex("a . b . c"), Some(".".into()));
        assert_eq!(flex("7 and ."), Some("7".into()));
    }

    #[test]
    fn scores() {
        assert_eq!(compute_score("#### 18", "18", Strict, 0.0, 1.0), 1.0);
        assert_eq!(compute_score("#### 17", "18", Strict, 0.1, 1.0), 0.1);
        assert_eq!(compute_score("18", "18", Strict, 0.1, 1.0), 0.0);
        assert_eq!(compute_score("so 18", "18", Flexible, 0.1, 1.0), 1.0);
        assert_eq!(compute_score("#### 1,800", "1800", Strict, 0.0, 1.0), 1.0);
        assert_eq!(compute_score("so 1,800", "1800", Flexible, 0.0, 1.0), 0.0);
        assert_eq!(compute_score("#### -3", "-3", Strict, 0.0, 2.0), 2.0);
    }
}

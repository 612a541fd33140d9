//! Hendrycks MATH scorer (verl `reward_score/math_reward.py`, itself the lm-eval-harness
//! normalisation): the content of the last `\boxed{..}` / `\boxed ..` / `\fbox{..}` is normalised
//! with [`strip_string`] and compared to the normalised ground truth. 1.0 on a match, else 0.0.
//!
//! Python raises in several places here (asserts, `s[0]` on an empty piece) and verl catches those
//! exceptions at two levels with different fallbacks; [`Raised`] marks those paths so the fallbacks
//! can be reproduced exactly.

use super::pystr::{char_len, first_char};

/// A Python exception inside the reference code: the caller decides the fallback, as verl does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Raised;

const BOXED_SPACE: &str = "\\boxed ";
const BOXED_BRACE: &str = "\\boxed{";

/// The last boxed expression including its `\boxed`/`\fbox` prefix, or None when there is none
/// or its braces never close.
pub fn last_boxed_only_string(string: &str) -> Option<String> {
    // The space form wins over any brace form, wherever they are: verl checks it first and
    // takes everything after its last occurrence up to the next `$`.
    if let Some(pos) = string.rfind(BOXED_SPACE) {
        let after = &string[pos + BOXED_SPACE.len()..];
        let content = after.split('$').next().unwrap_or("");
        return Some(format!("{BOXED_SPACE}{content}"));
    }
    let idx = string.rfind("\\boxed").or_else(|| string.rfind("\\fbox"))?;
    let mut open: i64 = 0;
    for (off, byte) in string.as_bytes()[idx..].iter().enumerate() {
        match byte {
            b'{' => open += 1,
            b'}' => {
                open -= 1;
                if open == 0 {
                    return Some(string[idx..=idx + off].to_string());
                }
            }
            _ => {}
        }
    }
    None
}

/// Strips the `\boxed ` / `\boxed{..}` wrapper. An `\fbox{..}`, or a `\boxed` not directly
/// followed by `{`, is an assertion failure in verl (and scores 0 there).
pub fn remove_boxed(s: &str) -> Result<&str, Raised> {
    if s.contains(BOXED_SPACE) {
        return s.strip_prefix(BOXED_SPACE).ok_or(Raised);
    }
    s.strip_prefix(BOXED_BRACE)
        .and_then(|inner| inner.strip_suffix('}'))
        .ok_or(Raised)
}

/// `\frac12` -> `\frac{1}{2}`, `\frac1{72}` -> `\frac{1}{72}`; `\frac{..}` untouched.
fn fix_fracs(string: &str) -> Result<String, Raised> {
    let mut pieces = string.split("\\frac");
    let mut out = pieces.next().unwrap_or("").to_string();
    for piece in pieces {
        out.push_str("\\frac");
        let mut chars = piece.chars();
        // `substr[0]` on an empty piece (`\frac` at the end, or `\frac\frac`) raises in verl.
        let a = chars.next().ok_or(Raised)?;
        if a == '{' {
            out.push_str(piece);
            continue;
        }
        let Some(b) = chars.next() else {
            // A one-character piece makes verl give up on the whole string, unchanged.
            return Ok(string.to_string());
        };
        let rest = chars.as_str();
        if b == '{' {
            out.push_str(&format!("{{{a}}}{b}{rest}"));
        } else {
            out.push_str(&format!("{{{a}}}{{{b}}}{rest}"));
        }
    }
    Ok(out)
}

/// Python's `str(int(s)) == s`: the only integers verl's `a/b` rewrite accepts.
fn is_canonical_int(s: &str) -> bool {
    let digits = s.strip_prefix('-').unwrap_or(s);
    // CPython refuses to convert integers with more than 4300 digits (ValueError).
    let ok_digits = !digits.is_empty()
        && digits.len() <= 4300
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'));
    ok_digits && s != "-0"
}

/// `3/4` -> `\frac{3}{4}` for plain integers only.
fn fix_a_slash_b(string: String) -> String {
    let mut parts = string.split('/');
    let (Some(a), Some(b), None) = (parts.next(), parts.next(), parts.next()) else {
        return string;
    };
    if is_canonical_int(a) && is_canonical_int(b) {
        format!("\\frac{{{a}}}{{{b}}}")
    } else {
        string
    }
}

/// Drops a trailing `\text{ unit}`; more than one such marker raises in verl.
fn remove_right_units(string: String) -> Result<String, Raised> {
    const MARK: &str = "\\text{ ";
    if !string.contains(MARK) {
        return Ok(string);
    }
    let mut parts = string.split(MARK);
    match (parts.next(), parts.next(), parts.next()) {
        (Some(head), Some(_), None) => Ok(head.to_string()),
        _ => Err(Raised),
    }
}

/// `\sqrt3` -> `\sqrt{3}`; a `\sqrt` at the very end (or twice in a row) raises in verl.
fn fix_sqrt(string: String) -> Result<String, Raised> {
    if !string.contains("\\sqrt") {
        return Ok(string);
    }
    let mut pieces = string.split("\\sqrt");
    let mut out = pieces.next().unwrap_or("").to_string();
    for piece in pieces {
        let a = first_char(piece).ok_or(Raised)?;
        if a == '{' {
            out.push_str("\\sqrt");
            out.push_str(piece);
        } else {
            out.push_str(&format!("\\sqrt{{{a}}}{}", &piece[a.len_utf8()..]));
        }
    }
    Ok(out)
}

/// lm-eval-harness's hendrycks MATH answer normalisation, step for step.
pub fn strip_string(string: &str) -> Result<String, Raised> {
    let mut s = string
        .replace('\n', "")
        .replace("\\!", "")
        .replace("\\\\", "\\")
        .replace("tfrac", "frac")
        .replace("dfrac", "frac")
        .replace("\\left", "")
        .replace("\\right", "")
        .replace("^{\\circ}", "")
        .replace("^\\circ", "")
        .replace("\\$", "");
    s = remove_right_units(s)?;
    s = s
        .replace("\\\\%", "")
        .replace("\\%", "")
        .replace(" .", " 0.")
        .replace("{.", "{0.");
    if s.is_empty() {
        return Ok(s);
    }
    if s.starts_with('.') {
        s.insert(0, '0');
    }
    // "k = 3" -> "3", but only for a short left-hand side and a single `=`.
    {
        let mut eq = s.split('=');
        if let (Some(lhs), Some(rhs), None) = (eq.next(), eq.next(), eq.next()) {
            if char_len(lhs) <= 2 {
                s = rhs.to_string();
            }
        }
    }
    s = fix_sqrt(s)?;
    s = s.replace(' ', "");
    s = fix_fracs(&s)?;
    if s == "0.5" {
        s = "\\frac{1}{2}".to_string();
    }
    Ok(fix_a_slash_b(s))
}

/// Equal after normalisation; when normalising either side raises, verl falls back to comparing
/// the raw strings.
pub fn is_equiv(a: &str, b: &str) -> bool {
    match (strip_string(a), strip_string(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

/// 1.0 when the last boxed answer is equivalent to the ground truth, else 0.0 (also when verl's
/// extraction raises, which it catches and prints).
pub fn compute_score(solution: &str, ground_truth: &str) -> f64 {
    let Some(boxed) = last_boxed_only_string(solution) else {
        return 0.0;
    };
    match remove_boxed(&boxed) {
        Ok(answer) if is_equiv(answer, ground_truth) => 1.0,
        _ => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_box_scores_zero() {
        assert_eq!(compute_score("The answer is 5.", "5"), 0.0);
        assert_eq!(last_boxed_only_string("nothing"), None);
        // Unclosed braces: no answer.
        assert_eq!(last_boxed_only_string("\\boxed{5"), None);
    }

    #[test]
    fn last_of_multiple_boxes_and_nested_braces() {
        let s = "first \\boxed{1} then \\boxed{\\frac{1}{2}} done";
        assert_eq!(
            last_boxed_only_string(s).as_deref(),
            Some("\\boxed{\\frac{1}{2}}")
        );
        assert_eq!(compute_score(s, "\\frac12"), 1.0);
        assert_eq!(compute_score(s, "1"), 0.0);
    }

    #[test]
    fn boxed_space_form_wins_and_stops_at_dollar() {
        let s = "\\boxed{7} and $\\boxed 3$ end";
        assert_eq!(last_boxed_only_string(s).as_deref(), Some("\\boxed 3"));
        assert_eq!(compute_score(s, "3"), 1.0);
        assert_eq!(compute_score(s, "7"), 0.0);
    }

    #[test]
    fn fbox_is_found_but_cannot_be_unboxed() {
        let s = "\\fbox{5}";
        assert_eq!(last_boxed_only_string(s).as_deref(), Some("\\fbox{5}"));
        assert_eq!(remove_boxed("\\fbox{5}"), Err(Raised));
        assert_eq!(compute_score(s, "5"), 0.0);
        // `\boxed` followed by something other than `{`: the span starts at `\boxed`.
        assert_eq!(compute_score("\\boxed\n{5}", "5"), 0.0);
    }

    #[test]
    fn normalisation_steps() {
        assert_eq!(strip_string("\\dfrac{1}{2}").unwrap(), "\\frac{1}{2}");
        assert_eq!(strip_string("0.5").unwrap(), "\\frac{1}{2}");
        // ".5" -> "0.5" -> the 0.5 special case.
        assert_eq!(strip_string(".5").unwrap(), "\\frac{1}{2}");
        assert_eq!(strip_string("\\frac12").unwrap(), "\\frac{1}{2}");
        assert_eq!(strip_string("\\frac1{72}").unwrap(), "\\frac{1}{72}");
        assert_eq!(strip_string("\\frac{72}1").unwrap(), "\\frac{72}1");
        assert_eq!(strip_string("3/4").unwrap(), "\\frac{3}{4}");
        assert_eq!(strip_string("-3/4").unwrap(), "\\frac{-3}{4}");
        assert_eq!(strip_string("03/4").unwrap(), "03/4");
        assert_eq!(strip_string("x = 5").unwrap(), "5");
        assert_eq!(strip_string("abc = 5").unwrap(), "abc=5");
        assert_eq!(strip_string("\\sqrt3").unwrap(), "\\sqrt{3}");
        assert_eq!(strip_string("10\\%").unwrap(), "10");
        assert_eq!(strip_string("90^\\circ").unwrap(), "90");
        assert_eq!(strip_string("\\$5").unwrap(), "5");
        assert_eq!(strip_string("5 \\text{ cm}").unwrap(), "5");
        assert_eq!(strip_string("1,\\!000").unwrap(), "1,000");
        assert_eq!(strip_string("\\left( 1, 2 \\right)").unwrap(), "(1,2)");
        assert_eq!(strip_string("").unwrap(), "");
    }

    #[test]
    fn raising_paths_fall_back_to_raw_comparison() {
        assert_eq!(strip_string("\\sqrt"), Err(Raised));
        assert_eq!(strip_string("2\\frac"), Err(Raised));
        assert_eq!(strip_string("1\\text{ a}\\text{ b}"), Err(Raised));
        // A one-character `\frac` piece leaves the string as it was (after the earlier steps).
        assert_eq!(strip_string("\\frac1").unwrap(), "\\frac1");
        assert!(is_equiv("\\sqrt", "\\sqrt"));
        assert!(!is_equiv("\\sqrt", "\\sqrt "));
    }

    #[test]
    fn equivalences() {
        assert!(is_equiv("0.5", "\\frac12"));
        assert!(is_equiv("\\frac{1}{2}", "1/2"));
        assert!(!is_equiv("0.50", "\\frac12"));
        assert!(is_equiv("-5", "-5"));
        assert!(!is_equiv("-5", "5"));
        assert!(!is_equiv("1,000", "1000"));
        assert!(is_equiv("1,\\!000", "1,000"));
        assert!(is_equiv("\\text{(A)}", "\\text{(A)}"));
    }
}

//! Python `str` semantics that verl's scorers rely on and that Rust's `str` does not share.
//!
//! Python indexes, slices and measures strings in code points, and its `isspace`/`isdigit`
//! (and therefore `re`'s `\s` and `str.strip`) use Unicode tables that differ from Rust's
//! `char::is_whitespace`/`is_ascii_digit`. Rewards flip on these details, so every scorer goes
//! through the helpers here instead of the std equivalents.

/// Python's `str.isspace` for one code point: Rust's White_Space set plus the four
/// information separators U+001C..U+001F, which Python counts as whitespace.
pub fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1C}'..='\u{1F}').contains(&c)
}

/// Python's `str.strip()` with no argument.
pub fn py_strip(s: &str) -> &str {
    s.trim_matches(is_py_space)
}

/// Code points for which Python's `str.isdigit` is true (Numeric_Type Digit or Decimal),
/// as inclusive ranges. Generated from CPython 3.11's Unicode 14 database.
const PY_DIGIT_RANGES: &[(char, char)] = &[
    ('\u{30}', '\u{39}'),
    ('\u{B2}', '\u{B3}'),
    ('\u{B9}', '\u{B9}'),
    ('\u{660}', '\u{669}'),
    ('\u{6F0}', '\u{6F9}'),
    ('\u{7C0}', '\u{7C9}'),
    ('\u{966}', '\u{96F}'),
    ('\u{9E6}', '\u{9EF}'),
    ('\u{A66}', '\u{A6F}'),
    ('\u{AE6}', '\u{AEF}'),
    ('\u{B66}', '\u{B6F}'),
    ('\u{BE6}', '\u{BEF}'),
    ('\u{C66}', '\u{C6F}'),
    ('\u{CE6}', '\u{CEF}'),
    ('\u{D66}', '\u{D6F}'),
    ('\u{DE6}', '\u{DEF}'),
    ('\u{E50}', '\u{E59}'),
    ('\u{ED0}', '\u{ED9}'),
    ('\u{F20}', '\u{F29}'),
    ('\u{1040}', '\u{1049}'),
    ('\u{1090}', '\u{1099}'),
    ('\u{1369}', '\u{1371}'),
    ('\u{17E0}', '\u{17E9}'),
    ('\u{1810}', '\u{1819}'),
    ('\u{1946}', '\u{194F}'),
    ('\u{19D0}', '\u{19DA}'),
    ('\u{1A80}', '\u{1A89}'),
    ('\u{1A90}', '\u{1A99}'),
    ('\u{1B50}', '\u{1B59}'),
    ('\u{1BB0}', '\u{1BB9}'),
    ('\u{1C40}', '\u{1C49}'),
    ('\u{1C50}', '\u{1C59}'),
    ('\u{2070}', '\u{2070}'),
    ('\u{2074}', '\u{2079}'),
    ('\u{2080}', '\u{2089}'),
    ('\u{2460}', '\u{2468}'),
    ('\u{2474}', '\u{247C}'),
    ('\u{2488}', '\u{2490}'),
    ('\u{24EA}', '\u{24EA}'),
    ('\u{24F5}', '\u{24FD}'),
    ('\u{24FF}', '\u{24FF}'),
    ('\u{2776}', '\u{277E}'),
    ('\u{2780}', '\u{2788}'),
    ('\u{278A}', '\u{2792}'),
    ('\u{A620}', '\u{A629}'),
    ('\u{A8D0}', '\u{A8D9}'),
    ('\u{A900}', '\u{A909}'),
    ('\u{A9D0}', '\u{A9D9}'),
    ('\u{A9F0}', '\u{A9F9}'),
    ('\u{AA50}', '\u{AA59}'),
    ('\u{ABF0}', '\u{ABF9}'),
    ('\u{FF10}', '\u{FF19}'),
    ('\u{104A0}', '\u{104A9}'),
    ('\u{10A40}', '\u{10A43}'),
    ('\u{10D30}', '\u{10D39}'),
    ('\u{10E60}', '\u{10E68}'),
    ('\u{11052}', '\u{1105A}'),
    ('\u{11066}', '\u{1106F}'),
    ('\u{110F0}', '\u{110F9}'),
    ('\u{11136}', '\u{1113F}'),
    ('\u{111D0}', '\u{111D9}'),
    ('\u{112F0}', '\u{112F9}'),
    ('\u{11450}', '\u{11459}'),
    ('\u{114D0}', '\u{114D9}'),
    ('\u{11650}', '\u{11659}'),
    ('\u{116C0}', '\u{116C9}'),
    ('\u{11730}', '\u{11739}'),
    ('\u{118E0}', '\u{118E9}'),
    ('\u{11950}', '\u{11959}'),
    ('\u{11C50}', '\u{11C59}'),
    ('\u{11D50}', '\u{11D59}'),
    ('\u{11DA0}', '\u{11DA9}'),
    ('\u{16A60}', '\u{16A69}'),
    ('\u{16AC0}', '\u{16AC9}'),
    ('\u{16B50}', '\u{16B59}'),
    ('\u{1D7CE}', '\u{1D7FF}'),
    ('\u{1E140}', '\u{1E149}'),
    ('\u{1E2F0}', '\u{1E2F9}'),
    ('\u{1E950}', '\u{1E959}'),
    ('\u{1F100}', '\u{1F10A}'),
    ('\u{1FBF0}', '\u{1FBF9}'),
];

fn is_py_digit_char(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_digit();
    }
    PY_DIGIT_RANGES
        .binary_search_by(|&(lo, hi)| {
            if hi < c {
                std::cmp::Ordering::Less
            } else if lo > c {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        })
        .is_ok()
}

/// Python's `str.isdigit()`: non-empty and every code point a digit.
pub fn py_isdigit(s: &str) -> bool {
    !s.is_empty() && s.chars().all(is_py_digit_char)
}

/// Number of code points, i.e. Python's `len(s)`.
pub fn char_len(s: &str) -> usize {
    s.chars().count()
}

/// Byte offset of code point `n` (or `s.len()` when `n` is past the end).
fn byte_offset(s: &str, n: usize) -> usize {
    s.char_indices().nth(n).map_or(s.len(), |(b, _)| b)
}

/// Python's `s[start:]` for any (possibly negative) `start`.
pub fn py_slice_from(s: &str, start: i64) -> &str {
    let len = char_len(s) as i64;
    let start = if start < 0 {
        (len + start).max(0)
    } else {
        start.min(len)
    };
    &s[byte_offset(s, start as usize)..]
}

/// Python's `s[-n:]`: the last `n` code points (all of `s` when it is shorter).
pub fn py_tail(s: &str, n: usize) -> &str {
    if n == 0 {
        // `s[-0:]` is `s[0:]` in Python: the whole string.
        return s;
    }
    py_slice_from(s, -(n as i64))
}

/// First code point, Python's `s[0]` (None where Python would raise IndexError).
pub fn first_char(s: &str) -> Option<char> {
    s.chars().next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strip_uses_python_whitespace() {
        assert_eq!(py_strip("\u{1C} a b\u{3000}\n"), "a b");
        // U+200B is not whitespace in either language.
        assert_eq!(py_strip("\u{200B}x"), "\u{200B}x");
    }

    #[test]
    fn isdigit_matches_python() {
        assert!(py_isdigit("0123"));
        assert!(py_isdigit("²³"));
        assert!(py_isdigit("١٢"));
        assert!(!py_isdigit(""));
        assert!(!py_isdigit("1.5"));
        assert!(!py_isdigit("-1"));
        assert!(!py_isdigit("½"));
    }

    #[test]
    fn slicing_counts_code_points() {
        assert_eq!(py_tail("héllo", 3), "llo");
        assert_eq!(py_tail("héllo", 4), "éllo");
        assert_eq!(py_tail("ab", 10), "ab");
        assert_eq!(py_tail("ab", 0), "ab");
        assert_eq!(py_slice_from("abcdef", -2), "ef");
        assert_eq!(py_slice_from("abcdef", -20), "abcdef");
        assert_eq!(py_slice_from("abcdef", 4), "ef");
        assert_eq!(py_slice_from("abcdef", 40), "");
        assert_eq!(char_len("日本"), 2);
    }
}

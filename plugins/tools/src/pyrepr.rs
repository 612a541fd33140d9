//! Python's `str()` and `repr()` of JSON values, for tool texts that verl builds with f-strings
//! (`f"{answer=}"` is `answer=` followed by `repr(answer)`).

use serde_json::Value;

/// `repr(s)` of a Python `str`: single quotes unless the text has a `'` and no `"`; backslash,
/// the quote, `\t \n \r` and non-printable characters escaped as Python escapes them.
/// Printability follows Python for the control, separator and format characters text carries
/// in practice (C0/C1 controls, the Unicode spaces other than U+0020, line and paragraph
/// separators, soft hyphen, zero-width and direction marks, BOM).
pub fn repr_str(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !printable(c) => {
                let v = c as u32;
                if v <= 0xff {
                    out.push_str(&format!("\\x{v:02x}"));
                } else if v <= 0xffff {
                    out.push_str(&format!("\\u{v:04x}"));
                } else {
                    out.push_str(&format!("\\U{v:08x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

fn printable(c: char) -> bool {
    let v = c as u32;
    !(v < 0x20
        || (0x7f..=0xa0).contains(&v)
        || v == 0xad
        || v == 0x1680
        || (0x2000..=0x200f).contains(&v)
        || (0x2028..=0x202f).contains(&v)
        || (0x205f..=0x206f).contains(&v)
        || v == 0x3000
        || v == 0xfeff)
}

/// `repr(x)` of a Python float: the shortest text that reads back the same, with `.0` on whole
/// numbers and the exponent form Python uses below 1e-4 and from 1e16.
pub fn repr_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    // Rust's `{:e}` is the shortest round-trip digits: `d[.ddd]e[-]x`.
    let sci = format!("{:e}", x.abs());
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` has an exponent");
    let exp: i32 = exp.parse().expect("`{:e}` exponent is an integer");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if x.is_sign_negative() { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let text = if exp >= 0 {
            let point = exp as usize + 1;
            if digits.len() <= point {
                format!("{digits:0<point$}.0")
            } else {
                format!("{}.{}", &digits[..point], &digits[point..])
            }
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        };
        format!("{sign}{text}")
    } else {
        let m = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{esign}{:02}", exp.abs())
    }
}

/// `repr()` of the Python value `json.loads` makes of `v`.
pub fn repr(v: &Value) -> String {
    match v {
        Value::String(s) => repr_str(s),
        other => str_of(other),
    }
}

/// `str()` of the Python value `json.loads` makes of `v` (ints as ints, other numbers as floats,
/// `True`/`False`/`None`, lists and dicts with their items' `repr`).
pub fn str_of(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => i.to_string(),
            (_, Some(u)) => u.to_string(),
            _ => repr_float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => s.clone(),
        Value::Array(items) => format!(
            "[{}]",
            items.iter().map(repr).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(m) => format!(
            "{{{}}}",
            m.iter()
                .map(|(k, v)| format!("{}: {}", repr_str(k), repr(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    // Expected values printed by CPython 3.11.
    #[test]
    fn strings_quote_and_escape_as_python() {
        assert_eq!(repr_str("72"), "'72'");
        assert_eq!(repr_str("it's"), "\"it's\"");
        assert_eq!(repr_str("it's \"x\""), "'it\\'s \"x\"'");
        assert_eq!(repr_str("a\\b\n\tc\r"), "'a\\\\b\\n\\tc\\r'");
        assert_eq!(repr_str("\u{0}\u{7f}\u{a0}é日"), "'\\x00\\x7f\\xa0é日'");
        assert_eq!(
            repr_str("\u{200b}\u{2028}\u{feff}"),
            "'\\u200b\\u2028\\ufeff'"
        );
    }

    #[test]
    fn floats_print_as_python_repr() {
        assert_eq!(repr_float(1.0), "1.0");
        assert_eq!(repr_float(0.0), "0.0");
        assert_eq!(repr_float(-0.05), "-0.05");
        assert_eq!(repr_float(0.1 + 0.2), "0.30000000000000004");
        assert_eq!(repr_float(123.456), "123.456");
        assert_eq!(repr_float(1e16), "1e+16");
        assert_eq!(repr_float(1.5e-5), "1.5e-05");
        assert_eq!(repr_float(0.0001), "0.0001");
        assert_eq!(repr_float(1234567890123456.0), "1234567890123456.0");
        assert_eq!(repr_float(1.2345678901234568e17), "1.2345678901234568e+17");
    }

    #[test]
    fn json_values_print_as_their_python_objects() {
        assert_eq!(str_of(&json!(72)), "72");
        assert_eq!(str_of(&json!(72.0)), "72.0");
        assert_eq!(str_of(&json!(null)), "None");
        assert_eq!(str_of(&json!(true)), "True");
        assert_eq!(str_of(&json!(["a", 1, null])), "['a', 1, None]");
        assert_eq!(str_of(&json!({"k": "v"})), "{'k': 'v'}");
        assert_eq!(repr(&json!("18")), "'18'");
    }
}

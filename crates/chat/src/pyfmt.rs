//! Python's text forms of template values: `json.dumps` (what HF's `tojson` filter calls) and
//! `str()`/`repr()` (what Jinja2 prints for `{{ value }}`). Chat templates were written against
//! CPython, and models were trained on its exact bytes, so these must match character for
//! character, not merely be valid JSON.

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};
use std::fmt::Write as _;

/// Options of Python's `json.dumps` that HF's `tojson` filter exposes.
#[derive(Debug, Clone)]
pub(crate) struct JsonOptions {
    pub ensure_ascii: bool,
    /// `None`: single line. `Some(s)`: pretty-print, one level of nesting = `s`.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
}

impl JsonOptions {
    /// Python's defaults depend on `indent`: without it items are joined by `", "`, with it by
    /// `","` (the newline carries the spacing).
    pub fn new(
        ensure_ascii: bool,
        indent: Option<String>,
        separators: Option<(String, String)>,
        sort_keys: bool,
    ) -> Self {
        let (item_separator, key_separator) = separators.unwrap_or_else(|| {
            if indent.is_some() {
                (",".to_owned(), ": ".to_owned())
            } else {
                (", ".to_owned(), ": ".to_owned())
            }
        });
        JsonOptions {
            ensure_ascii,
            indent,
            item_separator,
            key_separator,
            sort_keys,
        }
    }
}

impl Default for JsonOptions {
    fn default() -> Self {
        JsonOptions::new(false, None, None, false)
    }
}

fn not_serializable(value: &Value) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "tojson: a value of kind {} is not JSON serializable",
            value.kind()
        ),
    )
}

/// `json.dumps(value, ...)`.
pub(crate) fn json_dumps(value: &Value, opts: &JsonOptions) -> Result<String, Error> {
    let mut out = String::new();
    write_json(&mut out, value, opts, 0)?;
    Ok(out)
}

fn newline_indent(out: &mut String, indent: &str, level: usize) {
    out.push('\n');
    for _ in 0..level {
        out.push_str(indent);
    }
}

fn write_json(
    out: &mut String,
    value: &Value,
    opts: &JsonOptions,
    level: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_json_number(out, value),
        ValueKind::String => {
            write_json_string(out, value.as_str().unwrap_or_default(), opts.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_json_list(out, &items, opts, level)?;
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if opts.sort_keys {
                // Python sorts by code point; Rust's `str` ordering is by UTF-8 bytes, which
                // orders code points identically.
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_json_map(out, &entries, opts, level)?;
        }
        ValueKind::Undefined | ValueKind::Bytes | ValueKind::Plain | ValueKind::Invalid | _ => {
            return Err(not_serializable(value))
        }
    }
    Ok(())
}

fn write_json_list(
    out: &mut String,
    items: &[Value],
    opts: &JsonOptions,
    level: usize,
) -> Result<(), Error> {
    if items.is_empty() {
        out.push_str("[]");
        return Ok(());
    }
    out.push('[');
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&opts.item_separator);
        }
        if let Some(indent) = &opts.indent {
            newline_indent(out, indent, level + 1);
        }
        write_json(out, item, opts, level + 1)?;
    }
    if let Some(indent) = &opts.indent {
        newline_indent(out, indent, level);
    }
    out.push(']');
    Ok(())
}

fn write_json_map(
    out: &mut String,
    entries: &[(String, Value)],
    opts: &JsonOptions,
    level: usize,
) -> Result<(), Error> {
    if entries.is_empty() {
        out.push_str("{}");
        return Ok(());
    }
    out.push('{');
    for (i, (key, item)) in entries.iter().enumerate() {
        if i > 0 {
            out.push_str(&opts.item_separator);
        }
        if let Some(indent) = &opts.indent {
            newline_indent(out, indent, level + 1);
        }
        write_json_string(out, key, opts.ensure_ascii);
        out.push_str(&opts.key_separator);
        write_json(out, item, opts, level + 1)?;
    }
    if let Some(indent) = &opts.indent {
        newline_indent(out, indent, level);
    }
    out.push('}');
    Ok(())
}

/// Python's json converts non-string keys the way `json.dumps({1: 0, True: 0, None: 0})`
/// does: `{"1": 0, "true": 0, "null": 0}`.
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::Number => {
            let mut s = String::new();
            write_json_number(&mut s, key);
            Ok(s)
        }
        _ => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "tojson: keys must be str, int, float, bool or None, not {}",
                key.kind()
            ),
        )),
    }
}

fn write_json_number(out: &mut String, value: &Value) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
        return;
    }
    let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
    if f.is_nan() {
        out.push_str("NaN");
    } else if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
    } else {
        out.push_str(&py_float_repr(f));
    }
}

/// Python's `json` string encoder: `ensure_ascii=False` escapes only `"`, `\` and control
/// characters below U+0020; `ensure_ascii=True` also escapes everything outside printable
/// ASCII (U+007F included) as `\uXXXX`, astral characters as surrogate pairs.
pub(crate) fn write_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `repr(float)` in CPython: the shortest digits that round-trip, in positional notation
/// when the decimal exponent is in [-4, 16), otherwise as `d.ddde±XX`.
pub(crate) fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.to_owned();
    }
    // Rust's `{:e}` yields the same shortest round-trip digits CPython uses, e.g. "-1.5e-5".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` always has an exponent");
    let exp: i32 = exp.parse().expect("`{:e}` exponent is an integer");
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let mut out = String::new();
    if negative {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let sign = if exp < 0 { '-' } else { '+' };
        let _ = write!(out, "e{sign}{:02}", exp.abs());
    }
    out
}

/// Python's `str(value)`: what Jinja2 writes for `{{ value }}`. Returns `None` for kinds whose
/// text minijinja already produces the Python way (strings, integers, undefined, objects).
pub(crate) fn py_str(value: &Value) -> Option<String> {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map => Some(py_repr(value)),
        ValueKind::Number if !value.is_integer() => Some(py_repr(value)),
        _ => None,
    }
}

/// Python's `repr(value)` for the value kinds JSON-like chat data can hold.
pub(crate) fn py_repr(value: &Value) -> String {
    let mut out = String::new();
    write_repr(&mut out, value);
    out
}

fn write_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
                out.push_str(&py_float_repr(f));
            }
        }
        ValueKind::String => write_repr_str(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            out.push('[');
            if let Ok(iter) = value.try_iter() {
                for (i, item) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &item);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(iter) = value.try_iter() {
                for (i, key) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &key);
                    out.push_str(": ");
                    let item = value.get_item(&key).unwrap_or_default();
                    write_repr(out, &item);
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// `repr(str)`: single quotes unless the text has a `'` and no `"`; escapes backslash, the
/// chosen quote and non-printable characters.
fn write_repr_str(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..=0xa0).contains(&(c as u32)) || c == '\u{ad}' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_cpython() {
        let cases: &[(f64, &str)] = &[
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (1.5, "1.5"),
            (0.1, "0.1"),
            (123.456, "123.456"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e16, "1e+16"),
            (1.2345e20, "1.2345e+20"),
            (9999999999999998.0, "9999999999999998.0"),
            (1e15, "1000000000000000.0"),
            (1e100, "1e+100"),
            (2.5e-300, "2.5e-300"),
            (f64::NAN, "nan"),
            (f64::INFINITY, "inf"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float_repr(*f), *want, "repr({f:?})");
        }
    }

    #[test]
    fn json_dumps_default_separators_and_unicode() {
        let v = Value::from_serialize(serde_json::json!({
            "b": [1, 2.5, null, true, "x\"y\\z\n\u{1}"],
            "a": {},
            "c": [],
            "d": "naïve 🚀"
        }));
        let got = json_dumps(&v, &JsonOptions::default()).unwrap();
        assert_eq!(
            got,
            "{\"b\": [1, 2.5, null, true, \"x\\\"y\\\\z\\n\\u0001\"], \"a\": {}, \"c\": [], \"d\": \"naïve 🚀\"}"
        );
        let ascii = json_dumps(&v, &JsonOptions::new(true, None, None, true)).unwrap();
        assert_eq!(
            ascii,
            "{\"a\": {}, \"b\": [1, 2.5, null, true, \"x\\\"y\\\\z\\n\\u0001\"], \"c\": [], \"d\": \"na\\u00efve \\ud83d\\ude80\"}"
        );
    }

    #[test]
    fn json_dumps_indent_like_python() {
        // json.dumps({"a": [1, {"b": None}], "e": []}, indent=2)
        let v = Value::from_serialize(serde_json::json!({"a": [1, {"b": null}], "e": []}));
        let got = json_dumps(&v, &JsonOptions::new(false, Some("  ".into()), None, false)).unwrap();
        assert_eq!(
            got,
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": null\n    }\n  ],\n  \"e\": []\n}"
        );
    }

    #[test]
    fn repr_like_python() {
        let v = Value::from_serialize(serde_json::json!({"k": ["it's", "a\"b", 1.0, null, false]}));
        assert_eq!(py_repr(&v), "{'k': [\"it's\", 'a\"b', 1.0, None, False]}");
        assert_eq!(py_str(&Value::from("text")), None);
    }
}

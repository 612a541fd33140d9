//! JSON text exactly as Python's `json.dumps` writes it with its defaults (`ensure_ascii`,
//! `", "` / `": "` separators, or `indent` with `","` line ends): the form of the `datasets`
//! feature metadata and of verl's `*_example.json` files, which we reproduce byte for byte.

use std::fmt::Write;

use serde_json::Value;

/// `json.dumps(value)` when `indent` is `None`, `json.dumps(value, indent=n)` otherwise.
/// Numbers are written as serde_json writes them, which matches Python for integers (the only
/// numbers these files hold).
pub(crate) fn dumps(value: &Value, indent: Option<usize>) -> String {
    let mut out = String::new();
    write_value(&mut out, value, indent, 0);
    out
}

fn write_value(out: &mut String, value: &Value, indent: Option<usize>, depth: usize) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => write_str(out, s),
        Value::Array(items) => write_seq(out, ('[', ']'), items.iter(), indent, depth, |out, v| {
            write_value(out, v, indent, depth + 1)
        }),
        Value::Object(map) => {
            write_seq(out, ('{', '}'), map.iter(), indent, depth, |out, (k, v)| {
                write_str(out, k);
                out.push_str(": ");
                write_value(out, v, indent, depth + 1);
            })
        }
    }
}

fn write_seq<T>(
    out: &mut String,
    (open, close): (char, char),
    items: impl ExactSizeIterator<Item = T>,
    indent: Option<usize>,
    depth: usize,
    mut item: impl FnMut(&mut String, T),
) {
    out.push(open);
    if items.len() == 0 {
        out.push(close);
        return;
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    };
    for (i, v) in items.enumerate() {
        if i > 0 {
            out.push_str(if indent.is_some() { "," } else { ", " });
        }
        newline(out, depth + 1);
        item(out, v);
    }
    newline(out, depth);
    out.push(close);
}

/// A string literal with `ensure_ascii`: everything outside printable ASCII as `\uXXXX`
/// (UTF-16 surrogate pairs above the BMP), lowercase hex, the short escapes Python uses.
fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn compact_form_uses_python_separators_and_escapes_non_ascii() {
        let v = json!({"a": [1, null, true], "é": "x\u{7f}😀\u{1}\"", "e": {}, "l": []});
        assert_eq!(
            dumps(&v, None),
            r#"{"a": [1, null, true], "\u00e9": "x\u007f\ud83d\ude00\u0001\"", "e": {}, "l": []}"#
        );
    }

    #[test]
    fn indented_form_matches_json_dump_indent_2() {
        let v = json!({"p": [{"r": "u"}], "n": 3, "e": []});
        assert_eq!(
            dumps(&v, Some(2)),
            "{\n  \"p\": [\n    {\n      \"r\": \"u\"\n    }\n  ],\n  \"n\": 3,\n  \"e\": []\n}"
        );
    }
}

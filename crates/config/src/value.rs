//! Override values as Hydra types them: `null`, booleans, numbers, quoted strings, `[a, b]`
//! lists, `{k: v}` maps, anything else a bare string. Overrides and interpolation defaults
//! (`${oc.env:X,default}`) both parse their text here.

use serde_yaml::{Mapping, Number, Value};

/// Parses an override value: `null`, booleans, integers, floats (`1e-6`, `.5`, `inf`), quoted
/// strings, `[a, b]` lists, `{k: v}` maps, and anything else as a bare string (trimmed).
pub fn parse_value(text: &str) -> std::result::Result<Value, String> {
    let mut p = Parser {
        chars: text.chars().collect(),
        pos: 0,
    };
    p.skip_ws();
    if p.at_end() {
        return Ok(Value::String(String::new()));
    }
    let v = p.element(true)?;
    p.skip_ws();
    match p.peek() {
        None => Ok(v),
        Some(',') => Err(
            "a top-level `,` makes a Hydra sweep, which verl-rs does not run; write a list as `[a,b]`"
                .into(),
        ),
        Some(c) => Err(format!(
            "unexpected `{c}` at column {} of the value",
            p.pos + 1
        )),
    }
}

struct Parser {
    chars: Vec<char>,
    pos: usize,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn at_end(&self) -> bool {
        self.pos >= self.chars.len()
    }

    fn skip_ws(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.pos += 1;
        }
    }

    fn element(&mut self, top: bool) -> std::result::Result<Value, String> {
        self.skip_ws();
        match self.peek() {
            Some('[') => self.list(),
            Some('{') => self.map(),
            Some(q @ ('\'' | '"')) => {
                let s = self.quoted(q)?;
                Ok(Value::String(s))
            }
            _ => {
                let raw = self.primitive(top, false)?;
                Ok(classify(&raw))
            }
        }
    }

    fn quoted(&mut self, q: char) -> std::result::Result<String, String> {
        let start = self.pos;
        self.pos += 1;
        let mut out = String::new();
        while let Some(c) = self.peek() {
            self.pos += 1;
            match c {
                '\\' => match self.peek() {
                    Some(n) if n == q || n == '\\' => {
                        out.push(n);
                        self.pos += 1;
                    }
                    _ => out.push('\\'),
                },
                c if c == q => return Ok(out),
                c => out.push(c),
            }
        }
        Err(format!(
            "unterminated {q}-quoted string starting at column {}",
            start + 1
        ))
    }

    /// A bare token: up to a `,`, `]` or `}` outside `${...}` (at the top level only `,` stops
    /// it, and only so the caller can report a sweep); a map key also stops at `:`. As in Hydra,
    /// a backslash makes the next special character (`\{`, `\}`, `\[`, `\]`, `\(`, `\)`, `\:`, `\=`,
    /// `\,`, `\ `, `\\`) literal.
    fn primitive(&mut self, top: bool, key: bool) -> std::result::Result<String, String> {
        let mut out = String::new();
        let mut depth = 0usize;
        while let Some(c) = self.peek() {
            if c == '\\' {
                if let Some(&n) = self.chars.get(self.pos + 1) {
                    if "{}[]():=, \t\\".contains(n) {
                        out.push(n);
                        self.pos += 2;
                        continue;
                    }
                }
            }
            if depth == 0 {
                if c == ',' || (!top && (c == ']' || c == '}')) {
                    break;
                }
                if key && c == ':' {
                    break;
                }
            }
            if c == '$' && self.chars.get(self.pos + 1) == Some(&'{') {
                depth += 1;
                out.push_str("${");
                self.pos += 2;
                continue;
            }
            if depth > 0 && c == '{' {
                depth += 1;
            }
            if depth > 0 && c == '}' {
                depth -= 1;
            }
            out.push(c);
            self.pos += 1;
        }
        if depth > 0 {
            return Err("unterminated `${` interpolation".into());
        }
        Ok(out.trim().to_string())
    }

    fn list(&mut self) -> std::result::Result<Value, String> {
        self.pos += 1;
        let mut items = Vec::new();
        self.skip_ws();
        if self.peek() == Some(']') {
            self.pos += 1;
            return Ok(Value::Sequence(items));
        }
        loop {
            items.push(self.element(false)?);
            self.skip_ws();
            match self.peek() {
                Some(',') => self.pos += 1,
                Some(']') => {
                    self.pos += 1;
                    return Ok(Value::Sequence(items));
                }
                Some(c) => return Err(format!("expected `,` or `]` in a list, found `{c}`")),
                None => return Err("unterminated list: missing `]`".into()),
            }
        }
    }

    fn map(&mut self) -> std::result::Result<Value, String> {
        self.pos += 1;
        let mut map = Mapping::new();
        self.skip_ws();
        if self.peek() == Some('}') {
            self.pos += 1;
            return Ok(Value::Mapping(map));
        }
        loop {
            self.skip_ws();
            let key = match self.peek() {
                Some(q @ ('\'' | '"')) => self.quoted(q)?,
                _ => self.primitive(false, true)?,
            };
            if key.is_empty() {
                return Err("a map entry has an empty key".into());
            }
            self.skip_ws();
            if self.peek() != Some(':') {
                return Err(format!("expected `:` after map key `{key}`"));
            }
            self.pos += 1;
            let value = self.element(false)?;
            map.insert(Value::String(key), value);
            self.skip_ws();
            match self.peek() {
                Some(',') => self.pos += 1,
                Some('}') => {
                    self.pos += 1;
                    return Ok(Value::Mapping(map));
                }
                Some(c) => return Err(format!("expected `,` or `}}` in a map, found `{c}`")),
                None => return Err("unterminated map: missing `}`".into()),
            }
        }
    }
}

/// Types a bare token the way Hydra does.
fn classify(raw: &str) -> Value {
    let lower = raw.to_ascii_lowercase();
    match lower.as_str() {
        "null" | "~" => return Value::Null,
        "true" => return Value::Bool(true),
        "false" => return Value::Bool(false),
        "inf" | "+inf" => return Value::Number(Number::from(f64::INFINITY)),
        "-inf" => return Value::Number(Number::from(f64::NEG_INFINITY)),
        "nan" => return Value::Number(Number::from(f64::NAN)),
        _ => {}
    }
    let digits: String = raw.chars().filter(|c| *c != '_').collect();
    let body = digits.trim_start_matches(['+', '-']);
    let numeric = !body.is_empty()
        && body.starts_with(|c: char| c.is_ascii_digit() || c == '.')
        && body
            .chars()
            .all(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '+' | '-'));
    if numeric {
        if body.chars().all(|c| c.is_ascii_digit()) {
            if let Ok(i) = digits.parse::<i64>() {
                return Value::Number(Number::from(i));
            }
            if let Ok(u) = digits.parse::<u64>() {
                return Value::Number(Number::from(u));
            }
        }
        if let Ok(f) = digits.parse::<f64>() {
            return Value::Number(Number::from(f));
        }
    }
    Value::String(raw.to_string())
}

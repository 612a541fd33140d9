//! Chat templates rendered with minijinja, configured to behave like the Jinja2 environment HF
//! transformers builds in `chat_template_utils.py` (`ImmutableSandboxedEnvironment(trim_blocks,
//! lstrip_blocks)`, loop controls, `tojson` without HTML escaping, `raise_exception`,
//! `strftime_now`), plus Python's string/dict methods and Python's way of printing values.

use crate::error::{ChatError, Result};
use crate::pyfmt::{self, JsonOptions};
use minijinja::value::{Kwargs, Rest, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde::Serialize;
use std::fmt::Write as _;

const TEMPLATE_NAME: &str = "chat_template";

/// Names HF passes to every template itself; `ChatOptions::extra_vars` may not redefine them.
const RESERVED_VARS: &[&str] = &["messages", "tools", "documents", "add_generation_prompt"];

/// Options of one `apply_chat_template` call (HF's keyword arguments).
#[derive(Debug, Clone, Default)]
pub struct ChatOptions {
    /// Append the assistant header so the model answers next.
    pub add_generation_prompt: bool,
    /// Leave the last message open (no end-of-turn marker) so generation continues it.
    pub continue_final_message: bool,
    /// Tool (function) JSON schemas, as HF's `tools=`; `None` renders `tools` as `none`.
    pub tools: Option<Vec<serde_json::Value>>,
    /// RAG documents, as HF's `documents=`.
    pub documents: Option<Vec<serde_json::Value>>,
    /// Which of a tokenizer's named templates to use (`tool_use`, `rag`, ...).
    pub template_name: Option<String>,
    /// Further template variables (`enable_thinking`, `date_string`, ...). They override the
    /// special-token variables, as HF's `**kwargs` do.
    pub extra_vars: serde_json::Map<String, serde_json::Value>,
}

impl ChatOptions {
    pub fn with_generation_prompt() -> Self {
        ChatOptions {
            add_generation_prompt: true,
            ..Default::default()
        }
    }
}

/// A plain chat message. Anything richer (tool calls, content parts) can be passed as
/// `serde_json::Value` instead: the render functions take any `Serialize`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Message::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Message::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Message::new("assistant", content)
    }
}

/// Marker put in the source chain of the minijinja error raised by `raise_exception`, so the
/// render error can be told apart from engine errors without string matching.
#[derive(Debug)]
struct RaisedByTemplate(String);

impl std::fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

/// A compiled chat template.
pub struct ChatTemplate {
    name: String,
    source: String,
    env: Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("name", &self.name)
            .field("source_len", &self.source.len())
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source`. `name` only labels errors (e.g. `default`, `tool_use`, a file path).
    pub fn new(name: impl Into<String>, source: impl Into<String>) -> Result<Self> {
        let name = name.into();
        let source: String = source.into();
        let mut env = hf_environment();
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(&source))
            .map_err(|e| ChatError::TemplateSyntax {
                name: name.clone(),
                message: error_text(&e),
            })?;
        Ok(ChatTemplate { name, source, env })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders the conversation like HF's `render_jinja_template`. `base_vars` are variables
    /// below the options' own (the tokenizer passes its special tokens here).
    pub fn render<M: Serialize>(
        &self,
        messages: &[M],
        opts: &ChatOptions,
        base_vars: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        if opts.continue_final_message && opts.add_generation_prompt {
            return Err(ChatError::Options {
                message: "continue_final_message and add_generation_prompt are mutually exclusive \
                          (one closes the last message and opens a new turn, the other keeps the \
                          last message open)"
                    .into(),
            });
        }
        for key in opts.extra_vars.keys() {
            if RESERVED_VARS.contains(&key.as_str()) {
                return Err(ChatError::Options {
                    message: format!(
                        "extra variable `{key}` collides with a variable the renderer sets itself \
                         (reserved: {RESERVED_VARS:?})"
                    ),
                });
            }
        }
        let mut messages_value =
            serde_json::to_value(messages).map_err(|e| ChatError::Options {
                message: format!("messages cannot be serialized: {e}"),
            })?;
        let final_text = if opts.continue_final_message {
            Some(tag_final_message(&mut messages_value)?)
        } else {
            None
        };

        // Insertion order of this map decides nothing visible (templates look variables up by
        // name), but keep HF's precedence: special tokens < kwargs < the four fixed arguments.
        let mut ctx = serde_json::Map::new();
        for (k, v) in base_vars {
            ctx.insert(k.clone(), v.clone());
        }
        for (k, v) in &opts.extra_vars {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), messages_value);
        ctx.insert(
            "tools".into(),
            opts.tools
                .as_ref()
                .map(|t| serde_json::Value::Array(t.clone()))
                .unwrap_or(serde_json::Value::Null),
        );
        ctx.insert(
            "documents".into(),
            opts.documents
                .as_ref()
                .map(|d| serde_json::Value::Array(d.clone()))
                .unwrap_or(serde_json::Value::Null),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            serde_json::Value::Bool(opts.add_generation_prompt),
        );

        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .expect("template was added in ChatTemplate::new");
        let rendered = template
            .render(Value::from_serialize(&ctx))
            .map_err(|e| self.render_error(&e))?;

        match final_text {
            Some(text) => cut_at_final_message_tag(&rendered, &text),
            None => Ok(rendered),
        }
    }

    fn render_error(&self, e: &Error) -> ChatError {
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(err) = source {
            if let Some(raised) = err.downcast_ref::<RaisedByTemplate>() {
                return ChatError::TemplateRaised {
                    name: self.name.clone(),
                    message: raised.0.clone(),
                };
            }
            source = err.source();
        }
        ChatError::TemplateRender {
            name: self.name.clone(),
            message: error_text(e),
        }
    }
}

/// Appended to the final message for `continue_final_message`, exactly as transformers does, so
/// the end of that message can be found in the rendering whatever the template adds after it.
const CONTINUE_FINAL_MESSAGE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Tags the last message's text (its last text part for multimodal content) and returns the
/// untagged text.
fn tag_final_message(messages: &mut serde_json::Value) -> Result<String> {
    let last = messages
        .as_array_mut()
        .and_then(|m| m.last_mut())
        .ok_or_else(|| ChatError::Options {
            message: "continue_final_message needs at least one message".into(),
        })?;
    let content = last.get_mut("content");
    let text_slot: &mut serde_json::Value = match content {
        Some(slot @ serde_json::Value::String(_)) => slot,
        Some(serde_json::Value::Array(parts)) => parts
            .iter_mut()
            .rev()
            .find_map(|p| p.get_mut("text").filter(|t| t.is_string()))
            .ok_or_else(|| ChatError::Options {
                message: "continue_final_message is set but the final message has no text part \
                          to continue"
                    .into(),
            })?,
        other => {
            return Err(ChatError::Options {
                message: format!(
                    "continue_final_message: the final message's `content` must be a string or a \
                     list of parts, found {}",
                    other.map_or_else(|| "nothing".to_owned(), |v| crate::error::describe_json(v))
                ),
            })
        }
    };
    let text = text_slot.as_str().unwrap_or_default().to_owned();
    *text_slot = serde_json::Value::String(format!("{text}{CONTINUE_FINAL_MESSAGE_TAG}"));
    Ok(text)
}

/// HF's `continue_final_message`: cut the rendering where the tag starts, dropping the
/// end-of-turn tokens the template wrote after the last message.
fn cut_at_final_message_tag(rendered: &str, final_text: &str) -> Result<String> {
    let tag = CONTINUE_FINAL_MESSAGE_TAG.trim();
    let Some(loc) = rendered
        .rfind(tag)
        .filter(|_| rendered.contains(final_text.trim()))
    else {
        return Err(ChatError::Options {
            message: "continue_final_message is set but the final message does not appear in the \
                      rendered chat (the template changes its text)"
                .into(),
        });
    };
    // The template kept the tag's trailing space, so it kept the message verbatim; otherwise it
    // trimmed the message and its trailing whitespace must go too.
    if rendered[loc..].starts_with(CONTINUE_FINAL_MESSAGE_TAG) {
        Ok(rendered[..loc].to_owned())
    } else {
        Ok(rendered[..loc].trim_end().to_owned())
    }
}

fn error_text(e: &Error) -> String {
    let mut text = e.to_string();
    if let Some(line) = e.line() {
        if !text.contains("line") {
            let _ = write!(text, " (line {line})");
        }
    }
    text
}

/// The Jinja2 environment of HF's `_compile_jinja_template`, in minijinja.
fn hf_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    // Jinja2's default (HF does not change it): a single trailing newline of the template
    // source is dropped.
    env.set_keep_trailing_newline(false);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python_formatter);
    env.add_filter("tojson", tojson_filter);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env
}

/// Writes `{{ value }}` as Jinja2 would: `str(value)` in Python (`None`, `True`, `[1, 'a']`).
fn python_formatter(
    out: &mut minijinja::Output,
    state: &State,
    value: &Value,
) -> Result<(), Error> {
    match pyfmt::py_str(value) {
        Some(text) => out
            .write_str(&text)
            .map_err(|_| Error::new(ErrorKind::WriteFailure, "cannot write rendered output")),
        None => minijinja::escape_formatter(out, state, value),
    }
}

fn raise_exception(message: Value) -> Result<Value, Error> {
    let text = match message.as_str() {
        Some(s) => s.to_owned(),
        None => pyfmt::py_str(&message).unwrap_or_else(|| message.to_string()),
    };
    Err(Error::new(ErrorKind::InvalidOperation, text.clone()).with_source(RaisedByTemplate(text)))
}

/// `datetime.now().strftime(format)` (local time, like Python).
fn strftime_now(format: &str) -> Result<String, Error> {
    let mut out = String::new();
    write!(out, "{}", chrono::Local::now().format(format)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format string {format:?}"),
        )
    })?;
    Ok(out)
}

/// HF's `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`:
/// `json.dumps` with those arguments, positional or by keyword, and no HTML escaping.
fn tojson_filter(value: Value, positional: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    if positional.len() > 4 {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 positional arguments (ensure_ascii, indent, separators, sort_keys)",
        ));
    }
    let mut positional = positional.0.into_iter().map(Some);
    let mut next = || positional.next().flatten();
    let (ensure_ascii, indent, separators, sort_keys) = (next(), next(), next(), next());
    fn pick(
        name: &str,
        positional: Option<Value>,
        kwargs: &Kwargs,
    ) -> Result<Option<Value>, Error> {
        let keyword: Option<Value> = kwargs.get(name)?;
        match (positional, keyword) {
            (Some(_), Some(_)) => Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: argument `{name}` given both by position and by keyword"),
            )),
            (p, k) => Ok(p.or(k).filter(|v| !v.is_none() && !v.is_undefined())),
        }
    }
    let ensure_ascii = pick("ensure_ascii", ensure_ascii, &kwargs)?.is_some_and(|v| v.is_true());
    let sort_keys = pick("sort_keys", sort_keys, &kwargs)?.is_some_and(|v| v.is_true());
    let indent = match pick("indent", indent, &kwargs)? {
        None => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
        Some(v) if v.kind() == ValueKind::Number || v.kind() == ValueKind::Bool => {
            let n = i64::try_from(v.clone()).map_err(|_| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: `indent` must be an integer or a string, got {v}"),
                )
            })?;
            Some(" ".repeat(n.max(0) as usize))
        }
        Some(v) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: `indent` must be an integer or a string, got {v}"),
            ))
        }
    };
    let separators = match pick("separators", separators, &kwargs)? {
        None => None,
        Some(v) => {
            let parts: Vec<Value> = v.try_iter().map(|it| it.collect()).unwrap_or_default();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => Some((
                    a.as_str().unwrap_or_default().to_owned(),
                    b.as_str().unwrap_or_default().to_owned(),
                )),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        format!(
                            "tojson: `separators` must be a pair of strings (item, key), got {v}"
                        ),
                    ))
                }
            }
        }
    };
    kwargs.assert_all_used()?;
    let opts = JsonOptions::new(ensure_ascii, indent, separators, sort_keys);
    pyfmt::json_dumps(&value, &opts).map(Value::from)
}

/// HF registers a `{% generation %}...{% endgeneration %}` block tag (used to mark assistant
/// tokens for training masks); it renders its body unchanged. minijinja has no custom tags,
/// so the tags become `{% if true %}...{% endif %}`, which keeps every whitespace-control
/// marker (`-`, `+`) and therefore the exact output.
pub(crate) fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body) = split_marker_start(inner);
        let (body, trail) = split_marker_end(body);
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str("{%");
                out.push_str(lead);
                out.push(' ');
                out.push_str(r);
                out.push(' ');
                out.push_str(trail);
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn split_marker_start(s: &str) -> (&str, &str) {
    match s.as_bytes().first() {
        Some(b'-') | Some(b'+') => (&s[..1], &s[1..]),
        _ => ("", s),
    }
}

fn split_marker_end(s: &str) -> (&str, &str) {
    match s.as_bytes().last() {
        Some(b'-') | Some(b'+') => (&s[..s.len() - 1], &s[s.len() - 1..]),
        _ => (s, ""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(src: &str, messages: serde_json::Value, opts: &ChatOptions) -> Result<String> {
        let t = ChatTemplate::new("test", src)?;
        let msgs: Vec<serde_json::Value> = serde_json::from_value(messages).unwrap();
        t.render(&msgs, opts, &serde_json::Map::new())
    }

    #[test]
    fn trim_and_lstrip_blocks_like_hf() {
        let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
        let got = render(
            src,
            json!([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]),
            &ChatOptions::default(),
        )
        .unwrap();
        assert_eq!(got, "[a]\n[b]\n");
    }

    #[test]
    fn single_trailing_newline_is_dropped() {
        assert_eq!(
            render("x\n", json!([]), &ChatOptions::default()).unwrap(),
            "x"
        );
        assert_eq!(
            render("x\n\n", json!([]), &ChatOptions::default()).unwrap(),
            "x\n"
        );
    }

    #[test]
    fn raise_exception_becomes_template_raised() {
        let src = "{% if messages[0].role != 'system' %}{{ raise_exception('first must be system') }}{% endif %}";
        let err = render(
            src,
            json!([{"role": "user", "content": "x"}]),
            &ChatOptions::default(),
        )
        .unwrap_err();
        match err {
            ChatError::TemplateRaised { message, name } => {
                assert_eq!(message, "first must be system");
                assert_eq!(name, "test");
            }
            other => panic!("expected TemplateRaised, got {other:?}"),
        }
    }

    #[test]
    fn tojson_options_and_python_printing() {
        let src = "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=true) }}|{{ messages[0].content | tojson(ensure_ascii=true) }}|{{ messages[0] | tojson(separators=(',', ':')) }}|{{ none }}|{{ true }}|{{ [1, 'a', none] }}|{{ 2.0 }}";
        let got = render(
            src,
            json!([{"role": "user", "content": "é<>&"}]),
            &ChatOptions::default(),
        )
        .unwrap();
        assert_eq!(
            got,
            "{\"role\": \"user\", \"content\": \"é<>&\"}|{\n  \"content\": \"é<>&\",\n  \"role\": \"user\"\n}|\"\\u00e9<>&\"|{\"role\":\"user\",\"content\":\"é<>&\"}|None|True|[1, 'a', None]|2.0"
        );
    }

    #[test]
    fn pycompat_methods_and_loop_controls() {
        let src = "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.content.strip().split(' ')[-1].upper() }}{% if m.content.startswith(' ') %}!{% endif %},{% endfor %}{% for k, v in messages[0].items() %}{{ k }}={{ v|trim }};{% endfor %}";
        let got = render(
            src,
            json!([{"role": "user", "content": " hello world "}, {"role": "user", "content": "x y"}, {"role": "user", "content": "never"}]),
            &ChatOptions::default(),
        )
        .unwrap();
        assert_eq!(got, "WORLD!,Y,role=user;content=hello world;");
    }

    #[test]
    fn generation_tags_render_their_body() {
        let src = "{% for m in messages %}{%- generation -%}\n  <{{ m.content }}>\n{%- endgeneration %}{% endfor %}";
        let got = render(
            src,
            json!([{"role": "assistant", "content": "a"}]),
            &ChatOptions::default(),
        )
        .unwrap();
        assert_eq!(got, "<a>");
        assert_eq!(
            rewrite_generation_tags("{%+ generation %}"),
            "{%+ if true %}"
        );
        assert_eq!(
            rewrite_generation_tags("{% if x %}{% endif %}"),
            "{% if x %}{% endif %}"
        );
    }

    #[test]
    fn continue_final_message_truncates_like_hf() {
        let src = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>\n{% endfor %}";
        let opts = ChatOptions {
            continue_final_message: true,
            ..Default::default()
        };
        let msgs = json!([{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is "}]);
        assert_eq!(
            render(src, msgs, &opts).unwrap(),
            "<user>q</s>\n<assistant>The answer is "
        );
        let both = ChatOptions {
            continue_final_message: true,
            add_generation_prompt: true,
            ..Default::default()
        };
        assert!(matches!(
            render(src, json!([{"role": "user", "content": "q"}]), &both),
            Err(ChatError::Options { .. })
        ));
    }

    #[test]
    fn extra_vars_and_reserved_names() {
        let mut opts = ChatOptions::default();
        opts.extra_vars
            .insert("enable_thinking".into(), json!(false));
        let got = render(
            "{% if enable_thinking is false %}no-think{% endif %}",
            json!([]),
            &opts,
        )
        .unwrap();
        assert_eq!(got, "no-think");
        opts.extra_vars.insert("messages".into(), json!([]));
        let err = render("x", json!([]), &opts).unwrap_err();
        assert!(err.to_string().contains("`messages`"), "{err}");
    }

    #[test]
    fn syntax_error_names_template() {
        let err = ChatTemplate::new("tool_use", "{% if %}").unwrap_err();
        let text = err.to_string();
        assert!(text.contains("`tool_use` does not compile"), "{text}");
    }

    #[test]
    fn strftime_now_formats_today() {
        let got = render(
            "{{ strftime_now('%Y-%m-%d') }}",
            json!([]),
            &ChatOptions::default(),
        )
        .unwrap();
        assert_eq!(got.len(), 10, "{got}");
        assert_eq!(&got[4..5], "-");
    }
}

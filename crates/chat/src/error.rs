use std::path::PathBuf;

/// Everything that can go wrong while loading a tokenizer folder or rendering a chat template.
///
/// Variants carry the file and field they are about, what was expected and what was found, so a
/// message printed by the CLI is enough to fix a broken model folder without reading our code.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("{path}: file not found ({needed_for})")]
    MissingFile { path: PathBuf, needed_for: String },

    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: not valid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    #[error("{path}: field `{field}`: expected {expected}, found {found}")]
    Field {
        path: PathBuf,
        field: String,
        expected: String,
        found: String,
    },

    #[error("{path}: the `tokenizers` library rejected it: {message}")]
    TokenizerFile { path: PathBuf, message: String },

    #[error("tokenizer {operation} failed: {message}")]
    Tokenizer {
        operation: &'static str,
        message: String,
    },

    #[error("tokenizer training failed: {message}")]
    Training { message: String },

    #[error(
        "{dir}: no chat template (looked for chat_template.jinja, `chat_template` in \
         tokenizer_config.json and chat_template.json)"
    )]
    NoChatTemplate { dir: PathBuf },

    #[error("chat template `{name}` not found; available: {available:?}")]
    UnknownTemplateName {
        name: String,
        available: Vec<String>,
    },

    #[error(
        "this tokenizer has several chat templates {available:?} and none is named `default`; \
         pick one with ChatOptions::template_name"
    )]
    AmbiguousTemplate { available: Vec<String> },

    #[error("chat template `{name}` does not compile: {message}")]
    TemplateSyntax { name: String, message: String },

    #[error("chat template `{name}` failed while rendering: {message}")]
    TemplateRender { name: String, message: String },

    /// The template itself called `raise_exception(message)` (HF templates use it to reject
    /// conversations they cannot format, e.g. a wrong role order).
    #[error("chat template `{name}` rejected the conversation: {message}")]
    TemplateRaised { name: String, message: String },

    #[error("chat options: {message}")]
    Options { message: String },
}

pub type Result<T, E = ChatError> = std::result::Result<T, E>;

/// Short, single-line description of a JSON value for error messages: its type and a
/// truncated rendering, so huge fields (a whole template) do not flood the terminal.
pub(crate) fn describe_json(value: &serde_json::Value) -> String {
    let kind = match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    };
    let text = value.to_string();
    const MAX: usize = 80;
    if text.chars().count() > MAX {
        let cut: String = text.chars().take(MAX).collect();
        format!("{kind} {cut}…")
    } else {
        format!("{kind} {text}")
    }
}

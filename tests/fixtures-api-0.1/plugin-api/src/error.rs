//! The crate's one error type, and its `#[repr(C)]` transport form for crossing the ABI.

use abi_stable::{std_types::RString, StableAbi};

/// What kind of failure an [`Error::Plugin`] is; travels across the ABI as a `u8`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The call failed for a reason the plugin explains in the message.
    Failed,
    /// The plugin panicked; the panic was caught inside the plugin.
    Panic,
    /// The plugin does not implement this role or call (yet).
    NotImplemented,
    /// The input handed to the plugin was rejected.
    InvalidInput,
    /// A file-system or I/O failure.
    Io,
}

impl ErrorKind {
    pub(crate) fn code(self) -> u8 {
        match self {
            ErrorKind::Failed => 1,
            ErrorKind::Panic => 2,
            ErrorKind::NotImplemented => 3,
            ErrorKind::InvalidInput => 4,
            ErrorKind::Io => 5,
        }
    }
    pub(crate) fn from_code(code: u8) -> Self {
        match code {
            2 => ErrorKind::Panic,
            3 => ErrorKind::NotImplemented,
            4 => ErrorKind::InvalidInput,
            5 => ErrorKind::Io,
            _ => ErrorKind::Failed,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Failed => "failed",
            ErrorKind::Panic => "panicked",
            ErrorKind::NotImplemented => "not implemented",
            ErrorKind::InvalidInput => "invalid input",
            ErrorKind::Io => "I/O error",
        }
    }
}

/// Every failure this crate reports: batch contract violations, plugin failures, bad options.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{call}: column `{column}` is missing (columns present: {present})")]
    MissingColumn {
        call: String,
        column: String,
        present: String,
    },
    #[error("{call}: column `{column}` is a {found} column, expected a {expected} column")]
    ColumnKind {
        call: String,
        column: String,
        expected: String,
        found: String,
    },
    #[error("{call}: column `{column}` has dtype {found}, expected {expected}")]
    DType {
        call: String,
        column: String,
        expected: String,
        found: String,
    },
    #[error("{call}: column `{column}` has shape {found:?}, expected {expected}{note}")]
    Shape {
        call: String,
        column: String,
        expected: String,
        found: Vec<u64>,
        note: String,
    },
    #[error("{call}: column `{column}` holds {found} bytes, but shape {shape:?} of {dtype} needs {expected}")]
    Corrupt {
        call: String,
        column: String,
        shape: Vec<u64>,
        dtype: String,
        expected: u64,
        found: u64,
    },
    #[error("{call}: column `{column}` appears twice")]
    DuplicateColumn { call: String, column: String },
    #[error("{call}: row {row} of JSON column `{column}` is not valid JSON: {message}")]
    Json {
        call: String,
        column: String,
        row: usize,
        message: String,
    },
    #[error("{call}: invalid options: {message}")]
    Options { call: String, message: String },
    /// An error raised inside a plugin (or by a plugin author's code), possibly after crossing the ABI.
    #[error("{}", plugin_message(.plugin, .call, .kind, .message))]
    Plugin {
        plugin: String,
        call: String,
        kind: ErrorKind,
        message: String,
    },
}

fn plugin_message(plugin: &str, call: &str, kind: &ErrorKind, message: &str) -> String {
    let head = match (plugin.is_empty(), call.is_empty()) {
        (true, true) => String::new(),
        (false, true) => format!("plugin `{plugin}`: "),
        (true, false) => format!("{call}: "),
        (false, false) => format!("plugin `{plugin}` {call}: "),
    };
    match kind {
        ErrorKind::Failed | ErrorKind::InvalidInput | ErrorKind::Io => format!("{head}{message}"),
        ErrorKind::Panic => format!("{head}panicked: {message}"),
        ErrorKind::NotImplemented => format!("{head}not implemented: {message}"),
    }
}

impl Error {
    /// A plain failure with a message, for plugin authors.
    pub fn failed(message: impl Into<String>) -> Self {
        Self::with_kind(ErrorKind::Failed, message)
    }
    /// The role or call is not implemented by this plugin.
    pub fn not_implemented(message: impl Into<String>) -> Self {
        Self::with_kind(ErrorKind::NotImplemented, message)
    }
    /// The input was rejected.
    pub fn invalid_input(message: impl Into<String>) -> Self {
        Self::with_kind(ErrorKind::InvalidInput, message)
    }
    pub fn with_kind(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error::Plugin {
            plugin: String::new(),
            call: String::new(),
            kind,
            message: message.into(),
        }
    }

    /// The kind of failure, as it travels across the ABI.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Plugin { kind, .. } => *kind,
            Error::Options { .. } => ErrorKind::InvalidInput,
            _ => ErrorKind::InvalidInput,
        }
    }

    /// Fill in the plugin name and call where they are not known yet.
    pub fn in_call(self, plugin_name: &str, call_name: &str) -> Self {
        match self {
            Error::Plugin {
                plugin,
                call,
                kind,
                message,
            } => Error::Plugin {
                plugin: if plugin.is_empty() {
                    plugin_name.to_string()
                } else {
                    plugin
                },
                call: if call.is_empty() {
                    call_name.to_string()
                } else {
                    call
                },
                kind,
                message,
            },
            other => other,
        }
    }

    pub(crate) fn into_ffi(self) -> FfiError {
        let kind = self.kind();
        let message = match &self {
            // The plugin and call are added back by the receiving side, which knows them.
            Error::Plugin { message, .. } => message.clone(),
            other => other.to_string(),
        };
        FfiError {
            kind: kind.code(),
            message: message.into(),
        }
    }

    pub fn from_ffi(err: FfiError, plugin: &str, call: &str) -> Self {
        Error::Plugin {
            plugin: plugin.to_string(),
            call: call.to_string(),
            kind: ErrorKind::from_code(err.kind),
            message: err.message.into_string(),
        }
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::with_kind(ErrorKind::Io, e.to_string())
    }
}

/// The error as it crosses the ABI: a kind code and a message.
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct FfiError {
    pub kind: u8,
    pub message: RString,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

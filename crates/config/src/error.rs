use std::fmt;
use std::path::PathBuf;

/// Everything that can go wrong while loading, overriding, resolving or checking a config.
///
/// Each variant names the dotted key (and file or override) it is about, what was expected and
/// what was found, so the message can be shown to a user as is.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    // ---- reading the job file ----
    #[error("cannot read config file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}:{line}:{column}: YAML syntax error: {message}")]
    Syntax {
        file: String,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("{file}: the top level must be a mapping of sections (data:, actor_rollout_ref:, trainer:, ...), found {found}")]
    TopLevelNotMapping { file: String, found: String },

    // ---- schema ----
    #[error("{origin}: unknown key `{key}`{}", Hint(suggestion))]
    UnknownKey {
        key: String,
        origin: String,
        suggestion: Option<String>,
    },
    #[error("{origin}: `{key}`: expected {expected}, found {found}")]
    TypeMismatch {
        key: String,
        expected: String,
        found: String,
        origin: String,
    },
    #[error("{origin}: `{key}`: {message}")]
    Invalid {
        key: String,
        message: String,
        origin: String,
    },
    #[error(
        "{origin}: `{key}` must be one of {allowed}, found `{found}`{}",
        Hint(suggestion)
    )]
    InvalidChoice {
        key: String,
        allowed: String,
        found: String,
        suggestion: Option<String>,
        origin: String,
    },
    #[error("{a} and {b} name one setting (in verl's newer and older layouts) but have different values: give one of them")]
    Conflict { a: Box<SetKey>, b: Box<SetKey> },
    #[error("{origin}: {message}")]
    Refused {
        key: String,
        origin: String,
        message: String,
    },
    #[error("`{key}` is mandatory (`???`) and has no value: set it in the job file or with the override `{key}=...`")]
    MissingMandatory { key: String },

    // ---- overrides ----
    #[error("override `{text}`: {reason}")]
    OverrideSyntax { text: String, reason: String },
    #[error(
        "override `{text}`: there is no key `{key}` in the config{}",
        Hint(suggestion)
    )]
    OverrideMissingKey {
        text: String,
        key: String,
        suggestion: Option<String>,
    },
    #[error("override `{text}`: `+` adds keys only inside a free-form map (such as `*.override_config`, `*.engine_kwargs`, `reward_model.reward_kwargs`, `plugins.reward.routes`); `{key}` is not in the schema{}", Hint(suggestion))]
    OverrideAddNotAllowed {
        text: String,
        key: String,
        suggestion: Option<String>,
    },

    // ---- interpolation ----
    #[error(
        "`{key}`: interpolation `{expr}` refers to `{target}`, which does not exist{}",
        Hint(suggestion)
    )]
    InterpolationMissing {
        key: String,
        expr: String,
        target: String,
        suggestion: Option<String>,
    },
    #[error("`{key}`: interpolation cycle: {chain}")]
    InterpolationCycle { key: String, chain: String },
    #[error("`{key}`: cannot resolve interpolation `{expr}`: {reason}")]
    InterpolationInvalid {
        key: String,
        expr: String,
        reason: String,
    },

    // ---- lookups and output ----
    #[error("no key `{key}` in the config{}", Hint(suggestion))]
    NoSuchPath {
        key: String,
        suggestion: Option<String>,
    },
    #[error("cannot serialize `{what}`: {message}")]
    Serialize { what: String, message: String },

    // ---- batch-size arithmetic ----
    #[error("{message}{}", Suggest(key, suggested))]
    BatchSize {
        /// The key the user should change.
        key: String,
        /// Its current value (0 when unset).
        value: u64,
        /// The arithmetic that failed, spelled out.
        message: String,
        /// A nearby value of `key` that satisfies every batch rule, when there is one.
        suggested: Option<u64>,
    },
    #[error("{key}: {message}")]
    Layout { key: String, message: String },

    #[error("{} configuration errors:\n{}", .0.len(), List(.0))]
    Many(Vec<ConfigError>),
}

impl ConfigError {
    /// Folds a list of errors into one: the error itself when there is exactly one.
    pub(crate) fn from_list(mut errors: Vec<ConfigError>) -> Result<(), ConfigError> {
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.remove(0)),
            _ => Err(ConfigError::Many(errors)),
        }
    }

    /// A non-empty list of errors as one: the error itself when there is exactly one.
    pub(crate) fn from_errors(mut errors: Vec<ConfigError>) -> ConfigError {
        if errors.len() == 1 {
            errors.remove(0)
        } else {
            ConfigError::Many(errors)
        }
    }

    /// The individual errors (one, or the members of `Many`).
    pub fn errors(&self) -> Vec<&ConfigError> {
        match self {
            ConfigError::Many(list) => list.iter().collect(),
            other => vec![other],
        }
    }
}

pub type Result<T, E = ConfigError> = std::result::Result<T, E>;

struct Hint<'a>(&'a Option<String>);

impl fmt::Display for Hint<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(s) => write!(f, "; did you mean `{s}`?"),
            None => Ok(()),
        }
    }
}

struct Suggest<'a>(&'a String, &'a Option<u64>);

impl fmt::Display for Suggest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.1 {
            Some(v) => write!(f, "; a valid choice is {}={v}", self.0),
            None => Ok(()),
        }
    }
}

struct List<'a>(&'a [ConfigError]);

impl fmt::Display for List<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "  - {e}")?;
        }
        Ok(())
    }
}

/// A key as the user set it, for messages: `` `key=value` (origin) ``.
#[derive(Debug, Clone, PartialEq)]
pub struct SetKey {
    pub key: String,
    pub value: String,
    pub origin: String,
}

impl SetKey {
    pub fn new(
        key: impl Into<String>,
        value: impl Into<String>,
        origin: impl Into<String>,
    ) -> Box<Self> {
        Box::new(SetKey {
            key: key.into(),
            value: value.into(),
            origin: origin.into(),
        })
    }
}

impl fmt::Display for SetKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}={}` ({})", self.key, self.value, self.origin)
    }
}

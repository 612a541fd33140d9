//! One rule of [`crate::surface`]: a key pattern and what verl-rs does with the keys it matches.

use serde_yaml::Value;

use crate::schema::Config;

/// What verl-rs does with a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Acts,
    Harmless,
    Refused,
}

impl Class {
    pub fn name(self) -> &'static str {
        match self {
            Class::Acts => "acts",
            Class::Harmless => "harmless",
            Class::Refused => "refused",
        }
    }
}

/// What a value check decides about a value the user set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The value acts.
    Acts,
    /// The value means nothing for this job (the message says why): a warning.
    Ignored(String),
    /// The value asks for something verl-rs does not do (the message says what, and what to use
    /// instead): an error.
    Refused(String),
}

/// A value check for keys that act for some values (or some backends) only.
pub type ValueCheck = fn(&Value, &Config) -> Verdict;

/// One rule: a key pattern (dotted; `*` is one segment, a trailing `**` any number) and what
/// verl-rs does with the keys it matches. The most specific matching rule applies.
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    pub pattern: &'static str,
    pub class: Class,
    /// `Some(b)`: acts with the first-party backend `b` (`fsdp` or `megatron`) only.
    pub backend: Option<&'static str>,
    /// Acts: what the key does. Harmless: why it means nothing here. Refused: what it asks for.
    pub what: &'static str,
    /// Refused (or a failed check): what to use instead.
    pub instead: &'static str,
    /// Acts: the tests that show it, as `path/to/file.rs::test_name`.
    pub tests: &'static [&'static str],
    /// Acts for the values this accepts; the others are refused with its message.
    pub check: Option<ValueCheck>,
}

impl Rule {
    pub const fn acts(
        pattern: &'static str,
        what: &'static str,
        tests: &'static [&'static str],
    ) -> Rule {
        Rule {
            pattern,
            class: Class::Acts,
            backend: None,
            what,
            instead: "",
            tests,
            check: None,
        }
    }

    pub const fn harmless(pattern: &'static str, why: &'static str) -> Rule {
        Rule {
            pattern,
            class: Class::Harmless,
            backend: None,
            what: why,
            instead: "",
            tests: &[],
            check: None,
        }
    }

    pub const fn refused(pattern: &'static str, asks: &'static str, instead: &'static str) -> Rule {
        Rule {
            pattern,
            class: Class::Refused,
            backend: None,
            what: asks,
            instead,
            tests: &[],
            check: None,
        }
    }

    /// Acts with one first-party backend only.
    pub const fn with(self, backend: &'static str) -> Rule {
        Rule {
            backend: Some(backend),
            ..self
        }
    }

    /// Acts for the values `check` accepts.
    pub const fn checked(self, check: ValueCheck) -> Rule {
        Rule {
            check: Some(check),
            ..self
        }
    }

    /// The specificity of the most specific alternative of the pattern that matches `key`.
    pub(crate) fn match_specificity(&self, key: &[&str]) -> Option<(usize, bool, usize)> {
        self.pattern
            .split('|')
            .filter(|alt| {
                let pat: Vec<&str> = alt.split('.').collect();
                glob(&pat, key)
            })
            .map(specificity)
            .max()
    }

    #[cfg(test)]
    pub(crate) fn matches(&self, key: &[&str]) -> bool {
        self.match_specificity(key).is_some()
    }
}

/// Dotted glob: `**` is any number of segments (also none), `*` one segment, `abc*` a segment
/// starting with `abc`.
pub(crate) fn glob(pat: &[&str], key: &[&str]) -> bool {
    match pat.split_first() {
        None => key.is_empty(),
        Some((&"**", rest)) => (0..=key.len()).any(|i| glob(rest, &key[i..])),
        Some((p, rest)) => match key.split_first() {
            None => false,
            Some((k, krest)) => {
                let ok = match p.strip_suffix('*') {
                    Some(prefix) => k.starts_with(prefix),
                    None => p == k,
                };
                ok && glob(rest, krest)
            }
        },
    }
}

/// (literal segments, no `**`, literal segments before the first wildcard): the more specific
/// rule wins, so a section's rule beats a rule for a leaf name found anywhere.
pub(crate) fn specificity(alt: &str) -> (usize, bool, usize) {
    let segs: Vec<&str> = alt.split('.').collect();
    let literal = |s: &&&str| !s.contains('*');
    (
        segs.iter().filter(literal).count(),
        !segs.contains(&"**"),
        segs.iter().take_while(literal).count(),
    )
}

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

/// Everything that can go wrong talking to (or running) the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot start the rendezvous store on {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },

    #[error("cannot reach the rendezvous store at {addr} within {}: {source}", Secs(*.timeout))]
    Connect {
        addr: String,
        timeout: Duration,
        #[source]
        source: std::io::Error,
    },

    #[error("rendezvous store at {addr}: `{op}` on `{key}` failed: {source}")]
    Io {
        addr: SocketAddr,
        op: &'static str,
        key: String,
        #[source]
        source: std::io::Error,
    },

    /// Some rank posted a failure with `set_error` (or vanished without saying goodbye): every
    /// blocked and later `get`/`wait`/`barrier` on every rank returns this.
    #[error("rank {rank} failed: {message}")]
    RankFailed { rank: usize, message: String },

    #[error("key `{key}` was not set within {}", Secs(*.timeout))]
    GetTimeout { key: String, timeout: Duration },

    #[error("wait timed out after {}: keys {} never set", Secs(*.timeout), Backticked(.missing))]
    WaitTimeout {
        missing: Vec<String>,
        timeout: Duration,
    },

    #[error("rendezvous `{name}` timed out after {}: {} of {world_size} never arrived", Secs(*.timeout), RankList(.missing))]
    BarrierTimeout {
        name: String,
        timeout: Duration,
        missing: Vec<usize>,
        world_size: usize,
    },

    /// The server understood the request but refused it (inconsistent barrier arguments, a key
    /// holding something other than a counter, ...).
    #[error("rendezvous store at {addr} refused `{op}` on `{key}`: {message}")]
    Refused {
        addr: SocketAddr,
        op: &'static str,
        key: String,
        message: String,
    },

    #[error("environment variable {var}: expected {expected}, found {found:?}")]
    Env {
        var: &'static str,
        expected: &'static str,
        found: Option<String>,
    },
}

impl StoreError {
    /// The failed rank, when this error is the failure broadcast of another rank.
    pub fn failed_rank(&self) -> Option<usize> {
        match self {
            StoreError::RankFailed { rank, .. } => Some(*rank),
            _ => None,
        }
    }
}

/// `30s`, `1.5s`, `250ms`: short and exact enough for a log line.
pub(crate) struct Secs(pub Duration);

impl fmt::Display for Secs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        if d.subsec_nanos() == 0 {
            write!(f, "{}s", d.as_secs())
        } else if d < Duration::from_secs(1) {
            write!(f, "{}ms", d.as_millis())
        } else {
            write!(f, "{:.1}s", d.as_secs_f64())
        }
    }
}

struct RankList<'a>(&'a [usize]);

impl fmt::Display for RankList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.len() == 1 { "rank " } else { "ranks " })?;
        for (i, r) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{r}")?;
        }
        Ok(())
    }
}

struct Backticked<'a>(&'a [String]);

impl fmt::Display for Backticked<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, k) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "`{k}`")?;
        }
        Ok(())
    }
}

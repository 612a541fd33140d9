//! The rendezvous store of an SPMD job: a small TCP key-value server (torch `TCPStore`-style) that
//! rank 0 or the launcher runs on `MASTER_ADDR:MASTER_PORT`, and the client every rank uses for
//! blocking gets, counters, barriers and the failure broadcast that ends all ranks when one fails.
//!
//! It owns only coordination metadata (addresses, ids, small values). It must not carry tensor
//! data (that is the communicator's job) and must not link libtorch.

mod client;
mod error;
mod server;
mod wire;

use std::time::Duration;

pub use client::{ShutdownHandle, StoreClient};
pub use error::StoreError;
pub use server::StoreServer;

/// Set to `1` when the launcher hosts the store, so that rank 0 does not try to bind the port too.
pub const EXTERNAL_STORE_VAR: &str = "VERL_STORE_EXTERNAL";

/// The torchrun-style environment of one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// The launcher runs the store ([`EXTERNAL_STORE_VAR`]); rank 0 only connects.
    pub external_store: bool,
}

impl DistEnv {
    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (default: `RANK`), `MASTER_ADDR` (default
    /// `127.0.0.1`), `MASTER_PORT` and [`EXTERNAL_STORE_VAR`].
    pub fn from_env() -> Result<DistEnv, StoreError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// As [`DistEnv::from_env`], reading variables through `var` (for tests and launchers).
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<DistEnv, StoreError> {
        fn num<T: std::str::FromStr>(
            var: &impl Fn(&str) -> Option<String>,
            name: &'static str,
            expected: &'static str,
        ) -> Result<Option<T>, StoreError> {
            match var(name) {
                None => Ok(None),
                Some(s) => s.trim().parse().map(Some).map_err(|_| StoreError::Env {
                    var: name,
                    expected,
                    found: Some(s),
                }),
            }
        }
        let required = |name: &'static str, expected| {
            num::<usize>(&var, name, expected)?.ok_or(StoreError::Env {
                var: name,
                expected,
                found: None,
            })
        };
        let rank = required("RANK", "a rank number")?;
        let world_size = required("WORLD_SIZE", "a positive number of ranks")?;
        if world_size == 0 || rank >= world_size {
            return Err(StoreError::Env {
                var: "RANK",
                expected: "a rank below WORLD_SIZE",
                found: Some(format!("{rank} (WORLD_SIZE={world_size})")),
            });
        }
        let local_rank = num::<usize>(&var, "LOCAL_RANK", "a local rank number")?.unwrap_or(rank);
        let master_port =
            num::<u16>(&var, "MASTER_PORT", "a TCP port (0-65535)")?.ok_or(StoreError::Env {
                var: "MASTER_PORT",
                expected: "a TCP port (0-65535)",
                found: None,
            })?;
        let master_addr = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".to_string());
        let external_store = matches!(
            var(EXTERNAL_STORE_VAR).as_deref().map(str::trim),
            Some("1") | Some("true")
        );
        Ok(DistEnv {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            external_store,
        })
    }

    /// Joins the job's store: rank 0 starts the server (unless the launcher runs it), then every
    /// rank connects as itself. Keep the returned server alive for the whole job.
    pub fn join(
        &self,
        timeout: Duration,
    ) -> Result<(Option<StoreServer>, StoreClient), StoreError> {
        let addr = format!("{}:{}", self.master_addr, self.master_port);
        let server = if self.rank == 0 && !self.external_store {
            Some(StoreServer::bind(addr.as_str())?)
        } else {
            None
        };
        let client = StoreClient::connect_as(addr.as_str(), self.rank, timeout)?;
        Ok((server, client))
    }
}

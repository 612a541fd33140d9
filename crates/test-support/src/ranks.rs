//! A multi-rank job inside one test process: a store on 127.0.0.1 (none for one rank), each
//! rank's `InitArgs`, and the ranks run as threads (the backends' CPU communicator connects them).

use std::sync::mpsc;
use std::time::Duration;

use verl_comm::StoreServer;
use verl_plugin_api::{InitArgs, Rendezvous, Role};

pub struct Job {
    _server: Option<StoreServer>,
    port: u16,
    world: usize,
}

impl Job {
    pub fn new(world: usize) -> Job {
        if world == 1 {
            return Job {
                _server: None,
                port: 0,
                world,
            };
        }
        let server = StoreServer::bind("127.0.0.1:0").expect("bind a store on 127.0.0.1");
        let port = server.local_addr().port();
        Job {
            _server: Some(server),
            port,
            world,
        }
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Rank `rank`'s init args for `role` with `config`.
    pub fn init(&self, role: Role, rank: usize, config: &serde_json::Value) -> InitArgs {
        let mut init = InitArgs::new(role, config.clone());
        init.rank = rank as u32;
        init.local_rank = rank as u32;
        init.world_size = self.world as u32;
        if self.world > 1 {
            init.rendezvous = Some(Rendezvous {
                master_addr: "127.0.0.1".into(),
                master_port: self.port,
                timeout_s: 60,
            });
        }
        init
    }

    /// Runs `f(rank)` on every rank, each on its own thread, and returns the results in rank
    /// order; a rank's panic is re-raised, and a rank slower than two minutes fails the test (a
    /// hang).
    pub fn run<T: Send + 'static>(&self, f: impl Fn(usize) -> T + Send + Sync + 'static) -> Vec<T> {
        self.run_within(Duration::from_secs(120), f)
    }

    /// [`Job::run`] with its own limit.
    pub fn run_within<T: Send + 'static>(
        &self,
        limit: Duration,
        f: impl Fn(usize) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let f = std::sync::Arc::new(f);
        let (tx, rx) = mpsc::channel();
        for rank in 0..self.world {
            let (f, tx) = (f.clone(), tx.clone());
            std::thread::Builder::new()
                .name(format!("rank{rank}"))
                .spawn(move || {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(rank)));
                    let _ = tx.send((rank, r));
                })
                .expect("spawn a rank thread");
        }
        let mut out: Vec<Option<T>> = (0..self.world).map(|_| None).collect();
        for _ in 0..self.world {
            let (rank, r) = rx
                .recv_timeout(limit)
                .unwrap_or_else(|_| panic!("a rank hung for {limit:?}"));
            match r {
                Ok(v) => out[rank] = Some(v),
                Err(p) => std::panic::resume_unwind(p),
            }
        }
        out.into_iter()
            .map(|v| v.expect("every rank reported"))
            .collect()
    }
}

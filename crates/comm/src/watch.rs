//! The failure watcher: a thread blocked on the store's failure broadcast that, once some rank
//! fails, records the failure and runs every registered abort hook (shutting sockets down,
//! aborting NCCL communicators) so that collectives blocked on the failed rank return at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use verl_store::{ShutdownHandle, StoreClient, StoreError};

use crate::CommError;

type Hook = Box<dyn Fn() + Send + Sync>;

/// One per world communicator; its sub-groups share it.
pub(crate) struct Watch {
    inner: Arc<Inner>,
    stop_conn: ShutdownHandle,
    thread: Mutex<Option<JoinHandle<()>>>,
}

struct Inner {
    stop: AtomicBool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    failure: Option<(usize, String)>,
    hooks: HashMap<u64, Hook>,
    next_id: u64,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Watch {
    pub fn start(store: &StoreClient, timeout: Duration) -> Result<Arc<Watch>, CommError> {
        let conn = store.duplicate(timeout)?;
        let stop_conn = conn.shutdown_handle()?;
        let inner = Arc::new(Inner {
            stop: AtomicBool::new(false),
            state: Mutex::new(State::default()),
        });
        let thread_inner = Arc::clone(&inner);
        let thread = std::thread::Builder::new()
            .name("verl-comm-watch".into())
            .spawn(move || {
                while !thread_inner.stop.load(Ordering::SeqCst) {
                    match conn.wait_error(Duration::from_secs(1)) {
                        Ok(()) => continue,
                        Err(StoreError::RankFailed { rank, message }) => {
                            trigger(&thread_inner, rank, message);
                            return;
                        }
                        // The store is gone: the peers' sockets report that on their own.
                        Err(_) => return,
                    }
                }
            })
            .map_err(|e| CommError::Io {
                op: "start failure watcher",
                peer: store.rank().unwrap_or(0),
                source: e,
            })?;
        Ok(Arc::new(Watch {
            inner,
            stop_conn,
            thread: Mutex::new(Some(thread)),
        }))
    }

    pub fn failure(&self) -> Option<(usize, String)> {
        lock(&self.inner.state).failure.clone()
    }

    /// Registers a hook run once when a failure is seen (at once if one was already seen).
    pub fn register(&self, hook: Hook) -> u64 {
        let mut st = lock(&self.inner.state);
        if st.failure.is_some() {
            drop(st);
            hook();
            return u64::MAX;
        }
        let id = st.next_id;
        st.next_id += 1;
        st.hooks.insert(id, hook);
        id
    }

    pub fn unregister(&self, id: u64) {
        lock(&self.inner.state).hooks.remove(&id);
    }
}

fn trigger(inner: &Inner, rank: usize, message: String) {
    let hooks = {
        let mut st = lock(&inner.state);
        if st.failure.is_some() {
            return;
        }
        st.failure = Some((rank, message));
        std::mem::take(&mut st.hooks)
    };
    for h in hooks.values() {
        h();
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        self.stop_conn.shutdown();
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

//! A collective that may still be running on a communicator's own stream.

use std::sync::Arc;

use cudarc::driver::result;
use cudarc::driver::sys;
use cudarc::driver::CudaContext;
use tch::Tensor;

use crate::CommError;

/// An event recorded after a collective on the communicator's stream.
struct Event {
    ev: sys::CUevent,
    ctx: Arc<CudaContext>,
}

/// What an `_async` collective returns: the collective may still be running. [`Pending::wait`]
/// (or dropping it) makes work queued afterwards on the default stream wait for it, on the device
/// (the host does not block); only then may its output be read or its input written. It keeps
/// the collective's tensors alive until then, so the caching allocator cannot hand their memory
/// to other work while the collective still uses it.
pub struct Pending {
    event: Option<Event>,
    keep: Vec<Tensor>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("running", &self.event.is_some())
            .field("tensors", &self.keep.len())
            .finish()
    }
}

impl Pending {
    /// A collective that has completed (as far as the default stream is concerned).
    pub fn done() -> Pending {
        Pending {
            event: None,
            keep: Vec::new(),
        }
    }

    /// A collective on a device stream, followed by `ev` (owned from here on).
    pub(crate) fn on_device(ev: sys::CUevent, ctx: Arc<CudaContext>, keep: Vec<Tensor>) -> Pending {
        Pending {
            event: Some(Event { ev, ctx }),
            keep,
        }
    }

    /// Whether the default stream may still have to wait for it.
    pub fn is_running(&self) -> bool {
        self.event.is_some()
    }

    /// Orders the work queued from now on on the default stream after the collective.
    pub fn wait(mut self) -> Result<(), CommError> {
        self.finish()
    }

    fn finish(&mut self) -> Result<(), CommError> {
        let res = match self.event.take() {
            Some(e) => {
                let cuda = |what: &str, err: result::DriverError| CommError::CudaUnavailable {
                    reason: format!("{what}: {err:?}"),
                };
                let waited = e
                    .ctx
                    .bind_to_thread()
                    .map_err(|err| cuda("make the device current", err))
                    .and_then(|()| {
                        // SAFETY: the event is live (destroyed below, once); the null stream is
                        // the legacy default stream, which libtorch's default stream is.
                        unsafe {
                            result::stream::wait_event(
                                result::stream::null(),
                                e.ev,
                                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                            )
                        }
                        .map_err(|err| cuda("cuStreamWaitEvent", err))
                    });
                // SAFETY: owned event, destroyed once; the driver keeps it until the wait is done.
                let _ = unsafe { result::event::destroy(e.ev) };
                waited
            }
            None => Ok(()),
        };
        // The default stream is ordered after the collective now (or the wait failed and the
        // device is in no state to run more work): the allocator may reuse the memory.
        self.keep.clear();
        res
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

// SAFETY: the event handle may be used from any thread (calls bind the context first).
unsafe impl Send for Pending {}

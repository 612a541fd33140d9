//! Multi-turn generation across the ABI: the host's agent loop answers the turns a backend's
//! rollout engine reports, while the engine keeps serving every other sequence.
//!
//! The host calls `Actor.generate_turns(prompts, options, driver)`. A sequence that samples a stop
//! token waits (keeping its KV) and the engine calls `driver.turns(ended, idle)` with the turns
//! that ended; the driver answers with tokens to append (a tool response rendered by the chat
//! template) or a finish, now or on a later call. The engine calls the driver after every step
//! while anything waits; with `idle` true nothing else can run and the driver must answer at
//! least one waiting sequence. The output is [`crate::contract::GENERATE_TURNS_OUT`]: the whole
//! response (sampled and appended tokens) with `loss_mask` 1 on the sampled ones.

use abi_stable::{
    sabi_trait,
    sabi_trait::TD_Opaque,
    sabi_types::RMut,
    std_types::{RResult, RVec},
    StableAbi,
};

use crate::error::{Error, FfiError, Result};

/// A turn one sequence ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnEnd {
    /// Output row (`prompt * n + sample`).
    pub row: usize,
    /// The tokens sampled in this turn (the stop token included).
    pub tokens: Vec<i64>,
    /// Ended by a stop token (`false`: by the response budget).
    pub stopped: bool,
    /// Waits for an answer; `false`: finished (its response budget is spent).
    pub waits: bool,
    /// Response positions used so far (sampled and appended).
    pub response_len: usize,
}

/// The driver's answer for a waiting sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// Append these tokens and sample the next turn.
    Continue { row: usize, tokens: Vec<i64> },
    /// The conversation is over.
    Finish { row: usize },
}

/// The host's side of a multi-turn call (see the module docs).
pub trait TurnDriver {
    fn turns(&mut self, ended: Vec<TurnEnd>, idle: bool) -> Result<Vec<Resume>>;
}

/// [`TurnEnd`] as it crosses the ABI.
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct FfiTurnEnd {
    pub row: u64,
    pub tokens: RVec<i64>,
    pub stopped: bool,
    pub waits: bool,
    pub response_len: u64,
}

/// [`Resume`] as it crosses the ABI: `finish` true ends row `row`; otherwise `tokens` are
/// appended.
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct FfiResume {
    pub row: u64,
    pub finish: bool,
    pub tokens: RVec<i64>,
}

/// The driver object a backend calls back.
#[sabi_trait]
pub trait TurnDriverFfi {
    #[sabi(last_prefix_field)]
    fn turns(&mut self, ended: RVec<FfiTurnEnd>, idle: bool) -> RResult<RVec<FfiResume>, FfiError>;
}

/// A borrowed driver for the length of one `generate_turns` call.
pub type TurnDriverRef<'a> = TurnDriverFfi_TO<'a, RMut<'a, ()>>;

struct HostSide<'d>(&'d mut dyn TurnDriver);

impl TurnDriverFfi for HostSide<'_> {
    fn turns(&mut self, ended: RVec<FfiTurnEnd>, idle: bool) -> RResult<RVec<FfiResume>, FfiError> {
        let ended = ended
            .into_iter()
            .map(|e| TurnEnd {
                row: e.row as usize,
                tokens: e.tokens.into_vec(),
                stopped: e.stopped,
                waits: e.waits,
                response_len: e.response_len as usize,
            })
            .collect();
        // A panic must not unwind into the backend's frames.
        let r =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.0.turns(ended, idle)))
                .unwrap_or_else(|p| {
                    let what = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    Err(Error::failed(format!("the turn driver panicked: {what}")))
                });
        match r {
            Ok(answers) => RResult::ROk(
                answers
                    .into_iter()
                    .map(|a| match a {
                        Resume::Continue { row, tokens } => FfiResume {
                            row: row as u64,
                            finish: false,
                            tokens: tokens.into(),
                        },
                        Resume::Finish { row } => FfiResume {
                            row: row as u64,
                            finish: true,
                            tokens: RVec::new(),
                        },
                    })
                    .collect(),
            ),
            Err(e) => RResult::RErr(e.into_ffi()),
        }
    }
}

/// Lends `driver` to a backend for one call: `f` gets the ABI object.
pub fn with_driver<R>(driver: &mut dyn TurnDriver, f: impl FnOnce(TurnDriverRef<'_>) -> R) -> R {
    let mut host = HostSide(driver);
    f(TurnDriverFfi_TO::from_ptr(&mut host, TD_Opaque))
}

/// The backend's view of the host's driver.
pub struct RemoteDriver<'a>(pub TurnDriverRef<'a>);

impl TurnDriver for RemoteDriver<'_> {
    fn turns(&mut self, ended: Vec<TurnEnd>, idle: bool) -> Result<Vec<Resume>> {
        let ended: RVec<FfiTurnEnd> = ended
            .into_iter()
            .map(|e| FfiTurnEnd {
                row: e.row as u64,
                tokens: e.tokens.into(),
                stopped: e.stopped,
                waits: e.waits,
                response_len: e.response_len as u64,
            })
            .collect();
        match self.0.turns(ended, idle) {
            RResult::ROk(a) => Ok(a
                .into_iter()
                .map(|r| {
                    if r.finish {
                        Resume::Finish {
                            row: r.row as usize,
                        }
                    } else {
                        Resume::Continue {
                            row: r.row as usize,
                            tokens: r.tokens.into_vec(),
                        }
                    }
                })
                .collect()),
            RResult::RErr(e) => Err(Error::from_ffi(e, "host", "turn driver")),
        }
    }
}

//! Names of everything under `trainer.default_local_dir`, as verl lays them out.

use std::fmt;

/// The file at the checkpoint root naming the newest complete step (verl's tracker file).
pub const TRACKER_FILE: &str = "latest_checkpointed_iteration.txt";
/// The dataloader state inside a step folder (verl writes `data.pt`; ours is JSON).
pub const DATA_STATE_FILE: &str = "data.json";
/// The host loop's own state (RNG, KL controller, counters) inside a step folder.
pub const TRAINER_STATE_FILE: &str = "trainer_state.json";

const STEP_PREFIX: &str = "global_step_";

/// A model role whose backend writes its own subfolder of a step folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// `global_step_N/actor/` (policy, optimizer, scheduler, extra state).
    Actor,
    /// `global_step_N/critic/`.
    Critic,
}

impl Role {
    /// All roles, in the order verl saves them.
    pub const ALL: [Role; 2] = [Role::Actor, Role::Critic];

    /// The subfolder name verl uses (`str(Role.Critic)` is `critic`).
    pub fn dir_name(self) -> &'static str {
        match self {
            Role::Actor => "actor",
            Role::Critic => "critic",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.dir_name())
    }
}

/// `global_step_{step}`.
pub fn step_dir_name(step: u64) -> String {
    format!("{STEP_PREFIX}{step}")
}

/// The step of a folder named exactly `global_step_<digits>`; anything else (temp folders included) is `None`.
pub fn parse_step_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(STEP_PREFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

pub(crate) fn temp_dir_name(step: u64, tag: &str) -> String {
    format!(".{STEP_PREFIX}{step}.tmp-{tag}")
}

pub(crate) fn aside_dir_name(step: u64, tag: &str) -> String {
    format!(".{STEP_PREFIX}{step}.old-{tag}")
}

/// The tag of a leftover temp or set-aside folder (`.global_step_N.tmp-<tag>` / `.old-<tag>`) or tracker temp
/// file (`.latest_checkpointed_iteration.txt.tmp-<tag>`), if `name` is one.
pub(crate) fn parse_leftover_tag(name: &str) -> Option<&str> {
    // The tracker's own temp file (see `fsutil::write_atomic`).
    if let Some(tag) = name
        .strip_prefix('.')
        .and_then(|n| n.strip_prefix(TRACKER_FILE))
        .and_then(|n| n.strip_prefix(".tmp-"))
    {
        return Some(tag);
    }
    let rest = name.strip_prefix('.')?.strip_prefix(STEP_PREFIX)?;
    let dot = rest.find('.')?;
    let (digits, suffix) = rest.split_at(dot);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    suffix
        .strip_prefix(".tmp-")
        .or_else(|| suffix.strip_prefix(".old-"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_names_round_trip_and_reject_lookalikes() {
        assert_eq!(step_dir_name(42), "global_step_42");
        assert_eq!(parse_step_dir_name("global_step_42"), Some(42));
        for bad in [
            "global_step_",
            "global_step_4x",
            "global_step_-1",
            ".global_step_4.tmp-1",
            "step_4",
        ] {
            assert_eq!(parse_step_dir_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn leftover_names_parse_their_tag() {
        assert_eq!(parse_leftover_tag(&temp_dir_name(7, "123")), Some("123"));
        assert_eq!(
            parse_leftover_tag(&aside_dir_name(7, "run-a")),
            Some("run-a")
        );
        assert_eq!(parse_leftover_tag("global_step_7"), None);
        assert_eq!(parse_leftover_tag(".global_step_x.tmp-1"), None);
        assert_eq!(
            parse_leftover_tag(".latest_checkpointed_iteration.txt.tmp-1"),
            Some("1")
        );
        assert_eq!(
            parse_leftover_tag("latest_checkpointed_iteration.txt"),
            None
        );
    }
}

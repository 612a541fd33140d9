//! verl's multi-turn rollout settings (`actor_rollout_ref.rollout.multi_turn.*` and the agent
//! loop's `actor_rollout_ref.rollout.agent.default_agent_loop`), read with verl's defaults.

use serde_yaml::Value;

use crate::schema::Config;

/// The agent loop's settings as verl's `ToolAgentLoop` reads them.
#[derive(Debug, Clone, PartialEq)]
pub struct MultiTurn {
    /// `multi_turn.enable`.
    pub enable: bool,
    /// `multi_turn.tool_config_path`: verl's tool YAML.
    pub tool_config_path: Option<String>,
    /// `multi_turn.max_assistant_turns` / `max_user_turns`: `None` (verl's null) is no limit.
    pub max_assistant_turns: Option<u64>,
    pub max_user_turns: Option<u64>,
    /// Tool calls of one turn that run (the rest are dropped), verl's default 1.
    pub max_parallel_calls: u64,
    /// Characters of a tool response kept, verl's default 256.
    pub max_tool_response_length: u64,
    /// `left`, `right` or `middle` (verl's default).
    pub tool_response_truncate_side: String,
    /// The tool-call format the model writes (`hermes`).
    pub format: String,
    /// `agent.default_agent_loop`: the agent of rows without an `agent_name` column.
    pub default_agent_loop: String,
}

fn get<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.as_mapping()?.get(key).filter(|x| !x.is_null())
}

impl Config {
    /// The job's multi-turn settings (verl's defaults where a key is absent or null).
    pub fn multi_turn(&self) -> MultiTurn {
        let r = &self.actor_rollout_ref.rollout;
        let (m, a) = (&r.multi_turn, &r.agent);
        let text = |k: &str, d: &str| get(m, k).and_then(Value::as_str).unwrap_or(d).to_string();
        MultiTurn {
            enable: get(m, "enable").and_then(Value::as_bool).unwrap_or(false),
            tool_config_path: get(m, "tool_config_path")
                .and_then(Value::as_str)
                .map(str::to_string),
            max_assistant_turns: get(m, "max_assistant_turns").and_then(Value::as_u64),
            max_user_turns: get(m, "max_user_turns").and_then(Value::as_u64),
            max_parallel_calls: get(m, "max_parallel_calls")
                .and_then(Value::as_u64)
                .unwrap_or(1),
            max_tool_response_length: get(m, "max_tool_response_length")
                .and_then(Value::as_u64)
                .unwrap_or(256),
            tool_response_truncate_side: text("tool_response_truncate_side", "middle"),
            format: text("format", "hermes"),
            default_agent_loop: get(a, "default_agent_loop")
                .and_then(Value::as_str)
                .unwrap_or("single_turn_agent")
                .to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::Config;

    #[test]
    fn multi_turn_reads_verls_keys_with_verls_defaults() {
        let d = Config::from_overrides::<&str>(&[]).unwrap().multi_turn();
        assert!(!d.enable);
        assert_eq!((d.max_parallel_calls, d.max_tool_response_length), (1, 256));
        assert_eq!(d.tool_response_truncate_side, "middle");
        assert_eq!(
            (d.format.as_str(), d.default_agent_loop.as_str()),
            ("hermes", "single_turn_agent")
        );
        assert_eq!((d.max_assistant_turns, d.max_user_turns), (None, None));
        let c = Config::from_overrides(&[
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.tool_config_path=tools.yaml",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
            "actor_rollout_ref.rollout.multi_turn.max_user_turns=2",
            "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=4",
            "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=64",
            "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=left",
            "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
        ])
        .unwrap()
        .multi_turn();
        assert!(c.enable);
        assert_eq!(c.tool_config_path.as_deref(), Some("tools.yaml"));
        assert_eq!(
            (c.max_assistant_turns, c.max_user_turns),
            (Some(3), Some(2))
        );
        assert_eq!((c.max_parallel_calls, c.max_tool_response_length), (4, 64));
        assert_eq!(c.tool_response_truncate_side, "left");
        assert_eq!(c.default_agent_loop, "tool_agent");
    }
}

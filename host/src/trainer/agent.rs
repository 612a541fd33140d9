//! verl's tool agent loop (`ToolAgentLoop`) on the host, token in, token out.
//!
//! With `actor_rollout_ref.rollout.multi_turn.enable`, the actor generates through
//! `Actor.generate_turns`: every sample is a conversation. When the model ends a turn, the
//! [`AgentDriver`] decides as verl does: stop at the response budget, at `max_assistant_turns` /
//! `max_user_turns`, for a row whose agent is `single_turn_agent`, or when the turn calls no tool;
//! otherwise it runs the turn's calls (the first `max_parallel_calls`) on worker threads through
//! the job's [`ToolSet`], and when they return, renders the tool messages with the model's chat
//! template and hands the engine exactly the tokens that follow the model's end-of-turn token in
//! the rendered conversation. The engine keeps decoding every other sequence meanwhile.
//!
//! Nothing the model wrote is decoded and re-encoded: the response is the model's tokens and the
//! appended ones in order, `loss_mask` marks the model's. The rendered conversation is the model's
//! text as the assistant messages (the raw tool-call text included), so tokenizing it in one pass
//! gives the same ids wherever the model's tokens are the tokenizer's own split of its text.

use std::collections::BTreeMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use anyhow::{bail, Context};
use serde_json::{json, Value};
use verl_chat::{ChatOptions, Tokenizer};
use verl_config::MultiTurn;
use verl_data::Sample;
use verl_plugin_api::turns::{Resume, TurnDriver, TurnEnd};

use crate::tools::{ToolCallResult, ToolSet};

/// Per-row columns a multi-turn rollout adds to its batch (f32 `[rows]`): verl's `num_turns`
/// (user + assistant turns + 1) and the tool calls the row ran.
pub(crate) const NUM_TURNS: &str = "num_turns";
pub(crate) const TOOL_CALL_COUNTS: &str = "tool_call_counts";

/// Which agent loop a row runs (verl's per-row `agent_name`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AgentKind {
    SingleTurn,
    Tool,
}

impl AgentKind {
    fn parse(name: &str) -> Option<AgentKind> {
        match name {
            "single_turn_agent" => Some(AgentKind::SingleTurn),
            "tool_agent" => Some(AgentKind::Tool),
            _ => None,
        }
    }
}

/// The job's multi-turn settings and tools.
pub(crate) struct AgentLoop {
    pub settings: MultiTurn,
    pub tools: Option<Arc<ToolSet>>,
    default_agent: AgentKind,
}

impl AgentLoop {
    /// `None` unless `multi_turn.enable`.
    pub fn from_config(
        cfg: &verl_config::Config,
        load_tools: impl FnOnce(&std::path::Path) -> anyhow::Result<ToolSet>,
    ) -> anyhow::Result<Option<AgentLoop>> {
        let settings = cfg.multi_turn();
        if !settings.enable {
            return Ok(None);
        }
        if settings.format != "hermes" {
            bail!(
                "actor_rollout_ref.rollout.multi_turn.format={} asks for a tool-call format verl-rs \
                 does not parse; use hermes (<tool_call>{{\"name\": ..., \"arguments\": ...}}</tool_call>, \
                 what Qwen2.5 and most tool-tuned models write)",
                settings.format
            );
        }
        if !["left", "right", "middle"].contains(&settings.tool_response_truncate_side.as_str()) {
            bail!(
                "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side={}: expected left, right or middle",
                settings.tool_response_truncate_side
            );
        }
        let default_agent = AgentKind::parse(&settings.default_agent_loop).with_context(|| {
            format!(
                "actor_rollout_ref.rollout.agent.default_agent_loop={}: verl-rs runs \
                 single_turn_agent and tool_agent",
                settings.default_agent_loop
            )
        })?;
        let tools = match &settings.tool_config_path {
            Some(p) => Some(Arc::new(
                load_tools(&crate::paths::expand_home(p)).with_context(|| {
                    format!("actor_rollout_ref.rollout.multi_turn.tool_config_path={p}")
                })?,
            )),
            None => None,
        };
        Ok(Some(AgentLoop {
            settings,
            tools,
            default_agent,
        }))
    }

    /// The agent of `sample`: its `agent_name` column, else `agent.default_agent_loop`.
    pub fn agent_of(&self, sample: &Sample) -> anyhow::Result<AgentKind> {
        match sample.raw.get("agent_name") {
            None | Some(Value::Null) => Ok(self.default_agent),
            Some(Value::String(name)) => AgentKind::parse(name).with_context(|| {
                format!(
                    "row {} of {}: agent_name `{name}` is not an agent loop verl-rs runs \
                     (single_turn_agent, tool_agent)",
                    sample.origin.row,
                    sample.origin.path.display()
                )
            }),
            Some(other) => bail!(
                "row {} of {}: agent_name should be a string, found {other}",
                sample.origin.row,
                sample.origin.path.display()
            ),
        }
    }

    /// The tool schemas a row's prompt is rendered with (verl renders a tool agent's prompt
    /// with `tools=`).
    pub fn prompt_tools(&self, sample: &Sample) -> anyhow::Result<Option<Vec<Value>>> {
        Ok(match (self.agent_of(sample)?, &self.tools) {
            (AgentKind::Tool, Some(t)) => Some(t.schemas()),
            _ => None,
        })
    }
}

/// One tool call as the model wrote it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ToolCall {
    pub name: String,
    /// The `arguments` object as JSON text.
    pub arguments: String,
}

/// verl's hermes parser: every `<tool_call>…</tool_call>` block holding a JSON object with
/// `name` and `arguments`; blocks that are not are skipped (and counted).
pub(crate) fn parse_hermes(text: &str) -> (Vec<ToolCall>, usize) {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let (mut calls, mut bad) = (Vec::new(), 0);
    let mut rest = text;
    while let Some(i) = rest.find(OPEN) {
        let after = &rest[i + OPEN.len()..];
        let Some(j) = after.find(CLOSE) else {
            break;
        };
        let body = &after[..j];
        rest = &after[j + CLOSE.len()..];
        let parsed = serde_json::from_str::<Value>(body.trim())
            .ok()
            .and_then(|v| {
                let name = v.get("name")?.as_str()?.to_string();
                let arguments = v.get("arguments")?;
                Some(ToolCall {
                    name,
                    arguments: serde_json::to_string(arguments).ok()?,
                })
            });
        match parsed {
            Some(c) => calls.push(c),
            None => bad += 1,
        }
    }
    (calls, bad)
}

/// One conversation (an output row).
struct Conversation {
    kind: AgentKind,
    messages: Vec<Value>,
    tools_kwargs: Value,
    assistant_turns: u64,
    user_turns: u64,
    tool_calls: u64,
    /// The turn whose tools are running: its last sampled token (the stop token), and how many
    /// response positions it left used.
    pending: Option<(i64, usize)>,
}

/// What a finished multi-turn call reports per row and in total.
#[derive(Debug, Default)]
pub(crate) struct AgentReport {
    /// verl's `num_turns` (user + assistant turns + 1) and the tool calls run, per row.
    pub num_turns: Vec<f64>,
    pub tool_calls: Vec<f64>,
    /// Per tool: calls, failed calls, summed and longest seconds.
    pub per_tool: BTreeMap<String, ToolTally>,
    /// `<tool_call>` blocks that were not a JSON object with `name` and `arguments`.
    pub malformed_calls: u64,
}

#[derive(Debug, Default, Clone)]
pub(crate) struct ToolTally {
    pub calls: u64,
    pub errors: u64,
    pub seconds: f64,
    pub max_seconds: f64,
}

impl AgentReport {
    /// Adds the per-row [`NUM_TURNS`] and [`TOOL_CALL_COUNTS`] columns to the call's batch.
    pub fn add_columns(&self, batch: &mut verl_plugin_api::Batch) {
        let f = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
        batch.insert_tensor(NUM_TURNS, &[self.num_turns.len()], &f(&self.num_turns));
        batch.insert_tensor(
            TOOL_CALL_COUNTS,
            &[self.tool_calls.len()],
            &f(&self.tool_calls),
        );
    }

    /// The step's tool metrics (this rank's).
    pub fn metrics(&self) -> Vec<(String, f64)> {
        let mut m = Vec::new();
        let (mut calls, mut errors, mut secs, mut max) = (0, 0, 0.0, 0.0f64);
        for (name, t) in &self.per_tool {
            m.push((format!("tools/{name}/calls"), t.calls as f64));
            m.push((format!("tools/{name}/errors"), t.errors as f64));
            m.push((
                format!("tools/{name}/latency_s/mean"),
                t.seconds / t.calls.max(1) as f64,
            ));
            m.push((format!("tools/{name}/latency_s/max"), t.max_seconds));
            calls += t.calls;
            errors += t.errors;
            secs += t.seconds;
            max = max.max(t.max_seconds);
        }
        m.push(("tools/calls".into(), calls as f64));
        m.push(("tools/errors".into(), errors as f64));
        m.push(("tools/malformed_calls".into(), self.malformed_calls as f64));
        m.push(("tools/latency_s/mean".into(), secs / calls.max(1) as f64));
        m.push(("tools/latency_s/max".into(), max));
        m.push(("tools/busy_s".into(), secs));
        m
    }
}

/// The host's side of one `generate_turns` call.
pub(crate) struct AgentDriver<'a> {
    tokenizer: &'a Tokenizer,
    chat: ChatOptions,
    agent: &'a AgentLoop,
    response_length: usize,
    convs: Vec<Conversation>,
    tx: Sender<(usize, Vec<(String, ToolCallResult)>)>,
    rx: Receiver<(usize, Vec<(String, ToolCallResult)>)>,
    running: usize,
    pub report: AgentReport,
}

impl<'a> AgentDriver<'a> {
    /// A driver for rows `r = prompt * n + sample` of `samples`' prompts; `chat` is the
    /// encoder's template options (without tools).
    pub fn new(
        tokenizer: &'a Tokenizer,
        chat: &ChatOptions,
        agent: &'a AgentLoop,
        samples: &[&Sample],
        n: usize,
        response_length: usize,
    ) -> anyhow::Result<Self> {
        let mut convs = Vec::with_capacity(samples.len() * n);
        for s in samples {
            let kind = agent.agent_of(s)?;
            let messages: Vec<Value> = s
                .prompt
                .iter()
                .map(|m| json!({"role": m.role, "content": m.content}))
                .collect();
            let tools_kwargs = s
                .extra_info
                .get("tools_kwargs")
                .cloned()
                .unwrap_or_else(|| json!({}));
            for _ in 0..n {
                convs.push(Conversation {
                    kind,
                    messages: messages.clone(),
                    tools_kwargs: tools_kwargs.clone(),
                    assistant_turns: 0,
                    user_turns: 0,
                    tool_calls: 0,
                    pending: None,
                });
            }
        }
        let (tx, rx) = channel();
        let rows = convs.len();
        Ok(AgentDriver {
            tokenizer,
            chat: chat.clone(),
            agent,
            response_length,
            convs,
            tx,
            rx,
            running: 0,
            report: AgentReport {
                num_turns: vec![0.0; rows],
                tool_calls: vec![0.0; rows],
                ..AgentReport::default()
            },
        })
    }

    /// Per-row counts once the call is over.
    pub fn finish(mut self) -> AgentReport {
        for (r, c) in self.convs.iter().enumerate() {
            self.report.num_turns[r] = (c.user_turns + c.assistant_turns + 1) as f64;
            self.report.tool_calls[r] = c.tool_calls as f64;
        }
        self.report
    }

    fn options(&self, kind: AgentKind, generation_prompt: bool) -> ChatOptions {
        let mut o = self.chat.clone();
        o.add_generation_prompt = generation_prompt;
        if kind == AgentKind::Tool {
            o.tools = self.agent.tools.as_ref().map(|t| t.schemas());
        }
        o
    }

    /// A turn ended: finish the conversation or start its tool calls.
    fn turn_ended(&mut self, e: TurnEnd) -> anyhow::Result<Option<Resume>> {
        let row = e.row;
        let s = &self.agent.settings;
        let conv = self
            .convs
            .get_mut(row)
            .with_context(|| format!("the engine reported row {row}, which does not exist"))?;
        conv.assistant_turns += 1;
        if !e.waits {
            return Ok(None);
        }
        let finish = Some(Resume::Finish { row });
        // verl's order of checks after a generation.
        if e.response_len >= self.response_length
            || s.max_assistant_turns
                .is_some_and(|m| m > 0 && conv.assistant_turns >= m)
            || s.max_user_turns
                .is_some_and(|m| m > 0 && conv.user_turns >= m)
            || conv.kind == AgentKind::SingleTurn
        {
            return Ok(finish);
        }
        let Some(tools) = self.agent.tools.clone() else {
            return Ok(finish);
        };
        let stop = *e.tokens.last().context("a turn without tokens")?;
        let body: Vec<u32> = e.tokens[..e.tokens.len() - 1]
            .iter()
            .map(|&t| t as u32)
            .collect();
        let text = self
            .tokenizer
            .decode(&body, false)
            .context("decoding a turn")?;
        let (mut calls, bad) = parse_hermes(&text);
        self.report.malformed_calls += bad as u64;
        conv.messages
            .push(json!({"role": "assistant", "content": text}));
        if calls.is_empty() {
            return Ok(finish);
        }
        calls.truncate(s.max_parallel_calls.max(1) as usize);
        conv.tool_calls += calls.len() as u64;
        conv.pending = Some((stop, e.response_len));
        let (kwargs, tx) = (conv.tools_kwargs.clone(), self.tx.clone());
        self.running += 1;
        std::thread::spawn(move || {
            let results: Vec<(String, ToolCallResult)> = std::thread::scope(|scope| {
                let handles: Vec<_> = calls
                    .iter()
                    .map(|c| {
                        let (tools, kwargs) = (&tools, &kwargs);
                        scope.spawn(move || tools.call(&c.name, &c.arguments, kwargs))
                    })
                    .collect();
                calls
                    .iter()
                    .zip(handles)
                    .map(|(c, h)| {
                        let r = h
                            .join()
                            .unwrap_or_else(|_| ToolCallResult::crashed(&c.name));
                        (c.name.clone(), r)
                    })
                    .collect()
            });
            // The receiver is gone only when the call failed; nothing to tell then.
            let _ = tx.send((row, results));
        });
        Ok(None)
    }

    /// A turn's tool calls returned: the tokens that follow the model's stop token in the
    /// conversation rendered with the tool messages, or a finish when they do not fit.
    fn tools_returned(
        &mut self,
        row: usize,
        results: Vec<(String, ToolCallResult)>,
    ) -> anyhow::Result<Resume> {
        self.running -= 1;
        let s = &self.agent.settings;
        let (max_len, side) = (
            s.max_tool_response_length as usize,
            s.tool_response_truncate_side.clone(),
        );
        for (name, r) in &results {
            let t = self.report.per_tool.entry(name.clone()).or_default();
            t.calls += 1;
            t.errors += u64::from(r.error.is_some());
            t.seconds += r.seconds;
            t.max_seconds = t.max_seconds.max(r.seconds);
        }
        let kind = self.convs[row].kind;
        let (before_opts, after_opts) = (self.options(kind, false), self.options(kind, true));
        let conv = &mut self.convs[row];
        let (stop, used) = conv
            .pending
            .take()
            .context("tool results for a row not waiting")?;
        let before = self
            .tokenizer
            .apply_chat_template(&conv.messages, &before_opts)
            .context("rendering the conversation before the tool messages")?;
        let mut messages = conv.messages.clone();
        for (_, r) in results {
            // verl cuts a tool's answer, not its failure texts.
            messages.push(json!({
                "role": "tool",
                "content": r.truncated(max_len, &side).text,
            }));
        }
        let after = self
            .tokenizer
            .apply_chat_template(&messages, &after_opts)
            .context("rendering the conversation with the tool messages")?;
        let Some(added) = after.strip_prefix(before.as_str()) else {
            bail!(
                "the chat template renders the conversation differently once tool messages follow \
                 (the earlier turns are not a prefix), so the tool turn cannot be appended as tokens"
            );
        };
        // What the template puts after the model's stop token (Qwen2.5: a newline).
        let stop_text = self
            .tokenizer
            .decode(&[stop as u32], false)
            .context("decoding the stop token")?;
        let tail = match before.rfind(stop_text.as_str()) {
            Some(i) if !stop_text.is_empty() => &before[i + stop_text.len()..],
            _ => "",
        };
        let text = format!("{tail}{added}");
        let tokens: Vec<i64> = self
            .tokenizer
            .encode(&text, false)
            .context("tokenizing the tool turn")?
            .into_iter()
            .map(i64::from)
            .collect();
        // verl ends the conversation when the tool turn would fill the response.
        if used + tokens.len() >= self.response_length {
            return Ok(Resume::Finish { row });
        }
        let conv = &mut self.convs[row];
        conv.messages = messages;
        conv.user_turns += 1;
        Ok(Resume::Continue { row, tokens })
    }
}

impl TurnDriver for AgentDriver<'_> {
    fn turns(&mut self, ended: Vec<TurnEnd>, idle: bool) -> verl_plugin_api::Result<Vec<Resume>> {
        let fail = |e: anyhow::Error| verl_plugin_api::Error::failed(format!("{e:#}"));
        let mut answers = Vec::new();
        for e in ended {
            if let Some(a) = self.turn_ended(e).map_err(fail)? {
                answers.push(a);
            }
        }
        loop {
            let next = if idle && answers.is_empty() && self.running > 0 {
                self.rx.recv().ok()
            } else {
                self.rx.try_recv().ok()
            };
            let Some((row, results)) = next else {
                break;
            };
            answers.push(self.tools_returned(row, results).map_err(fail)?);
        }
        Ok(answers)
    }
}

#[cfg(test)]
mod tests;

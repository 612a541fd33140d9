//! `gsm8k`: verl's GSM8K tool (`verl.tools.gsm8k_tool.Gsm8kTool`, default name
//! `calc_gsm8k_reward`). `create` keeps the row's `ground_truth`; each `execute` takes
//! `{"answer": ...}`, scores `#### <answer>` with gsm8k's flexible extraction (1.0 right, 0.0
//! wrong, the integer 0 when no number is found), answers `Current parsed answer=<repr>
//! reward=<repr>` as verl's f-string does, and gives a step reward of 0.0 when the score
//! improved, -0.05 otherwise. The scoring is `verl-reward-score`'s, the one the `rewards` plugin
//! uses.

use std::collections::HashMap;
use std::sync::Mutex;

use serde_json::{json, Value};
use verl_plugin_api::sdk::next_instance_id;
use verl_plugin_api::{Error, Result, Tool, ToolInit, ToolOutput};
use verl_reward_score::gsm8k::extract_solution;
use verl_reward_score::Gsm8kMethod;

use crate::pyrepr;

/// verl's class name for this tool.
pub const VERL_CLASS: &str = "verl.tools.gsm8k_tool.Gsm8kTool";

/// verl's step reward for a submission that did not improve the score.
const NO_IMPROVEMENT: f64 = -0.05;

pub struct Gsm8kTool {
    schema: Value,
    instances: Mutex<HashMap<String, Instance>>,
}

struct Instance {
    ground_truth: Option<Value>,
    score: Score,
}

/// gsm8k's score as verl's `compute_score` returns it: a float, or the integer 0 when the
/// response has no number (which the tool's text prints as `0`, not `0.0`).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Score {
    NoAnswer,
    Value(f64),
}

impl Score {
    fn value(self) -> f64 {
        match self {
            Score::NoAnswer => 0.0,
            Score::Value(v) => v,
        }
    }
    fn repr(self) -> String {
        match self {
            Score::NoAnswer => "0".into(),
            Score::Value(v) => pyrepr::repr_float(v),
        }
    }
}

fn default_schema() -> Value {
    json!({
        "type": "function",
        "function": {
            "name": "calc_gsm8k_reward",
            "description": "A tool for calculating the reward of gsm8k",
            "parameters": {
                "type": "object",
                "properties": {
                    "answer": {"type": "string", "description": "The answer to the question"}
                },
                "required": ["answer"],
            }
        }
    })
}

impl Gsm8kTool {
    pub fn create(init: &ToolInit) -> Result<Self> {
        init.config_object(&[])?;
        Ok(Gsm8kTool {
            schema: init.schema_or(default_schema()),
            instances: Mutex::new(HashMap::new()),
        })
    }

    fn with_instance<T>(&self, id: &str, f: impl FnOnce(&mut Instance) -> T) -> Result<T> {
        let mut map = self.instances.lock().unwrap_or_else(|p| p.into_inner());
        let inst = map.get_mut(id).ok_or_else(|| {
            Error::invalid_input(format!("no instance `{id}` (never created or released)"))
        })?;
        Ok(f(inst))
    }
}

/// gsm8k's flexible score of `#### <answer>` (verl's tool: `format_score` 0.0, `score` 1.0).
fn score(response: &str, ground_truth: Option<&Value>) -> Score {
    match extract_solution(response, Gsm8kMethod::Flexible) {
        None => Score::NoAnswer,
        // Python compares the extracted str with the ground truth as given: a non-string
        // ground truth never equals it.
        Some(a) if ground_truth.and_then(Value::as_str) == Some(a.as_str()) => Score::Value(1.0),
        Some(_) => Score::Value(0.0),
    }
}

impl Tool for Gsm8kTool {
    fn schema(&self) -> Value {
        self.schema.clone()
    }

    fn create(&self, create_kwargs: &Value) -> Result<String> {
        let id = next_instance_id();
        let ground_truth = create_kwargs
            .get("ground_truth")
            .filter(|v| !v.is_null())
            .cloned();
        let mut map = self.instances.lock().unwrap_or_else(|p| p.into_inner());
        map.insert(
            id.clone(),
            Instance {
                ground_truth,
                score: Score::Value(0.0),
            },
        );
        Ok(id)
    }

    fn execute(&self, instance_id: &str, arguments: &Value) -> Result<ToolOutput> {
        let answer = match arguments.get("answer") {
            None => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(other) => pyrepr::str_of(other),
        };
        let response = if answer.starts_with("#### ") {
            answer.clone()
        } else {
            format!("#### {answer}")
        };
        let (new, step) = self.with_instance(instance_id, |inst| {
            let new = score(&response, inst.ground_truth.as_ref());
            let step = if new.value() > inst.score.value() {
                0.0
            } else {
                NO_IMPROVEMENT
            };
            inst.score = new;
            (new, step)
        })?;
        Ok(ToolOutput::text(format!(
            "Current parsed answer={} reward={}",
            pyrepr::repr_str(&answer),
            new.repr()
        ))
        .with_reward(step))
    }

    fn calc_reward(&self, instance_id: &str) -> Result<f64> {
        self.with_instance(instance_id, |inst| inst.score.value())
    }

    fn release(&self, instance_id: &str) -> Result<()> {
        let mut map = self.instances.lock().unwrap_or_else(|p| p.into_inner());
        map.remove(instance_id)
            .map(|_| ())
            .ok_or_else(|| Error::invalid_input(format!("no instance `{instance_id}` to release")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Texts and step rewards verl's `Gsm8kTool.execute` gives for these calls (generated by
    /// running verl's gsm8k scorer and the tool's execute steps in CPython 3.11).
    #[test]
    fn texts_and_step_rewards_match_verl() {
        let cases = [
            (
                json!("72"),
                vec![
                    (
                        json!({"answer": "72"}),
                        "Current parsed answer='72' reward=1.0",
                        0.0,
                    ),
                    (
                        json!({"answer": "72"}),
                        "Current parsed answer='72' reward=1.0",
                        -0.05,
                    ),
                    (
                        json!({"answer": "71"}),
                        "Current parsed answer='71' reward=0.0",
                        -0.05,
                    ),
                    (
                        json!({"answer": "no idea"}),
                        "Current parsed answer='no idea' reward=0",
                        -0.05,
                    ),
                    (
                        json!({"answer": 72}),
                        "Current parsed answer='72' reward=1.0",
                        0.0,
                    ),
                    (
                        json!({"answer": "#### 72"}),
                        "Current parsed answer='#### 72' reward=1.0",
                        -0.05,
                    ),
                ],
            ),
            (
                json!("1000"),
                vec![
                    (
                        json!({"answer": "1,000"}),
                        "Current parsed answer='1,000' reward=0.0",
                        -0.05,
                    ),
                    (json!({}), "Current parsed answer='' reward=0", -0.05),
                    (
                        json!({"answer": 1000.0}),
                        "Current parsed answer='1000.0' reward=0.0",
                        -0.05,
                    ),
                    (
                        json!({"answer": "it's 1000"}),
                        "Current parsed answer=\"it's 1000\" reward=1.0",
                        0.0,
                    ),
                ],
            ),
            (
                Value::Null,
                vec![(
                    json!({"answer": "5"}),
                    "Current parsed answer='5' reward=0.0",
                    -0.05,
                )],
            ),
        ];
        let tool =
            Gsm8kTool::create(&ToolInit::new(VERL_CLASS, json!({"type": "native"}))).unwrap();
        for (truth, calls) in cases {
            let id = tool.create(&json!({ "ground_truth": truth })).unwrap();
            for (args, text, step) in calls {
                let out = tool.execute(&id, &args).unwrap();
                assert_eq!(out.text, text, "{args}");
                assert_eq!(out.reward, Some(step), "{args}");
            }
            tool.release(&id).unwrap();
        }
    }

    #[test]
    fn calc_reward_is_the_latest_score_and_instances_are_separate() {
        let tool = Gsm8kTool::create(&ToolInit::new("gsm8k", json!({}))).unwrap();
        let a = tool.create(&json!({"ground_truth": "18"})).unwrap();
        let b = tool.create(&json!({"ground_truth": "20"})).unwrap();
        tool.execute(&a, &json!({"answer": "18"})).unwrap();
        tool.execute(&b, &json!({"answer": "18"})).unwrap();
        assert_eq!(tool.calc_reward(&a).unwrap(), 1.0);
        assert_eq!(tool.calc_reward(&b).unwrap(), 0.0);
        tool.release(&a).unwrap();
        let e = tool
            .execute(&a, &json!({"answer": "18"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no instance"), "{e}");
    }

    #[test]
    fn the_name_comes_from_the_tool_schema_with_verls_default() {
        let tool = Gsm8kTool::create(&ToolInit::new(VERL_CLASS, json!({}))).unwrap();
        assert_eq!(tool.schema()["function"]["name"], "calc_gsm8k_reward");
        let mut schema = default_schema();
        schema["function"]["name"] = json!("check_answer");
        let tool =
            Gsm8kTool::create(&ToolInit::new(VERL_CLASS, json!({})).with_schema(schema)).unwrap();
        assert_eq!(tool.schema()["function"]["name"], "check_answer");
        let e = Gsm8kTool::create(&ToolInit::new(VERL_CLASS, json!({"method": "strict"})))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("`config.method`"), "{e}");
    }
}

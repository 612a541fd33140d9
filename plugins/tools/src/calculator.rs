//! `calculator`: evaluates an arithmetic expression exactly and answers with just the number.
//!
//! The arithmetic is `verl-calculator`'s (shared with `verl data gsm8k --tools calculator`):
//! exact integers and decimals, Python's `+ - * / // % **` and parentheses, results beyond 38
//! digits refused. This module owns the tool: its schema, config and arguments.

use serde_json::{json, Value};
use verl_calculator::evaluate;
use verl_plugin_api::{Error, Result, Tool, ToolInit, ToolOutput};

/// The calculator tool.
pub struct Calculator {
    schema: Value,
}

impl Calculator {
    pub fn create(init: &ToolInit) -> Result<Self> {
        init.config_object(&[])?;
        Ok(Calculator {
            schema: init.schema_or(default_schema()),
        })
    }
}

fn default_schema() -> Value {
    json!({
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression and return the number. Integers and \
                decimals, + - * / // % ** and parentheses, e.g. \"(4821 + 3977) * 2\".",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": "The arithmetic expression to evaluate.",
                    }
                },
                "required": ["expression"],
            }
        }
    })
}

impl Tool for Calculator {
    fn schema(&self) -> Value {
        self.schema.clone()
    }

    fn execute(&self, _instance_id: &str, arguments: &Value) -> Result<ToolOutput> {
        let expression = match arguments.get("expression") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            Some(other) => {
                return Err(Error::invalid_input(format!(
                    "the `expression` argument must be a string, found {other}"
                )))
            }
            None => {
                return Err(Error::invalid_input(
                    "missing the `expression` argument (a string such as \"2 + 3\")",
                ))
            }
        };
        evaluate(&expression)
            .map(ToolOutput::text)
            .map_err(|e| Error::failed(e.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tool_reads_the_expression_argument() {
        let calc =
            Calculator::create(&ToolInit::new("calculator", json!({"type": "native"}))).unwrap();
        let out = calc
            .execute("i", &json!({"expression": "4821 + 3977"}))
            .unwrap();
        assert_eq!(out, ToolOutput::text("8798"));
        let e = calc.execute("i", &json!({})).unwrap_err().to_string();
        assert!(e.contains("missing the `expression` argument"), "{e}");
        let e = calc
            .execute("i", &json!({"expression": "1/0"}))
            .unwrap_err()
            .to_string();
        assert_eq!(e, "division by zero");
        assert_eq!(
            calc.schema()["function"]["parameters"]["required"],
            json!(["expression"])
        );
    }

    #[test]
    fn an_unknown_config_key_is_refused_by_name() {
        let e = Calculator::create(&ToolInit::new("calculator", json!({"precision": 3})))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("`config.precision`"), "{e}");
    }
}

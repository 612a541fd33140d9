//! The tool plugin: which class names it serves and which tool each one creates.

use verl_plugin_api::{BuildInfo, Error, PluginInfo, Result, Tool, ToolInit, ToolPlugin};

use crate::calculator::Calculator;
use crate::gsm8k::{self, Gsm8kTool};
use crate::python::PythonTool;

/// The built-in tools: `calculator`, `gsm8k` (also verl's `verl.tools.gsm8k_tool.Gsm8kTool`) and
/// `python`.
pub struct BuiltinTools;

impl ToolPlugin for BuiltinTools {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "tools".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            description: "built-in tools: calculator, gsm8k (verl's Gsm8kTool), python (a \
                          sandboxed python3 subprocess)"
                .into(),
            capabilities: vec![],
            build: BuildInfo::plain(),
        }
    }

    fn tool_classes() -> Vec<String> {
        ["calculator", "gsm8k", gsm8k::VERL_CLASS, "python"]
            .map(String::from)
            .to_vec()
    }

    fn create_tool(init: &ToolInit) -> Result<Box<dyn Tool>> {
        Ok(match init.class_name.as_str() {
            "calculator" => Box::new(Calculator::create(init)?),
            "gsm8k" | gsm8k::VERL_CLASS => Box::new(Gsm8kTool::create(init)?),
            "python" => Box::new(PythonTool::create(init)?),
            other => {
                return Err(Error::invalid_input(format!(
                    "no built-in tool `{other}` (built-ins: {})",
                    Self::tool_classes().join(", ")
                )))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use verl_plugin_api::{testing, PluginKind};

    #[test]
    fn the_header_lists_every_built_in_class() {
        let h = testing::tool_header::<BuiltinTools>().unwrap();
        assert_eq!((h.name.as_str(), h.kind), ("tools", PluginKind::Tool));
        for class in [
            "calculator",
            "gsm8k",
            "verl.tools.gsm8k_tool.Gsm8kTool",
            "python",
        ] {
            assert!(h.provides_tool(class), "{class}");
        }
    }

    #[test]
    fn the_calculator_answers_through_the_abi() {
        let tool = testing::tool::<BuiltinTools>(&ToolInit::new("calculator", json!({}))).unwrap();
        assert_eq!(tool.name(), "calculator");
        let id = tool.create(&json!({})).unwrap();
        let out = tool
            .execute(&id, &json!({"expression": "4821 + 3977"}))
            .unwrap();
        assert_eq!(out.text, "8798");
        tool.release(&id).unwrap();
    }

    #[test]
    fn verls_gsm8k_class_keeps_its_ground_truth_per_instance_through_the_abi() {
        let tool = testing::tool::<BuiltinTools>(&ToolInit::new(
            gsm8k::VERL_CLASS,
            json!({"type": "native"}),
        ))
        .unwrap();
        assert_eq!(tool.name(), "calc_gsm8k_reward");
        let id = tool.create(&json!({"ground_truth": "72"})).unwrap();
        let out = tool.execute(&id, &json!({"answer": "72"})).unwrap();
        assert_eq!(out.text, "Current parsed answer='72' reward=1.0");
        assert_eq!(out.reward, Some(0.0));
        assert_eq!(tool.calc_reward(&id).unwrap(), 1.0);
        tool.release(&id).unwrap();
    }

    #[test]
    fn an_unknown_class_is_refused_with_the_list_of_built_ins() {
        let e = testing::tool::<BuiltinTools>(&ToolInit::new("search", json!({})))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("no built-in tool `search`"), "{e}");
        assert!(e.contains("calculator, gsm8k"), "{e}");
    }
}

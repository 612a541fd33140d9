//! Coverage checklist: every key that verl's own GRPO/PPO example scripts set must load.

use serde_yaml::Value;
use verl_config::Config;

/// A value of the right shape for `key`: its current value (so types always fit), or a
/// string for a key being added to a free-form map.
fn override_for(defaults: &Config, line: &str) -> String {
    let key = line.trim_start_matches(['+', '~']);
    let value = match defaults.get_path(key) {
        Ok(Value::Null) | Err(_) => "x".to_string(),
        Ok(v) => serde_json::to_string(&v).unwrap(),
    };
    format!("{line}={value}")
}

#[test]
fn every_key_set_by_verls_example_scripts_is_accepted() {
    let path = format!(
        "{}/tests/fixtures/verl_example_keys.txt",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(path).unwrap();
    let defaults = Config::default();
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    assert!(lines.len() > 200, "the checklist is loaded");
    let mut failures = Vec::new();
    for line in &lines {
        let ov = override_for(&defaults, line);
        // Keys whose default is null take the string "x"; those are typed (numbers, paths)
        // and only the key's acceptance is under test, so a type error is not a failure.
        if let Err(e) = Config::from_overrides(&[ov.as_str()]) {
            let key_error = e.errors().iter().any(|e| {
                matches!(
                    e,
                    verl_config::ConfigError::OverrideMissingKey { .. }
                        | verl_config::ConfigError::OverrideAddNotAllowed { .. }
                        | verl_config::ConfigError::UnknownKey { .. }
                )
            });
            if key_error {
                failures.push(format!("{ov}: {e}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} keys rejected:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

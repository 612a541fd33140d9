//! The key table stays honest: every test a rule cites exists and deals with the key, and the
//! page users read is the one the rules generate.

use std::path::{Path, PathBuf};

use verl_config::defaults_tree;
use verl_config::surface::{markdown, Class, RULES};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The source of test `name` in `file` (from its `fn` line to the next `fn` at the same depth).
fn test_body(file: &str, name: &str) -> Option<String> {
    let needle = format!("fn {name}(");
    let start = file.find(&needle)?;
    let line_start = file[..start].rfind('\n').map(|i| i + 1).unwrap_or(0);
    let indent = &file[line_start..start];
    let rest = &file[start..];
    let end = rest
        .find(&format!("\n{indent}}}"))
        .map(|i| i + indent.len() + 2)
        .unwrap_or(rest.len());
    Some(rest[..end].to_string())
}

#[test]
fn every_test_a_rule_cites_exists_and_deals_with_the_key() {
    let root = workspace();
    let mut problems = Vec::new();
    for rule in RULES.iter().filter(|r| r.class == Class::Acts) {
        for cited in rule.tests {
            let Some((path, name)) = cited.rsplit_once("::") else {
                problems.push(format!(
                    "{}: `{cited}` is not path::test_name",
                    rule.pattern
                ));
                continue;
            };
            // `file.rs::tests::name`: the module path does not matter for the search.
            let path = path.split("::").next().unwrap_or(path);
            let Ok(text) = std::fs::read_to_string(root.join(path)) else {
                problems.push(format!("{}: no file {path}", rule.pattern));
                continue;
            };
            let Some(body) = test_body(&text, name) else {
                problems.push(format!("{}: no test `{name}` in {path}", rule.pattern));
                continue;
            };
            // The key's last literal segment appears in the test or in the file's fixtures.
            let leaves: Vec<&str> = rule
                .pattern
                .split('|')
                .filter_map(|alt| alt.split('.').rev().find(|s| !s.contains('*')))
                .collect();
            if !leaves.iter().any(|l| body.contains(l) || text.contains(l)) {
                problems.push(format!(
                    "{}: `{cited}` does not mention {leaves:?}",
                    rule.pattern
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_docs_table_is_the_one_the_rules_generate() {
    let path = workspace().join("docs/config-keys.md");
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    let generated = markdown(defaults_tree());
    assert!(
        on_disk == generated,
        "{} is stale: regenerate it with `verl config keys --markdown > docs/config-keys.md`",
        path.display()
    );
}

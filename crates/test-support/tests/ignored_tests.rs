//! `make test-gpu` runs `cargo test -- --ignored _on_cuda`: it must pick exactly the GPU-only
//! tests. So every `#[ignore = "needs CUDA"]` test is named `…_on_cuda`, and every other ignored
//! test gives its own reason and is not. Checked over the workspace's Rust sources.

use std::path::{Path, PathBuf};

use verl_test_support::shared::workspace_root;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if !name.starts_with('.') && name != "target" {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

/// `(file:line, attribute, test name)` of every `#[ignore…]` attribute.
fn ignored_tests(root: &Path) -> Vec<(String, String, String)> {
    let mut files = Vec::new();
    for top in [
        "host",
        "plugins",
        "plugin-api",
        "tests",
        "crates",
        "examples",
    ] {
        rust_files(&root.join(top), &mut files);
    }
    let mut found = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let attr = line.trim();
            if !attr.starts_with("#[ignore") {
                continue;
            }
            let name = lines[i + 1..]
                .iter()
                .find_map(|l| {
                    let l = l.trim_start();
                    let l = l.strip_prefix("pub ").unwrap_or(l);
                    let l = l.strip_prefix("async ").unwrap_or(l);
                    l.strip_prefix("fn ")
                        .map(|rest| rest.split(['(', '<']).next().unwrap().to_string())
                })
                .unwrap_or_default();
            let at = format!(
                "{}:{}",
                file.strip_prefix(root).unwrap_or(&file).display(),
                i + 1
            );
            found.push((at, attr.to_string(), name));
        }
    }
    found
}

#[test]
fn cuda_tests_and_only_they_are_named_on_cuda() {
    let root = workspace_root();
    let tests = ignored_tests(&root);
    assert!(
        tests
            .iter()
            .any(|(_, a, _)| a == "#[ignore = \"needs CUDA\"]"),
        "no GPU-only test found under {}",
        root.display()
    );
    let mut bad = Vec::new();
    for (at, attr, name) in &tests {
        let cuda = attr == "#[ignore = \"needs CUDA\"]";
        if cuda != name.ends_with("_on_cuda") {
            bad.push(format!("{at}: {attr} fn {name}"));
        }
        if attr == "#[ignore]" {
            bad.push(format!("{at}: fn {name} is ignored without a reason"));
        }
    }
    assert!(
        bad.is_empty(),
        "`#[ignore = \"needs CUDA\"]` tests must be named `…_on_cuda`, other ignored tests must \
         not be, and every ignore gives its reason:\n{}",
        bad.join("\n")
    );
}

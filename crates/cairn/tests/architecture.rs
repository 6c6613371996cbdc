//! The crate dependency graph follows the architecture (STYLE.md): lower
//! layers never reach up. Checked against `cargo metadata`, so a new
//! dependency that breaks the direction fails here.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

/// For each workspace crate, the workspace crates it may depend on.
const ALLOWED: &[(&str, &[&str])] = &[
    ("cairn-protocol", &[]),
    ("cairn-testkit", &[]),
    ("cairn-llm", &[]),
    ("cairn-init", &["cairn-protocol"]),
    ("cairn-store", &[]),
    ("cairn-layers", &["cairn-store"]),
    ("cairn-sandbox", &["cairn-protocol", "cairn-layers", "cairn-store"]),
    (
        "cairn-engine",
        &[
            "cairn-protocol",
            "cairn-sandbox",
            "cairn-layers",
            "cairn-store",
            "cairn-llm",
        ],
    ),
    ("cairn-tools", &["cairn-engine", "cairn-sandbox", "cairn-protocol"]),
    ("cairn-agent", &["cairn-engine", "cairn-tools", "cairn-llm"]),
    (
        "cairn-api",
        &["cairn-engine", "cairn-tools", "cairn-sandbox", "cairn-protocol"],
    ),
    (
        "cairn",
        &[
            "cairn-engine",
            "cairn-sandbox",
            "cairn-protocol",
            "cairn-api",
            "cairn-agent",
            "cairn-llm",
            "cairn-store",
            "cairn-layers",
        ],
    ),
];

#[test]
fn crates_depend_only_downwards() {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo metadata");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let allowed: BTreeMap<&str, BTreeSet<&str>> =
        ALLOWED.iter().map(|(k, v)| (*k, v.iter().copied().collect())).collect();
    let members: BTreeSet<String> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    let mut violations = Vec::new();
    for pkg in meta["packages"].as_array().unwrap() {
        let name = pkg["name"].as_str().unwrap();
        let Some(ok) = allowed.get(name) else {
            violations.push(format!("{name} is not in the architecture table of this test"));
            continue;
        };
        for dep in pkg["dependencies"].as_array().unwrap() {
            let dep_name = dep["name"].as_str().unwrap();
            let dev = dep["kind"].as_str() == Some("dev");
            if members.contains(dep_name) && !dev && !ok.contains(dep_name) {
                violations.push(format!("{name} depends on {dep_name}"));
            }
        }
    }
    assert!(violations.is_empty(), "dependency direction broken: {violations:?}");
}

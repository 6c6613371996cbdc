//! The crate dependency graph follows the architecture (STYLE.md): lower
//! layers never reach up. Checked against `cargo metadata`, so a new
//! dependency that breaks the direction fails here. Within a crate, no
//! two top-level modules may reach one another, directly or round a circle.

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
    // The state store's rows record a sandbox's network policy
    // (`cairn_sandbox::net::NetPolicy`); nothing of the engine's.
    ("cairn-state", &["cairn-sandbox"]),
    (
        "cairn-engine",
        &[
            "cairn-protocol",
            "cairn-sandbox",
            "cairn-layers",
            "cairn-store",
            "cairn-state",
        ],
    ),
    (
        "cairn-pipeline",
        &[
            "cairn-protocol",
            "cairn-sandbox",
            "cairn-store",
            "cairn-state",
            "cairn-engine",
            "cairn-llm",
        ],
    ),
    (
        "cairn-session",
        &[
            "cairn-protocol",
            "cairn-sandbox",
            "cairn-layers",
            "cairn-store",
            "cairn-state",
            "cairn-engine",
        ],
    ),
    (
        "cairn-tools",
        &[
            "cairn-engine",
            "cairn-pipeline",
            "cairn-session",
            "cairn-sandbox",
            "cairn-protocol",
        ],
    ),
    (
        "cairn-agent",
        &[
            "cairn-engine",
            "cairn-pipeline",
            "cairn-session",
            "cairn-tools",
            "cairn-llm",
        ],
    ),
    (
        "cairn-api",
        &[
            "cairn-engine",
            "cairn-pipeline",
            "cairn-session",
            "cairn-tools",
            "cairn-sandbox",
            "cairn-protocol",
        ],
    ),
    (
        "cairn",
        &[
            "cairn-engine",
            "cairn-pipeline",
            "cairn-session",
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

/// For each top-level module of the crate whose sources are in `src`, the
/// crate's other top-level modules its code names (`crate::x`, `crate::{x,
/// y}`), outside comments and the test module at a file's end. The crate
/// root (lib.rs, main.rs) is left out: it declares and re-exports them.
fn module_graph(src: &std::path::Path) -> BTreeMap<String, BTreeSet<String>> {
    fn files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let mut all = Vec::new();
    files(src, &mut all);
    let top_of = |path: &std::path::Path| -> Option<String> {
        let rel = path.strip_prefix(src).unwrap();
        let first = rel.components().next()?.as_os_str().to_str()?.to_string();
        match first.as_str() {
            "lib.rs" | "main.rs" => None,
            f => Some(f.trim_end_matches(".rs").to_string()),
        }
    };
    let modules: BTreeSet<String> = all.iter().filter_map(|p| top_of(p)).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = modules.iter().map(|m| (m.clone(), BTreeSet::new())).collect();
    for path in &all {
        let Some(top) = top_of(path) else { continue };
        let text = std::fs::read_to_string(path).unwrap();
        let code = match text.find("#[cfg(test)]\nmod tests") {
            Some(at) => &text[..at],
            None => &text[..],
        };
        // In a top-level module's own file (`src/x.rs`, `src/x/mod.rs`),
        // `super::` is the crate root too.
        let rel = path.strip_prefix(src).unwrap();
        let top_file = rel.components().count() == 1 || rel.ends_with("mod.rs") && rel.components().count() == 2;
        let roots: &[&str] = if top_file {
            &["crate::", "super::"]
        } else {
            &["crate::"]
        };
        for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
            let found = roots
                .iter()
                .flat_map(|root| line.match_indices(root).map(move |(at, _)| at + root.len()));
            for start in found.collect::<Vec<_>>() {
                if line[..start].ends_with("super::") && line[..start - "super::".len()].ends_with("::") {
                    continue; // `self::super::`, `super::super::`: not the root
                }
                let rest = &line[start..];
                let named: Vec<&str> = match rest.strip_prefix('{') {
                    Some(group) => group
                        .split([',', '}'])
                        .map(|part| part.trim().split("::").next().unwrap_or(""))
                        .collect(),
                    None => vec![rest
                        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                        .next()
                        .unwrap_or("")],
                };
                for name in named {
                    if name != top && modules.contains(name) {
                        graph.get_mut(&top).unwrap().insert(name.to_string());
                    }
                }
            }
        }
    }
    graph
}

/// The circles of `graph`: sets of two or more modules each reaching the
/// others.
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<Vec<String>> {
    let reach = |from: &str| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(m) = todo.pop() {
            for next in &graph[&m] {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> = graph.keys().map(|m| (m, reach(m))).collect();
    graph
        .keys()
        .map(|m| {
            let mut circle: Vec<String> = reaches[m]
                .iter()
                .filter(|other| reaches[other].contains(m))
                .cloned()
                .collect();
            if !circle.contains(m) {
                circle.clear();
            }
            circle.sort();
            circle
        })
        .filter(|c| c.len() > 1)
        .collect()
}

#[test]
fn modules_within_a_crate_form_no_circle() {
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut found = BTreeSet::new();
    for entry in std::fs::read_dir(&crates).unwrap() {
        let dir = entry.unwrap().path();
        let src = dir.join("src");
        if !src.is_dir() {
            continue;
        }
        let name = dir.file_name().unwrap().to_str().unwrap().to_string();
        for circle in circles(&module_graph(&src)) {
            found.insert((name.clone(), circle));
        }
    }
    assert!(
        found.is_empty(),
        "modules of one crate reach one another in a circle: {found:?}; untie them: move what both need into a \
         module below both"
    );
}

#[test]
fn the_circle_finder_finds_a_circle_and_only_circles() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a", "d"]),
        ("d", vec![]),
        ("e", vec!["d"]),
    ]
    .into_iter()
    .map(|(m, to)| (m.to_string(), to.into_iter().map(String::from).collect()))
    .collect();
    let abc: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
    assert_eq!(circles(&graph), BTreeSet::from([abc]));
}

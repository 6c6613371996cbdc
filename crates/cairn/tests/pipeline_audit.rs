//! End-to-end: `cairn audit` on real runs, and the old spellings of the
//! pipeline run commands.

mod common;

use common::{skip, stderr, stdout, Home};
use serde_json::Value;

fn write(home: &Home, name: &str, text: &str) -> String {
    let path = home.path().join(name);
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

fn run(home: &Home, text: &str) -> String {
    let file = write(home, "p.toml", text);
    let out = home.cairn(&["pipeline", "run", &file]);
    assert!(out.status.success(), "{}", stderr(&out));
    stdout(&out).trim().to_string()
}

fn audit(home: &Home, run: &str, extra: &[&str]) -> Value {
    let mut args = vec!["audit", run, "--json"];
    args.extend_from_slice(extra);
    serde_json::from_str(&home.ok(&args)).unwrap()
}

fn kinds(a: &Value) -> Vec<(String, String)> {
    a["recommendations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["stage"].as_str().unwrap().to_string(),
                r["kind"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// A stage that fails twice after its first (slow) command, retried from
/// its checkpoints.
const RETRIED: &str = r#"
[pipeline]
name = "retried"
image = "busybox"

[[stage]]
name = "long"
key = "long-v1"
retries = 2
checkpoint_every = "300ms"
run = [
  "mkdir -p /work",
  "[ -e /work/before ] || { echo written > /work/before; sleep 1.5; }",
  "if [ $CAIRN_ATTEMPT -le 2 ]; then exit 7; fi",
]
"#;

#[test]
fn audit_counts_setup_compute_retries_and_what_checkpoints_saved() {
    if skip("audit_counts_setup_compute_retries_and_what_checkpoints_saved") {
        return;
    }
    let home = Home::new();
    let id = run(&home, RETRIED);
    // Even at a one-second bar, a stage with checkpoints gets no checkpoint advice.
    let a = audit(&home, &id, &["--long-stage-secs", "1"]);
    assert_eq!(a["status"], "completed");
    let stages = a["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 1, "{a}");
    let s = &stages[0];
    assert_eq!(
        (s["attempts"].as_u64(), s["retries"].as_u64()),
        (Some(3), Some(2)),
        "{s}"
    );
    assert!(
        s["compute_ms"].as_u64().unwrap() >= 1500,
        "the first attempt slept 1.5 s: {s}"
    );
    assert!(
        s["setup_ms"].as_u64().unwrap() >= s["restore_ms"].as_u64().unwrap(),
        "{s}"
    );
    assert!(s["checkpoints"].as_u64().unwrap() >= 1, "{s}");
    // The retries restored a checkpoint taken after the slow command began.
    assert!(s["saved_ms"].as_u64().unwrap() >= 300, "{s}");
    assert!(s["lost_ms"].as_u64().is_some(), "{s}");
    assert!(s["state_bytes"].as_u64().is_some(), "{s}");
    assert!(kinds(&a).is_empty(), "{a}");
    let text = home.ok(&["audit", &id]);
    assert!(text.contains("long") && text.contains("no advice"), "{text}");
}

/// A long prefix with a large artifact, then branches that each repeat
/// the same first command.
const WASTEFUL: &str = r#"
[pipeline]
name = "wasteful"
image = "busybox"

[[stage]]
name = "prep"
key = "prep-v1"
run = ["sleep 1.2", "head -c 2097152 /dev/urandom > /big"]
artifacts = ["/big"]

[[stage]]
name = "sweep"
after = "prep"
key = "sweep-{hypothesis}"
run = ["sleep 0.8", "echo {hypothesis.v} > /v"]
[stage.branches]
select = "first_success"
hypotheses = [
  { name = "a", v = "1" },
  { name = "b", v = "2" },
  { name = "c", v = "3" },
]
"#;

#[test]
fn audit_advises_checkpoints_snapshots_and_a_shared_prefix_where_they_apply() {
    if skip("audit_advises_checkpoints_snapshots_and_a_shared_prefix_where_they_apply") {
        return;
    }
    let home = Home::new();
    let id = run(&home, WASTEFUL);
    // At the seed's bars (5 minutes, 10 GiB) nothing here is worth advice.
    let a = audit(&home, &id, &[]);
    assert!(kinds(&a).is_empty(), "{a}");
    // The branches are audited one by one; the group's own row is not.
    let names: Vec<String> = a["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| format!("{}/{}", s["stage"].as_str().unwrap(), s["branch"].as_str().unwrap()))
        .collect();
    assert_eq!(names.len(), 4, "{names:?}");
    assert!(
        names.contains(&"prep/".to_string()) && names.contains(&"sweep/b".to_string()),
        "{names:?}"
    );
    let prep = &a["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == "prep")
        .unwrap()
        .clone();
    assert_eq!(prep["artifact_bytes"].as_u64(), Some(2 << 20));
    // Lowered bars: each heuristic fires where, and only where, it applies.
    let a = audit(&home, &id, &["--long-stage-secs", "1", "--large-state", "1M"]);
    let mut got = kinds(&a);
    got.sort();
    let want: Vec<(String, String)> = [
        ("prep", "checkpoint"),
        ("prep", "snapshot-state"),
        ("sweep", "share-prefix"),
    ]
    .iter()
    .map(|(s, k)| (s.to_string(), k.to_string()))
    .collect();
    assert_eq!(got, want, "{a}");
    let share = a["recommendations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["kind"] == "share-prefix")
        .unwrap();
    assert!(
        share["advice"].as_str().unwrap().contains("first 1 command(s)"),
        "{share}"
    );
    let text = home.ok(&["audit", &id, "--long-stage-secs", "1", "--large-state", "1M"]);
    assert!(text.contains("advice (share-prefix)"), "{text}");
}

#[test]
fn audit_of_an_unknown_run_says_how_to_find_one() {
    let home = Home::empty();
    let out = home.cairn(&["audit", "nosuchrun"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("cairn pipeline ls"), "{}", stderr(&out));
    let out = home.cairn(&["audit", "nosuchrun", "--long-stage-secs", "0"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--long-stage-secs"), "{}", stderr(&out));
}

#[test]
fn the_old_spellings_of_pipeline_run_commands_work_with_a_note() {
    if skip("the_old_spellings_of_pipeline_run_commands_work_with_a_note") {
        return;
    }
    let home = Home::new();
    let id = run(
        &home,
        "[pipeline]\nname = \"one\"\nimage = \"busybox\"\n\n[[stage]]\nname = \"a\"\nkey = \"a-v1\"\nrun = [\"true\"]\n",
    );
    let new: Value = serde_json::from_str(&home.ok(&["pipeline", "show", &id, "--json"])).unwrap();
    let old = home.cairn(&["run", "show", &id, "--json"]);
    assert!(old.status.success(), "{}", stderr(&old));
    let old_json: Value = serde_json::from_str(&stdout(&old)).unwrap();
    assert_eq!(old_json["run"]["id"], new["run"]["id"]);
    assert!(stderr(&old).contains("use `cairn pipeline show`"), "{}", stderr(&old));
    let listed = home.cairn(&["runs"]);
    assert!(listed.status.success() && stdout(&listed).contains(&id));
    assert!(
        stderr(&listed).contains("use `cairn pipeline ls`"),
        "{}",
        stderr(&listed)
    );
    assert!(home.ok(&["pipeline", "ls"]).contains(&id));
    // `cairn run -- CMD` still runs a command, `show` included as an argument.
    assert_eq!(home.ok(&["run", "--", "echo", "show"]).trim(), "show");
}

//! Hostile and malformed arguments, refused before anything runs.

use super::*;
use serde_json::json;

fn refused(name: &str, v: Value) -> String {
    match parse(name, v) {
        Err(ToolError::InvalidArguments { message, .. }) => message,
        other => panic!("{name}: expected invalid arguments, got {other:?}"),
    }
}

#[test]
fn hostile_arguments_are_refused_before_anything_runs() {
    let good = json!({"snapshot_id": "ab12", "commands": ["true"], "reason": "r"});
    assert!(matches!(parse("run_stage", good.clone()), Ok(ToolArgs::RunStage(_))));
    let with = |k: &str, v: Value| {
        let mut g = good.clone();
        g[k] = v;
        g
    };
    assert!(refused("run_stage", with("snapshot_id", json!("../etc"))).contains("not an id"));
    assert!(refused("run_stage", with("bogus", json!(1))).contains("unknown field"));
    assert!(refused("run_stage", with("stage_key", json!("{params.x}"))).contains("stage_key"));
    assert!(refused("run_stage", with("timeout", json!("forever"))).contains("not a duration"));
    assert!(refused("run_stage", with("wait_secs", json!(3600))).contains("stage_status"));
    assert!(refused("run_stage", with("commands", json!([]))).contains("at least one"));
    assert!(refused("run_stage", with("reason", json!(""))).contains("reason"));
    let big = "x".repeat((1 << 20) + 1);
    assert!(refused("run_stage", with("edits", json!([{"path": "/a", "content": big}]))).contains("content"));
    assert!(refused("run_stage", with("edits", json!([{"path": "a", "content": ""}]))).contains("absolute"));
    assert!(refused("fork_from", good.clone()).contains("hypothesis"));
    let group = |hypotheses: Value| {
        let mut g = good.clone();
        g["hypotheses"] = hypotheses;
        g
    };
    let three = json!([{"name": "a", "commands": ["true"]}, {"name": "b"}, {"name": "c-2", "edits": [{"path": "/x", "content": ""}]}]);
    match parse("fork_from", group(three)) {
        Ok(ToolArgs::ForkFrom(s)) => assert_eq!(s.hypotheses.map(|h| h.len()), Some(3)),
        other => panic!("{other:?}"),
    }
    assert!(refused("fork_from", group(json!([{"name": "a"}]))).contains("2 to 16"));
    assert!(refused("fork_from", group(json!([{"name": "a"}, {"name": "a"}]))).contains("two hypotheses"));
    assert!(refused("fork_from", group(json!([{"name": "a b"}, {"name": "c"}]))).contains("letters, digits"));
    let bad_edit = json!([{"name": "a"}, {"name": "b", "edits": [{"path": "rel", "content": ""}]}]);
    assert!(refused("fork_from", group(bad_edit)).contains("hypothesis \"b\""));
    let mut both = group(json!([{"name": "a"}, {"name": "b"}]));
    both["hypothesis"] = json!("h");
    assert!(refused("fork_from", both).contains("not both"));
    assert!(refused("run_stage", group(json!([{"name": "a"}, {"name": "b"}]))).contains("use fork_from"));
    let group_select = json!({"handle": "ab", "winner": "amber", "reason": "r"});
    assert!(matches!(
        parse("select", group_select),
        Ok(ToolArgs::Select {
            group: Some(_),
            choice: Choice::Winner(_),
            ..
        })
    ));
    let first = json!({"branches": ["ab", "cd"], "rule": "first_success", "reason": "r"});
    assert!(matches!(
        parse("select", first),
        Ok(ToolArgs::Select {
            choice: Choice::FirstSuccess,
            ..
        })
    ));
    assert!(refused(
        "select",
        json!({"handle": "ab", "branches": ["cd"], "rule": "first_success", "reason": "r"})
    )
    .contains("not both"));
    assert!(refused(
        "select",
        json!({"branches": ["ab"], "rule": "first_success", "metric": "output", "reason": "r"})
    )
    .contains("no metric"));
    assert!(refused(
        "session_create",
        json!({"image": "busybox", "snapshot_id": "ab", "reason": "r"})
    )
    .contains("not both"));
    assert!(refused("session_close", json!({"session": "s", "reason": "r", "force": true})).contains("unknown field"));
    assert!(matches!(
        parse("session_close", json!({"session": "s", "purge": true, "reason": "r"})),
        Ok(ToolArgs::SessionLifecycle {
            action: Lifecycle::Close { purge: true },
            ..
        })
    ));
    assert!(refused("session_fork", json!({"session": "s", "name": "../x", "reason": "r"})).contains("name"));
    assert!(refused("inspect", json!({"snapshot_id": "ab", "path": "etc"})).contains("absolute"));
    assert!(refused("inspect_logs", json!({"stage": "ab", "tail_lines": 0})).contains("tail_lines"));
    assert!(refused("diff", json!({"from_snapshot_id": "ab"})).contains("to_snapshot_id"));
    assert!(refused("diff", json!({"from_snapshot_id": "ab", "to_snapshot_id": "../x"})).contains("to_snapshot_id"));
    assert!(matches!(
        parse(
            "diff",
            json!({"from_snapshot_id": "ab", "to_snapshot_id": "cd", "text": false})
        ),
        Ok(ToolArgs::Diff { text: false, .. })
    ));
    assert!(refused("select", json!({"branches": [], "winner": "ab", "reason": "r"})).contains("branches"));
    let sel = |extra: Value| {
        let mut v = json!({"branches": ["ab"], "reason": "r"});
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        v
    };
    assert!(refused("select", sel(json!({}))).contains("winner"));
    assert!(refused("select", sel(json!({"winner": "ab", "rule": "min"}))).contains("not both"));
    assert!(refused("select", sel(json!({"rule": "best", "metric": "output"}))).contains("min or max"));
    assert!(refused("select", sel(json!({"rule": "min"}))).contains("metric"));
    assert!(refused("select", sel(json!({"rule": "min", "metric": "file:rel"}))).contains("absolute"));
    match parse("select", sel(json!({"rule": "max", "metric": "file:/work/score"}))) {
        Ok(ToolArgs::Select { choice, .. }) => assert_eq!(
            choice,
            Choice::Rule {
                max: true,
                metric: Metric::File("/work/score".into())
            }
        ),
        other => panic!("{other:?}"),
    }
    assert!(refused("stage_status", Value::Null).contains("handle"));
    assert!(matches!(parse("rm_rf", json!({})), Err(ToolError::UnknownTool(_))));
    assert!(refused("dlq", json!({"action": "retry"})).contains("id"));
    assert!(refused("dlq", json!({"action": "retry", "id": "ab"})).contains("reason"));
    assert!(refused("dlq", json!({"action": "drop"})).contains("list or retry"));
    let exec = json!({"session": "s1", "argv": ["true"], "reason": "r"});
    assert!(matches!(parse("exec", exec), Ok(ToolArgs::Exec { .. })));
    assert!(refused("exec", json!({"session": "../s", "argv": ["true"], "reason": "r"})).contains("session"));
    assert!(refused("exec", json!({"session": "s", "argv": [], "reason": "r"})).contains("argv"));
    assert!(refused(
        "exec",
        json!({"session": "s", "argv": ["x"], "timeout_secs": 0, "reason": "r"})
    )
    .contains("timeout"));
    assert!(refused(
        "write_file",
        json!({"session": "s", "path": "/", "content": "", "reason": "r"})
    )
    .contains("file"));
}

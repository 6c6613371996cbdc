//! End-to-end: decide stages, through the CLI, with real sandboxes and a
//! scripted model server speaking Anthropic's Messages API on loopback.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cairn_testkit::model_server::ScriptedModel;
use common::{skip, stderr, stdout, Home};
use serde_json::{json, Value};

/// A cairn command with a key for the scripted model (it checks one is sent).
fn cairn(home: &Home, args: &[&str]) -> Command {
    let mut c = home.command(args);
    c.env("ANTHROPIC_API_KEY", "sk-ant-test");
    c
}

fn output(home: &Home, args: &[&str]) -> std::process::Output {
    cairn(home, args).output().unwrap()
}

fn write(home: &Home, name: &str, text: &str) -> String {
    let path = home.path().join(name);
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

fn show(home: &Home, run: &str) -> Value {
    serde_json::from_str(&home.ok(&["pipeline", "show", run, "--json"])).unwrap()
}

fn events<'a>(v: &'a Value, kind: &str) -> Vec<&'a Value> {
    v["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == kind)
        .collect()
}

fn rows<'a>(v: &'a Value, stage: &str) -> Vec<&'a Value> {
    v["stages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["stage"] == stage)
        .collect()
}

/// A pipeline whose decide stage `choose` picks the hypotheses of `fit`
/// (each with a force field and a weight) and the `scale` parameter.
fn branching(model: &ScriptedModel, fit_cmd: &str) -> String {
    format!(
        r#"
[pipeline]
name = "decided"
image = "busybox"
model = {{ provider = "anthropic", model = "claude-test", base_url = "{url}", retries = 1 }}

[params]
tag = "t"
scale = "1"

[[stage]]
name = "measure"
key = "measure-{{params.tag}}"
run = ["echo energy 42.5 after minimisation"]

[[stage]]
name = "choose"
after = "measure"
key = "choose-{{params.tag}}"
decide = {{ prompt = "Pick force fields worth a full fit.", choose = ["hypotheses", "params"] }}

[[stage]]
name = "fit"
after = "choose"
key = "fit-{{params.tag}}-{{params.scale}}-{{hypothesis}}"
run = ["{fit_cmd}", "echo {{hypothesis.ff}}; expr {{hypothesis.weight}} \\* {{params.scale}} > /m"]
[stage.branches]
select = "min"
metric = "file:/m"
"#,
        url = model.url()
    )
}

fn three_hypotheses() -> Value {
    json!({
        "name": "decide",
        "arguments": {
            "reason": "charmm minimised lowest; amber and opls bracket it",
            "hypotheses": [
                {"name": "amber", "ff": "amber99", "weight": "3"},
                {"name": "charmm", "ff": "charmm36", "weight": "1"},
                {"name": "opls", "ff": "oplsaa", "weight": "2"}
            ],
            "params": {"scale": "5"}
        }
    })
}

fn tag() -> String {
    format!("t{}", std::process::id())
}

#[test]
fn a_decide_stage_chooses_three_hypotheses_that_the_next_stage_runs_as_a_branch_group() {
    if skip("a_decide_stage_chooses_three_hypotheses_that_the_next_stage_runs_as_a_branch_group") {
        return;
    }
    let home = Home::new();
    // The first answer is invalid (one hypothesis, without a weight): it
    // is sent back with the error, and the second is accepted.
    let model = ScriptedModel::start(json!({"turns": [
        {"tool_calls": [{"name": "decide", "arguments": {"reason": "one", "hypotheses": [{"name": "amber", "ff": "amber99"}], "params": {}}}]},
        {"tool_calls": [three_hypotheses()]}
    ]}));
    let file = write(&home, "d.toml", &branching(&model, "true"));
    let out = output(&home, &["pipeline", "run", &file, "--param", &format!("tag={}", tag())]);
    assert!(out.status.success(), "{}", stderr(&out));
    let run = stdout(&out).trim().to_string();
    let v = show(&home, &run);
    assert_eq!(v["run"]["status"], "completed", "{v}");
    let mut branches: Vec<&str> = rows(&v, "fit")
        .iter()
        .filter_map(|r| r["branch"].as_str())
        .filter(|b| !b.is_empty())
        .collect();
    branches.sort();
    assert_eq!(branches, ["amber", "charmm", "opls"]);
    // charmm wins under min: 1 * scale, the scale the model chose (5).
    let won = events(&v, "won");
    assert_eq!(won.len(), 1);
    assert_eq!(won[0]["detail"], "charmm won under min with 5; runner-up opls with 10");
    assert_eq!(
        (won[0]["branch"].as_str(), won[0]["data"]["runner_up"].as_str()),
        (Some("charmm"), Some("opls"))
    );
    assert_eq!(home.ok(&["logs", &run, "fit.opls"]), "oplsaa");
    // One decision, recorded with its model, reason, tokens and calls.
    let d = &v["decisions"];
    assert_eq!(d.as_array().unwrap().len(), 1, "{d}");
    assert_eq!(d[0]["model"], "anthropic/claude-test");
    assert_eq!(d[0]["calls"], 2);
    assert_eq!(d[0]["answer"]["params"]["scale"], "5");
    assert!(d[0]["input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(d[0]["reason"], "charmm minimised lowest; amber and opls bracket it");
    // The lineage's `decided` event carries the model's reason as a field.
    let decided = events(&v, "decided");
    assert_eq!(decided.len(), 1, "{v}");
    assert_eq!(
        (
            decided[0]["data"]["reason"].as_str(),
            decided[0]["data"]["model"].as_str()
        ),
        (
            Some("charmm minimised lowest; amber and opls bracket it"),
            Some("anthropic/claude-test")
        )
    );
    let tree = home.ok(&["pipeline", "show", &run]);
    assert!(
        tree.contains("◇ decision 1 by anthropic/claude-test: hypotheses amber, charmm, opls; params scale=5"),
        "{tree}"
    );
    // What the model was told, and what it was told was wrong.
    let requests = model.requests();
    assert_eq!(requests.len(), 2);
    let first = requests[0].body.to_string();
    assert!(first.contains("Pick force fields worth a full fit."), "{first}");
    assert!(
        first.contains("energy 42.5 after minimisation"),
        "the log's tail: {first}"
    );
    assert!(
        first.contains("{hypothesis.weight}"),
        "the next stage's definition: {first}"
    );
    let second = requests[1].body.to_string();
    assert!(second.contains("give 2 to 16 hypotheses, not 1"), "{second}");
    assert!(model.violations().is_empty(), "{:?}", model.violations());

    // Another run with the same decide key reuses the decision: no call.
    let out = output(&home, &["pipeline", "run", &file, "--param", &format!("tag={}", tag())]);
    assert!(out.status.success(), "{}", stderr(&out));
    let again = show(&home, stdout(&out).trim());
    let reused: Vec<&str> = events(&again, "reused")
        .iter()
        .filter_map(|e| e["stage"].as_str())
        .collect();
    assert!(reused.contains(&"choose") && reused.contains(&"measure"), "{again}");
    assert_eq!(again["decisions"][0]["calls"], 0);
    assert_eq!(model.requests().len(), 2, "the model is not asked again");
}

#[test]
fn invalid_answers_send_the_decide_stage_to_the_dead_letters_and_a_dlq_retry_asks_again() {
    if skip("invalid_answers_send_the_decide_stage_to_the_dead_letters_and_a_dlq_retry_asks_again") {
        return;
    }
    let home = Home::new();
    let model = ScriptedModel::start(json!({"turns": [
        {"text": "I think charmm."},
        {"tool_calls": [{"name": "decide", "raw_arguments": "{not json"}]},
        {"tool_calls": [{"name": "decide", "arguments": {"reason": "r", "hypotheses": [
            {"name": "a", "ff": "x", "weight": "1"}, {"name": "b", "ff": "y", "weight": "2"}],
            "params": {"temperature": "300"}}}]}
    ]}));
    let file = write(&home, "d.toml", &branching(&model, "true"));
    let out = output(&home, &["pipeline", "run", &file, "--param", &format!("tag={}", tag())]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let run = stdout(&out).trim().to_string();
    let v = show(&home, &run);
    assert_eq!(v["run"]["status"], "failed");
    assert_eq!(rows(&v, "choose")[0]["status"], "dead");
    assert!(rows(&v, "fit").is_empty(), "nothing after it ran");
    let dlq: Value = serde_json::from_str(&home.ok(&["dlq", "ls", "--json"])).unwrap();
    assert_eq!(dlq.as_array().unwrap().len(), 1);
    assert_eq!(dlq[0]["stage"], "choose");
    let error = dlq[0]["error"].as_str().unwrap();
    assert!(
        error.contains("no valid decision in 3 calls") && error.contains("\"temperature\" is not a parameter"),
        "{error}"
    );
    assert_eq!(model.requests().len(), 3, "two retries, no more");
    assert!(model.violations().is_empty(), "{:?}", model.violations());
    assert!(v["decisions"].as_array().unwrap().is_empty());

    // Retried from the dead letters, the stage asks again: here a better
    // model, named on the command line.
    let better = ScriptedModel::start(json!({"turns": [{"tool_calls": [three_hypotheses()]}]}));
    let dl = dlq[0]["id"].as_str().unwrap();
    let out = cairn(&home, &["dlq", "retry", dl, "--base-url", &better.url()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let v = show(&home, &run);
    assert_eq!(v["run"]["status"], "completed", "{v}");
    assert_eq!(v["decisions"].as_array().unwrap().len(), 1);
    assert_eq!(
        events(&v, "won")[0]["detail"],
        "charmm won under min with 5; runner-up opls with 10"
    );
    assert_eq!(events(&v, "won")[0]["data"]["branch"], "charmm");
    assert_eq!((model.requests().len(), better.requests().len()), (3, 1));
}

#[test]
fn an_outage_leaves_the_run_interrupted_and_resume_asks_again() {
    if skip("an_outage_leaves_the_run_interrupted_and_resume_asks_again") {
        return;
    }
    let home = Home::new();
    // Two failures: the first call and its one retry (retries = 1).
    let model = ScriptedModel::start(json!({"turns": [
        {"tool_calls": [three_hypotheses()], "fail": [{"status": 503}, {"status": 500}]}
    ]}));
    let file = write(&home, "d.toml", &branching(&model, "true"));
    let out = output(&home, &["pipeline", "run", &file, "--param", &format!("tag={}", tag())]);
    assert_eq!(out.status.code(), Some(125), "an error of cairn's: {}", stderr(&out));
    let run = stdout(&out).trim().to_string();
    assert!(
        stderr(&out).contains(&format!("cairn pipeline resume {run}")),
        "{}",
        stderr(&out)
    );
    let runs: Value = serde_json::from_str(&home.ok(&["pipeline", "ls", "--json"])).unwrap();
    assert_eq!(runs[0]["interrupted"], true, "{runs}");
    let v = show(&home, &run);
    assert_eq!(events(&v, "model-unavailable").len(), 1);
    assert_eq!(rows(&v, "measure")[0]["status"], "completed");
    assert!(home.ps().is_empty(), "nothing is left running: {:?}", home.ps());
    assert_eq!(model.requests().len(), 2);

    let out = output(&home, &["pipeline", "resume", &run]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v = show(&home, &run);
    assert_eq!(v["run"]["status"], "completed");
    assert_eq!(
        events(&v, "forked").iter().filter(|e| e["stage"] == "measure").count(),
        1,
        "measure ran once"
    );
    assert_eq!(model.requests().len(), 3);
    assert!(model.violations().is_empty(), "{:?}", model.violations());
}

#[test]
fn a_decision_recorded_before_a_kill_is_not_asked_for_again() {
    if skip("a_decision_recorded_before_a_kill_is_not_asked_for_again") {
        return;
    }
    let home = Home::new();
    let model = ScriptedModel::start(json!({"turns": [{"tool_calls": [three_hypotheses()]}]}));
    let file = write(&home, "d.toml", &branching(&model, "sleep 2"));
    let mut child = cairn(&home, &["pipeline", "run", &file, "--param", &format!("tag={}", tag())])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    let run = loop {
        assert!(Instant::now() < deadline, "the branches never started");
        let runs: Value = serde_json::from_str(&home.ok(&["pipeline", "ls", "--json"])).unwrap();
        if let Some(id) = runs[0]["id"].as_str() {
            let v = show(&home, id);
            if rows(&v, "fit").iter().any(|r| r["status"] == "running") {
                break id.to_string();
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(model.requests().len(), 1);
    let out = output(&home, &["pipeline", "resume", &run]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v = show(&home, &run);
    assert_eq!(v["run"]["status"], "completed", "{v}");
    assert_eq!(
        model.requests().len(),
        1,
        "the recorded decision was applied, not asked for"
    );
    assert_eq!(v["decisions"].as_array().unwrap().len(), 1);
    assert_eq!(
        events(&v, "won")[0]["detail"],
        "charmm won under min with 5; runner-up opls with 10"
    );
    assert_eq!(events(&v, "won")[0]["data"]["branch"], "charmm");
}

#[test]
fn a_decision_to_retry_runs_the_stage_before_again_until_the_limit_then_dead_letters_it() {
    if skip("a_decision_to_retry_runs_the_stage_before_again_until_the_limit_then_dead_letters_it") {
        return;
    }
    let home = Home::new();
    let model = ScriptedModel::start(json!({"turns": [
        {"tool_calls": [{"name": "decide", "arguments": {"action": "retry", "reason": "the energy did not converge"}}]}
    ]}));
    let text = format!(
        r#"
[pipeline]
name = "judged"
image = "busybox"
model = {{ provider = "anthropic", model = "claude-test", base_url = "{}" }}

[[stage]]
name = "measure"
key = "judged-measure-{}"
run = ["echo attempt $CAIRN_ATTEMPT"]

[[stage]]
name = "judge"
after = "measure"
key = "judged-judge"
decide = {{ prompt = "Did it converge?", choose = ["retry-or-dlq"] }}

[[stage]]
name = "report"
after = "judge"
key = "judged-report"
run = ["echo report"]
"#,
        model.url(),
        tag()
    );
    let file = write(&home, "j.toml", &text);
    let out = output(&home, &["pipeline", "run", &file]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let run = stdout(&out).trim().to_string();
    let v = show(&home, &run);
    // Two retries asked for and run; the third request sends it to the DLQ.
    assert_eq!(model.requests().len(), 3);
    assert_eq!(v["decisions"].as_array().unwrap().len(), 3);
    let log = home.ok(&["logs", &run, "measure"]);
    assert_eq!(log.lines().count(), 3, "measure ran three times: {log}");
    assert_eq!(rows(&v, "measure")[0]["status"], "dead");
    assert!(rows(&v, "report").is_empty());
    let dlq: Value = serde_json::from_str(&home.ok(&["dlq", "ls", "--json"])).unwrap();
    assert_eq!(dlq[0]["stage"], "measure");
    assert!(
        dlq[0]["error"]
            .as_str()
            .unwrap()
            .contains("asked for a retry after 2 already"),
        "{dlq}"
    );
    assert!(v["run"]["error"].as_str().unwrap().contains("dead-letter queue"), "{v}");

    // Retried from the dead letters, the stage runs again and the count of
    // retries starts again: two more, then the dead letters again.
    let dl = dlq[0]["id"].as_str().unwrap();
    let out = cairn(&home, &["dlq", "retry", dl]).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_eq!(model.requests().len(), 6);
    assert_eq!(home.ok(&["logs", &run, "measure"]).lines().count(), 6);
    let dlq: Value = serde_json::from_str(&home.ok(&["dlq", "ls", "--json"])).unwrap();
    assert_eq!(dlq.as_array().unwrap().len(), 2);
    assert!(rows(&show(&home, &run), "report").is_empty());
}

#[test]
fn a_decide_stage_asks_an_openai_compatible_model_too() {
    if skip("a_decide_stage_asks_an_openai_compatible_model_too") {
        return;
    }
    let home = Home::new();
    let model = ScriptedModel::start(json!({"turns": [
        {"tool_calls": [{"name": "decide", "arguments": {"action": "continue", "reason": "it converged"}}]}
    ]}));
    let text = format!(
        r#"
[pipeline]
name = "judged"
image = "busybox"

[[stage]]
name = "measure"
key = "openai-measure-{}"
run = ["echo converged"]

[[stage]]
name = "judge"
after = "measure"
key = "openai-judge-{}"
decide = {{ prompt = "Did it converge?", choose = ["retry-or-dlq"] }}

[[stage]]
name = "report"
after = "judge"
key = "openai-report-{}"
run = ["echo report"]
"#,
        tag(),
        tag(),
        tag()
    );
    let file = write(&home, "o.toml", &text);
    // No model in the file: refused before anything is recorded or runs.
    let out = cairn(&home, &["pipeline", "run", &file]).output().unwrap();
    assert_eq!(out.status.code(), Some(125), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("decide stage judge needs a model") && stderr(&out).contains("--provider"),
        "{}",
        stderr(&out)
    );
    assert_eq!(home.ok(&["pipeline", "ls", "--json"]), "[]");
    // A provider's own endpoint without its key is refused too.
    let out = home
        .command(&["pipeline", "run", &file, "--provider", "openai", "--model", "gpt-test"])
        .env_remove("OPENAI_API_KEY")
        .output()
        .unwrap();
    assert!(stderr(&out).contains("OPENAI_API_KEY is not set"), "{}", stderr(&out));
    assert_eq!(home.ok(&["pipeline", "ls", "--json"]), "[]");
    // The flags name the model.
    let url = format!("{}/v1", model.url());
    let args = ["--provider", "openai", "--model", "gpt-test", "--base-url", &url];
    let out = cairn(&home, &[&["pipeline", "run", &file][..], &args[..]].concat())
        .env("OPENAI_API_KEY", "sk-test")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let run = stdout(&out).trim().to_string();
    let v = show(&home, &run);
    assert_eq!(v["run"]["status"], "completed");
    assert_eq!(v["decisions"][0]["model"], "openai/gpt-test");
    assert_eq!(v["decisions"][0]["answer"]["action"], "continue");
    assert_eq!(home.ok(&["logs", &run, "report"]), "report");
    let requests = model.requests();
    assert_eq!((requests.len(), requests[0].provider), (1, "openai"));
    assert!(model.violations().is_empty(), "{:?}", model.violations());
}

#[test]
fn a_person_approves_before_the_model_is_asked_and_before_its_branches_run() {
    if skip("a_person_approves_before_the_model_is_asked_and_before_its_branches_run") {
        return;
    }
    let home = Home::new();
    let model = ScriptedModel::start(json!({"turns": [{"tool_calls": [three_hypotheses()]}]}));
    let text = branching(&model, "true")
        .replace(
            "key = \"choose-{params.tag}\"\n",
            "key = \"choose-{params.tag}\"\napprove = true\n",
        )
        .replace(
            "key = \"fit-{params.tag}-{params.scale}-{hypothesis}\"\n",
            "key = \"fit-{params.tag}-{params.scale}-{hypothesis}\"\napprove = true\n",
        );
    assert_eq!(text.matches("approve = true").count(), 2);
    let file = write(&home, "a.toml", &text);
    let out = output(&home, &["pipeline", "run", &file, "--param", &format!("tag={}", tag())]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let run = stdout(&out).trim().to_string();
    assert!(model.requests().is_empty(), "nobody approved asking the model yet");

    let out = cairn(&home, &["pipeline", "approve", &run, "choose", "--reason", "budget ok"])
        .env("USER", "erin")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "it stops again before fit: {}",
        stderr(&out)
    );
    assert!(
        stderr(&out).contains(&format!("cairn pipeline approve {run} fit")),
        "{}",
        stderr(&out)
    );
    assert_eq!(model.requests().len(), 1);
    let tree = home.ok(&["pipeline", "show", &run]);
    assert!(
        tree.contains("◇ decision 1") && tree.contains("awaiting approval of stage fit"),
        "{tree}"
    );
    let v = show(&home, &run);
    let fit = rows(&v, "fit");
    assert_eq!(fit.len(), 1, "no branch started: {v}");
    assert_eq!(
        (fit[0]["branch"].as_str(), fit[0]["status"].as_str()),
        (Some(""), Some("awaiting_approval"))
    );

    let out = cairn(&home, &["pipeline", "approve", &run, "fit"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let v = show(&home, &run);
    assert_eq!(v["run"]["status"], "completed");
    assert_eq!(
        events(&v, "won")[0]["detail"],
        "charmm won under min with 5; runner-up opls with 10"
    );
    assert_eq!(events(&v, "won")[0]["data"]["branch"], "charmm");
    assert_eq!(model.requests().len(), 1, "approving fit did not ask again");
    let approved: Vec<&str> = events(&v, "approved")
        .iter()
        .filter_map(|e| e["detail"].as_str())
        .collect();
    assert_eq!(approved[0], "approved by erin: budget ok");
}

#[test]
fn the_decide_example_runs_with_the_model_choosing_the_sweep() {
    if skip("the_decide_example_runs_with_the_model_choosing_the_sweep") {
        return;
    }
    let home = Home::new();
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/decide-sweep.toml");
    let model = ScriptedModel::start(json!({"turns": [{"tool_calls": [{"name": "decide", "arguments": {
        "reason": "a 2 MB corpus: the smallest and the largest block, and one between",
        "hypotheses": [{"name": "size-1", "level": "1"}, {"name": "size-5", "level": "5"}, {"name": "size-9", "level": "9"}]}}]}]}));
    let run = |args: &[&str]| {
        home.command(args)
            .args(["--provider", "anthropic", "--base-url", &model.url()])
            .env("ANTHROPIC_API_KEY", "sk-test")
            .output()
            .unwrap()
    };
    let out = run(&["pipeline", "run", example]);
    assert_eq!(
        out.status.code(),
        Some(3),
        "waits at report: {}{}",
        stdout(&out),
        stderr(&out)
    );
    let runs: Value = serde_json::from_str(&home.ok(&["pipeline", "ls", "--json"])).unwrap();
    let id = runs[0]["id"].as_str().unwrap().to_string();
    let tree = home.ok(&["pipeline", "show", &id]);
    assert!(tree.contains("hypotheses size-1, size-5, size-9"), "{tree}");
    assert!(tree.contains("the smallest and the largest block"), "{tree}");
    let out = run(&["pipeline", "approve", &id, "report", "--reason", "sizes look right"]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let shown: Value = serde_json::from_str(&home.ok(&["pipeline", "show", &id, "--json"])).unwrap();
    assert_eq!(shown["run"]["status"], "completed");
    let won: Vec<&Value> = shown["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "won")
        .collect();
    assert_eq!(won.len(), 1);
    assert!(
        won[0]["detail"].as_str().unwrap().contains("size-9"),
        "block size 9 compresses best: {won:?}"
    );
    assert_eq!(model.requests().len(), 1, "the model is asked once");
    assert!(model.violations().is_empty(), "{:?}", model.violations());
}

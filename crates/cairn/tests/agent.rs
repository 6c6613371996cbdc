//! End-to-end: `cairn agent` against a scripted model server on loopback
//! (cairn-testkit; its wire format is proven against the official SDKs by
//! tests/agent), driving real stages in real sandboxes.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use cairn_testkit::model_server::ScriptedModel;
use common::{skip, stderr, stdout, Home};
use serde_json::{json, Value};

const KEY: &str = "sk-test-0123456789-never-recorded";

/// `cairn agent ARGS` with the model at `model` through `provider`.
fn agent(home: &Home, model: &ScriptedModel, provider: &str, args: &[&str]) -> Command {
    let mut c = home.command(&["agent"]);
    c.args(args);
    if args.first() == Some(&"run") {
        let base = match provider {
            "openai" => format!("{}/v1", model.url()),
            _ => model.url(),
        };
        c.args([
            "--provider",
            provider,
            "--base-url",
            &base,
            "--retries",
            "2",
            "--backoff-ms",
            "20",
        ]);
    }
    c.env("ANTHROPIC_API_KEY", KEY).env("OPENAI_API_KEY", KEY);
    c
}

fn run(home: &Home, model: &ScriptedModel, provider: &str, args: &[&str]) -> Output {
    agent(home, model, provider, args).output().expect("run cairn agent")
}

fn show(home: &Home, name: &str) -> Value {
    serde_json::from_str(&home.ok(&["agent", "show", name, "--json"])).unwrap()
}

fn only_agent(home: &Home) -> String {
    let all: Value = serde_json::from_str(&home.ok(&["agent", "ls", "--json"])).unwrap();
    assert_eq!(all.as_array().unwrap().len(), 1, "{all}");
    all[0]["agent"].as_str().unwrap().to_string()
}

fn run_json(home: &Home, run: &str) -> Value {
    serde_json::from_str(&home.ok(&["pipeline", "show", run, "--json"])).unwrap()
}

fn event_kinds(run: &Value) -> Vec<String> {
    run["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_string())
        .collect()
}

/// The turns a requests list asked for, in order.
fn turns(model: &ScriptedModel) -> Vec<usize> {
    model.requests().iter().map(|r| r.turn).collect()
}

/// plan → three parallel hypotheses → a winner by the smallest number
/// printed → one more stage on the winner → done.
fn sweep_script() -> Value {
    let fork = |h: &str, n: u32| {
        json!({"name": "fork_from", "arguments": {
            "snapshot_id": "{{results[0].snapshots[0].id}}", "hypothesis": h,
            "commands": [format!("mkdir -p /work && echo {h} > /work/level && sleep 1 && echo {n}")],
            "reason": format!("level {h} might compress best")}})
    };
    json!({"turns": [
        {"text": "I will try three levels in parallel.",
         "tool_calls": [{"name": "plan_stage", "arguments": {"context": "sweep levels a, b, c", "reason": "the goal names three"}}]},
        {"tool_calls": [fork("a", 30), fork("b", 10), fork("c", 20)]},
        {"tool_calls": [{"name": "select", "arguments": {
            "branches": ["{{results[1].handle}}", "{{results[2].handle}}", "{{results[3].handle}}"],
            "rule": "min", "metric": "output", "reason": "the smallest output is the best compression"}}]},
        {"tool_calls": [{"name": "run_stage", "arguments": {
            "snapshot_id": "{{results[4].output_snapshot}}", "commands": ["cat /work/level"],
            "reason": "confirm the winner's tree"}}]},
        {"text": "Level b won with 10.", "stop": "end_turn"}
    ]})
}

#[test]
fn a_model_forks_three_hypotheses_and_keeps_a_winner_with_its_reason() {
    if skip("a_model_forks_three_hypotheses_and_keeps_a_winner_with_its_reason") {
        return;
    }
    for provider in ["anthropic", "openai"] {
        let home = Home::new();
        let model = ScriptedModel::start(sweep_script());
        let out = run(
            &home,
            &model,
            provider,
            &["run", "--goal", "find the best level", "--json"],
        );
        assert!(out.status.success(), "{provider}: {}{}", stdout(&out), stderr(&out));
        let outcome: Value = serde_json::from_str(&stdout(&out)).unwrap();
        assert_eq!(outcome["status"], "completed", "{outcome}");
        assert_eq!(outcome["stages"], 4);
        assert_eq!(outcome["model_calls"], 5);
        assert!(model.violations().is_empty(), "{provider}: {:?}", model.violations());
        assert_eq!(turns(&model), vec![0, 1, 2, 3, 4], "each turn asked for once");

        let name = outcome["agent"].as_str().unwrap();
        let shown = show(&home, name);
        assert_eq!(shown["detail"], "Level b won with 10.");
        let rounds = shown["rounds"].as_array().unwrap();
        assert_eq!(rounds.len(), 5);
        let forks: Vec<String> = rounds[1]["calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["stage_run"].as_str().unwrap().to_string())
            .collect();
        let select: Value = serde_json::from_str(rounds[2]["calls"][0]["result"].as_str().unwrap()).unwrap();
        assert_eq!(
            select["winner"],
            forks[1].as_str(),
            "b printed the smallest number: {select}"
        );

        // The lineage carries who asked and why, beside each branch.
        let won = run_json(&home, &forks[1]);
        let detail = |run: &Value, kind: &str| {
            run["events"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["kind"] == kind)
                .map(|e| e["detail"].as_str().unwrap().to_string())
                .unwrap_or_default()
        };
        assert!(detail(&won, "won").contains("the smallest output is the best compression"));
        assert!(detail(&won, "won").contains(&format!("agent {name}")));
        assert!(detail(&won, "asked").contains("level b might compress best"));
        assert_eq!(detail(&won, "hypothesis"), "b");
        for lost in [&forks[0], &forks[2]] {
            assert!(detail(&run_json(&home, lost), "lost").contains(forks[1].as_str()));
        }
        // The last stage started from the winner's output.
        let last = rounds[3]["calls"][0]["stage_run"].as_str().unwrap();
        let final_run = run_json(&home, last);
        assert_eq!(final_run["stages"][0]["input_snapshot"], select["output_snapshot"]);
        let log = home.ok(&["logs", last, "stage"]);
        assert_eq!(log.trim(), "b");

        // Tokens and cost are recorded per reply; the key is nowhere.
        assert!(rounds.iter().all(|r| r["input_tokens"].as_u64().unwrap() > 0));
        assert!(
            shown["cost_usd"].as_f64().unwrap() > 0.0,
            "claude/gpt list prices apply: {shown}"
        );
        for f in std::fs::read_dir(home.path()).unwrap() {
            let f = f.unwrap().path();
            if f.file_name().unwrap().to_string_lossy().starts_with("state.db") {
                let bytes = std::fs::read(&f).unwrap();
                assert!(
                    !bytes.windows(KEY.len()).any(|w| w == KEY.as_bytes()),
                    "the API key is in {f:?}"
                );
            }
        }
        assert!(!stderr(&out).contains(KEY) && !shown.to_string().contains(KEY));
    }
}

#[test]
fn a_malformed_tool_call_gets_an_error_the_model_recovers_from() {
    if skip("a_malformed_tool_call_gets_an_error_the_model_recovers_from") {
        return;
    }
    let home = Home::new();
    let model = ScriptedModel::start(json!({"turns": [
        {"tool_calls": [{"name": "plan_stage", "arguments": {"context": "c", "reason": "r"}}]},
        {"tool_calls": [{"name": "run_stage", "raw_arguments": "{\"snapshot_id\": oops"}]},
        {"tool_calls": [{"name": "run_stage", "arguments": {"commands": ["true"], "reason": "no snapshot"}}]},
        {"tool_calls": [{"name": "explode", "arguments": {"reason": "r"}}]},
        {"tool_calls": [{"name": "run_stage", "arguments": {
            "snapshot_id": "{{results[0].snapshots[0].id}}", "commands": ["echo fixed"], "reason": "corrected"}}]},
        {"text": "Recovered."}
    ]}));
    let out = run(&home, &model, "openai", &["run", "--goal", "g", "--model", "gpt-4.1"]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(model.violations().is_empty(), "{:?}", model.violations());
    let shown = show(&home, &only_agent(&home));
    let rounds = shown["rounds"].as_array().unwrap();
    let result = |i: usize| {
        let c = &rounds[i]["calls"][0];
        (
            c["is_error"].as_bool().unwrap(),
            c["result"].as_str().unwrap().to_string(),
        )
    };
    let (err, text) = result(1);
    assert!(err && text.contains("not JSON"), "{text}");
    let (err, text) = result(2);
    assert!(
        err && text.contains("snapshot_id") && text.contains("input schema"),
        "{text}"
    );
    let (err, text) = result(3);
    assert!(err && text.contains("unknown tool"), "{text}");
    let (err, text) = result(4);
    assert!(!err && text.contains("\"completed\""), "{text}");
    // The model saw each error in the next request, as a tool message.
    let req = model.requests().into_iter().find(|r| r.turn == 2).unwrap().body;
    let tool_msgs: Vec<&Value> = req["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .collect();
    assert!(tool_msgs.last().unwrap()["content"]
        .as_str()
        .unwrap()
        .contains("not JSON"));
    assert_eq!(shown["stages"], 1, "only the corrected call started a stage");
}

#[test]
fn an_outage_pauses_the_agent_and_resume_continues_without_asking_twice() {
    if skip("an_outage_pauses_the_agent_and_resume_continues_without_asking_twice") {
        return;
    }
    let home = Home::new();
    // Turn 1 meets a 429 with retry-after, a reply slower than the call's
    // timeout and a 503: three attempts, the first run's all, so it pauses.
    // The resume meets a 500, then the reply.
    let model = ScriptedModel::start(json!({"turns": [
        {"tool_calls": [{"name": "plan_stage", "arguments": {"context": "c", "reason": "r"}}]},
        {"tool_calls": [{"name": "run_stage", "arguments": {
            "snapshot_id": "{{results[0].snapshots[0].id}}", "commands": ["echo one"], "reason": "r"}}],
         "fail": [{"status": 429, "retry_after": 1}, {"delay_ms": 2500}, {"status": 503}, {"status": 500}]},
        {"text": "done"}
    ]}));
    let count = |turn: usize| turns(&model).iter().filter(|t| **t == turn).count();
    let out = run(&home, &model, "anthropic", &["run", "--goal", "g", "--timeout", "1"]);
    assert_eq!(out.status.code(), Some(75), "paused: {}{}", stdout(&out), stderr(&out));
    assert!(stdout(&out).contains("unavailable") && stdout(&out).contains("agent resume"));
    assert!(
        stderr(&out).contains("retrying"),
        "each retry is reported: {}",
        stderr(&out)
    );
    let name = only_agent(&home);
    let shown = show(&home, &name);
    assert_eq!(shown["status"], "paused");
    assert_eq!(shown["rounds"].as_array().unwrap().len(), 1, "the first reply is kept");
    assert!(
        stderr(&out).contains("timed out"),
        "the slow reply timed out: {}",
        stderr(&out)
    );
    // (The request the client gave up on is recorded as it arrived.)
    assert_eq!((count(0), count(1)), (1, 3));

    let out = run(&home, &model, "anthropic", &["resume", &name]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert_eq!(
        (count(0), count(1), count(2)),
        (1, 5, 1),
        "no recorded reply asked again"
    );
    let shown = show(&home, &name);
    assert_eq!(shown["status"], "completed");
    assert_eq!(shown["stages"], 1);
    assert!(model.violations().is_empty(), "{:?}", model.violations());
}

#[test]
fn the_budget_and_the_stage_limit_stop_the_agent_and_resume_raises_them() {
    if skip("the_budget_and_the_stage_limit_stop_the_agent_and_resume_raises_them") {
        return;
    }
    let home = Home::new();
    let mtok = json!({"input": 1_000_000, "output": 0});
    let stage = |n: u32| {
        json!({"name": "run_stage", "arguments": {
            "snapshot_id": "{{results[0].snapshots[0].id}}", "commands": [format!("echo {n}")], "reason": "r"}})
    };
    let model = ScriptedModel::start(json!({"turns": [
        {"tool_calls": [{"name": "plan_stage", "arguments": {"context": "c", "reason": "r"}}], "usage": mtok},
        {"tool_calls": [stage(1)], "usage": mtok},
        {"tool_calls": [stage(2), stage(3)]},
        {"tool_calls": [stage(4)]},
        {"text": "done"}
    ]}));
    // $1 per reply: the second reply brings the cost to $2, past $1.50,
    // so its call waits for more budget.
    let args = [
        "run",
        "--goal",
        "g",
        "--model",
        "local",
        "--price-in",
        "1",
        "--price-out",
        "0",
        "--budget-usd",
        "1.5",
    ];
    let out = run(&home, &model, "openai", &args);
    assert_eq!(out.status.code(), Some(3), "stopped: {}{}", stdout(&out), stderr(&out));
    let name = only_agent(&home);
    let shown = show(&home, &name);
    assert_eq!(shown["status"], "stopped");
    assert!(shown["detail"].as_str().unwrap().contains("budget"));
    assert_eq!(shown["stages"], 0, "the over-budget reply's stage did not start");
    assert!((shown["cost_usd"].as_f64().unwrap() - 2.0).abs() < 1e-9);

    // More budget, but a limit of one stage: the pending call runs, the
    // model gets its wrap-up rounds, its further stage calls are refused,
    // and the agent stops when it keeps asking for stages.
    let out = run(
        &home,
        &model,
        "openai",
        &["resume", &name, "--budget-usd", "10", "--max-stages", "1"],
    );
    assert_eq!(out.status.code(), Some(3), "{}{}", stdout(&out), stderr(&out));
    let shown = show(&home, &name);
    assert!(shown["detail"].as_str().unwrap().contains("stage limit"), "{shown}");
    assert_eq!(shown["stages"], 1);
    for (round, call) in [(2, 0), (2, 1), (3, 0)] {
        let c = &shown["rounds"][round]["calls"][call];
        assert_eq!(c["is_error"], true, "{c}");
        assert!(c["result"].as_str().unwrap().contains("stage limit"));
    }
    let note = model
        .requests()
        .into_iter()
        .find(|r| r.turn == 2)
        .unwrap()
        .body
        .to_string();
    assert!(note.contains("The stage limit is reached"), "the model is told: {note}");
    assert_eq!(turns(&model), vec![0, 1, 2, 3], "no reply asked for twice");
    let out = run(&home, &model, "openai", &["resume", &name, "--max-stages", "3"]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert_eq!(show(&home, &name)["status"], "completed");

    // Bad input is refused before anything is made.
    let out = run(
        &home,
        &model,
        "openai",
        &["run", "--goal", "g", "--model", "unpriced", "--budget-usd", "1"],
    );
    assert!(
        !out.status.success() && stderr(&out).contains("--price-in"),
        "{}",
        stderr(&out)
    );
    let out = run(&home, &model, "anthropic", &["run", "--goal", " "]);
    assert!(
        !out.status.success() && stderr(&out).contains("--goal"),
        "{}",
        stderr(&out)
    );
    assert_eq!(home.ps().len(), 0, "no sandbox left running");
}

#[test]
fn a_loop_killed_at_random_instants_resumes_without_a_stage_twice_or_a_reply_lost() {
    if skip("a_loop_killed_at_random_instants_resumes_without_a_stage_twice_or_a_reply_lost") {
        return;
    }
    let home = Home::new();
    let model = ScriptedModel::start(sweep_script());
    // Kill at spread instants until the loop completes; before each resume,
    // note how many replies the log holds: no later request may ask for one
    // of those again.
    let delays = [150u64, 400, 250, 600, 100, 350, 800, 200, 500, 300, 700, 120];
    let mut seen = 0;
    let mut name: Option<String> = None;
    let mut done = false;
    for (i, delay) in delays.iter().chain(std::iter::repeat(&60_000)).enumerate().take(24) {
        let recorded = match &name {
            Some(n) => show(&home, n)["rounds"].as_array().unwrap().len(),
            None => 0,
        };
        let before = model.requests().len();
        let mut child = match &name {
            None => agent(&home, &model, "anthropic", &["run", "--goal", "find the best level"]),
            Some(n) => agent(&home, &model, "anthropic", &["resume", n]),
        }
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_millis(*delay);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break Some(s);
            }
            if std::time::Instant::now() >= deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if status.is_none() {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGKILL,
            )
            .unwrap();
            child.wait().unwrap();
        }
        for r in &model.requests()[before..] {
            assert!(
                r.turn >= recorded,
                "attempt {i}: turn {} asked again after it was recorded",
                r.turn
            );
        }
        if name.is_none() {
            let all: Value = serde_json::from_str(&home.ok(&["agent", "ls", "--json"])).unwrap();
            name = all
                .as_array()
                .unwrap()
                .first()
                .map(|a| a["agent"].as_str().unwrap().to_string());
        }
        seen = i + 1;
        if let (None, Some(n)) = (&status, &name) {
            // Killed: no process drives it, unless the kill came after the
            // end was recorded (the loop was suspending its sandbox).
            let st = show(&home, n)["status"].clone();
            if st == "completed" {
                done = true;
                break;
            }
            assert_eq!(st, "interrupted", "attempt {i}: killed, so no process drives it");
        }
        if let Some(s) = status {
            assert!(s.success(), "attempt {i} ended with {s}");
            done = true;
            break;
        }
    }
    assert!(done, "the loop did not complete in {seen} attempts");
    let name = name.unwrap();
    let shown = show(&home, &name);
    assert_eq!(shown["status"], "completed", "{shown}");
    let rounds = shown["rounds"].as_array().unwrap();
    let ids: Vec<u64> = rounds.iter().map(|r| r["seq"].as_u64().unwrap()).collect();
    assert_eq!(rounds.len(), 5, "one recorded reply per turn: {ids:?}");
    assert_eq!(shown["stages"], 4);
    // Exactly the four runs the calls named, each completed once.
    let runs: Value = serde_json::from_str(&home.ok(&["pipeline", "ls", "--json"])).unwrap();
    assert_eq!(runs.as_array().unwrap().len(), 4, "{runs}");
    for r in runs.as_array().unwrap() {
        let run = run_json(&home, r["id"].as_str().unwrap());
        // A stage completes once: re-attached after a kill, never run again.
        let kinds = event_kinds(&run);
        let stage_completions = run["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["kind"] == "completed" && !e["stage"].is_null())
            .count();
        assert_eq!(stage_completions, 1, "{kinds:?}");
        assert_eq!(run["run"]["status"], "completed");
    }
    assert!(model.violations().is_empty(), "{:?}", model.violations());
    assert_eq!(home.ps().len(), 0, "no sandbox left running");
    eprintln!("completed after {seen} attempts; requests {:?}", turns(&model));
}

#[test]
fn the_example_pipeline_starts_an_agent_that_sweeps_its_corpus() {
    if skip("the_example_pipeline_starts_an_agent_that_sweeps_its_corpus") {
        return;
    }
    let home = Home::new();
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/agent-sweep.toml");
    let level = |n: u32| {
        json!({"name": "fork_from", "arguments": {
            "snapshot_id": "{{results[0].snapshots[0].id}}", "hypothesis": format!("bzip2-{n}"),
            "commands": [format!("bzip2 -c -{n} /work/corpus.txt | wc -c")], "reason": format!("block size {n}")}})
    };
    let model = ScriptedModel::start(json!({"turns": [
        {"tool_calls": [{"name": "plan_stage", "arguments": {"context": "sweep 1, 5, 9", "reason": "extremes and middle"}}]},
        {"tool_calls": [level(1), level(5), level(9)]},
        {"tool_calls": [{"name": "select", "arguments": {
            "branches": ["{{results[1].handle}}", "{{results[2].handle}}", "{{results[3].handle}}"],
            "rule": "min", "metric": "output", "reason": "smallest compressed size"}}]},
        {"text": "Block size 9 compresses best."}
    ]}));
    let out = run(
        &home,
        &model,
        "anthropic",
        &["run", "--goal", "sweep", "--pipeline", example, "--json"],
    );
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let shown = show(&home, &only_agent(&home));
    let corpus_run = shown["pipeline_run"].as_str().unwrap();
    let corpus = run_json(&home, corpus_run);
    assert_eq!(corpus["run"]["pipeline"], "agent-sweep");
    // The model planned against the corpus stage's output.
    assert_eq!(shown["base_snapshots"][0], corpus["stages"][0]["output_snapshot"]);
    let rounds = shown["rounds"].as_array().unwrap();
    let plan: Value = serde_json::from_str(rounds[0]["calls"][0]["result"].as_str().unwrap()).unwrap();
    assert_eq!(plan["snapshots"][0]["id"], shown["base_snapshots"][0]);
    let sizes: Vec<u64> = rounds[1]["calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            home.ok(&["logs", c["stage_run"].as_str().unwrap(), "fork"])
                .trim()
                .parse()
                .unwrap()
        })
        .collect();
    assert!(sizes[2] < sizes[0], "block size 9 beats 1 on this corpus: {sizes:?}");
    let select: Value = serde_json::from_str(rounds[2]["calls"][0]["result"].as_str().unwrap()).unwrap();
    assert_eq!(select["winner"], rounds[1]["calls"][2]["stage_run"]);
    assert!(model.violations().is_empty(), "{:?}", model.violations());
}

#[test]
fn a_group_of_hypotheses_runs_as_one_stage_and_the_first_success_wins() {
    if skip("a_group_of_hypotheses_runs_as_one_stage_and_the_first_success_wins") {
        return;
    }
    let home = Home::new();
    let model = ScriptedModel::start(json!({"turns": [
        {"tool_calls": [{"name": "plan_stage", "arguments": {"context": "race three", "reason": "r"}}]},
        {"tool_calls": [{"name": "fork_from", "arguments": {
            "snapshot_id": "{{results[0].snapshots[0].id}}", "reason": "whichever finishes first",
            "hypotheses": [
                {"name": "slow", "commands": ["sleep 2; echo slow"]},
                {"name": "fast", "commands": ["echo fast"]},
                {"name": "broken", "commands": ["exit 1"]}]}}]},
        {"tool_calls": [{"name": "select", "arguments": {
            "handle": "{{results[1].handle}}", "rule": "first_success", "reason": "speed matters here"}}]},
        {"text": "fast won."}
    ]}));
    let out = run(
        &home,
        &model,
        "openai",
        &["run", "--goal", "g", "--json", "--max-stages", "1"],
    );
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let outcome: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(outcome["status"], "completed", "{outcome}");
    assert_eq!(outcome["stages"], 1, "a group is one stage");
    let shown = show(&home, outcome["agent"].as_str().unwrap());
    let rounds = shown["rounds"].as_array().unwrap();
    let group = rounds[1]["calls"][0]["stage_run"].as_str().unwrap();
    let select: Value = serde_json::from_str(rounds[2]["calls"][0]["result"].as_str().unwrap()).unwrap();
    assert_eq!(select["winner"], "fast", "{select}");
    let runs: Value = serde_json::from_str(&home.ok(&["pipeline", "ls", "--json"])).unwrap();
    assert_eq!(runs.as_array().unwrap().len(), 1, "three hypotheses, one run: {runs}");
    let won = run_json(&home, group);
    assert!(won["events"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["kind"] == "won" && e["detail"].as_str().unwrap().contains("speed matters here")));
    assert!(model.violations().is_empty(), "{:?}", model.violations());
}

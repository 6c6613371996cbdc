//! Pipeline commands: run, resume, ls, show, approve and reject, audit, dlq,
//! artifacts, stage logs.

use std::io::Write;

use anyhow::{bail, Context, Result};
use cairn_engine::tenants::Owned;
use cairn_engine::Engine;
use cairn_pipeline::records::RunRecord;
use cairn_pipeline::run::{parse_params, RunWatcher};

use cairn_pipeline::approval::{approve_command, Verdict, AWAITING};
use cairn_pipeline::prelude::*;

use crate::cli::{ArtifactCommand, DlqCommand, PipelineCommand, PipelineModelArgs, RunCommand, VerdictCommand};

/// Stage progress and a live tail of stage output, on stderr.
struct Progress;

impl RunWatcher for Progress {
    fn stage(&self, stage: &str, branch: &str, status: &str, detail: &str) {
        let name = if branch.is_empty() {
            stage.to_string()
        } else {
            format!("{stage}[{branch}]")
        };
        eprintln!("cairn: {name:<24} {status:<10} {detail}");
    }
    fn output(&self, stage: &str, branch: &str, data: &[u8]) {
        let name = if branch.is_empty() {
            stage.to_string()
        } else {
            format!("{stage}[{branch}]")
        };
        let mut err = std::io::stderr().lock();
        for line in String::from_utf8_lossy(data).lines() {
            let _ = writeln!(err, "  {name} | {line}");
        }
    }
}

pub fn pipeline(engine: &mut Engine, cmd: PipelineCommand) -> Result<i32> {
    let run = match cmd {
        PipelineCommand::Run {
            file,
            params,
            check,
            model,
            queue,
        } => {
            set_model(engine, &model);
            let params = parse_params(&params)?;
            if check {
                let text = cairn_pipeline::spec::read_file(&file)
                    .with_context(|| format!("cannot read {}", file.display()))?;
                let p = cairn_pipeline::parse(&file.display().to_string(), &text, &params)?;
                eprintln!(
                    "cairn: {} is a valid pipeline of {} stages",
                    file.display(),
                    p.stages.len()
                );
                return Ok(0);
            }
            let run = engine.start_run(&file, &params)?;
            eprintln!("cairn: run {} of {}", run.id, run.pipeline);
            println!("{}", run.id);
            if queue.queue {
                return queued(engine, &run.id, queue.detach);
            }
            engine.execute_run(&run.id, &Progress)?
        }
        PipelineCommand::Resume { run, model, queue } => {
            set_model(engine, &model);
            let run = engine.run_record(&run)?;
            if queue.queue {
                return queued(engine, &run.id, queue.detach);
            }
            eprintln!("cairn: resuming run {}", run.id);
            engine.execute_run(&run.id, &Progress)?
        }
        PipelineCommand::Ls { json } => return runs(engine, json).map(|()| 0),
        PipelineCommand::Show { run, json } => return show(engine, &run, json).map(|()| 0),
        PipelineCommand::Verdict(v) => return verdict(engine, v),
    };
    ended(engine, &run)
}

/// The spellings from before `cairn pipeline show|ls|approve|reject`: they
/// work, with a note saying what replaces them.
pub fn deprecated(engine: &mut Engine, cmd: RunCommand) -> Result<i32> {
    let (old, new) = match &cmd {
        RunCommand::Show { .. } => ("run show", "pipeline show"),
        RunCommand::Approve { .. } => ("run approve", "pipeline approve"),
        RunCommand::Reject { .. } => ("run reject", "pipeline reject"),
    };
    note_deprecated(old, new);
    match cmd {
        RunCommand::Show { run, json } => show(engine, &run, json).map(|()| 0),
        RunCommand::Approve {
            run,
            stage,
            reason,
            no_continue,
            model,
        } => verdict(
            engine,
            VerdictCommand::Approve {
                run,
                stage,
                reason,
                no_continue,
                model,
            },
        ),
        RunCommand::Reject { run, stage, reason } => verdict(engine, VerdictCommand::Reject { run, stage, reason }),
    }
}

/// Says on stderr that `cairn OLD` is now `cairn NEW`.
pub fn note_deprecated(old: &str, new: &str) {
    eprintln!("cairn: `cairn {old}` is deprecated and will be removed in the next release; use `cairn {new}`");
}

/// `cairn audit RUN`: each stage's time and bytes, then the advice.
pub fn audit(engine: &Engine, run: &str, json: bool, limits: &cairn_pipeline::audit::AuditLimits) -> Result<()> {
    use cairn_pipeline::audit::{bytes_words, duration_words};
    let a = engine.audit_run(run, limits)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&a)?);
        return Ok(());
    }
    let t = |ms: Option<u64>| ms.map(duration_words).unwrap_or_else(|| "-".into());
    let b = |n: Option<u64>| n.map(bytes_words).unwrap_or_else(|| "-".into());
    println!("run {} · {} · {}", a.run, a.pipeline, a.status);
    println!(
        "{:<24} {:<10} {:>4} {:>8} {:>8} {:>8} {:>8} {:>11} {:>10} {:>10} {:>8} {:>8}",
        "STAGE",
        "STATUS",
        "TRY",
        "SETUP",
        "COMPUTE",
        "RESTORE",
        "SNAPSHOT",
        "CHECKPOINTS",
        "STATE",
        "ARTIFACTS",
        "LOST",
        "SAVED"
    );
    for s in &a.stages {
        let name = if s.branch.is_empty() {
            s.stage.clone()
        } else {
            format!("{}[{}]", s.stage, s.branch)
        };
        let status = if s.reused { "reused" } else { &s.status };
        println!(
            "{:<24} {:<10} {:>4} {:>8} {:>8} {:>8} {:>8} {:>11} {:>10} {:>10} {:>8} {:>8}",
            name,
            status,
            s.attempts,
            t(s.setup_ms),
            t(s.compute_ms),
            t(s.restore_ms),
            t(s.snapshot_ms),
            format!("{} · {}", s.checkpoints, duration_words(s.checkpoint_ms)),
            b(s.state_bytes),
            bytes_words(s.artifact_bytes),
            t(s.lost_ms),
            duration_words(s.saved_ms)
        );
    }
    for n in &a.notes {
        println!("note: {n}");
    }
    if a.recommendations.is_empty() {
        println!("no advice: no stage computed over the time worth a snapshot without checkpoints, none carried large state as artifacts, and no branch group repeated a shared prefix");
    }
    for r in &a.recommendations {
        println!("advice ({}): {}", r.kind, r.advice);
    }
    Ok(())
}

/// Queues a run for the workers and, unless detached, follows its events
/// until it ends; exits like a run in this process.
fn queued(engine: &Engine, run: &str, detach: bool) -> Result<i32> {
    engine.enqueue_run(run)?;
    eprintln!("cairn: run {run} queued for `cairn worker`s");
    if detach {
        return Ok(0);
    }
    let rec = engine.follow_run(run, None, |e| {
        let name = match (e.stage.as_deref(), e.branch.as_deref()) {
            (Some(s), Some(b)) if !b.is_empty() => format!("{s}[{b}]"),
            (Some(s), _) => s.to_string(),
            _ => "run".to_string(),
        };
        eprintln!("cairn: {name:<24} {:<10} {}", e.kind, e.detail);
    })?;
    if !matches!(rec.status.as_str(), "completed" | "failed" | AWAITING) {
        eprintln!(
            "cairn: run {} is {} and no worker holds it; `cairn pipeline resume --queue {}` queues it again",
            rec.id, rec.status, rec.id
        );
        return Ok(1);
    }
    ended(engine, &rec)
}

fn set_model(engine: &mut Engine, m: &PipelineModelArgs) {
    engine.set_model_override(cairn_pipeline::spec::ModelSpec {
        provider: m.provider.clone(),
        model: m.model.clone(),
        base_url: m.base_url.clone(),
        retries: None,
    });
}

/// Exit status when a run waits for a person at a stage (`approve = true`).
pub const AWAITING_APPROVAL_EXIT: i32 = 3;

/// Says how a run ended (or where it waits) and gives the exit status:
/// 0 completed, 1 failed, 3 waiting for approval.
fn ended(engine: &Engine, run: &RunRecord) -> Result<i32> {
    if run.status == AWAITING {
        let stage = engine.awaiting_approval(&run.id)?.unwrap_or_default();
        eprintln!("cairn: run {} waits for approval of stage {stage}", run.id);
        eprintln!("cairn: to continue it, run: {}", approve_command(&run.id, &stage));
        eprintln!(
            "cairn: to fail it there, run: cairn pipeline reject {} {stage} --reason TEXT",
            run.id
        );
        return Ok(AWAITING_APPROVAL_EXIT);
    }
    eprintln!("cairn: run {} {}", run.id, run.status);
    if let Some(e) = &run.error {
        if e.contains("dead-letter") {
            eprintln!("cairn: {e}; `cairn dlq ls` shows it, `cairn dlq retry ID` runs it again");
        } else {
            eprintln!("cairn: {e}");
        }
    }
    Ok(if run.status == "completed" { 0 } else { 1 })
}

/// Who approves or rejects a stage: `$USER`, or the uid when it is unset.
fn who() -> String {
    std::env::var("USER")
        .ok()
        .filter(|u| !u.trim().is_empty())
        .unwrap_or_else(|| format!("uid {}", nix::unistd::getuid()))
}

/// `cairn pipeline approve|reject`: records the verdict, then (approved)
/// continues the run in the foreground.
fn verdict(engine: &mut Engine, cmd: VerdictCommand) -> Result<i32> {
    match cmd {
        VerdictCommand::Approve {
            run,
            stage,
            reason,
            no_continue,
            model,
        } => {
            set_model(engine, &model);
            let run = engine.decide_approval(&run, &stage, Verdict::Approve, &who(), reason.as_deref())?;
            eprintln!("cairn: stage {stage} of run {} approved", run.id);
            if no_continue {
                eprintln!("cairn: `cairn pipeline resume {}` continues the run", run.id);
                return Ok(0);
            }
            let run = engine.execute_run(&run.id, &Progress)?;
            ended(engine, &run)
        }
        VerdictCommand::Reject { run, stage, reason } => {
            let run = engine.decide_approval(&run, &stage, Verdict::Reject, &who(), Some(&reason))?;
            eprintln!("cairn: stage {stage} of run {} rejected; the run failed", run.id);
            Ok(0)
        }
    }
}

/// A run record as listed: with the pid of the process executing it, and
/// `interrupted` when it is recorded as running but nothing executes it
/// (its orchestrator died; `cairn pipeline resume` continues it).
#[derive(serde::Serialize)]
struct Listed<'a> {
    #[serde(flatten)]
    run: &'a RunRecord,
    orchestrator_pid: Option<u32>,
    /// The stage queue's job for the run, when it went through the queue:
    /// queued, or claimed by a worker (named) under a lease.
    queue: Option<cairn_pipeline::queue::Job>,
    interrupted: bool,
    /// The stage the run waits at for a person, and the command that continues it.
    awaiting_approval: Option<String>,
    approve_command: Option<String>,
}

impl Listed<'_> {
    fn of<'a>(engine: &Engine, run: &'a RunRecord) -> Listed<'a> {
        // Only a running run has an orchestrator (one starting sets the
        // status first thing).
        let orchestrator_pid = (run.status == "running")
            .then(|| engine.run_orchestrator(&run.id))
            .flatten();
        let queue = engine.queue_job(&run.id).ok().flatten();
        // A job waiting for a worker, or held under a live lease, executes it.
        let queued = queue
            .as_ref()
            .is_some_and(|j| j.status == "queued" || (j.status == "claimed" && j.lease_left_ms.is_some_and(|l| l > 0)));
        let awaiting_approval = (run.status == AWAITING)
            .then(|| engine.awaiting_approval(&run.id).ok().flatten())
            .flatten();
        Listed {
            run,
            orchestrator_pid,
            interrupted: run.status == "running" && orchestrator_pid.is_none() && !queued,
            queue,
            approve_command: awaiting_approval.as_deref().map(|s| approve_command(&run.id, s)),
            awaiting_approval,
        }
    }

    /// The status column: `interrupted` for a running run nothing executes.
    fn status(&self) -> &str {
        if self.interrupted {
            "interrupted"
        } else if self.run.status == "running" && self.queue.as_ref().is_some_and(|j| j.status == "queued") {
            "queued"
        } else {
            &self.run.status
        }
    }
}

pub fn runs(engine: &Engine, json: bool) -> Result<()> {
    let mut records = engine.runs()?;
    engine.keep_mine(Owned::Run, &mut records, |r| &r.id)?;
    let runs: Vec<Listed> = records.iter().map(|r| Listed::of(engine, r)).collect();
    if json {
        println!("{}", serde_json::to_string_pretty(&runs)?);
        return Ok(());
    }
    println!("{:<12}  {:<20}  {:<18}  FILE", "RUN", "PIPELINE", "STATUS");
    for r in &runs {
        println!(
            "{:<12}  {:<20}  {:<18}  {}",
            r.run.id,
            r.run.pipeline,
            r.status(),
            r.run.file
        );
    }
    if runs.iter().any(|r| r.interrupted) {
        eprintln!("cairn: an interrupted run's orchestrator is gone; `cairn pipeline resume RUN` continues it");
    }
    for r in runs.iter().filter(|r| r.run.status == AWAITING) {
        if let Some(stage) = &r.awaiting_approval {
            eprintln!(
                "cairn: run {} waits for approval of stage {stage}: {}",
                r.run.id,
                approve_command(&r.run.id, stage)
            );
        }
    }
    Ok(())
}

/// The lineage of a run as a tree: stages in order, branches under their
/// group, each with its attempts and events.
pub fn show(engine: &Engine, key: &str, json: bool) -> Result<()> {
    let run = engine.run_record(key)?;
    let stages = engine.run_stages(&run.id)?;
    let events = engine.run_events(&run.id)?;
    let artifacts = engine.artifacts(Some(&run.id))?;
    let decisions = engine.run_decisions(&run.id)?;
    let listed = Listed::of(engine, &run);
    // The edges as the API gives them: none when the stored file no longer parses.
    let graph = engine.run_graph(&run);
    let branch_diffs = branch_diffs(engine, &run.id, &stages);
    if json {
        let decisions: Vec<serde_json::Value> = decisions
            .iter()
            .map(|d| {
                let mut v = serde_json::to_value(d).expect("a record serialises");
                // The answer as data, not as the text it is stored in.
                v["answer"] = cairn_pipeline::decision::Answer::from_stored(&d.answer)
                    .map(|a| serde_json::to_value(a).expect("an answer serialises"))
                    .unwrap_or_else(serde_json::Value::String);
                v
            })
            .collect();
        let v = serde_json::json!({ "run": listed, "stages": stages, "events": events, "artifacts": artifacts, "decisions": decisions, "graph": graph, "branch_diffs": branch_diffs });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "run {} · {} · {}{}{}",
        run.id,
        run.pipeline,
        listed.status(),
        run.error.as_deref().map(|e| format!(" · {e}")).unwrap_or_default(),
        match (listed.orchestrator_pid, listed.interrupted, &listed.approve_command) {
            (Some(pid), _, _) => format!(" · executed by pid {pid}"),
            (None, false, None) if run.status == "running" && listed.queue.is_some() => {
                let job = listed.queue.as_ref().expect("checked");
                match &job.worker {
                    Some(w) if job.status == "claimed" => format!(" · executed by worker {w} (claim {})", job.epoch),
                    _ => " · waiting for a `cairn worker`".to_string(),
                }
            }
            (None, true, _) => format!(" · `cairn pipeline resume {}` continues it", run.id),
            (None, false, Some(cmd)) => format!(
                " · awaiting approval of stage {} · `{cmd}` continues it",
                listed.awaiting_approval.as_deref().unwrap_or_default()
            ),
            _ => String::new(),
        }
    );
    let mut names: Vec<&str> = Vec::new();
    for s in &stages {
        if !names.contains(&s.stage.as_str()) {
            names.push(&s.stage);
        }
    }
    // Each stage under the stage whose output it forks; without the
    // pipeline's edges (a file that no longer parses), one after another.
    let mut children: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    let mut roots = Vec::new();
    for name in &names {
        let parent = graph
            .iter()
            .flatten()
            .find(|e| e.stage == *name)
            .and_then(|e| e.after.first())
            .map(String::as_str)
            .filter(|p| names.contains(p) && p != name);
        match parent {
            Some(p) => children.entry(p).or_default().push(name),
            None => roots.push(*name),
        }
    }
    let tree = Tree {
        branch_diffs: &branch_diffs,
        stages: &stages,
        events: &events,
        artifacts: &artifacts,
        decisions: &decisions,
        children: &children,
    };
    for (i, name) in roots.iter().enumerate() {
        tree.print(name, "", i + 1 == roots.len());
    }
    Ok(())
}

/// How a losing branch's output differs from the winner's.
#[derive(serde::Serialize)]
struct BranchDiff {
    stage: String,
    winner: String,
    branch: String,
    added: u64,
    removed: u64,
    changed: u64,
    /// The command that shows the whole difference.
    command: String,
}

/// For each branch group with a winner, how each other branch with an
/// output differs from it (counts only: `cairn diff` shows the rest).
fn branch_diffs(engine: &Engine, run: &str, stages: &[cairn_pipeline::records::StageRecord]) -> Vec<BranchDiff> {
    let mut out = Vec::new();
    for group in stages.iter().filter(|s| s.branch.is_empty()) {
        let Some(won) = group.output_snapshot.as_deref() else {
            continue;
        };
        let of_group = || stages.iter().filter(|s| s.stage == group.stage && !s.branch.is_empty());
        let Some(winner) = of_group().find(|s| s.output_snapshot.as_deref() == Some(won)) else {
            continue;
        };
        for loser in of_group().filter(|s| s.branch != winner.branch) {
            let Some(lost) = loser.output_snapshot.as_deref() else {
                continue;
            };
            // Collected under the run's retention: the lineage says so.
            if engine.snapshot_record(lost).is_err() {
                continue;
            }
            let opts = cairn_engine::DiffOptions {
                text_max: 0,
                max_changes: 0,
                ..cairn_engine::DiffOptions::default()
            };
            match engine.diff(won, lost, &opts) {
                Ok(d) => out.push(BranchDiff {
                    stage: group.stage.clone(),
                    winner: winner.branch.clone(),
                    branch: loser.branch.clone(),
                    added: d.added,
                    removed: d.removed,
                    changed: d.changed,
                    command: format!(
                        "cairn diff {run}/{}.{} {run}/{}.{}",
                        group.stage, winner.branch, group.stage, loser.branch
                    ),
                }),
                Err(e) => {
                    tracing::warn!(run, stage = %group.stage, branch = %loser.branch, "no diff from the winner: {e}")
                }
            }
        }
    }
    out
}

/// A run's records, printed as a tree of stages.
struct Tree<'a> {
    branch_diffs: &'a [BranchDiff],
    stages: &'a [cairn_pipeline::records::StageRecord],
    events: &'a [cairn_pipeline::records::EventRecord],
    artifacts: &'a [cairn_pipeline::records::ArtifactRecord],
    decisions: &'a [cairn_pipeline::records::DecisionRecord],
    children: &'a std::collections::BTreeMap<&'a str, Vec<&'a str>>,
}

impl Tree<'_> {
    /// One stage: its summary, decisions, events, branches and artifacts,
    /// then the stages after it, one level in.
    fn print(&self, name: &str, prefix: &str, last: bool) {
        let (head, pad) = if last {
            (format!("{prefix}└─"), format!("{prefix}   "))
        } else {
            (format!("{prefix}├─"), format!("{prefix}│  "))
        };
        let stages = self.stages;
        let group = stages.iter().find(|s| s.stage == name && s.branch.is_empty());
        let summary = group
            .map(|g| {
                format!(
                    "{} · key {} · {} attempt(s){}",
                    g.status,
                    g.stage_key,
                    g.attempts,
                    g.output_snapshot
                        .as_deref()
                        .map(|o| format!(" · output {}", &o[..12]))
                        .unwrap_or_default()
                )
            })
            .unwrap_or_else(|| "branches".into());
        println!("{head} {name}: {summary}");
        for d in self.decisions.iter().filter(|d| d.stage == name) {
            let chosen = cairn_pipeline::decision::Answer::from_stored(&d.answer)
                .map(|a| a.summary())
                .unwrap_or_else(|e| e);
            println!(
                "{pad}  ◇ decision {} by {}: {chosen} — {} ({} tokens in, {} out, {} call(s))",
                d.round, d.model, d.reason, d.input_tokens, d.output_tokens, d.calls
            );
        }
        let stage_events: Vec<_> = self
            .events
            .iter()
            .filter(|e| e.stage.as_deref() == Some(name))
            .collect();
        let branches: Vec<&str> = {
            let mut b: Vec<&str> = stages
                .iter()
                .filter(|s| s.stage == name && !s.branch.is_empty())
                .map(|s| s.branch.as_str())
                .collect();
            b.dedup();
            b
        };
        for e in stage_events
            .iter()
            .filter(|e| e.branch.as_deref().unwrap_or("").is_empty())
        {
            println!(
                "{pad}  · {} {}{}",
                e.kind,
                e.detail,
                e.snapshot_id
                    .as_deref()
                    .map(|s| format!(" [{}]", &s[..12]))
                    .unwrap_or_default()
            );
        }
        let after: &[&str] = self.children.get(name).map(Vec::as_slice).unwrap_or_default();
        for (j, b) in branches.iter().enumerate() {
            // The stages after this one follow its branches at their level.
            let bl = j + 1 == branches.len() && after.is_empty();
            let row = stages.iter().find(|s| s.stage == name && s.branch == *b).unwrap();
            println!(
                "{pad}{} {b}: {}{}",
                if bl { "└─" } else { "├─" },
                row.status,
                row.metric.map(|m| format!(" · metric {m}")).unwrap_or_default()
            );
            if let Some(d) = self.branch_diffs.iter().find(|d| d.stage == name && d.branch == *b) {
                println!(
                    "{pad}{}  · differs from the winner {}: {} added, {} removed, {} changed · `{}`",
                    if bl { "   " } else { "│  " },
                    d.winner,
                    d.added,
                    d.removed,
                    d.changed,
                    d.command
                );
            }
            for e in stage_events.iter().filter(|e| e.branch.as_deref() == Some(*b)) {
                println!(
                    "{pad}{}  · {} {}{}",
                    if bl { "   " } else { "│  " },
                    e.kind,
                    e.detail,
                    e.snapshot_id
                        .as_deref()
                        .map(|s| format!(" [{}]", &s[..12]))
                        .unwrap_or_default()
                );
            }
        }
        for a in self.artifacts.iter().filter(|a| a.stage == name) {
            println!("{pad}  ◆ artifact {} {} ({} bytes)", &a.id[..12], a.path, a.size_bytes);
        }
        for (k, child) in after.iter().enumerate() {
            self.print(child, &pad, k + 1 == after.len());
        }
    }
}

pub fn dlq(engine: &mut Engine, cmd: DlqCommand) -> Result<i32> {
    match cmd {
        DlqCommand::Ls { json } => {
            let all = own_dead_letters(engine)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&all)?);
            } else {
                println!("{:<12}  {:<12}  {:<16}  {:<8}  ERROR", "ID", "RUN", "STAGE", "RETRIED");
                for d in all {
                    let stage = if d.branch.is_empty() {
                        d.stage.clone()
                    } else {
                        format!("{}[{}]", d.stage, d.branch)
                    };
                    println!(
                        "{:<12}  {:<12}  {:<16}  {:<8}  {}",
                        d.id,
                        d.run_id,
                        stage,
                        d.retried_at.is_some(),
                        d.error
                    );
                }
            }
            Ok(0)
        }
        DlqCommand::Show { id } => {
            let d = own_dead_letters(engine)?
                .into_iter()
                .find(|d| d.id.starts_with(&id))
                .with_context(|| format!("no dead letter matches {id:?}; `cairn dlq ls` lists them"))?;
            println!("{}", serde_json::to_string_pretty(&d)?);
            Ok(0)
        }
        DlqCommand::Retry { id, model } => {
            set_model(engine, &model);
            let run = engine.retry_dead_letter(&id, &Progress)?;
            eprintln!("cairn: run {} {}", run.id, run.status);
            Ok(if run.status == "completed" { 0 } else { 1 })
        }
    }
}

/// The dead letters of the runs this engine's tenant owns (all, for the
/// administrator).
fn own_dead_letters(engine: &Engine) -> Result<Vec<cairn_pipeline::records::DeadLetter>> {
    let mut all = engine.dead_letters()?;
    engine.keep_mine(Owned::Run, &mut all, |d| &d.run_id)?;
    Ok(all)
}

pub fn artifact(engine: &Engine, cmd: ArtifactCommand) -> Result<()> {
    match cmd {
        ArtifactCommand::Ls { run, json } => {
            let run = match run {
                Some(r) => Some(engine.run_record(&r)?.id),
                None => None,
            };
            let mut all = engine.artifacts(run.as_deref())?;
            engine.keep_mine(Owned::Run, &mut all, |a| &a.run_id)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&all)?);
            } else {
                for a in all {
                    println!(
                        "{}  {}  {}  {}  {} bytes",
                        &a.id[..12],
                        a.run_id,
                        a.stage,
                        a.path,
                        a.size_bytes
                    );
                }
            }
        }
        ArtifactCommand::Get { id, output } => {
            if output.as_os_str() == "-" {
                engine.artifact_get(&id, &mut std::io::stdout().lock())?;
            } else {
                let mut tmp = crate::host_files::temporary_beside(&output)?;
                engine.artifact_get(&id, tmp.as_file_mut())?;
                // Readable as a file the user made would be.
                let mode = 0o666 & !crate::user_umask();
                tmp.as_file()
                    .set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))?;
                tmp.persist(&output)
                    .with_context(|| format!("cannot write {}", output.display()))?;
            }
        }
    }
    Ok(())
}

pub fn stage_log(engine: &Engine, run: &str, stage: &str, tail: Option<usize>) -> Result<()> {
    let run = engine.run_record(run)?;
    let path = engine.run_dir(&run.id).join(format!("{stage}.log"));
    if !path.exists() {
        bail!(
            "run {} has no log for stage {stage:?} (for a branch, write STAGE.BRANCH)",
            run.id
        );
    }
    crate::host_files::print_log(std::fs::File::open(&path)?, tail)
}

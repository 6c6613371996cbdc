//! A tool call's arguments, from a model: parsed into types and checked
//! against the bounds the schema states before anything runs.

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

use crate::ToolError;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Edit {
    pub path: String,
    pub content: String,
    pub mode: Option<u32>,
}

/// One hypothesis of a fork_from group: its own edits and commands, after
/// the group's shared ones.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HypothesisArgs {
    pub name: String,
    #[serde(default)]
    pub edits: Vec<Edit>,
    #[serde(default)]
    pub commands: Vec<String>,
}

/// How many hypotheses one fork_from group holds.
pub const HYPOTHESES_MIN: usize = 2;
pub const HYPOTHESES_MAX: usize = 16;

/// run_stage's and fork_from's arguments.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageArgs {
    pub snapshot_id: String,
    #[serde(default)]
    pub hypothesis: Option<String>,
    /// Instead of `hypothesis`: a group of branches in one run.
    #[serde(default)]
    pub hypotheses: Option<Vec<HypothesisArgs>>,
    #[serde(default)]
    pub edits: Vec<Edit>,
    #[serde(default)]
    pub commands: Vec<String>,
    pub stage_key: Option<String>,
    pub timeout: Option<String>,
    pub checkpoint_every: Option<String>,
    pub wait_secs: Option<u64>,
    pub reason: String,
}

#[derive(Debug)]
pub enum ToolArgs {
    PlanStage {
        context: String,
        constraints: Option<String>,
        handle: Option<String>,
        reason: String,
    },
    RunStage(StageArgs),
    ForkFrom(StageArgs),
    StageStatus {
        handle: String,
        wait_secs: Option<u64>,
    },
    Select {
        /// Handles to choose among (empty when `group` is given).
        branches: Vec<String>,
        /// A fork_from group's handle: choose among its branches.
        group: Option<String>,
        choice: Choice,
        reason: String,
    },
    InspectLogs {
        stage: String,
        branch: Option<String>,
        tail_lines: Option<u32>,
    },
    SessionCreate {
        image: Option<String>,
        snapshot_id: Option<String>,
        name: Option<String>,
        reason: String,
    },
    /// session_suspend, session_resume and session_close.
    SessionLifecycle {
        action: Lifecycle,
        session: String,
        reason: String,
    },
    SessionFork {
        session: String,
        name: Option<String>,
        reason: String,
    },
    Inspect {
        snapshot_id: String,
        path: String,
    },
    Diff {
        from: String,
        to: String,
        text: bool,
    },
    Dlq {
        retry: Option<String>,
        reason: Option<String>,
    },
    Exec {
        session: String,
        argv: Vec<String>,
        cwd: Option<String>,
        timeout_secs: Option<u64>,
        reason: String,
    },
    ReadFile {
        session: String,
        path: String,
    },
    Snapshot {
        session: String,
        label: Option<String>,
        reason: String,
    },
    Restore {
        snapshot_id: String,
        name: Option<String>,
        reason: String,
    },
    WriteFile {
        session: String,
        path: String,
        content: String,
        mode: Option<u32>,
        reason: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Dlq {
    action: String,
    id: Option<String>,
    reason: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Exec {
    session: String,
    argv: Vec<String>,
    cwd: Option<String>,
    timeout_secs: Option<u64>,
    reason: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Snapshot {
    session: String,
    label: Option<String>,
    reason: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Restore {
    snapshot_id: String,
    name: Option<String>,
    reason: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReadFile {
    session: String,
    path: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WriteFile {
    session: String,
    path: String,
    content: String,
    mode: Option<u32>,
    reason: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Plan {
    context: String,
    constraints: Option<String>,
    handle: Option<String>,
    reason: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Status {
    handle: String,
    wait_secs: Option<u64>,
}

/// What session_suspend, session_resume and session_close do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    Suspend,
    Resume,
    /// Close; its log stays unless `purge`.
    Close {
        purge: bool,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SessionCreate {
    image: Option<String>,
    snapshot_id: Option<String>,
    name: Option<String>,
    reason: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SessionAction {
    session: String,
    reason: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SessionClose {
    session: String,
    #[serde(default)]
    purge: bool,
    reason: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SessionFork {
    session: String,
    name: Option<String>,
    reason: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Select {
    #[serde(default)]
    branches: Vec<String>,
    handle: Option<String>,
    winner: Option<String>,
    rule: Option<String>,
    metric: Option<String>,
    reason: String,
}

/// How `select` picks its winner.
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    /// The model named it (a handle, or a branch name in a group).
    Winner(String),
    /// The branch that completed first.
    FirstSuccess,
    /// The completed branch with the smallest (or largest) metric.
    Rule { max: bool, metric: Metric },
}

/// Where a branch's number comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum Metric {
    /// The last number the stage printed.
    Output,
    /// The first number in a file of its output snapshot.
    File(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Logs {
    stage: String,
    branch: Option<String>,
    tail_lines: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Inspect {
    snapshot_id: String,
    path: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Diff {
    from_snapshot_id: String,
    to_snapshot_id: String,
    text: Option<bool>,
}

struct Check<'a> {
    tool: &'a str,
}

impl Check<'_> {
    fn bad(&self, message: String) -> ToolError {
        ToolError::InvalidArguments {
            tool: self.tool.to_string(),
            message,
        }
    }

    fn text(&self, field: &str, v: &str, min: usize, max: usize) -> Result<(), ToolError> {
        if v.len() < min || v.len() > max {
            return Err(self.bad(format!("{field} must be {min} to {max} bytes, not {}", v.len())));
        }
        if v.contains('\0') {
            return Err(self.bad(format!("{field} must not contain NUL")));
        }
        Ok(())
    }

    fn hex_id(&self, field: &str, v: &str) -> Result<(), ToolError> {
        self.text(field, v, 1, 64)?;
        if !v.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(self.bad(format!(
                "{field} {v:?} is not an id: use lowercase hex as returned by the tools"
            )));
        }
        Ok(())
    }

    fn session(&self, v: &str) -> Result<(), ToolError> {
        self.text("session", v, 1, 128)?;
        let ok = v.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
            && v.as_bytes()[0].is_ascii_alphanumeric();
        if !ok {
            return Err(self.bad(format!("session {v:?} is not a session id or name")));
        }
        Ok(())
    }

    /// A name made of letters, digits, '-' and '_' (a hypothesis, a
    /// session), starting with a letter or digit.
    fn name(&self, field: &str, v: &str) -> Result<(), ToolError> {
        self.text(field, v, 1, 63)?;
        let ok = v.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b))
            && v.as_bytes()[0].is_ascii_alphanumeric();
        if !ok {
            return Err(self.bad(format!(
                "{field} {v:?} may hold letters, digits, '-' and '_', starting with a letter or digit"
            )));
        }
        Ok(())
    }

    fn path(&self, field: &str, v: &str) -> Result<(), ToolError> {
        self.text(field, v, 1, 4096)?;
        if !v.starts_with('/') {
            return Err(self.bad(format!("{field} {v:?} must be an absolute path")));
        }
        Ok(())
    }

    fn wait(&self, v: Option<u64>) -> Result<(), ToolError> {
        match v {
            Some(w) if w > 30 => Err(self.bad(format!(
                "wait_secs is at most 30, not {w}: poll with stage_status instead"
            ))),
            _ => Ok(()),
        }
    }

    fn duration(&self, field: &str, v: &Option<String>) -> Result<(), ToolError> {
        if let Some(d) = v {
            self.text(field, d, 1, 32)?;
            if cairn_pipeline::spec::parse_duration(d).is_none() {
                return Err(self.bad(format!("{field} {d:?} is not a duration: write 45s, 30m, 1h30m or 6h")));
            }
        }
        Ok(())
    }

    fn stage(&self, s: &StageArgs, fork: bool) -> Result<(), ToolError> {
        self.hex_id("snapshot_id", &s.snapshot_id)?;
        self.text("reason", &s.reason, 1, 4096)?;
        match (&s.hypothesis, &s.hypotheses, fork) {
            (Some(h), None, true) => self.text("hypothesis", h, 1, 4096)?,
            (None, Some(group), true) => self.hypotheses(group)?,
            (Some(_), Some(_), true) => {
                return Err(self.bad("give hypothesis (one branch) or hypotheses (a group), not both".into()))
            }
            (None, None, true) => {
                return Err(self
                    .bad("hypothesis is required: say what this branch tests (or give hypotheses for a group)".into()))
            }
            (Some(_), _, false) | (_, Some(_), false) => {
                return Err(self.bad("hypothesis and hypotheses are not arguments of run_stage: use fork_from".into()))
            }
            (None, None, false) => {}
        }
        if s.commands.is_empty() && !fork {
            return Err(self.bad("commands must name at least one command".into()));
        }
        self.work(&s.commands, &s.edits)?;
        let in_group = s.hypotheses.iter().flatten().flat_map(|h| &h.edits);
        let total: usize = s.edits.iter().chain(in_group).map(|e| e.content.len()).sum();
        if total > 4 << 20 {
            return Err(self.bad(format!("edits hold {total} bytes; at most 4 MiB in all")));
        }
        if let Some(k) = &s.stage_key {
            self.text("stage_key", k, 1, 128)?;
            let ok = k.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
                && k.as_bytes()[0].is_ascii_alphanumeric();
            if !ok {
                return Err(self.bad(format!(
                    "stage_key {k:?} may hold letters, digits, '.', '_' and '-', starting with a letter or digit"
                )));
            }
        }
        self.duration("timeout", &s.timeout)?;
        self.duration("checkpoint_every", &s.checkpoint_every)?;
        self.wait(s.wait_secs)
    }

    fn hypotheses(&self, group: &[HypothesisArgs]) -> Result<(), ToolError> {
        if !(HYPOTHESES_MIN..=HYPOTHESES_MAX).contains(&group.len()) {
            return Err(self.bad(format!(
                "hypotheses holds {HYPOTHESES_MIN} to {HYPOTHESES_MAX} branches, not {}; one branch is hypothesis",
                group.len()
            )));
        }
        let mut names = std::collections::HashSet::new();
        for h in group {
            self.name("a hypothesis's name", &h.name)?;
            if !names.insert(h.name.as_str()) {
                return Err(self.bad(format!("two hypotheses are named {:?}", h.name)));
            }
            self.work(&h.commands, &h.edits)
                .map_err(|e| self.bad(format!("hypothesis {:?}: {}", h.name, message_of(e))))?;
        }
        Ok(())
    }

    /// Commands and edits: counts, sizes, paths, modes.
    fn work(&self, commands: &[String], edits: &[Edit]) -> Result<(), ToolError> {
        if commands.len() > 64 || edits.len() > 64 {
            return Err(self.bad("at most 64 commands and 64 edits per stage".into()));
        }
        for c in commands {
            self.text("each command", c, 1, 16384)?;
        }
        for e in edits {
            self.path("an edit's path", &e.path)?;
            if e.path == "/" {
                return Err(self.bad("an edit's path must name a file, not /".into()));
            }
            self.text("an edit's content", &e.content, 0, 1 << 20)?;
            if e.mode.is_some_and(|m| m > 0o7777) {
                return Err(self.bad(format!("{}: mode is permission bits, at most 0o7777", e.path)));
            }
        }
        Ok(())
    }
}

fn message_of(e: ToolError) -> String {
    match e {
        ToolError::InvalidArguments { message, .. } => message,
        other => other.to_string(),
    }
}

fn from<T: DeserializeOwned>(tool: &str, v: Value) -> Result<T, ToolError> {
    serde_json::from_value(v).map_err(|e| ToolError::InvalidArguments {
        tool: tool.to_string(),
        message: format!("{e}; the tool's inputSchema lists its arguments"),
    })
}

/// Parses and checks tool `name`'s arguments (`null` reads as `{}`).
pub fn parse(name: &str, arguments: Value) -> Result<ToolArgs, ToolError> {
    let v = if arguments.is_null() {
        Value::Object(Default::default())
    } else {
        arguments
    };
    let c = Check { tool: name };
    Ok(match name {
        "plan_stage" => {
            let p: Plan = from(name, v)?;
            c.text("context", &p.context, 1, 16384)?;
            if let Some(k) = &p.constraints {
                c.text("constraints", k, 0, 16384)?;
            }
            if let Some(h) = &p.handle {
                c.hex_id("handle", h)?;
            }
            c.text("reason", &p.reason, 1, 4096)?;
            ToolArgs::PlanStage {
                context: p.context,
                constraints: p.constraints,
                handle: p.handle,
                reason: p.reason,
            }
        }
        "run_stage" | "fork_from" => {
            let s: StageArgs = from(name, v)?;
            let fork = name == "fork_from";
            if fork && s.checkpoint_every.is_some() {
                return Err(c.bad("checkpoint_every is an argument of run_stage only".into()));
            }
            c.stage(&s, fork)?;
            if fork {
                ToolArgs::ForkFrom(s)
            } else {
                ToolArgs::RunStage(s)
            }
        }
        "stage_status" => {
            let s: Status = from(name, v)?;
            c.hex_id("handle", &s.handle)?;
            c.wait(s.wait_secs)?;
            ToolArgs::StageStatus {
                handle: s.handle,
                wait_secs: s.wait_secs,
            }
        }
        "select" => {
            let s: Select = from(name, v)?;
            match &s.handle {
                Some(h) if s.branches.is_empty() => c.hex_id("handle", h)?,
                Some(_) => return Err(c.bad("give branches (handles) or handle (a group's), not both".into())),
                None if s.branches.is_empty() || s.branches.len() > 32 => {
                    return Err(c.bad(format!(
                        "branches holds 1 to 32 handles, not {} (or give a group's handle)",
                        s.branches.len()
                    )))
                }
                None => {}
            }
            for b in &s.branches {
                c.hex_id("each branch", b)?;
            }
            let choice = match (s.winner, s.rule) {
                (Some(w), None) => {
                    match s.handle {
                        Some(_) => c.name("winner (a branch name of the group)", &w)?,
                        None => c.hex_id("winner", &w)?,
                    }
                    if s.metric.is_some() {
                        return Err(c.bad("metric goes with rule, not winner".into()));
                    }
                    Choice::Winner(w)
                }
                (None, Some(rule)) if rule == "first_success" => {
                    if s.metric.is_some() {
                        return Err(c.bad("rule first_success takes no metric".into()));
                    }
                    Choice::FirstSuccess
                }
                (None, Some(rule)) => {
                    let max = match rule.as_str() {
                        "min" => false,
                        "max" => true,
                        other => return Err(c.bad(format!("rule {other:?} is not first_success, min or max"))),
                    };
                    let metric = match s.metric.as_deref() {
                        Some("output") => Metric::Output,
                        Some(m) if m.starts_with("file:") => {
                            c.path("metric's file", &m[5..])?;
                            Metric::File(m[5..].to_string())
                        }
                        Some(m) => return Err(c.bad(format!("metric {m:?} is not \"output\" or \"file:/PATH\""))),
                        None => return Err(c.bad("rule needs a metric: \"output\" or \"file:/PATH\"".into())),
                    };
                    Choice::Rule { max, metric }
                }
                (Some(_), Some(_)) => return Err(c.bad("give winner or rule, not both".into())),
                (None, None) => {
                    return Err(c.bad(
                        "give winner (a handle, or a group's branch name) or rule (first_success, or min or max with metric)"
                            .into(),
                    ))
                }
            };
            c.text("reason", &s.reason, 1, 4096)?;
            ToolArgs::Select {
                branches: s.branches,
                group: s.handle,
                choice,
                reason: s.reason,
            }
        }
        "inspect_logs" => {
            let s: Logs = from(name, v)?;
            c.hex_id("stage", &s.stage)?;
            if let Some(b) = &s.branch {
                c.name("branch", b)?;
            }
            if s.tail_lines.is_some_and(|n| n == 0 || n > 2000) {
                return Err(c.bad("tail_lines is 1 to 2000".into()));
            }
            ToolArgs::InspectLogs {
                stage: s.stage,
                branch: s.branch,
                tail_lines: s.tail_lines,
            }
        }
        "inspect" => {
            let s: Inspect = from(name, v)?;
            c.hex_id("snapshot_id", &s.snapshot_id)?;
            c.path("path", &s.path)?;
            ToolArgs::Inspect {
                snapshot_id: s.snapshot_id,
                path: s.path,
            }
        }
        "diff" => {
            let d: Diff = from(name, v)?;
            c.hex_id("from_snapshot_id", &d.from_snapshot_id)?;
            c.hex_id("to_snapshot_id", &d.to_snapshot_id)?;
            ToolArgs::Diff {
                from: d.from_snapshot_id,
                to: d.to_snapshot_id,
                text: d.text.unwrap_or(true),
            }
        }
        "dlq" => {
            let d: Dlq = from(name, v)?;
            if let Some(r) = &d.reason {
                c.text("reason", r, 1, 4096)?;
            }
            match (d.action.as_str(), d.id) {
                ("list", None) => ToolArgs::Dlq {
                    retry: None,
                    reason: None,
                },
                ("list", Some(_)) => return Err(c.bad("action list takes no id".into())),
                ("retry", Some(id)) => {
                    c.hex_id("id", &id)?;
                    if d.reason.is_none() {
                        return Err(c.bad("reason is required to retry: say why it may pass now".into()));
                    }
                    ToolArgs::Dlq {
                        retry: Some(id),
                        reason: d.reason,
                    }
                }
                ("retry", None) => {
                    return Err(c.bad("action retry needs the dead letter's id (action list names them)".into()))
                }
                (other, _) => return Err(c.bad(format!("action {other:?} is not list or retry"))),
            }
        }
        "exec" => {
            let e: Exec = from(name, v)?;
            c.session(&e.session)?;
            if e.argv.is_empty() || e.argv.len() > 256 {
                return Err(c.bad(format!("argv holds 1 to 256 strings, not {}", e.argv.len())));
            }
            for a in &e.argv {
                c.text("each argv string", a, 0, 16384)?;
            }
            c.text("argv[0]", &e.argv[0], 1, 16384)?;
            if let Some(cwd) = &e.cwd {
                c.path("cwd", cwd)?;
            }
            if e.timeout_secs.is_some_and(|t| t == 0 || t > 3600) {
                return Err(c.bad("timeout_secs is 1 to 3600: run longer work with run_stage".into()));
            }
            c.text("reason", &e.reason, 1, 4096)?;
            ToolArgs::Exec {
                session: e.session,
                argv: e.argv,
                cwd: e.cwd,
                timeout_secs: e.timeout_secs,
                reason: e.reason,
            }
        }
        "snapshot" => {
            let n: Snapshot = from(name, v)?;
            c.session(&n.session)?;
            if let Some(l) = &n.label {
                c.text("label", l, 1, 63)?;
                let ok = l.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
                    && l.as_bytes()[0].is_ascii_alphanumeric();
                if !ok {
                    return Err(c.bad(format!("label {l:?} may hold letters, digits, '.', '_' and '-'")));
                }
            }
            c.text("reason", &n.reason, 1, 4096)?;
            ToolArgs::Snapshot {
                session: n.session,
                label: n.label,
                reason: n.reason,
            }
        }
        "restore" => {
            let r: Restore = from(name, v)?;
            c.hex_id("snapshot_id", &r.snapshot_id)?;
            if let Some(n) = &r.name {
                c.text("name", n, 1, 63)?;
                let ok = n.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b))
                    && n.as_bytes()[0].is_ascii_alphanumeric();
                if !ok {
                    return Err(c.bad(format!("name {n:?} may hold letters, digits, '-' and '_'")));
                }
            }
            c.text("reason", &r.reason, 1, 4096)?;
            ToolArgs::Restore {
                snapshot_id: r.snapshot_id,
                name: r.name,
                reason: r.reason,
            }
        }
        "read_file" => {
            let r: ReadFile = from(name, v)?;
            c.session(&r.session)?;
            c.path("path", &r.path)?;
            ToolArgs::ReadFile {
                session: r.session,
                path: r.path,
            }
        }
        "write_file" => {
            let w: WriteFile = from(name, v)?;
            c.session(&w.session)?;
            c.path("path", &w.path)?;
            if w.path == "/" {
                return Err(c.bad("path must name a file, not /".into()));
            }
            c.text("content", &w.content, 0, 1 << 20)?;
            if w.mode.is_some_and(|m| m > 0o7777) {
                return Err(c.bad("mode is permission bits, at most 0o7777".into()));
            }
            c.text("reason", &w.reason, 1, 4096)?;
            ToolArgs::WriteFile {
                session: w.session,
                path: w.path,
                content: w.content,
                mode: w.mode,
                reason: w.reason,
            }
        }
        "session_create" => {
            let n: SessionCreate = from(name, v)?;
            match (&n.image, &n.snapshot_id) {
                (Some(i), None) => c.text("image", i, 1, 256)?,
                (None, Some(id)) => c.hex_id("snapshot_id", id)?,
                (None, None) => {}
                (Some(_), Some(_)) => return Err(c.bad("give image or snapshot_id, not both".into())),
            }
            if let Some(n) = &n.name {
                c.name("name", n)?;
            }
            c.text("reason", &n.reason, 1, 4096)?;
            ToolArgs::SessionCreate {
                image: n.image,
                snapshot_id: n.snapshot_id,
                name: n.name,
                reason: n.reason,
            }
        }
        "session_suspend" | "session_resume" => {
            let a: SessionAction = from(name, v)?;
            c.session(&a.session)?;
            c.text("reason", &a.reason, 1, 4096)?;
            let action = if name == "session_suspend" {
                Lifecycle::Suspend
            } else {
                Lifecycle::Resume
            };
            ToolArgs::SessionLifecycle {
                action,
                session: a.session,
                reason: a.reason,
            }
        }
        "session_close" => {
            let a: SessionClose = from(name, v)?;
            c.session(&a.session)?;
            c.text("reason", &a.reason, 1, 4096)?;
            ToolArgs::SessionLifecycle {
                action: Lifecycle::Close { purge: a.purge },
                session: a.session,
                reason: a.reason,
            }
        }
        "session_fork" => {
            let f: SessionFork = from(name, v)?;
            c.session(&f.session)?;
            if let Some(n) = &f.name {
                c.name("name", n)?;
            }
            c.text("reason", &f.reason, 1, 4096)?;
            ToolArgs::SessionFork {
                session: f.session,
                name: f.name,
                reason: f.reason,
            }
        }
        other => return Err(ToolError::UnknownTool(other.to_string())),
    })
}

#[cfg(test)]
mod tests;

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

/// run_stage's and fork_from's arguments.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageArgs {
    pub snapshot_id: String,
    #[serde(default)]
    pub hypothesis: Option<String>,
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
        branches: Vec<String>,
        choice: Choice,
        reason: String,
    },
    InspectLogs {
        stage: String,
        tail_lines: Option<u32>,
    },
    Inspect {
        snapshot_id: String,
        path: String,
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Select {
    branches: Vec<String>,
    winner: Option<String>,
    rule: Option<String>,
    metric: Option<String>,
    reason: String,
}

/// How `select` picks its winner.
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    /// The model named it.
    Winner(String),
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
    tail_lines: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Inspect {
    snapshot_id: String,
    path: String,
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
            if cairn_engine::pipeline::spec::parse_duration(d).is_none() {
                return Err(self.bad(format!("{field} {d:?} is not a duration: write 45s, 30m, 1h30m or 6h")));
            }
        }
        Ok(())
    }

    fn stage(&self, s: &StageArgs, fork: bool) -> Result<(), ToolError> {
        self.hex_id("snapshot_id", &s.snapshot_id)?;
        self.text("reason", &s.reason, 1, 4096)?;
        match (&s.hypothesis, fork) {
            (Some(h), true) => self.text("hypothesis", h, 1, 4096)?,
            (None, true) => return Err(self.bad("hypothesis is required: say what this branch tests".into())),
            (Some(_), false) => {
                return Err(self.bad("hypothesis is not an argument of run_stage: use fork_from".into()))
            }
            (None, false) => {}
        }
        if s.commands.is_empty() && !fork {
            return Err(self.bad("commands must name at least one command".into()));
        }
        if s.commands.len() > 64 || s.edits.len() > 64 {
            return Err(self.bad("at most 64 commands and 64 edits per stage".into()));
        }
        for c in &s.commands {
            self.text("each command", c, 1, 16384)?;
        }
        let mut total = 0;
        for e in &s.edits {
            self.path("an edit's path", &e.path)?;
            if e.path == "/" {
                return Err(self.bad("an edit's path must name a file, not /".into()));
            }
            self.text("an edit's content", &e.content, 0, 1 << 20)?;
            total += e.content.len();
            if e.mode.is_some_and(|m| m > 0o7777) {
                return Err(self.bad(format!("{}: mode is permission bits, at most 0o7777", e.path)));
            }
        }
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
            if s.branches.is_empty() || s.branches.len() > 32 {
                return Err(c.bad(format!("branches holds 1 to 32 handles, not {}", s.branches.len())));
            }
            for b in &s.branches {
                c.hex_id("each branch", b)?;
            }
            let choice = match (s.winner, s.rule) {
                (Some(w), None) => {
                    c.hex_id("winner", &w)?;
                    if s.metric.is_some() {
                        return Err(c.bad("metric goes with rule, not winner".into()));
                    }
                    Choice::Winner(w)
                }
                (None, Some(rule)) => {
                    let max = match rule.as_str() {
                        "min" => false,
                        "max" => true,
                        other => return Err(c.bad(format!("rule {other:?} is not min or max"))),
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
                (None, None) => return Err(c.bad("give winner (a handle) or rule (min or max) with metric".into())),
            };
            c.text("reason", &s.reason, 1, 4096)?;
            ToolArgs::Select {
                branches: s.branches,
                choice,
                reason: s.reason,
            }
        }
        "inspect_logs" => {
            let s: Logs = from(name, v)?;
            c.hex_id("stage", &s.stage)?;
            if s.tail_lines.is_some_and(|n| n == 0 || n > 2000) {
                return Err(c.bad("tail_lines is 1 to 2000".into()));
            }
            ToolArgs::InspectLogs {
                stage: s.stage,
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
        other => return Err(ToolError::UnknownTool(other.to_string())),
    })
}

#[cfg(test)]
mod tests {
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
        assert!(refused("inspect", json!({"snapshot_id": "ab", "path": "etc"})).contains("absolute"));
        assert!(refused("inspect_logs", json!({"stage": "ab", "tail_lines": 0})).contains("tail_lines"));
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
}

//! The tool schema as data: each tool's name, description, input and
//! output JSON Schema. `docs/tools.md` holds the same document
//! ([`document`]); a test fails when the two drift.

use serde_json::{json, Value};

/// The schema's version, independent of the crate's: bumped when a tool
/// is renamed or removed or an argument changes meaning (additions keep it).
pub const TOOLS_VERSION: &str = "2";

/// One tool a model may call.
#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub name: &'static str,
    pub description: &'static str,
    /// JSON Schema (2020-12) of the arguments object.
    pub input: Value,
    /// JSON Schema of the structured result.
    pub output: Value,
}

fn reason() -> Value {
    json!({"type": "string", "minLength": 1, "maxLength": 4096,
           "description": "Why you are making this call; recorded in the run's events beside the outcome"})
}

fn session() -> Value {
    json!({"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]*$",
           "description": "An agent session's id or name (docs/sessions.md)"})
}

fn snapshot_id() -> Value {
    json!({"type": "string", "minLength": 1, "maxLength": 64, "pattern": "^[0-9a-f]+$",
           "description": "A snapshot id, or a unique prefix of one"})
}

fn handle() -> Value {
    json!({"type": "string", "minLength": 1, "maxLength": 64, "pattern": "^[0-9a-f]+$",
           "description": "A stage handle returned by run_stage or fork_from (the run id)"})
}

fn edits() -> Value {
    json!({"type": "array", "maxItems": 64,
           "description": "Files to write into the sandbox before the commands run",
           "items": {"type": "object", "additionalProperties": false, "required": ["path", "content"],
                     "properties": {
                        "path": {"type": "string", "minLength": 2, "maxLength": 4096, "pattern": "^/",
                                 "description": "Absolute path"},
                        "content": {"type": "string", "maxLength": 1048576},
                        "mode": {"type": "integer", "minimum": 0, "maximum": 4095,
                                 "description": "Permission bits, 0644 (420) when absent"}}}})
}

fn commands() -> Value {
    json!({"type": "array", "maxItems": 64,
           "items": {"type": "string", "minLength": 1, "maxLength": 16384},
           "description": "Shell commands, each run with /bin/sh -c in order; the stage fails at the first that fails"})
}

fn duration(what: &str) -> Value {
    json!({"type": "string", "maxLength": 32, "pattern": "^([0-9]+(ms|s|m|h|d))+$",
           "description": format!("{what}, such as 45s, 30m, 1h30m or 6h")})
}

fn wait_secs() -> Value {
    json!({"type": "integer", "minimum": 0, "maximum": 30,
           "description": "How long to wait for the stage before returning its handle (default 5); poll with stage_status"})
}

fn session_result() -> Value {
    json!({"type": "object", "required": ["session", "name", "state"],
           "properties": {
              "session": {"type": "string"},
              "name": {"type": "string"},
              "state": {"type": "string", "enum": ["active", "suspending", "suspended", "resuming", "failed", "closed"]},
              "sandbox_id": {"type": ["string", "null"]},
              "snapshot_id": {"type": ["string", "null"], "description": "The snapshot a suspended session resumes from"},
              "head_seq": {"type": "integer", "description": "The newest entry of its context log"},
              "parent": {"type": "string", "description": "session_fork: the session forked"},
              "forked_at": {"type": "integer", "description": "session_fork: the parent's entry the fork starts after"}}})
}

fn hypotheses() -> Value {
    json!({"type": "array", "minItems": 2, "maxItems": 16,
           "description": "Instead of hypothesis: 2 to 16 branches in one run (one handle), each forked from the snapshot;                            each runs the shared edits and commands, then its own",
           "items": {"type": "object", "additionalProperties": false, "required": ["name"],
                     "properties": {
                        "name": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": "^[A-Za-z0-9][A-Za-z0-9_-]*$",
                                 "description": "The branch's name: what it tests, in a word; select's winner names it"},
                        "edits": edits(),
                        "commands": commands()}}})
}

fn stage_result() -> Value {
    json!({"type": "object", "required": ["handle", "status", "stage_key", "cached"],
           "properties": {
              "handle": {"type": "string", "description": "Poll with stage_status; name in select and inspect_logs"},
              "branches": {"type": "array", "description": "A fork_from group's branches",
                           "items": {"type": "object", "required": ["name", "status"],
                                     "properties": {
                                        "name": {"type": "string"},
                                        "status": {"type": "string", "enum": ["running", "completed", "failed"]},
                                        "stage_key": {"type": ["string", "null"]},
                                        "output_snapshot": {"type": ["string", "null"]},
                                        "error": {"type": ["string", "null"]},
                                        "selected": {"type": ["string", "null"], "enum": ["won", "lost", null],
                                                     "description": "What select made of it"}}}},
              "status": {"type": "string", "enum": ["running", "completed", "failed"]},
              "stage_key": {"type": "string"},
              "cached": {"type": "boolean", "description": "The stage key had completed before: nothing ran"},
              "hypothesis": {"type": ["string", "null"]},
              "input_snapshot": {"type": ["string", "null"]},
              "output_snapshot": {"type": ["string", "null"],
                                  "description": "The stage's result snapshot: run or fork further stages from it"},
              "error": {"type": ["string", "null"]}}})
}

/// Every tool, in the order they are listed.
pub fn tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "plan_stage",
            description: "Record a plan entry (what to try next and why) and get the snapshots to plan \
                          against, newest first. With `handle`, the plan goes into that stage's run events.",
            input: json!({"type": "object", "additionalProperties": false, "required": ["context", "reason"],
                "properties": {
                    "context": {"type": "string", "minLength": 1, "maxLength": 16384,
                                "description": "What you know now and what you will try next"},
                    "constraints": {"type": "string", "maxLength": 16384},
                    "handle": handle(),
                    "reason": reason()}}),
            output: json!({"type": "object", "required": ["recorded", "snapshots"],
                "properties": {
                    "recorded": {"type": "boolean"},
                    "snapshots": {"type": "array", "items": {"type": "object",
                        "required": ["id", "created_at"],
                        "properties": {"id": {"type": "string"}, "label": {"type": ["string", "null"]},
                                       "parent_id": {"type": ["string", "null"]},
                                       "created_at": {"type": "integer"}}}}}}),
        },
        ToolSpec {
            name: "run_stage",
            description: "Run commands durably in a sandbox forked from a snapshot, after writing `edits`; \
                          ends with an output snapshot. A stage key that completed before returns its result \
                          without running. Returns within `wait_secs`: a stage still running comes back with \
                          status running and a handle to poll with stage_status.",
            input: json!({"type": "object", "additionalProperties": false,
                "required": ["snapshot_id", "commands", "reason"],
                "properties": {
                    "snapshot_id": snapshot_id(),
                    "edits": edits(),
                    "commands": commands(),
                    "stage_key": {"type": "string", "minLength": 1, "maxLength": 128,
                                  "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                  "description": "Names the work: a key that completed returns its result at once"},
                    "timeout": duration("The whole stage's limit"),
                    "checkpoint_every": duration("Snapshot the running stage this often"),
                    "wait_secs": wait_secs(),
                    "reason": reason()}}),
            output: stage_result(),
        },
        ToolSpec {
            name: "stage_status",
            description: "Poll a stage started by run_stage or fork_from: waits up to `wait_secs` for it to end.",
            input: json!({"type": "object", "additionalProperties": false, "required": ["handle"],
                "properties": {"handle": handle(), "wait_secs": wait_secs()}}),
            output: stage_result(),
        },
        ToolSpec {
            name: "fork_from",
            description: "Start a hypothesis: a branch stage forked from a snapshot, with its own edits and \
                          commands; or, with hypotheses, 2 to 16 branches at once in one run with one handle, whose \
                          stage_status lists every branch. Branches run in parallel; compare them and choose with select.",
            input: json!({"type": "object", "additionalProperties": false,
                "required": ["snapshot_id", "reason"],
                "properties": {
                    "snapshot_id": snapshot_id(),
                    "hypothesis": {"type": "string", "minLength": 1, "maxLength": 4096,
                                   "description": "What this branch tests (one branch; or give hypotheses)"},
                    "hypotheses": hypotheses(),
                    "edits": edits(),
                    "commands": commands(),
                    "stage_key": {"type": "string", "minLength": 1, "maxLength": 128,
                                  "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]*$"},
                    "timeout": duration("The whole stage's limit"),
                    "wait_secs": wait_secs(),
                    "reason": reason()}}),
            output: stage_result(),
        },
        ToolSpec {
            name: "select",
            description: "Choose the winning branch among hypotheses started with fork_from (their handles in \
                          branches, or a group's handle), by name (winner) or by rule; the choice and the reason go \
                          into the runs' events, the others are marked lost.",
            input: json!({"type": "object", "additionalProperties": false,
                "required": ["reason"],
                "properties": {
                    "branches": {"type": "array", "minItems": 1, "maxItems": 32, "items": handle(),
                                 "description": "Handles of single-branch fork_from calls"},
                    "handle": {"type": "string", "minLength": 1, "maxLength": 64, "pattern": "^[0-9a-f]+$",
                               "description": "Instead of branches: a fork_from group's handle; choose among its branches"},
                    "winner": {"type": "string", "minLength": 1, "maxLength": 64, "pattern": "^[A-Za-z0-9][A-Za-z0-9_-]*$",
                               "description": "A handle among branches, or with handle a branch's name"},
                    "rule": {"type": "string", "enum": ["first_success", "min", "max"],
                             "description": "Instead of winner: the branch that completed first, or the completed branch \
                                             with the smallest or largest metric"},
                    "metric": {"type": "string", "maxLength": 4101, "pattern": "^(output|file:/.*)$",
                               "description": "With rule: \"output\" (the last number the stage printed) or \"file:/PATH\" (the first number in that file of its output snapshot)"},
                    "reason": reason()}}),
            output: json!({"type": "object", "required": ["winner", "output_snapshot", "lost"],
                "properties": {
                    "handle": {"type": "string", "description": "With handle: the group"},
                    "winner": {"type": "string", "description": "A handle, or with handle a branch's name"},
                    "metrics": {"type": "object", "description": "With rule: each branch's number, by handle"},
                    "output_snapshot": {"type": "string"},
                    "lost": {"type": "array", "items": {"type": "string"}}}}),
        },
        ToolSpec {
            name: "inspect_logs",
            description: "The last lines a stage's commands printed (stdout and stderr, interleaved).",
            input: json!({"type": "object", "additionalProperties": false, "required": ["stage"],
                "properties": {
                    "stage": handle(),
                    "branch": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": "^[A-Za-z0-9][A-Za-z0-9_-]*$",
                               "description": "With a fork_from group's handle: the branch's name"},
                    "tail_lines": {"type": "integer", "minimum": 1, "maximum": 2000,
                                   "description": "Default 100"}}}),
            output: json!({"type": "object", "required": ["handle", "lines", "truncated"],
                "properties": {
                    "handle": {"type": "string"},
                    "lines": {"type": "array", "items": {"type": "string"}},
                    "truncated": {"type": "boolean", "description": "Earlier lines exist"}}}),
        },
        ToolSpec {
            name: "inspect",
            description: "Read a file (up to 256 KiB of text) or list a directory (up to 1,000 entries) in any \
                          snapshot, straight from its layers: no sandbox starts. A symlink is shown with its target, \
                          never followed.",
            input: json!({"type": "object", "additionalProperties": false, "required": ["snapshot_id", "path"],
                "properties": {
                    "snapshot_id": snapshot_id(),
                    "path": {"type": "string", "minLength": 1, "maxLength": 4096, "pattern": "^/"}}}),
            output: json!({"type": "object", "required": ["snapshot_id", "path", "kind"],
                "properties": {
                    "snapshot_id": {"type": "string"},
                    "path": {"type": "string"},
                    "kind": {"type": "string", "enum": ["file", "directory", "symlink", "fifo", "socket", "device"]},
                    "content": {"type": "string", "description": "A file's text (invalid UTF-8 replaced)"},
                    "size": {"type": "integer"},
                    "target": {"type": "string", "description": "A symlink's target (not followed)"},
                    "entries": {"type": "array", "items": {"type": "object",
                        "required": ["name", "kind"],
                        "properties": {"name": {"type": "string"}, "kind": {"type": "string"},
                                       "size": {"type": "integer"}, "target": {"type": "string"}}}},
                    "truncated": {"type": "boolean"}}}),
        },
        ToolSpec {
            name: "diff",
            description: "What differs between two snapshots (two branches' output_snapshot, say, before you \
                          select): files added, removed and changed (type, content, mode, owner), with a unified \
                          diff of each changed text file up to 64 KiB. Read from the snapshots' layers: no sandbox \
                          starts, nothing unchanged is read.",
            input: json!({"type": "object", "additionalProperties": false,
                "required": ["from_snapshot_id", "to_snapshot_id"],
                "properties": {
                    "from_snapshot_id": snapshot_id(),
                    "to_snapshot_id": snapshot_id(),
                    "text": {"type": "boolean",
                             "description": "Unified diffs of text files (the default); false: the list alone"}}}),
            output: json!({"type": "object", "required": ["added", "removed", "changed", "changes", "truncated"],
                "properties": {
                    "from_snapshot_id": {"type": "string"},
                    "to_snapshot_id": {"type": "string"},
                    "added": {"type": "integer"},
                    "removed": {"type": "integer"},
                    "changed": {"type": "integer"},
                    "changes": {"type": "array", "description": "At most 500, in path order",
                        "items": {"type": "object", "required": ["path", "change"],
                        "properties": {
                            "path": {"type": "string"},
                            "change": {"type": "string", "enum": ["added", "removed", "changed"]},
                            "kind": {"type": "string"},
                            "what": {"type": "array", "items": {"type": "string"}},
                            "size": {"type": "integer"},
                            "diff": {"type": "string", "description": "Unified diff of a text file"}}}},
                    "truncated": {"type": "boolean", "description": "More changes exist than listed"}}}),
        },
        ToolSpec {
            name: "dlq",
            description: "Stages whose retries ran out (action list), or run one again with fresh retries \
                          (action retry, with its id): the stage continues in its run in the background; poll \
                          the returned handle with stage_status.",
            input: json!({"type": "object", "additionalProperties": false, "required": ["action"],
                "properties": {
                    "action": {"type": "string", "enum": ["list", "retry"]},
                    "id": {"type": "string", "minLength": 1, "maxLength": 64, "pattern": "^[0-9a-f]+$",
                           "description": "The dead letter to retry"},
                    "reason": reason()}}),
            output: json!({"type": "object",
                "properties": {
                    "dead_letters": {"type": "array", "items": {"type": "object",
                        "required": ["id", "handle", "stage", "error"],
                        "properties": {"id": {"type": "string"}, "handle": {"type": "string"},
                                       "stage": {"type": "string"}, "branch": {"type": "string"},
                                       "error": {"type": "string"},
                                       "failure_snapshot": {"type": ["string", "null"]},
                                       "input_snapshot": {"type": ["string", "null"]},
                                       "retried": {"type": "boolean"}}}},
                    "handle": {"type": "string", "description": "The retried stage's run: poll with stage_status"}}}),
        },
        ToolSpec {
            name: "snapshot",
            description: "Snapshot an agent session's sandbox while it keeps running; the snapshot is recorded \
                          in the session's log and can start stages (run_stage, fork_from) or be inspected.",
            input: json!({"type": "object", "additionalProperties": false, "required": ["session", "reason"],
                "properties": {
                    "session": session(),
                    "label": {"type": "string", "minLength": 1, "maxLength": 63,
                              "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]*$"},
                    "reason": reason()}}),
            output: json!({"type": "object", "required": ["snapshot_id"],
                "properties": {"snapshot_id": {"type": "string"}, "label": {"type": ["string", "null"]}}}),
        },
        ToolSpec {
            name: "restore",
            description: "Start a new agent session from a snapshot (a stage's output, a winner's): its sandbox \
                          is restored from it, and exec, read_file, write_file and snapshot work on it.",
            input: json!({"type": "object", "additionalProperties": false, "required": ["snapshot_id", "reason"],
                "properties": {
                    "snapshot_id": snapshot_id(),
                    "name": {"type": "string", "minLength": 1, "maxLength": 63,
                             "pattern": "^[A-Za-z0-9][A-Za-z0-9_-]*$",
                             "description": "A name to find the session by"},
                    "reason": reason()}}),
            output: json!({"type": "object", "required": ["session", "name", "snapshot_id"],
                "properties": {"session": {"type": "string"}, "name": {"type": "string"},
                               "snapshot_id": {"type": "string"}}}),
        },
        ToolSpec {
            name: "exec",
            description: "Run a command in an agent session's sandbox (resuming a suspended session) and wait \
                          for it; recorded in the session's context log with the reason.",
            input: json!({"type": "object", "additionalProperties": false,
                "required": ["session", "argv", "reason"],
                "properties": {
                    "session": session(),
                    "argv": {"type": "array", "minItems": 1, "maxItems": 256,
                             "items": {"type": "string", "maxLength": 16384},
                             "description": "The command and its arguments, e.g. [\"sh\", \"-c\", \"make test\"]"},
                    "cwd": {"type": "string", "minLength": 1, "maxLength": 4096, "pattern": "^/"},
                    "timeout_secs": {"type": "integer", "minimum": 1, "maximum": 3600,
                                     "description": "Default 300; the command is killed after it"},
                    "reason": reason()}}),
            output: json!({"type": "object", "required": ["status", "stdout", "stderr", "truncated"],
                "properties": {
                    "status": {"type": "integer", "description": "As a shell gives it: 128+N for signal N"},
                    "stdout": {"type": "string"},
                    "stderr": {"type": "string"},
                    "truncated": {"type": "boolean", "description": "Only the last 64 KiB of a stream are kept"},
                    "call_seq": {"type": "integer"}}}),
        },
        ToolSpec {
            name: "read_file",
            description: "Read a file (up to 256 KiB of text) from an agent session's sandbox.",
            input: json!({"type": "object", "additionalProperties": false, "required": ["session", "path"],
                "properties": {
                    "session": session(),
                    "path": {"type": "string", "minLength": 1, "maxLength": 4096, "pattern": "^/"}}}),
            output: json!({"type": "object", "required": ["path", "size", "content"],
                "properties": {
                    "path": {"type": "string"}, "size": {"type": "integer"},
                    "content": {"type": "string", "description": "The text (invalid UTF-8 replaced)"}}}),
        },
        ToolSpec {
            name: "write_file",
            description: "Write a file (up to 1 MiB of text) into an agent session's sandbox; recorded in the \
                          session's context log with its hash and the reason.",
            input: json!({"type": "object", "additionalProperties": false,
                "required": ["session", "path", "content", "reason"],
                "properties": {
                    "session": session(),
                    "path": {"type": "string", "minLength": 2, "maxLength": 4096, "pattern": "^/"},
                    "content": {"type": "string", "maxLength": 1048576},
                    "mode": {"type": "integer", "minimum": 0, "maximum": 4095},
                    "reason": reason()}}),
            output: json!({"type": "object", "required": ["path", "size"],
                "properties": {"path": {"type": "string"}, "size": {"type": "integer"}}}),
        },
        ToolSpec {
            name: "session_create",
            description: "Start a new agent session: a sandbox from an image (busybox when neither is given) or \
                          restored from a snapshot, and a context log whose first entry names the caller and the \
                          reason.",
            input: json!({"type": "object", "additionalProperties": false, "required": ["reason"],
                "properties": {
                    "image": {"type": "string", "minLength": 1, "maxLength": 256,
                              "description": "An image name (`cairn images`); or give snapshot_id"},
                    "snapshot_id": snapshot_id(),
                    "name": {"type": "string", "minLength": 1, "maxLength": 63,
                             "pattern": "^[A-Za-z0-9][A-Za-z0-9_-]*$",
                             "description": "A name to find the session by"},
                    "reason": reason()}}),
            output: session_result(),
        },
        ToolSpec {
            name: "session_suspend",
            description: "Suspend an agent session: its sandbox is snapshotted and removed; exec, read_file, \
                          write_file and session_resume bring it back. A session running a command is busy: try later.",
            input: json!({"type": "object", "additionalProperties": false, "required": ["session", "reason"],
                "properties": {"session": session(), "reason": reason()}}),
            output: session_result(),
        },
        ToolSpec {
            name: "session_resume",
            description: "Resume a suspended (or failed) agent session: its sandbox is restored from its newest \
                          snapshot.",
            input: json!({"type": "object", "additionalProperties": false, "required": ["session", "reason"],
                "properties": {"session": session(), "reason": reason()}}),
            output: session_result(),
        },
        ToolSpec {
            name: "session_fork",
            description: "Fork an agent session: a new session whose log is the parent's so far and whose sandbox \
                          is restored from the parent's newest snapshot (take one with snapshot first to carry the \
                          files as they are now).",
            input: json!({"type": "object", "additionalProperties": false, "required": ["session", "reason"],
                "properties": {
                    "session": session(),
                    "name": {"type": "string", "minLength": 1, "maxLength": 63,
                             "pattern": "^[A-Za-z0-9][A-Za-z0-9_-]*$"},
                    "reason": reason()}}),
            output: session_result(),
        },
        ToolSpec {
            name: "session_close",
            description: "Close an agent session: its sandbox is removed; its log stays (and its snapshots) \
                          unless purge.",
            input: json!({"type": "object", "additionalProperties": false, "required": ["session", "reason"],
                "properties": {
                    "session": session(),
                    "purge": {"type": "boolean", "description": "Delete its log too (refused while it has forks)"},
                    "reason": reason()}}),
            output: session_result(),
        },
    ]
}

/// The whole schema as one JSON document: the block in `docs/tools.md`.
pub fn document() -> Value {
    json!({
        "version": TOOLS_VERSION,
        "tools": tools().into_iter().map(|t| json!({
            "name": t.name, "description": t.description,
            "inputSchema": t.input, "outputSchema": t.output,
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checks a JSON Schema validator's meta-schema makes on the
    /// keywords these schemas use.
    fn check_schema(at: &str, s: &Value) {
        let o = s.as_object().unwrap_or_else(|| panic!("{at}: a schema is an object"));
        let known = [
            "type",
            "properties",
            "required",
            "additionalProperties",
            "items",
            "minItems",
            "maxItems",
            "minLength",
            "maxLength",
            "pattern",
            "minimum",
            "maximum",
            "enum",
            "description",
        ];
        for k in o.keys() {
            assert!(known.contains(&k.as_str()), "{at}: unknown keyword {k}");
        }
        let types = ["object", "array", "string", "integer", "number", "boolean", "null"];
        match &o["type"] {
            Value::String(t) => assert!(types.contains(&t.as_str()), "{at}: type {t}"),
            Value::Array(ts) => assert!(ts.iter().all(|t| types.contains(&t.as_str().unwrap_or("")))),
            other => panic!("{at}: type is {other}"),
        }
        if let Some(p) = o.get("properties") {
            let p = p.as_object().expect("properties is an object");
            for (name, sub) in p {
                check_schema(&format!("{at}.{name}"), sub);
            }
            for r in o.get("required").and_then(Value::as_array).into_iter().flatten() {
                assert!(
                    p.contains_key(r.as_str().unwrap()),
                    "{at}: required {r} is not a property"
                );
            }
        }
        if let Some(i) = o.get("items") {
            check_schema(&format!("{at}[]"), i);
        }
        if let Some(p) = o.get("pattern") {
            assert!(p.as_str().is_some_and(|p| p.starts_with('^')), "{at}: pattern {p}");
        }
        for k in ["minLength", "maxLength", "minItems", "maxItems"] {
            if let Some(v) = o.get(k) {
                assert!(v.as_u64().is_some(), "{at}: {k} is a non-negative integer");
            }
        }
    }

    #[test]
    fn every_tool_schema_is_a_closed_object_schema() {
        let specs = tools();
        let mut names: Vec<_> = specs.iter().map(|t| t.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), specs.len(), "tool names are unique");
        for t in specs {
            assert!(t.name.chars().all(|c| c.is_ascii_lowercase() || c == '_'), "{}", t.name);
            check_schema(t.name, &t.input);
            check_schema(&format!("{}->", t.name), &t.output);
            assert_eq!(t.input["type"], "object");
            assert_eq!(
                t.input["additionalProperties"], false,
                "{}: unknown arguments are refused",
                t.name
            );
            assert_eq!(t.output["type"], "object");
        }
    }

    #[test]
    fn docs_tools_md_holds_this_schema() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/tools.md");
        let text = std::fs::read_to_string(path).expect("docs/tools.md exists");
        let start = text.find("```json\n").expect("docs/tools.md has a ```json block") + 8;
        let end = start + text[start..].find("\n```").expect("the block ends");
        let documented: Value = serde_json::from_str(&text[start..end]).expect("the block is JSON");
        assert!(
            documented == document(),
            "docs/tools.md's schema differs from the code: replace its ```json block with the output of \
             `cairn mcp --schema`"
        );
    }
}

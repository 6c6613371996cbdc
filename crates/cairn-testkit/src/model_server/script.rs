//! The script a `ScriptedModel` plays: one reply per assistant turn, each
//! with the failures served before it. Parsed once, strictly: a typo in a
//! test's script is an error naming the field, not a silently empty turn.

use serde::Deserialize;
use serde_json::Value;
use std::fmt;

/// The longest `delay_ms` a script may ask for (ten minutes).
const DELAY_MAX_MS: u64 = 600_000;

#[derive(Debug, Clone)]
pub struct Script {
    pub turns: Vec<Turn>,
}

#[derive(Debug, Clone)]
pub struct Turn {
    pub text: Option<String>,
    pub tool_calls: Vec<ToolCall>,
    pub fail: Vec<Failure>,
    pub stop: Option<Stop>,
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Arguments,
}

#[derive(Debug, Clone)]
pub enum Arguments {
    /// A JSON object whose strings may hold `{{results[..]}}` placeholders.
    Json(Value),
    /// Text sent as it is (a malformed call, for the client's error path).
    Raw(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Answer this status with the provider's error body.
    Status { status: u16, retry_after: Option<u64> },
    /// Sleep, then answer the turn's reply.
    Delay { ms: u64 },
}

/// Why the model stopped, in provider-neutral terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    EndTurn,
    ToolUse,
    MaxTokens,
}

impl Stop {
    pub fn anthropic(self) -> &'static str {
        match self {
            Stop::EndTurn => "end_turn",
            Stop::ToolUse => "tool_use",
            Stop::MaxTokens => "max_tokens",
        }
    }

    pub fn openai(self) -> &'static str {
        match self {
            Stop::EndTurn => "stop",
            Stop::ToolUse => "tool_calls",
            Stop::MaxTokens => "length",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Usage {
    pub input: u64,
    pub output: u64,
}

/// A script that cannot be played, with where and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScriptError(pub String);

impl fmt::Display for ScriptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ScriptError {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScriptFile {
    turns: Vec<TurnFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TurnFile {
    text: Option<String>,
    #[serde(default)]
    tool_calls: Vec<ToolCallFile>,
    #[serde(default)]
    fail: Vec<FailureFile>,
    stop: Option<String>,
    usage: Option<Usage>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolCallFile {
    name: String,
    arguments: Option<Value>,
    raw_arguments: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FailureFile {
    status: Option<u16>,
    retry_after: Option<u64>,
    delay_ms: Option<u64>,
}

impl Script {
    pub fn from_json(value: Value) -> Result<Script, ScriptError> {
        let file: ScriptFile = serde_json::from_value(value).map_err(|e| {
            ScriptError(format!(
                "the script is not {{\"turns\": [{{text?, tool_calls?, fail?, stop?, usage?}}, ...]}}: {e}"
            ))
        })?;
        if file.turns.is_empty() {
            return Err(ScriptError("the script has no turns: give at least one".into()));
        }
        let turns = file
            .turns
            .into_iter()
            .enumerate()
            .map(|(n, t)| turn(t).map_err(|e| ScriptError(format!("turn {n}: {e}"))))
            .collect::<Result<_, _>>()?;
        Ok(Script { turns })
    }
}

fn turn(file: TurnFile) -> Result<Turn, String> {
    let text = file.text.filter(|t| !t.is_empty());
    if text.is_none() && file.tool_calls.is_empty() {
        return Err("has neither text nor tool_calls: a reply needs one of them".into());
    }
    let tool_calls = file
        .tool_calls
        .into_iter()
        .enumerate()
        .map(|(k, c)| tool_call(c).map_err(|e| format!("tool_calls[{k}]: {e}")))
        .collect::<Result<_, _>>()?;
    let fail = file
        .fail
        .into_iter()
        .enumerate()
        .map(|(k, f)| failure(f).map_err(|e| format!("fail[{k}]: {e}")))
        .collect::<Result<_, _>>()?;
    let stop = file.stop.as_deref().map(stop).transpose()?;
    Ok(Turn {
        text,
        tool_calls,
        fail,
        stop,
        usage: file.usage,
    })
}

fn tool_call(file: ToolCallFile) -> Result<ToolCall, String> {
    if file.name.is_empty() {
        return Err("name is empty".into());
    }
    let arguments = match (file.arguments, file.raw_arguments) {
        (Some(Value::Object(map)), None) => Arguments::Json(Value::Object(map)),
        (Some(_), None) => return Err("arguments must be a JSON object".into()),
        (None, Some(raw)) => Arguments::Raw(raw),
        (None, None) => Arguments::Json(Value::Object(Default::default())),
        (Some(_), Some(_)) => {
            return Err("has both arguments and raw_arguments: give one".into());
        }
    };
    Ok(ToolCall {
        name: file.name,
        arguments,
    })
}

fn failure(file: FailureFile) -> Result<Failure, String> {
    match (file.status, file.delay_ms) {
        (Some(status), None) if (400..=599).contains(&status) => Ok(Failure::Status {
            status,
            retry_after: file.retry_after,
        }),
        (Some(status), None) => Err(format!("status {status} is not an error (give 400..=599)")),
        (None, Some(_)) if file.retry_after.is_some() => {
            Err("retry_after goes with a status, not with delay_ms".into())
        }
        (None, Some(ms)) if ms > DELAY_MAX_MS => Err(format!("delay_ms {ms} is over the limit of {DELAY_MAX_MS}")),
        (None, Some(ms)) => Ok(Failure::Delay { ms }),
        (Some(_), Some(_)) => Err("has both status and delay_ms: give one".into()),
        (None, None) => Err("needs status or delay_ms".into()),
    }
}

fn stop(name: &str) -> Result<Stop, String> {
    match name {
        "end_turn" | "stop" => Ok(Stop::EndTurn),
        "tool_use" | "tool_calls" => Ok(Stop::ToolUse),
        "max_tokens" | "length" => Ok(Stop::MaxTokens),
        other => Err(format!(
            "stop {other:?} is not one of end_turn (stop), tool_use (tool_calls), max_tokens (length)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_full_script_parses() {
        let script = Script::from_json(json!({"turns": [
            {"text": "plan", "tool_calls": [{"name": "a", "arguments": {"x": 1}}],
             "fail": [{"status": 429, "retry_after": 1}, {"delay_ms": 5}]},
            {"tool_calls": [{"name": "b", "raw_arguments": "{nope"}], "stop": "length"},
            {"text": "done", "stop": "end_turn", "usage": {"input": 3, "output": 4}}
        ]}))
        .unwrap();
        assert_eq!(script.turns.len(), 3);
        assert_eq!(
            script.turns[0].fail,
            vec![
                Failure::Status {
                    status: 429,
                    retry_after: Some(1)
                },
                Failure::Delay { ms: 5 }
            ]
        );
        assert_eq!(script.turns[1].stop, Some(Stop::MaxTokens));
        assert!(matches!(script.turns[1].tool_calls[0].arguments, Arguments::Raw(ref r) if r == "{nope"));
        assert_eq!(script.turns[2].usage, Some(Usage { input: 3, output: 4 }));
    }

    #[test]
    fn bad_scripts_are_refused_naming_the_place() {
        let cases = [
            (json!({"turns": []}), "no turns"),
            (json!({"turns": [{}]}), "turn 0: has neither"),
            (
                json!({"turns": [{"text": "a", "tool_calls": [{"name": "x", "arguments": [1]}]}]}),
                "JSON object",
            ),
            (
                json!({"turns": [{"text": "a", "fail": [{"status": 200}]}]}),
                "not an error",
            ),
            (
                json!({"turns": [{"text": "a", "fail": [{}]}]}),
                "needs status or delay_ms",
            ),
            (json!({"turns": [{"text": "a", "stop": "halt"}]}), "stop \"halt\""),
            (json!({"turns": [{"text": "a", "txt": "b"}]}), "unknown field `txt`"),
            (
                json!({"turns": [{"text": "a"}, {"text": "b", "fail": [{"delay_ms": 700000}]}]}),
                "turn 1: fail[0]",
            ),
        ];
        for (script, expected) in cases {
            let err = Script::from_json(script.clone()).unwrap_err().0;
            assert!(err.contains(expected), "{script}: {err}");
        }
    }
}

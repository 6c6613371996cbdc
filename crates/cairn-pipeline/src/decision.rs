//! A decide stage's answer: the `decide` tool's JSON Schema, built from what
//! the stage may choose, and the check every answer passes before it is
//! recorded. The model's arguments are hostile input: sizes are bounded and
//! every name is checked against the pipeline.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::spec::Choice;

/// Most hypotheses one decision may choose, and fewest.
pub const MAX_HYPOTHESES: usize = 16;
pub const MIN_HYPOTHESES: usize = 2;
/// Longest hypothesis name, in bytes.
pub const MAX_NAME: usize = 32;
/// Longest value (a hypothesis's field, a parameter), in bytes.
pub const MAX_VALUE: usize = 1024;
/// Longest reason, in bytes.
pub const MAX_REASON: usize = 2000;
/// Largest answer, serialised, in bytes.
pub const MAX_ANSWER: usize = 64 << 10;
/// Version of the stored answer (`decisions.answer`, docs/formats.md).
pub const ANSWER_VERSION: u32 = 1;

/// What the model chose.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Answer {
    pub reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hypotheses: Option<Vec<BTreeMap<String, String>>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<Action>,
}

/// What becomes of the stage before the decide stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Its output goes on to the next stage.
    Continue,
    /// It runs again from its input; then the decide stage decides again.
    Retry,
    /// It goes to the dead-letter queue and the run fails.
    Dlq,
}

/// The answer as stored: versioned.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Stored {
    v: u32,
    answer: Answer,
}

impl Answer {
    /// The stored form (`{"v": 1, "answer": {...}}`).
    pub fn to_stored(&self) -> String {
        serde_json::to_string(&Stored {
            v: ANSWER_VERSION,
            answer: self.clone(),
        })
        .expect("an answer serialises")
    }

    /// Reads a stored answer; one of another version or damaged is refused.
    pub fn from_stored(text: &str) -> Result<Answer, String> {
        if text.len() > MAX_ANSWER * 2 {
            return Err("a recorded decision is larger than any Cairn writes; the state store is damaged".into());
        }
        let v: Value = serde_json::from_str(text).map_err(|e| format!("a recorded decision is damaged: {e}"))?;
        match v.get("v").and_then(Value::as_u64) {
            Some(n) if n == u64::from(ANSWER_VERSION) => {}
            Some(n) => {
                return Err(format!(
                    "a recorded decision has format version {n}, written by a newer Cairn; upgrade to read it"
                ))
            }
            None => return Err("a recorded decision has no format version; the state store is damaged".into()),
        }
        serde_json::from_value::<Stored>(v)
            .map(|s| s.answer)
            .map_err(|e| format!("a recorded decision is damaged: {e}"))
    }

    /// One line for lineage: what was chosen.
    pub fn summary(&self) -> String {
        let mut parts = Vec::new();
        if let Some(h) = &self.hypotheses {
            let names: Vec<&str> = h.iter().filter_map(|h| h.get("name").map(String::as_str)).collect();
            parts.push(format!("hypotheses {}", names.join(", ")));
        }
        if let Some(p) = &self.params {
            let kv: Vec<String> = p.iter().map(|(k, v)| format!("{k}={v}")).collect();
            parts.push(format!(
                "params {}",
                if kv.is_empty() {
                    "unchanged".into()
                } else {
                    kv.join(" ")
                }
            ));
        }
        if let Some(a) = self.action {
            parts.push(format!("{a:?}").to_lowercase());
        }
        parts.join("; ")
    }
}

/// What an answer must fit: the stage's choices, the next stage's
/// hypothesis fields, the pipeline's declared parameters.
#[derive(Debug, Clone)]
pub struct Rules {
    pub choose: Vec<Choice>,
    /// `{hypothesis.KEY}` keys the next stage uses.
    pub fields: Vec<String>,
    pub params: BTreeSet<String>,
}

fn string(max: usize) -> Value {
    json!({ "type": "string", "maxLength": max })
}

/// The `decide` tool's input schema.
pub fn schema(rules: &Rules) -> Value {
    let mut props = serde_json::Map::new();
    let mut required = vec![json!("reason")];
    props.insert(
        "reason".into(),
        json!({ "type": "string", "minLength": 1, "maxLength": MAX_REASON, "description": "Why: what in the evidence supports this choice" }),
    );
    for c in &rules.choose {
        match c {
            Choice::Hypotheses => {
                let mut item = serde_json::Map::new();
                item.insert(
                    "name".into(),
                    json!({ "type": "string", "pattern": format!("^[A-Za-z0-9_-]{{1,{MAX_NAME}}}$") }),
                );
                for f in &rules.fields {
                    item.insert(f.clone(), string(MAX_VALUE));
                }
                let mut req = vec![json!("name")];
                req.extend(rules.fields.iter().map(|f| json!(f)));
                props.insert(
                    "hypotheses".into(),
                    json!({
                        "type": "array", "minItems": MIN_HYPOTHESES, "maxItems": MAX_HYPOTHESES,
                        "description": "The hypotheses the next stage runs in parallel, one branch each; names unique",
                        "items": { "type": "object", "properties": item, "required": req, "additionalProperties": false }
                    }),
                );
                required.push(json!("hypotheses"));
            }
            Choice::Params => {
                let p: serde_json::Map<String, Value> =
                    rules.params.iter().map(|k| (k.clone(), string(MAX_VALUE))).collect();
                props.insert(
                    "params".into(),
                    json!({ "type": "object", "properties": p, "additionalProperties": false,
                            "description": "New values for the pipeline's parameters; leave out those to keep" }),
                );
                required.push(json!("params"));
            }
            Choice::RetryOrDlq => {
                props.insert(
                    "action".into(),
                    json!({ "type": "string", "enum": ["continue", "retry", "dlq"],
                            "description": "continue: the previous stage's output goes on; retry: run it again; dlq: send it to the dead-letter queue and stop the run" }),
                );
                required.push(json!("action"));
            }
        }
    }
    json!({ "type": "object", "properties": props, "required": required, "additionalProperties": false })
}

/// A value a command may receive: bounded, no control characters.
fn check_value(what: &str, v: &str) -> Result<(), String> {
    if v.len() > MAX_VALUE {
        return Err(format!("{what} is {} bytes; at most {MAX_VALUE}", v.len()));
    }
    if v.chars().any(char::is_control) {
        return Err(format!("{what} holds a control character (a newline?); give one line"));
    }
    Ok(())
}

/// Checks the model's arguments against the rules; the error says what to
/// fix, for the model to try again.
pub fn check(args: &Value, rules: &Rules) -> Result<Answer, String> {
    let size = serde_json::to_string(args).map(|s| s.len()).unwrap_or(usize::MAX);
    if size > MAX_ANSWER {
        return Err(format!("the answer is {size} bytes; at most {MAX_ANSWER}"));
    }
    let obj = args.as_object().ok_or("the arguments must be a JSON object")?;
    let allowed: Vec<&str> = std::iter::once("reason")
        .chain(rules.choose.iter().map(|c| match c {
            Choice::Hypotheses => "hypotheses",
            Choice::Params => "params",
            Choice::RetryOrDlq => "action",
        }))
        .collect();
    for k in obj.keys() {
        if !allowed.contains(&k.as_str()) {
            return Err(format!(
                "{k:?} is not an argument here; give only {}",
                allowed.join(", ")
            ));
        }
    }
    for k in &allowed {
        if !obj.contains_key(*k) {
            return Err(format!("{k:?} is missing; give {}", allowed.join(", ")));
        }
    }
    let answer: Answer = serde_json::from_value(args.clone()).map_err(|e| format!("the arguments do not fit: {e}"))?;
    if answer.reason.trim().is_empty() || answer.reason.len() > MAX_REASON {
        return Err(format!("reason must say why, in 1 to {MAX_REASON} bytes"));
    }
    if let Some(hs) = &answer.hypotheses {
        if !(MIN_HYPOTHESES..=MAX_HYPOTHESES).contains(&hs.len()) {
            return Err(format!(
                "give {MIN_HYPOTHESES} to {MAX_HYPOTHESES} hypotheses, not {}",
                hs.len()
            ));
        }
        let want: BTreeSet<&str> = std::iter::once("name")
            .chain(rules.fields.iter().map(String::as_str))
            .collect();
        let mut names = BTreeSet::new();
        for (i, h) in hs.iter().enumerate() {
            let name = h.get("name").ok_or(format!("hypothesis {} has no name", i + 1))?;
            if name.is_empty()
                || name.len() > MAX_NAME
                || !name
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
            {
                return Err(format!(
                    "hypothesis name {name:?}: use 1 to {MAX_NAME} letters, digits, '-' and '_'"
                ));
            }
            if !names.insert(name.clone()) {
                return Err(format!("two hypotheses are named {name:?}; names must be unique"));
            }
            let have: BTreeSet<&str> = h.keys().map(String::as_str).collect();
            if have != want {
                return Err(format!(
                    "hypothesis {name:?} has {}; each must have exactly {}",
                    have.into_iter().collect::<Vec<_>>().join(", "),
                    want.iter().copied().collect::<Vec<_>>().join(", ")
                ));
            }
            for (k, v) in h {
                check_value(&format!("{name}.{k}"), v)?;
            }
        }
    }
    if let Some(ps) = &answer.params {
        for (k, v) in ps {
            if !rules.params.contains(k) {
                return Err(format!(
                    "{k:?} is not a parameter of this pipeline; its parameters are {}",
                    rules.params.iter().cloned().collect::<Vec<_>>().join(", ")
                ));
            }
            check_value(&format!("parameter {k}"), v)?;
        }
    }
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> Rules {
        Rules {
            choose: vec![Choice::Hypotheses, Choice::Params, Choice::RetryOrDlq],
            fields: vec!["ff".into()],
            params: ["steps".to_string()].into(),
        }
    }

    fn good() -> Value {
        json!({
            "reason": "energies suggest it",
            "hypotheses": [{"name": "a", "ff": "amber"}, {"name": "b", "ff": "charmm"}],
            "params": {"steps": "100"},
            "action": "continue"
        })
    }

    #[test]
    fn a_good_answer_passes_and_round_trips_through_its_stored_form() {
        let a = check(&good(), &rules()).unwrap();
        assert_eq!(a.action, Some(Action::Continue));
        assert_eq!(Answer::from_stored(&a.to_stored()).unwrap(), a);
        assert_eq!(a.summary(), "hypotheses a, b; params steps=100; continue");
    }

    #[test]
    fn bad_answers_are_refused_with_what_to_fix() {
        let cases: Vec<(Value, &str)> = vec![
            (json!([1]), "JSON object"),
            (
                json!({"reason": "r", "hypotheses": [], "params": {}, "action": "continue"}),
                "2 to 16",
            ),
            (
                json!({"reason": "", "hypotheses": good()["hypotheses"], "params": {}, "action": "retry"}),
                "reason",
            ),
            (json!({"reason": "r", "params": {}, "action": "continue"}), "missing"),
            (
                json!({"reason": "r", "hypotheses": good()["hypotheses"], "params": {"nope": "1"}, "action": "dlq"}),
                "not a parameter",
            ),
            (
                json!({"reason": "r", "hypotheses": good()["hypotheses"], "params": {}, "action": "later"}),
                "do not fit",
            ),
            (
                json!({"reason": "r", "hypotheses": [{"name": "a", "ff": "1"}, {"name": "a", "ff": "2"}], "params": {}, "action": "continue"}),
                "unique",
            ),
            (
                json!({"reason": "r", "hypotheses": [{"name": "a b", "ff": "1"}, {"name": "c", "ff": "2"}], "params": {}, "action": "continue"}),
                "letters",
            ),
            (
                json!({"reason": "r", "hypotheses": [{"name": "a"}, {"name": "c", "ff": "2"}], "params": {}, "action": "continue"}),
                "exactly",
            ),
            (
                json!({"reason": "r", "hypotheses": [{"name": "a", "ff": "x\ny"}, {"name": "c", "ff": "2"}], "params": {}, "action": "continue"}),
                "control",
            ),
            (
                json!({"reason": "r", "hypotheses": good()["hypotheses"], "params": {}, "action": "continue", "extra": 1}),
                "not an argument",
            ),
            (json!({"reason": "r".repeat(MAX_ANSWER + 1)}), "bytes"),
        ];
        for (args, says) in cases {
            let e = check(&args, &rules()).unwrap_err();
            assert!(e.contains(says), "{args}: {e}");
        }
        let many: Vec<Value> = (0..17).map(|i| json!({"name": format!("h{i}"), "ff": "1"})).collect();
        let e = check(
            &json!({"reason": "r", "hypotheses": many, "params": {}, "action": "continue"}),
            &rules(),
        )
        .unwrap_err();
        assert!(e.contains("not 17"), "{e}");
    }

    #[test]
    fn a_stored_answer_of_another_version_or_damaged_is_refused() {
        let a = check(&good(), &rules()).unwrap();
        let future = a.to_stored().replace("\"v\":1", "\"v\":2");
        assert!(Answer::from_stored(&future).unwrap_err().contains("newer Cairn"));
        assert!(Answer::from_stored("{\"answer\":{}}")
            .unwrap_err()
            .contains("no format version"));
        assert!(Answer::from_stored("{not json").unwrap_err().contains("damaged"));
        let extra = a.to_stored().replace("\"v\":1", "\"v\":1,\"x\":0");
        assert!(Answer::from_stored(&extra).unwrap_err().contains("damaged"));
    }

    #[test]
    fn the_schema_asks_for_exactly_what_the_stage_chooses() {
        let s = schema(&Rules {
            choose: vec![Choice::Hypotheses],
            fields: vec!["ff".into()],
            params: BTreeSet::new(),
        });
        assert_eq!(s["required"], json!(["reason", "hypotheses"]));
        assert_eq!(
            s["properties"]["hypotheses"]["items"]["required"],
            json!(["name", "ff"])
        );
        assert!(s["properties"].get("action").is_none());
    }
}

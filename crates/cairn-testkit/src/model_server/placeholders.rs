//! `{{results[i].a.b[0]}}` in a scripted tool call's arguments: filled from
//! the tool results the request carries, so a script can pass on an id the
//! real tools made (a snapshot id, a run handle) without knowing it ahead.

use serde_json::Value;

/// How much of each result an error message shows.
const PREVIEW_CHARS: usize = 160;
/// How many results an error message lists.
const PREVIEW_RESULTS: usize = 8;

/// Every tool result in an Anthropic conversation, in order: the
/// `tool_result` blocks of user messages, content as a string or text
/// blocks, parsed as JSON when it is JSON.
pub fn anthropic_results(messages: &[Value]) -> Vec<Value> {
    let blocks = messages
        .iter()
        .filter(|m| m["role"] == "user")
        .filter_map(|m| m["content"].as_array())
        .flatten()
        .filter(|b| b["type"] == "tool_result");
    blocks.map(|b| parsed(&b["content"])).collect()
}

/// Every tool result in an OpenAI conversation, in order: the
/// `role: "tool"` messages, parsed as JSON when they are JSON.
pub fn openai_results(messages: &[Value]) -> Vec<Value> {
    messages
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| parsed(&m["content"]))
        .collect()
}

/// A result's content as one value: text (a string or text blocks joined)
/// parsed as JSON when it parses, else the text itself.
fn parsed(content: &Value) -> Value {
    let text = match content {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks.iter().filter_map(|b| b["text"].as_str()).collect(),
        Value::Null => String::new(),
        other => return other.clone(),
    };
    serde_json::from_str(&text).unwrap_or(Value::String(text))
}

/// `arguments` with every placeholder in its strings filled. A string that
/// is exactly one placeholder becomes the value itself (of any type); a
/// placeholder inside longer text is replaced by the value's text.
pub fn fill(arguments: &Value, results: &[Value]) -> Result<Value, String> {
    match arguments {
        Value::String(s) => fill_string(s, results),
        Value::Array(items) => items
            .iter()
            .map(|v| fill(v, results))
            .collect::<Result<_, _>>()
            .map(Value::Array),
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| Ok((k.clone(), fill(v, results)?)))
            .collect::<Result<_, String>>()
            .map(Value::Object),
        other => Ok(other.clone()),
    }
}

fn fill_string(s: &str, results: &[Value]) -> Result<Value, String> {
    let mut out = String::new();
    let mut rest = s;
    while let Some(open) = rest.find("{{") {
        let Some(close) = rest[open + 2..].find("}}") else {
            break;
        };
        let expr = &rest[open + 2..open + 2 + close];
        let value = resolve(expr, results).map_err(|why| unresolved(expr, &why, results))?;
        let whole = rest.len() == s.len() && open == 0 && close + 4 == s.len();
        if whole {
            return Ok(value);
        }
        out.push_str(&rest[..open]);
        match value {
            Value::String(text) => out.push_str(&text),
            other => out.push_str(&other.to_string()),
        }
        rest = &rest[open + 4 + close..];
    }
    out.push_str(rest);
    Ok(Value::String(out))
}

#[derive(Clone, Copy)]
enum Step<'a> {
    Field(&'a str),
    Index(i64),
}

fn resolve(expr: &str, results: &[Value]) -> Result<Value, String> {
    let (first, steps) = parse(expr.trim())?;
    let mut at = index(results, first).ok_or_else(|| format!("there is no results[{first}]"))?;
    let mut path = format!("results[{first}]");
    for step in steps {
        let next = match (step, at) {
            (Step::Field(name), Value::Object(map)) => map.get(name),
            (Step::Index(i), Value::Array(items)) => index(items, i),
            _ => None,
        };
        let shown = match step {
            Step::Field(name) => format!(".{name}"),
            Step::Index(i) => format!("[{i}]"),
        };
        at = next.ok_or_else(|| format!("{path} is {} and has no {shown}", preview(at)))?;
        path.push_str(&shown);
    }
    Ok(at.clone())
}

/// Python-style: negative counts from the end.
fn index(items: &[Value], i: i64) -> Option<&Value> {
    let len = i64::try_from(items.len()).ok()?;
    let at = if i < 0 { len.checked_add(i)? } else { i };
    usize::try_from(at).ok().and_then(|at| items.get(at))
}

/// `results[i]` then `.name` or `[n]` steps.
fn parse(expr: &str) -> Result<(i64, Vec<Step<'_>>), String> {
    let bad = || format!("not results[i] followed by .field or [n] steps: {expr:?}");
    let rest = expr.strip_prefix("results").ok_or_else(bad)?;
    let (first, mut rest) = bracket(rest).ok_or_else(bad)?;
    let mut steps = Vec::new();
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix('.') {
            let end = after.find(['.', '[']).unwrap_or(after.len());
            let name = &after[..end];
            let ok = !name.is_empty() && name.chars().all(|c| c.is_alphanumeric() || c == '_' || c == '-');
            if !ok {
                return Err(bad());
            }
            steps.push(Step::Field(name));
            rest = &after[end..];
        } else {
            let (i, after) = bracket(rest).ok_or_else(bad)?;
            steps.push(Step::Index(i));
            rest = after;
        }
    }
    Ok((first, steps))
}

fn bracket(s: &str) -> Option<(i64, &str)> {
    let inner = s.strip_prefix('[')?;
    let end = inner.find(']')?;
    Some((inner[..end].trim().parse().ok()?, &inner[end + 1..]))
}

fn preview(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(PREVIEW_CHARS) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

fn unresolved(expr: &str, why: &str, results: &[Value]) -> String {
    let mut message = format!(
        "the script's placeholder {{{{{expr}}}}} cannot be filled: {why}; the request carries {} tool result(s)",
        results.len()
    );
    for (i, r) in results.iter().enumerate().take(PREVIEW_RESULTS) {
        message.push_str(&format!("; results[{i}] = {}", preview(r)));
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn results() -> Vec<Value> {
        vec![
            json!({"snapshots": [{"id": "snap-a"}], "n": 3}),
            json!("plain text"),
            json!({"ok": true}),
        ]
    }

    #[test]
    fn a_whole_string_placeholder_becomes_the_value_of_any_type() {
        let args = json!({"id": "{{results[0].snapshots[0].id}}", "n": "{{results[0].n}}", "all": "{{ results[-1] }}"});
        assert_eq!(
            fill(&args, &results()).unwrap(),
            json!({"id": "snap-a", "n": 3, "all": {"ok": true}})
        );
    }

    #[test]
    fn a_placeholder_inside_text_is_replaced_by_its_text() {
        let args =
            json!({"c": ["echo {{results[0].snapshots[-1].id}} {{results[0].n}} {{results[1]}}", "keep {{ this"]});
        assert_eq!(
            fill(&args, &results()).unwrap(),
            json!({"c": ["echo snap-a 3 plain text", "keep {{ this"]})
        );
    }

    #[test]
    fn an_unresolved_placeholder_names_itself_and_the_results() {
        let err = fill(&json!({"x": "{{results[0].snapshot.id}}"}), &results()).unwrap_err();
        assert!(
            err.contains("{{results[0].snapshot.id}}") && err.contains("has no .snapshot"),
            "{err}"
        );
        assert!(
            err.contains("3 tool result(s)") && err.contains("results[1] = \"plain text\""),
            "{err}"
        );
        let err = fill(&json!("{{results[3]}}"), &results()).unwrap_err();
        assert!(err.contains("there is no results[3]"), "{err}");
        let err = fill(&json!("{{results[-4]}}"), &[]).unwrap_err();
        assert!(err.contains("0 tool result(s)"), "{err}");
        let err = fill(&json!("{{calls[0]}}"), &results()).unwrap_err();
        assert!(err.contains("not results[i]"), "{err}");
        let err = fill(&json!("{{results[i64::MIN]}}"), &results()).unwrap_err();
        assert!(err.contains("not results[i]"), "{err}");
        assert!(fill(&json!(format!("{{{{results[{}]}}}}", i64::MIN)), &results()).is_err());
    }

    #[test]
    fn results_are_collected_from_both_providers_in_order() {
        let anthropic = json!([
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "a", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t", "content": "{\"a\": 1}"},
                {"type": "tool_result", "tool_use_id": "u", "content": [{"type": "text", "text": "[1,"}, {"type": "text", "text": "2]"}]},
                {"type": "tool_result", "tool_use_id": "v", "content": "not json"}
            ]}
        ]);
        let got = anthropic_results(anthropic.as_array().unwrap());
        assert_eq!(got, vec![json!({"a": 1}), json!([1, 2]), json!("not json")]);
        let openai = json!([
            {"role": "user", "content": "go"},
            {"role": "tool", "tool_call_id": "c", "content": "{\"b\": 2}"},
            {"role": "tool", "tool_call_id": "d", "content": [{"type": "text", "text": "7"}]}
        ]);
        assert_eq!(
            openai_results(openai.as_array().unwrap()),
            vec![json!({"b": 2}), json!(7)]
        );
    }
}

//! The checks a request must pass before it is answered: what the real
//! APIs refuse (and a little more, where a refusal would only come later,
//! such as a tool call left unanswered). Each problem is a sentence naming
//! the place in the request; the server records them as violations.

use axum::http::HeaderMap;
use serde_json::{Map, Value};
use std::collections::BTreeSet;

/// The largest `max_tokens` the Anthropic SDK sends without streaming.
pub const ANTHROPIC_MAX_TOKENS: u64 = 21_333;
/// Problems listed per request, at most.
const PROBLEMS_MAX: usize = 20;

#[derive(Default)]
struct Problems(Vec<String>);

impl Problems {
    fn push(&mut self, problem: String) {
        if self.0.len() < PROBLEMS_MAX {
            self.0.push(problem);
        }
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

fn bearer(headers: &HeaderMap) -> bool {
    header(headers, "authorization")
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|token| !token.trim().is_empty())
}

/// The fields every request shares: a JSON object with a `model` and a
/// non-empty `messages` array, not streamed.
fn common<'a>(body: &'a Value, p: &mut Problems) -> Option<&'a [Value]> {
    let Some(body) = body.as_object() else {
        p.push("the body is not a JSON object".into());
        return None;
    };
    if body.get("model").and_then(Value::as_str).is_none_or(str::is_empty) {
        p.push("model is missing or not a non-empty string".into());
    }
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        p.push("stream is true: the scripted model answers whole messages only; send stream false".into());
    }
    match body.get("messages").and_then(Value::as_array) {
        Some(messages) if !messages.is_empty() => Some(messages),
        _ => {
            p.push("messages is missing, not an array or empty".into());
            None
        }
    }
}

/// The problems of a Messages API request (`POST /v1/messages`).
pub fn anthropic(headers: &HeaderMap, body: &Value) -> Vec<String> {
    let mut p = Problems::default();
    if header(headers, "x-api-key").is_none() && !bearer(headers) {
        p.push("no x-api-key header (nor Authorization: Bearer)".into());
    }
    if header(headers, "anthropic-version").is_none() {
        p.push("no anthropic-version header".into());
    }
    let messages = common(body, &mut p);
    match body.get("max_tokens").and_then(Value::as_u64) {
        Some(n) if (1..=ANTHROPIC_MAX_TOKENS).contains(&n) => {}
        Some(n) => p.push(format!("max_tokens {n} is not in 1..={ANTHROPIC_MAX_TOKENS}")),
        None => p.push("max_tokens is missing or not a positive integer".into()),
    }
    if let Some(tools) = body.get("tools") {
        anthropic_tools(tools, &mut p);
    }
    if let Some(messages) = messages {
        anthropic_messages(messages, &mut p);
    }
    p.0
}

fn anthropic_tools(tools: &Value, p: &mut Problems) {
    let Some(tools) = tools.as_array() else {
        return p.push("tools is not an array".into());
    };
    let mut names = BTreeSet::new();
    for (i, tool) in tools.iter().enumerate() {
        let name = tool["name"].as_str().filter(|n| !n.is_empty());
        match name {
            None => p.push(format!("tools[{i}] has no name")),
            Some(n) if !names.insert(n) => p.push(format!("tools[{i}]: the name {n:?} is given twice")),
            Some(_) => {}
        }
        if !tool["description"].is_string() {
            p.push(format!("tools[{i}] has no description"));
        }
        if tool["input_schema"]["type"] != "object" {
            p.push(format!(
                "tools[{i}].input_schema is not an object schema ({{\"type\": \"object\", ...}})"
            ));
        }
    }
}

fn blocks(message: &Value) -> &[Value] {
    message["content"].as_array().map(Vec::as_slice).unwrap_or_default()
}

fn anthropic_messages(messages: &[Value], p: &mut Problems) {
    // A set: a hostile request may carry thousands of calls.
    let mut pending: BTreeSet<&str> = BTreeSet::new();
    for (i, m) in messages.iter().enumerate() {
        let role = m["role"].as_str().unwrap_or("");
        let expected = if i % 2 == 0 { "user" } else { "assistant" };
        if role != expected {
            p.push(format!(
                "messages[{i}] has role {role:?}, expected {expected:?}: roles alternate starting with user"
            ));
        }
        if !(m["content"].is_string() || m["content"].is_array()) {
            p.push(format!(
                "messages[{i}].content is neither a string nor an array of blocks"
            ));
        }
        for (k, b) in blocks(m).iter().enumerate() {
            let at = format!("messages[{i}].content[{k}]");
            match b["type"].as_str() {
                Some("text") if !b["text"].is_string() => p.push(format!("{at} is a text block without text")),
                Some("tool_use") if role != "assistant" => {
                    p.push(format!("{at}: a tool_use block outside an assistant message"))
                }
                Some("tool_use") if !(b["id"].is_string() && b["name"].is_string() && b["input"].is_object()) => {
                    p.push(format!("{at}: a tool_use block needs id, name and an object input"))
                }
                Some("tool_result") if role != "user" => {
                    p.push(format!("{at}: a tool_result block outside a user message"))
                }
                Some("tool_result") => {
                    let id = b["tool_use_id"].as_str().unwrap_or("");
                    if !pending.remove(id) {
                        p.push(format!(
                            "{at}: tool_result for {id:?}, which the message before did not ask for (or was answered already)"
                        ));
                    }
                }
                None => p.push(format!("{at} has no type")),
                _ => {}
            }
        }
        for id in std::mem::take(&mut pending) {
            p.push(format!(
                "messages[{}]: tool_use {id:?} is not answered by a tool_result in the next user message",
                i - 1
            ));
        }
        if role == "assistant" {
            pending = blocks(m)
                .iter()
                .filter(|b| b["type"] == "tool_use")
                .filter_map(|b| b["id"].as_str())
                .collect();
        }
    }
    if messages.len().is_multiple_of(2) {
        p.push("the last message is the assistant's: the scripted model does not continue a prefilled reply".into());
    }
}

/// The problems of a Chat Completions request (`POST /v1/chat/completions`).
pub fn openai(headers: &HeaderMap, body: &Value) -> Vec<String> {
    let mut p = Problems::default();
    if !bearer(headers) {
        p.push("no Authorization: Bearer header".into());
    }
    let messages = common(body, &mut p);
    if let Some(tools) = body.get("tools") {
        openai_tools(tools, &mut p);
    }
    if let Some(messages) = messages {
        openai_messages(messages, &mut p);
    }
    p.0
}

fn openai_tools(tools: &Value, p: &mut Problems) {
    let Some(tools) = tools.as_array() else {
        return p.push("tools is not an array".into());
    };
    let mut names = BTreeSet::new();
    for (i, tool) in tools.iter().enumerate() {
        if tool["type"] != "function" {
            p.push(format!("tools[{i}].type is not \"function\""));
        }
        let function = &tool["function"];
        match function["name"].as_str().filter(|n| !n.is_empty()) {
            None => p.push(format!("tools[{i}].function has no name")),
            Some(n) if !names.insert(n) => p.push(format!("tools[{i}]: the name {n:?} is given twice")),
            Some(_) => {}
        }
        if !function["description"].is_string() {
            p.push(format!("tools[{i}].function has no description"));
        }
        if function["parameters"]["type"] != "object" {
            p.push(format!(
                "tools[{i}].function.parameters is not an object schema ({{\"type\": \"object\", ...}})"
            ));
        }
    }
}

fn openai_messages(messages: &[Value], p: &mut Problems) {
    // A set: a hostile request may carry thousands of calls.
    let mut pending: BTreeSet<&str> = BTreeSet::new();
    let mut asked_at = 0;
    for (i, m) in messages.iter().enumerate() {
        let role = m["role"].as_str().unwrap_or("");
        if role != "tool" {
            for id in std::mem::take(&mut pending) {
                p.push(format!(
                    "messages[{asked_at}]: tool call {id:?} is not answered by a role \"tool\" message before messages[{i}]"
                ));
            }
        }
        match role {
            "system" | "developer" | "user" => {
                if !(m["content"].is_string() || m["content"].is_array()) {
                    p.push(format!(
                        "messages[{i}].content is neither a string nor an array of parts"
                    ));
                }
            }
            "assistant" => {
                let calls = m
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .map(Vec::as_slice)
                    .unwrap_or_default();
                let content = m.get("content").unwrap_or(&Value::Null);
                if calls.is_empty() && !(content.is_string() || content.is_array()) {
                    p.push(format!(
                        "messages[{i}] is an assistant message with neither content nor tool_calls"
                    ));
                }
                for (k, call) in calls.iter().enumerate() {
                    openai_call(&format!("messages[{i}].tool_calls[{k}]"), call, p);
                }
                pending = calls.iter().filter_map(|c| c["id"].as_str()).collect();
                asked_at = i;
            }
            "tool" => {
                let id = m["tool_call_id"].as_str().unwrap_or("");
                if !pending.remove(id) {
                    p.push(format!(
                        "messages[{i}]: a tool message for {id:?}, which no unanswered assistant tool call asked for"
                    ));
                }
                if !(m["content"].is_string() || m["content"].is_array()) {
                    p.push(format!(
                        "messages[{i}].content is neither a string nor an array of parts"
                    ));
                }
            }
            other => p.push(format!(
                "messages[{i}] has role {other:?}: not system, developer, user, assistant or tool"
            )),
        }
    }
    for id in pending {
        p.push(format!(
            "messages[{asked_at}]: tool call {id:?} is not answered by a role \"tool\" message"
        ));
    }
    if messages.last().is_some_and(|m| m["role"] == "assistant") {
        p.push("the last message is the assistant's: the scripted model does not continue a prefilled reply".into());
    }
}

fn openai_call(at: &str, call: &Value, p: &mut Problems) {
    let empty = Map::new();
    let function = call["function"].as_object().unwrap_or(&empty);
    if call["id"].as_str().is_none_or(str::is_empty) {
        p.push(format!("{at} has no id"));
    }
    if call["type"] != "function" {
        p.push(format!("{at}.type is not \"function\""));
    }
    if !function.get("name").is_some_and(Value::is_string) {
        p.push(format!("{at}.function has no name"));
    }
    if !function.get("arguments").is_some_and(Value::is_string) {
        p.push(format!(
            "{at}.function.arguments is not a string (send the JSON text, not an object)"
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    fn anthropic_ok() -> HeaderMap {
        headers(&[("x-api-key", "k"), ("anthropic-version", "2023-06-01")])
    }

    fn tool_round(answer: Value) -> Value {
        json!({"model": "m", "max_tokens": 100,
        "tools": [{"name": "a", "description": "d", "input_schema": {"type": "object", "properties": {}}}],
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "text", "text": "t"}, {"type": "tool_use", "id": "toolu_1", "name": "a", "input": {}}]},
            {"role": "user", "content": answer}
        ]})
    }

    #[test]
    fn a_correct_anthropic_tool_round_passes() {
        let body = tool_round(json!([{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]));
        assert_eq!(anthropic(&anthropic_ok(), &body), Vec::<String>::new());
    }

    #[test]
    fn an_unanswered_or_stray_tool_use_is_a_violation() {
        let unanswered = anthropic(&anthropic_ok(), &tool_round(json!("just text")));
        assert!(
            unanswered
                .iter()
                .any(|p| p.contains("tool_use \"toolu_1\" is not answered")),
            "{unanswered:?}"
        );
        let stray = anthropic(
            &anthropic_ok(),
            &tool_round(json!([
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"},
                {"type": "tool_result", "tool_use_id": "toolu_9", "content": "ok"}
            ])),
        );
        assert!(
            stray
                .iter()
                .any(|p| p.contains("\"toolu_9\", which the message before did not ask for")),
            "{stray:?}"
        );
    }

    #[test]
    fn anthropic_headers_roles_tokens_and_tools_are_checked() {
        let body = json!({"model": "m", "max_tokens": 30000, "stream": true,
            "tools": [{"name": "a", "input_schema": {"type": "string"}}],
            "messages": [{"role": "assistant", "content": "hi"}, {"role": "assistant", "content": "x"}]});
        let problems = anthropic(&HeaderMap::new(), &body).join("\n");
        for expected in [
            "no x-api-key",
            "no anthropic-version",
            "max_tokens 30000",
            "stream is true",
            "tools[0] has no description",
            "tools[0].input_schema is not an object schema",
            "messages[0] has role \"assistant\", expected \"user\"",
            "last message is the assistant's",
        ] {
            assert!(problems.contains(expected), "{expected} not in {problems}");
        }
        let bearer = headers(&[("authorization", "Bearer t"), ("anthropic-version", "x")]);
        let body = json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(anthropic(&bearer, &body), Vec::<String>::new());
    }

    fn openai_round(tail: Value) -> Value {
        let mut messages = vec![
            json!({"role": "system", "content": "s"}),
            json!({"role": "user", "content": "go"}),
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "a", "arguments": "{}"}},
                {"id": "call_2", "type": "function", "function": {"name": "a", "arguments": "{}"}}
            ]}),
        ];
        messages.extend(tail.as_array().unwrap().iter().cloned());
        json!({"model": "m", "messages": messages,
            "tools": [{"type": "function", "function": {"name": "a", "description": "d", "parameters": {"type": "object"}}}]})
    }

    #[test]
    fn a_correct_openai_tool_round_passes() {
        let h = headers(&[("authorization", "Bearer k")]);
        let body = openai_round(json!([
            {"role": "tool", "tool_call_id": "call_2", "content": "b"},
            {"role": "tool", "tool_call_id": "call_1", "content": "a"}
        ]));
        assert_eq!(openai(&h, &body), Vec::<String>::new());
    }

    #[test]
    fn openai_calls_must_be_answered_before_the_next_message() {
        let h = headers(&[("authorization", "Bearer k")]);
        let body = openai_round(json!([
            {"role": "tool", "tool_call_id": "call_1", "content": "a"},
            {"role": "user", "content": "more"},
            {"role": "tool", "tool_call_id": "call_2", "content": "late"}
        ]));
        let problems = openai(&h, &body).join("\n");
        assert!(
            problems.contains("tool call \"call_2\" is not answered by a role \"tool\" message before messages[4]"),
            "{problems}"
        );
        assert!(
            problems.contains("messages[5]: a tool message for \"call_2\""),
            "{problems}"
        );
    }

    #[test]
    fn openai_headers_arguments_and_tools_are_checked() {
        let body = json!({"model": "m", "tools": [{"type": "fn", "function": {"name": "a", "parameters": {}}}],
            "messages": [{"role": "user", "content": "go"},
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "a", "arguments": {}}}]},
                {"role": "tool", "tool_call_id": "c", "content": "x"},
                {"role": "wizard", "content": "x"}]});
        let problems = openai(&headers(&[("authorization", "Basic x")]), &body).join("\n");
        for expected in [
            "no Authorization: Bearer",
            "tools[0].type is not \"function\"",
            "tools[0].function has no description",
            "parameters is not an object schema",
            "messages[1].tool_calls[0].function.arguments is not a string",
            "messages[3] has role \"wizard\"",
        ] {
            assert!(problems.contains(expected), "{expected} not in {problems}");
        }
    }
}

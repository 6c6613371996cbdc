//! The server over real HTTP on loopback: a plain HTTP/1.1 client on a
//! `TcpStream`, so what is tested is what goes over the wire.

use super::*;
use std::io::{Read, Write};
use std::net::TcpStream;

struct Answer {
    status: u16,
    head: String,
    body: Value,
}

fn send(model: &ScriptedModel, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Answer {
    let mut stream = TcpStream::connect(model.addr).unwrap();
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).unwrap();
    // The server may answer (413) before reading everything.
    let _ = stream.write_all(body);
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    Answer {
        status,
        head: head.to_lowercase(),
        body: serde_json::from_str(body).unwrap_or(Value::Null),
    }
}

const ANTHROPIC: &[(&str, &str)] = &[
    ("x-api-key", "k"),
    ("anthropic-version", "2023-06-01"),
    ("content-type", "application/json"),
];
const OPENAI: &[(&str, &str)] = &[("authorization", "Bearer k"), ("content-type", "application/json")];

fn messages(model: &ScriptedModel, conversation: Value) -> Answer {
    let body = json!({"model": "claude-test", "max_tokens": 1000, "messages": conversation});
    send(model, "POST", "/v1/messages", ANTHROPIC, body.to_string().as_bytes())
}

fn completions(model: &ScriptedModel, conversation: Value) -> Answer {
    let body = json!({"model": "gpt-test", "messages": conversation});
    send(
        model,
        "POST",
        "/v1/chat/completions",
        OPENAI,
        body.to_string().as_bytes(),
    )
}

fn two_turns() -> Value {
    json!({"turns": [
        {"text": "looking", "tool_calls": [{"name": "list", "arguments": {"path": "/"}}]},
        {"tool_calls": [{"name": "read", "arguments": {"id": "{{results[-1].files[1]}}", "note": "after {{results[0].n}}"}}]},
        {"text": "done"}
    ]})
}

fn anthropic_round(result: &str) -> Value {
    json!([
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "text", "text": "looking"},
            {"type": "tool_use", "id": "toolu_t0_0", "name": "list", "input": {"path": "/"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_t0_0", "content": result}]}
    ])
}

#[test]
fn the_turn_is_the_number_of_assistant_messages_so_a_repeat_gets_the_same_reply() {
    let model = ScriptedModel::start(two_turns());
    let first = messages(&model, json!([{"role": "user", "content": "go"}]));
    assert_eq!(first.status, 200);
    assert_eq!(first.body["id"], "msg_t0");
    assert_eq!(first.body["content"][1]["id"], "toolu_t0_0");
    assert_eq!(first.body["model"], "claude-test");
    let again = messages(&model, json!([{"role": "user", "content": "go"}]));
    assert_eq!(again.body, first.body);
    let second = messages(&model, anthropic_round(r#"{"files": ["a", "b"], "n": 2}"#));
    assert_eq!(second.body["id"], "msg_t1");
    assert_eq!(second.body["stop_reason"], "tool_use");
    assert_eq!(
        second.body["content"][0]["input"],
        json!({"id": "b", "note": "after 2"})
    );
    let turns: Vec<usize> = model.requests().iter().map(|r| r.turn).collect();
    assert_eq!(turns, vec![0, 0, 1]);
    assert!(model.violations().is_empty(), "{:?}", model.violations());
}

#[test]
fn a_turn_beyond_the_script_is_refused_in_the_providers_shape() {
    let model = ScriptedModel::start(json!({"turns": [{"text": "only"}]}));
    let answer = completions(
        &model,
        json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "only"}, {"role": "user", "content": "b"}]),
    );
    assert_eq!(answer.status, 400);
    let message = answer.body["error"]["message"].as_str().unwrap();
    assert!(message.contains("the script has no turn 1"), "{message}");
    assert_eq!(answer.body["error"]["type"], "invalid_request_error");
    assert_eq!(model.violations().len(), 1);
    assert_eq!(model.requests()[0].answered, 400);
}

#[test]
fn scripted_failures_are_served_once_each_then_the_reply() {
    let model = ScriptedModel::start(json!({"turns": [{"text": "hi",
        "fail": [{"status": 429, "retry_after": 7}, {"status": 503}, {"delay_ms": 20}]}]}));
    let user = || json!([{"role": "user", "content": "go"}]);
    let limited = messages(&model, user());
    assert_eq!(limited.status, 429);
    assert!(limited.head.contains("retry-after: 7"), "{}", limited.head);
    assert_eq!(limited.body["error"]["type"], "rate_limit_error");
    assert_eq!(limited.body["type"], "error");
    let overloaded = completions(&model, user());
    assert_eq!(overloaded.status, 503);
    assert_eq!(overloaded.body["error"]["type"], "server_error");
    let delayed = messages(&model, user());
    assert_eq!(
        (delayed.status, delayed.body["content"][0]["text"].as_str()),
        (200, Some("hi"))
    );
    assert_eq!(messages(&model, user()).status, 200);
    let answered: Vec<u16> = model.requests().iter().map(|r| r.answered).collect();
    assert_eq!(answered, vec![429, 503, 200, 200]);
    assert!(model.violations().is_empty());
}

#[test]
fn a_client_that_leaves_during_a_delay_is_recorded_unanswered() {
    let model = ScriptedModel::start(json!({"turns": [{"text": "late", "fail": [{"delay_ms": 3000}]}]}));
    let body = json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let mut stream = TcpStream::connect(model.addr).unwrap();
    let head = format!(
        "POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n",
        body.len()
    );
    let auth = "x-api-key: k\r\nanthropic-version: 1\r\ncontent-type: application/json\r\n\r\n";
    stream.write_all(format!("{head}{auth}{body}").as_bytes()).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while model.requests().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the delayed request was never recorded"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    drop(stream);
    let seen = model.requests();
    assert_eq!((seen.len(), seen[0].answered, seen[0].turn), (1, 0, 0));
    // The next request, after the delay was consumed, is answered at once.
    let answer = messages(&model, json!([{"role": "user", "content": "hi"}]));
    assert_eq!(answer.body["content"][0]["text"], "late");
    let answered: Vec<u16> = model.requests().iter().map(|r| r.answered).collect();
    assert_eq!(answered, vec![0, 200]);
}

#[test]
fn openai_replies_carry_tool_calls_as_json_text_and_raw_arguments_verbatim() {
    let model = ScriptedModel::start(json!({"turns": [
        {"tool_calls": [{"name": "a", "arguments": {"x": [1]}}, {"name": "b", "raw_arguments": "{not json"}]},
        {"text": "end", "stop": "max_tokens", "usage": {"input": 5, "output": 6}}
    ]}));
    let first = completions(&model, json!([{"role": "user", "content": "go"}]));
    let message = &first.body["choices"][0]["message"];
    assert_eq!(message["tool_calls"][0]["function"]["arguments"], "{\"x\":[1]}");
    assert_eq!(message["tool_calls"][1]["function"]["arguments"], "{not json");
    assert_eq!(message["content"], Value::Null);
    assert_eq!(first.body["choices"][0]["finish_reason"], "tool_calls");
    let second = completions(
        &model,
        json!([{"role": "user", "content": "go"}, {"role": "assistant", "content": null, "tool_calls": message["tool_calls"]},
            {"role": "tool", "tool_call_id": "call_t0_0", "content": "1"},
            {"role": "tool", "tool_call_id": "call_t0_1", "content": "bad arguments"}]),
    );
    assert_eq!(second.body["choices"][0]["finish_reason"], "length");
    assert_eq!(
        second.body["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11})
    );
    assert!(model.violations().is_empty(), "{:?}", model.violations());
}

#[test]
fn a_bad_request_is_a_recorded_violation_and_a_400() {
    let model = ScriptedModel::start(two_turns());
    let unanswered = json!([
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_t0_0", "name": "list", "input": {}}]},
        {"role": "user", "content": "forgot the result"}
    ]);
    let answer = messages(&model, unanswered);
    assert_eq!(answer.status, 400);
    assert_eq!(answer.body["error"]["type"], "invalid_request_error");
    let violations = model.violations();
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        violations[0].contains("anthropic request 1 (turn 1)") && violations[0].contains("not answered"),
        "{violations:?}"
    );
    let no_key = send(&model, "POST", "/v1/messages", &[], b"{\"model\": \"m\"}");
    assert_eq!(no_key.status, 400);
    assert!(model.violations().iter().any(|v| v.contains("no x-api-key")));
    let not_json = send(&model, "POST", "/v1/chat/completions", OPENAI, b"{nope");
    assert_eq!(
        (not_json.status, not_json.body["error"]["param"].clone()),
        (400, Value::Null)
    );
}

#[test]
fn a_request_with_fifty_thousand_tool_calls_is_checked_and_answered() {
    let model = ScriptedModel::start(json!({"turns": [{"text": "a"}, {"text": "b"}]}));
    let n = 50_000;
    let calls: Vec<Value> = (0..n)
        .map(|k| json!({"id": format!("c{k}"), "type": "function", "function": {"name": "f", "arguments": "{}"}}))
        .collect();
    let mut conversation = vec![
        json!({"role": "user", "content": "go"}),
        json!({"role": "assistant", "tool_calls": calls}),
    ];
    conversation.extend(
        (0..n)
            .rev()
            .map(|k| json!({"role": "tool", "tool_call_id": format!("c{k}"), "content": "x"})),
    );
    let answer = completions(&model, Value::Array(conversation));
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert!(model.violations().is_empty());
}

#[test]
fn an_unfillable_placeholder_is_refused_naming_it() {
    let model = ScriptedModel::start(two_turns());
    let answer = messages(&model, anthropic_round("plain words"));
    assert_eq!(answer.status, 400);
    let message = answer.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("{{results[-1].files[1]}}") && message.contains("results[0] = \"plain words\""),
        "{message}"
    );
    assert_eq!(model.violations().len(), 1);
}

#[test]
fn an_oversized_body_is_refused_with_413() {
    let model = ScriptedModel::start(two_turns());
    let answer = send(&model, "POST", "/v1/messages", ANTHROPIC, &vec![b' '; BODY_MAX + 1]);
    assert_eq!(answer.status, 413);
    assert_eq!(answer.body["error"]["type"], "request_too_large");
    assert_eq!(model.requests()[0].body, Value::Null);
}

#[test]
fn the_requests_route_returns_requests_and_violations() {
    let model = ScriptedModel::start(two_turns());
    messages(&model, json!([{"role": "user", "content": "go"}]));
    send(&model, "POST", "/v1/chat/completions", &[], b"{}");
    let listed = send(&model, "GET", "/_requests", &[], b"");
    assert_eq!(listed.status, 200);
    let requests = listed.body["requests"].as_array().unwrap();
    assert_eq!(requests.len(), 2);
    assert_eq!(
        (requests[0]["provider"].as_str(), requests[0]["answered"].as_u64()),
        (Some("anthropic"), Some(200))
    );
    assert_eq!(requests[1]["provider"], "openai");
    assert!(!listed.body["violations"].as_array().unwrap().is_empty());
}

#[test]
fn the_record_keeps_only_the_newest_requests() {
    let mut log = Log::default();
    let entry = |turn| Recorded {
        provider: "openai",
        turn,
        body: Value::Null,
        answered: 200,
    };
    for turn in 0..RECORDED_MAX + 3 {
        log.record(turn as u64, entry(turn), 1);
    }
    assert_eq!(log.recorded.len(), RECORDED_MAX);
    assert_eq!(log.recorded.front().unwrap().1.turn, 3);
    log.record(0, entry(0), RECORDED_BYTES_MAX);
    assert_eq!(log.recorded.len(), 1);
    assert_eq!(log.recorded_bytes, RECORDED_BYTES_MAX);
}

#[test]
#[should_panic(expected = "bad script: turn 0: has neither text nor tool_calls")]
fn a_bad_script_panics_saying_why() {
    ScriptedModel::start(json!({"turns": [{"stop": "end_turn"}]}));
}

//! Anthropic's Messages API: `POST /v1/messages`, tools with
//! `input_schema`, `tool_use` and `tool_result` blocks, `stop_reason`.

use serde_json::{json, Map, Value};

use crate::{Conversation, LlmError, ModelConfig, Reply, Stop, ToolCall, ToolDef, Turn, Usage};

/// The API version sent with every request (`anthropic-version`).
pub(crate) const API_VERSION: &str = "2023-06-01";

pub(crate) fn request(cfg: &ModelConfig, conv: &Conversation, tools: &[ToolDef]) -> Value {
    let mut messages: Vec<Value> = Vec::new();
    let mut push = |role: &str, blocks: Vec<Value>| {
        // Consecutive messages of one role are one message to this API.
        if let Some(last) = messages.last_mut().filter(|m| m["role"] == role) {
            if let Some(content) = last["content"].as_array_mut() {
                content.extend(blocks);
                return;
            }
        }
        messages.push(json!({"role": role, "content": blocks}));
    };
    for turn in &conv.turns {
        match turn {
            Turn::User { text } => push("user", vec![json!({"type": "text", "text": text})]),
            Turn::Assistant { reply } => {
                let mut blocks = Vec::new();
                if !reply.text.is_empty() {
                    blocks.push(json!({"type": "text", "text": reply.text}));
                }
                for call in &reply.calls {
                    let input = match &call.arguments {
                        Value::Object(_) => call.arguments.clone(),
                        Value::Null => json!({}),
                        other => json!({ "value": other }),
                    };
                    blocks.push(json!({"type": "tool_use", "id": call.id, "name": call.name, "input": input}));
                }
                if blocks.is_empty() {
                    blocks.push(json!({"type": "text", "text": "(no reply)"}));
                }
                push("assistant", blocks);
            }
            Turn::ToolResults { results, note } => {
                let mut blocks: Vec<Value> = results
                    .iter()
                    .map(|r| {
                        json!({"type": "tool_result", "tool_use_id": r.call_id, "content": r.content, "is_error": r.is_error})
                    })
                    .collect();
                if let Some(n) = note {
                    blocks.push(json!({"type": "text", "text": n}));
                }
                push("user", blocks);
            }
        }
    }
    let mut body = json!({
        "model": cfg.model,
        "max_tokens": cfg.max_tokens,
        "messages": messages,
    });
    if !conv.system.is_empty() {
        body["system"] = json!(conv.system);
    }
    if !tools.is_empty() {
        body["tools"] = tools
            .iter()
            .map(|t| json!({"name": t.name, "description": t.description, "input_schema": t.input_schema}))
            .collect();
        body["tool_choice"] = json!({"type": "auto"});
    }
    body
}

pub(crate) fn reply(v: &Value) -> Result<Reply, LlmError> {
    let bad = |what: &str| LlmError::Malformed(format!("an Anthropic message without {what}"));
    if v["type"] != "message" {
        return Err(bad("\"type\": \"message\""));
    }
    let id = v["id"].as_str().ok_or_else(|| bad("an id"))?.to_string();
    let content = v["content"].as_array().ok_or_else(|| bad("a content list"))?;
    let mut text = String::new();
    let mut calls = Vec::new();
    for block in content {
        match block["type"].as_str() {
            Some("text") => {
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(block["text"].as_str().ok_or_else(|| bad("a text block's text"))?);
            }
            Some("tool_use") => {
                let input = &block["input"];
                // A "_raw" input is how a non-JSON argument text arrives
                // from OpenAI-style relays; keep it as the raw text.
                let raw = input
                    .as_object()
                    .filter(|o| o.len() == 1)
                    .and_then(|o: &Map<String, Value>| o.get("_raw"))
                    .and_then(Value::as_str)
                    .map(str::to_string);
                calls.push(ToolCall {
                    id: block["id"].as_str().ok_or_else(|| bad("a tool_use id"))?.to_string(),
                    name: block["name"]
                        .as_str()
                        .ok_or_else(|| bad("a tool_use name"))?
                        .to_string(),
                    arguments: if raw.is_some() { Value::Null } else { input.clone() },
                    raw,
                });
            }
            // Thinking and other blocks carry nothing the loop acts on.
            _ => {}
        }
    }
    let stop = match v["stop_reason"].as_str() {
        Some("end_turn" | "stop_sequence") => Stop::EndTurn,
        Some("tool_use") => Stop::ToolUse,
        Some("max_tokens" | "model_context_window_exceeded") => Stop::MaxTokens,
        Some("refusal") => Stop::Refusal,
        Some(other) => Stop::Other(other.to_string()),
        None => Stop::Other("none".into()),
    };
    let usage = Usage {
        input_tokens: v["usage"]["input_tokens"]
            .as_u64()
            .ok_or_else(|| bad("usage.input_tokens"))?,
        output_tokens: v["usage"]["output_tokens"]
            .as_u64()
            .ok_or_else(|| bad("usage.output_tokens"))?,
    };
    Ok(Reply {
        id,
        model: v["model"].as_str().unwrap_or_default().to_string(),
        text,
        calls,
        stop,
        usage,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ProviderKind, ToolResult};

    #[test]
    fn tool_results_and_a_note_are_one_user_message() {
        let cfg = ModelConfig::new(ProviderKind::Anthropic, "claude");
        let call = ToolCall {
            id: "toolu_1".into(),
            name: "run_stage".into(),
            arguments: json!({"snapshot_id": "s"}),
            raw: None,
        };
        let conv = Conversation {
            system: "sys".into(),
            turns: vec![
                Turn::User { text: "goal".into() },
                Turn::Assistant {
                    reply: Reply {
                        id: "m".into(),
                        model: "claude".into(),
                        text: String::new(),
                        calls: vec![call],
                        stop: Stop::ToolUse,
                        usage: Usage::default(),
                    },
                },
                Turn::ToolResults {
                    results: vec![ToolResult {
                        call_id: "toolu_1".into(),
                        content: "{}".into(),
                        is_error: false,
                    }],
                    note: Some("lineage".into()),
                },
            ],
        };
        let body = request(&cfg, &conv, &[]);
        let msgs = body["messages"].as_array().unwrap();
        assert_eq!(msgs.len(), 3);
        assert_eq!(msgs[2]["content"][0]["type"], "tool_result");
        assert_eq!(msgs[2]["content"][1]["text"], "lineage");
        assert_eq!(body["system"], "sys");
    }

    #[test]
    fn a_reply_without_usage_is_malformed() {
        let v = json!({"type": "message", "id": "m", "content": [], "stop_reason": "end_turn"});
        assert!(reply(&v).unwrap_err().to_string().contains("usage"));
    }
}

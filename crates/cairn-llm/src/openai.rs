//! OpenAI's Chat Completions: `POST {base}/chat/completions`, `tools` of
//! type function, `tool_calls` whose arguments are JSON text, `role: tool`
//! answers. Local servers (llama.cpp, vLLM, Ollama) speak the same.

use serde_json::{json, Value};

use crate::{Conversation, LlmError, ModelConfig, Reply, Stop, ToolCall, ToolDef, Turn, Usage};

pub(crate) fn request(cfg: &ModelConfig, conv: &Conversation, tools: &[ToolDef]) -> Value {
    let mut messages = Vec::new();
    if !conv.system.is_empty() {
        messages.push(json!({"role": "system", "content": conv.system}));
    }
    for turn in &conv.turns {
        match turn {
            Turn::User { text } => messages.push(json!({"role": "user", "content": text})),
            Turn::Assistant { reply } => {
                let mut m = json!({
                    "role": "assistant",
                    "content": if reply.text.is_empty() { Value::Null } else { json!(reply.text) },
                });
                if !reply.calls.is_empty() {
                    m["tool_calls"] = reply
                        .calls
                        .iter()
                        .map(|c| {
                            let arguments = c.raw.clone().unwrap_or_else(|| c.arguments.to_string());
                            json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments}})
                        })
                        .collect();
                }
                messages.push(m);
            }
            Turn::ToolResults { results, note } => {
                for r in results {
                    messages.push(json!({"role": "tool", "tool_call_id": r.call_id, "content": r.content}));
                }
                if let Some(n) = note {
                    messages.push(json!({"role": "user", "content": n}));
                }
            }
        }
    }
    let mut body = json!({"model": cfg.model, "messages": messages});
    // OpenAI's own endpoint takes max_completion_tokens (its reasoning
    // models refuse max_tokens); compatible servers know max_tokens.
    let limit = if cfg.base_url.is_none() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    body[limit] = json!(cfg.max_tokens);
    if !tools.is_empty() {
        body["tools"] = tools
            .iter()
            .map(|t| {
                json!({"type": "function", "function": {
                    "name": t.name, "description": t.description, "parameters": t.input_schema}})
            })
            .collect();
        body["tool_choice"] = json!("auto");
    }
    body
}

pub(crate) fn reply(v: &Value) -> Result<Reply, LlmError> {
    let bad = |what: &str| LlmError::Malformed(format!("a chat completion without {what}"));
    let id = v["id"].as_str().ok_or_else(|| bad("an id"))?.to_string();
    let choice = v["choices"].get(0).ok_or_else(|| bad("a choice"))?;
    let message = choice
        .get("message")
        .filter(|m| m.is_object())
        .ok_or_else(|| bad("a message"))?;
    let text = message["content"].as_str().unwrap_or_default().to_string();
    let mut calls = Vec::new();
    for c in message["tool_calls"].as_array().into_iter().flatten() {
        if c["type"] != "function" {
            continue;
        }
        let args_text = c["function"]["arguments"].as_str().unwrap_or_default();
        let (arguments, raw) = match serde_json::from_str::<Value>(args_text) {
            Ok(v) => (v, None),
            Err(_) => (Value::Null, Some(args_text.to_string())),
        };
        calls.push(ToolCall {
            id: c["id"].as_str().ok_or_else(|| bad("a tool call id"))?.to_string(),
            name: c["function"]["name"]
                .as_str()
                .ok_or_else(|| bad("a tool call's name"))?
                .to_string(),
            arguments,
            raw,
        });
    }
    let stop = match choice["finish_reason"].as_str() {
        Some("stop") => Stop::EndTurn,
        Some("tool_calls" | "function_call") => Stop::ToolUse,
        Some("length") => Stop::MaxTokens,
        Some("content_filter") => Stop::Refusal,
        Some(other) => Stop::Other(other.to_string()),
        // Some compatible servers leave it out; the calls say it all.
        None if !calls.is_empty() => Stop::ToolUse,
        None => Stop::EndTurn,
    };
    let usage = Usage {
        input_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
        output_tokens: v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
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

    #[test]
    fn arguments_that_are_not_json_are_kept_as_text() {
        let v = json!({"id": "c", "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls",
            "message": {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "run_stage", "arguments": "{oops"}}]}}]});
        let r = reply(&v).unwrap();
        assert_eq!(r.calls[0].raw.as_deref(), Some("{oops"));
        assert_eq!(r.calls[0].arguments, Value::Null);
        assert_eq!(r.stop, Stop::ToolUse);
        assert_eq!(r.usage, Usage::default());
    }
}

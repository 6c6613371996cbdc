//! A scripted reply and an error, in the shape each provider's SDK parses
//! strictly: Anthropic's Messages API and OpenAI's Chat Completions.

use super::script::{Stop, Usage};
use serde_json::{json, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    Anthropic,
    OpenAi,
}

/// One tool call of a reply, its arguments filled.
pub enum Call {
    Json { name: String, arguments: Value },
    Raw { name: String, text: String },
}

impl Call {
    fn name(&self) -> &str {
        match self {
            Call::Json { name, .. } | Call::Raw { name, .. } => name,
        }
    }

    /// The arguments as OpenAI carries them: JSON text, or the raw text.
    fn text(&self) -> String {
        match self {
            Call::Json { arguments, .. } => arguments.to_string(),
            Call::Raw { text, .. } => text.clone(),
        }
    }

    /// The arguments as Anthropic carries them: an object (raw text cannot
    /// be carried, so it travels as `{"_raw": text}`).
    fn input(&self) -> Value {
        match self {
            Call::Json { arguments, .. } => arguments.clone(),
            Call::Raw { text, .. } => json!({ "_raw": text }),
        }
    }
}

/// A reply about to be rendered.
pub struct Reply<'a> {
    pub turn: usize,
    pub model: &'a str,
    pub text: Option<&'a str>,
    pub calls: Vec<Call>,
    pub stop: Option<Stop>,
    pub usage: Option<Usage>,
    /// The request body's size, for the default usage.
    pub request_bytes: usize,
}

impl Reply<'_> {
    fn stop(&self) -> Stop {
        self.stop.unwrap_or(if self.calls.is_empty() {
            Stop::EndTurn
        } else {
            Stop::ToolUse
        })
    }

    /// The script's usage, else numbers that follow the sizes (a token per
    /// four bytes), the same for the same exchange.
    fn usage(&self) -> Usage {
        self.usage.unwrap_or_else(|| {
            let reply: usize = self.text.map_or(0, str::len)
                + self
                    .calls
                    .iter()
                    .map(|c| c.name().len() + c.text().len())
                    .sum::<usize>();
            let tokens = |bytes: usize| u64::try_from(bytes / 4).unwrap_or(u64::MAX).max(1);
            Usage {
                input: tokens(self.request_bytes),
                output: tokens(reply),
            }
        })
    }
}

impl Provider {
    pub fn name(self) -> &'static str {
        match self {
            Provider::Anthropic => "anthropic",
            Provider::OpenAi => "openai",
        }
    }

    pub fn reply(self, reply: &Reply) -> Value {
        match self {
            Provider::Anthropic => anthropic_reply(reply),
            Provider::OpenAi => openai_reply(reply),
        }
    }

    pub fn error(self, status: u16, message: &str) -> Value {
        match self {
            Provider::Anthropic => {
                let kind = match status {
                    400 => "invalid_request_error",
                    401 => "authentication_error",
                    403 => "permission_error",
                    404 => "not_found_error",
                    413 => "request_too_large",
                    429 => "rate_limit_error",
                    503 | 529 => "overloaded_error",
                    500..=599 => "api_error",
                    _ => "invalid_request_error",
                };
                json!({"type": "error", "error": {"type": kind, "message": message}})
            }
            Provider::OpenAi => {
                let kind = match status {
                    401 => "authentication_error",
                    403 => "permission_error",
                    404 => "not_found_error",
                    429 => "rate_limit_error",
                    500..=599 => "server_error",
                    _ => "invalid_request_error",
                };
                json!({"error": {"message": message, "type": kind, "param": null, "code": null}})
            }
        }
    }
}

fn anthropic_reply(reply: &Reply) -> Value {
    let mut content: Vec<Value> = reply
        .text
        .map(|t| json!({"type": "text", "text": t}))
        .into_iter()
        .collect();
    content.extend(reply.calls.iter().enumerate().map(|(k, call)| {
        json!({"type": "tool_use", "id": format!("toolu_t{}_{k}", reply.turn), "name": call.name(), "input": call.input()})
    }));
    let usage = reply.usage();
    json!({
        "id": format!("msg_t{}", reply.turn),
        "type": "message",
        "role": "assistant",
        "model": reply.model,
        "content": content,
        "stop_reason": reply.stop().anthropic(),
        "stop_sequence": null,
        "usage": {"input_tokens": usage.input, "output_tokens": usage.output},
    })
}

fn openai_reply(reply: &Reply) -> Value {
    let mut message = json!({"role": "assistant", "content": reply.text, "refusal": null});
    if !reply.calls.is_empty() {
        let calls: Vec<Value> = reply
            .calls
            .iter()
            .enumerate()
            .map(|(k, call)| {
                json!({"id": format!("call_t{}_{k}", reply.turn), "type": "function",
                       "function": {"name": call.name(), "arguments": call.text()}})
            })
            .collect();
        message["tool_calls"] = Value::Array(calls);
    }
    let usage = reply.usage();
    json!({
        "id": format!("chatcmpl-t{}", reply.turn),
        "object": "chat.completion",
        // Fixed, so that a replayed turn is byte for byte the same.
        "created": 1_700_000_000,
        "model": reply.model,
        "choices": [{"index": 0, "finish_reason": reply.stop().openai(), "logprobs": null, "message": message}],
        "usage": {"prompt_tokens": usage.input, "completion_tokens": usage.output,
                  "total_tokens": usage.input.saturating_add(usage.output)},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(calls: Vec<Call>, stop: Option<Stop>) -> Reply<'static> {
        Reply {
            turn: 2,
            model: "m-1",
            text: Some("hi"),
            calls,
            stop,
            usage: None,
            request_bytes: 400,
        }
    }

    #[test]
    fn a_tool_call_reply_has_deterministic_ids_and_the_tool_stop() {
        let calls = || {
            vec![
                Call::Json {
                    name: "a".into(),
                    arguments: json!({"x": 1}),
                },
                Call::Raw {
                    name: "b".into(),
                    text: "{bad".into(),
                },
            ]
        };
        let a = Provider::Anthropic.reply(&reply(calls(), None));
        assert_eq!(a["id"], "msg_t2");
        assert_eq!(
            a["content"][1],
            json!({"type": "tool_use", "id": "toolu_t2_0", "name": "a", "input": {"x": 1}})
        );
        assert_eq!(a["content"][2]["input"], json!({"_raw": "{bad"}));
        assert_eq!(a["stop_reason"], "tool_use");
        assert_eq!(a["usage"]["input_tokens"], 100);
        let o = Provider::OpenAi.reply(&reply(calls(), None));
        assert_eq!(o["id"], "chatcmpl-t2");
        let call = &o["choices"][0]["message"]["tool_calls"][1];
        assert_eq!(
            (call["id"].as_str(), call["function"]["arguments"].as_str()),
            (Some("call_t2_1"), Some("{bad"))
        );
        assert_eq!(
            o["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            "{\"x\":1}"
        );
        assert_eq!(o["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(
            o["usage"]["total_tokens"],
            o["usage"]["prompt_tokens"].as_u64().unwrap() + o["usage"]["completion_tokens"].as_u64().unwrap()
        );
    }

    #[test]
    fn stops_map_between_providers_and_text_replies_have_no_tool_calls() {
        let o = Provider::OpenAi.reply(&reply(vec![], Some(Stop::MaxTokens)));
        assert_eq!(o["choices"][0]["finish_reason"], "length");
        assert!(o["choices"][0]["message"].get("tool_calls").is_none());
        assert_eq!(
            Provider::Anthropic.reply(&reply(vec![], None))["stop_reason"],
            "end_turn"
        );
        assert_eq!(
            Provider::OpenAi.reply(&reply(vec![], None))["choices"][0]["finish_reason"],
            "stop"
        );
    }
}

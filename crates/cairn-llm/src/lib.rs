//! The models Cairn's planner talks to: Anthropic's Messages API and
//! OpenAI's Chat Completions (which local OpenAI-compatible servers such as
//! llama.cpp, vLLM and Ollama also speak), behind one provider-neutral
//! conversation.
//!
//! One call is [`complete`]: the conversation and the tools in, the
//! model's reply out (text, tool calls, why it stopped, tokens used). An
//! outage (a timeout, 408, 409, 429, 5xx, a dropped connection) is retried
//! with exponential backoff, honouring `retry-after`; when the retries run
//! out the error is [`LlmError::Unavailable`], which a caller treats as
//! "pause and resume later", never as the model's answer. API keys are read
//! from the environment at call time and never written anywhere.

mod anthropic;
mod openai;
mod price;

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use price::{price_for, Price};

/// The most of a reply body read into memory.
const REPLY_MAX: u64 = 16 << 20;
/// The longest wait between two attempts, whatever `retry-after` says.
const BACKOFF_MAX: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    Anthropic,
    #[serde(rename = "openai")]
    OpenAi,
}

impl ProviderKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Anthropic => "anthropic",
            ProviderKind::OpenAi => "openai",
        }
    }

    /// The environment variable holding this provider's API key.
    pub fn key_variable(self) -> &'static str {
        match self {
            ProviderKind::Anthropic => "ANTHROPIC_API_KEY",
            ProviderKind::OpenAi => "OPENAI_API_KEY",
        }
    }

    fn default_base_url(self) -> &'static str {
        match self {
            ProviderKind::Anthropic => "https://api.anthropic.com",
            ProviderKind::OpenAi => "https://api.openai.com/v1",
        }
    }
}

impl fmt::Display for ProviderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ProviderKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "anthropic" => Ok(ProviderKind::Anthropic),
            "openai" => Ok(ProviderKind::OpenAi),
            other => Err(format!(
                "unknown provider {other:?}: use \"anthropic\" (Messages API) or \"openai\" \
                 (Chat Completions, also for llama.cpp, vLLM and Ollama with --base-url)"
            )),
        }
    }
}

/// Which model, where, and how patiently. The API key is not here: it is
/// read from [`ProviderKind::key_variable`] when a call is made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub provider: ProviderKind,
    pub model: String,
    /// `None` is the provider's own endpoint. Anthropic's is the host
    /// (`/v1/messages` is appended); OpenAI's includes `/v1`
    /// (`/chat/completions` is appended), as their SDKs take them.
    pub base_url: Option<String>,
    pub max_tokens: u32,
    /// For one attempt, connecting and reading the whole reply.
    pub timeout: Duration,
    /// Attempts after the first one, on an outage.
    pub retries: u32,
    /// The first wait between attempts; it doubles each time.
    pub backoff: Duration,
}

impl ModelConfig {
    pub fn new(provider: ProviderKind, model: &str) -> ModelConfig {
        ModelConfig {
            provider,
            model: model.to_string(),
            base_url: None,
            max_tokens: 4096,
            timeout: Duration::from_secs(300),
            retries: 5,
            backoff: Duration::from_secs(1),
        }
    }

    fn endpoint(&self) -> String {
        let base = self
            .base_url
            .as_deref()
            .unwrap_or(self.provider.default_base_url())
            .trim_end_matches('/');
        match self.provider {
            ProviderKind::Anthropic => format!("{base}/v1/messages"),
            ProviderKind::OpenAi => format!("{base}/chat/completions"),
        }
    }

    /// The key from the environment. A provider's own endpoint needs one; a
    /// local server given by `base_url` may do without.
    fn key(&self) -> Result<Option<String>, LlmError> {
        let var = self.provider.key_variable();
        match std::env::var(var) {
            Ok(k) if !k.trim().is_empty() => Ok(Some(k.trim().to_string())),
            _ if self.base_url.is_some() => Ok(None),
            _ => Err(LlmError::Config(format!(
                "{var} is not set: export your {} API key as {var}, or point --base-url at a server that needs none",
                self.provider
            ))),
        }
    }

    /// Checks what can be checked before any call: the model's name, the
    /// URL, the key.
    pub fn check(&self) -> Result<(), LlmError> {
        if self.model.trim().is_empty() || self.model.len() > 256 {
            return Err(LlmError::Config(
                "the model's name is empty or too long; name one with --model".into(),
            ));
        }
        if let Some(url) = &self.base_url {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(LlmError::Config(format!(
                    "base URL {url:?} is not an http:// or https:// URL"
                )));
            }
        }
        if self.max_tokens == 0 {
            return Err(LlmError::Config("max_tokens must be at least 1".into()));
        }
        self.key().map(|_| ())
    }
}

/// A tool the model may call: its name, what it does, its arguments'
/// JSON Schema (an object schema).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDef {
    pub name: String,
    pub description: String,
    pub input_schema: serde_json::Value,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Conversation {
    pub system: String,
    pub turns: Vec<Turn>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "turn", rename_all = "snake_case")]
pub enum Turn {
    User {
        text: String,
    },
    Assistant {
        reply: Reply,
    },
    /// The results of the previous reply's tool calls, one per call, and
    /// optionally a note after them (what changed since).
    ToolResults {
        results: Vec<ToolResult>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        note: Option<String>,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    pub id: String,
    pub model: String,
    pub text: String,
    pub calls: Vec<ToolCall>,
    pub stop: Stop,
    pub usage: Usage,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as the model gave them; `Null` when they were not JSON.
    pub arguments: serde_json::Value,
    /// The arguments' text when it was not JSON (a malformed call).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolResult {
    pub call_id: String,
    pub content: String,
    pub is_error: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// Why the model stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stop {
    /// It finished its turn.
    EndTurn,
    /// It wants its tool calls run.
    ToolUse,
    /// It ran out of `max_tokens`.
    MaxTokens,
    /// It declined (a refusal, a content filter).
    Refusal,
    Other(String),
}

#[derive(Debug, thiserror::Error)]
pub enum LlmError {
    /// The provider could not be reached or kept failing: worth trying
    /// again later; nothing about the conversation is wrong.
    #[error("the model is unavailable after {attempts} attempts (last: {last}); try again later")]
    Unavailable { attempts: u32, last: String },
    /// The provider refused the request (a bad key, a bad model name, a
    /// request it cannot take): retrying the same request will not help.
    #[error("the provider refused the request ({status}): {message}")]
    Rejected { status: u16, message: String },
    /// A reply that is not the provider's format.
    #[error("the provider's reply is malformed: {0}")]
    Malformed(String),
    #[error("{0}")]
    Config(String),
}

/// One attempt that failed and will be retried: for progress output.
#[derive(Debug, Clone)]
pub struct Retry {
    pub attempt: u32,
    pub error: String,
    pub wait: Duration,
}

/// Asks the model for its next reply.
pub fn complete(cfg: &ModelConfig, conv: &Conversation, tools: &[ToolDef]) -> Result<Reply, LlmError> {
    complete_with(cfg, conv, tools, &mut |_| {})
}

/// [`complete`], telling `on_retry` about each failed attempt before its wait.
pub fn complete_with(
    cfg: &ModelConfig,
    conv: &Conversation,
    tools: &[ToolDef],
    on_retry: &mut dyn FnMut(&Retry),
) -> Result<Reply, LlmError> {
    cfg.check()?;
    let key = cfg.key()?;
    let body = match cfg.provider {
        ProviderKind::Anthropic => anthropic::request(cfg, conv, tools),
        ProviderKind::OpenAi => openai::request(cfg, conv, tools),
    };
    let agent = ureq::AgentBuilder::new()
        .timeout_connect(cfg.timeout.min(Duration::from_secs(30)))
        .timeout(cfg.timeout)
        .user_agent(concat!("cairn/", env!("CARGO_PKG_VERSION")))
        .build();
    let url = cfg.endpoint();
    let mut attempt = 0;
    loop {
        attempt += 1;
        let mut req = agent.post(&url).set("content-type", "application/json");
        req = match cfg.provider {
            ProviderKind::Anthropic => {
                let req = req.set("anthropic-version", anthropic::API_VERSION);
                match &key {
                    Some(k) => req.set("x-api-key", k),
                    None => req,
                }
            }
            ProviderKind::OpenAi => match &key {
                Some(k) => req.set("authorization", &format!("Bearer {k}")),
                None => req,
            },
        };
        let failure = match req.send_json(&body) {
            Ok(resp) => {
                let value = read_json(resp)?;
                return match cfg.provider {
                    ProviderKind::Anthropic => anthropic::reply(&value),
                    ProviderKind::OpenAi => openai::reply(&value),
                };
            }
            Err(ureq::Error::Status(status, resp)) => {
                let retry_after = resp
                    .header("retry-after")
                    .and_then(|v| v.trim().parse::<f64>().ok())
                    .filter(|s| s.is_finite() && *s >= 0.0)
                    .map(Duration::from_secs_f64);
                let message = error_message(resp);
                if !matches!(status, 408 | 409 | 429) && status < 500 {
                    return Err(LlmError::Rejected { status, message });
                }
                (format!("{status}: {message}"), retry_after)
            }
            Err(ureq::Error::Transport(t)) => (format!("{t}"), None),
        };
        let (error, retry_after) = failure;
        if attempt > cfg.retries {
            return Err(LlmError::Unavailable {
                attempts: attempt,
                last: error,
            });
        }
        let doubled = cfg.backoff.saturating_mul(1 << (attempt - 1).min(16));
        let wait = retry_after.unwrap_or(doubled).min(BACKOFF_MAX);
        tracing::info!(attempt, ?wait, "model call failed: {error}; retrying");
        on_retry(&Retry { attempt, error, wait });
        std::thread::sleep(wait);
    }
}

fn read_json(resp: ureq::Response) -> Result<serde_json::Value, LlmError> {
    use std::io::Read;
    let mut text = String::new();
    resp.into_reader()
        .take(REPLY_MAX + 1)
        .read_to_string(&mut text)
        .map_err(|e| LlmError::Malformed(format!("cannot read the reply: {e}")))?;
    if text.len() as u64 > REPLY_MAX {
        return Err(LlmError::Malformed(format!(
            "the reply is larger than {REPLY_MAX} bytes"
        )));
    }
    serde_json::from_str(&text).map_err(|e| LlmError::Malformed(format!("the reply is not JSON: {e}")))
}

/// The message of a provider's error body (both providers put it at
/// `error.message`), cut short; the raw text when it is not that shape.
fn error_message(resp: ureq::Response) -> String {
    use std::io::Read;
    let mut text = String::new();
    let _ = resp.into_reader().take(64 << 10).read_to_string(&mut text);
    let message = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or(text);
    clip(message.trim(), 1000)
}

/// `s` cut to at most `max` bytes on a character boundary.
pub fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_follow_the_sdks_base_urls() {
        let mut c = ModelConfig::new(ProviderKind::Anthropic, "m");
        assert_eq!(c.endpoint(), "https://api.anthropic.com/v1/messages");
        c.base_url = Some("http://127.0.0.1:9/".into());
        assert_eq!(c.endpoint(), "http://127.0.0.1:9/v1/messages");
        let mut o = ModelConfig::new(ProviderKind::OpenAi, "m");
        assert_eq!(o.endpoint(), "https://api.openai.com/v1/chat/completions");
        o.base_url = Some("http://127.0.0.1:9/v1".into());
        assert_eq!(o.endpoint(), "http://127.0.0.1:9/v1/chat/completions");
    }

    #[test]
    fn bad_configuration_is_refused_before_any_call() {
        let mut c = ModelConfig::new(ProviderKind::OpenAi, "");
        c.base_url = Some("http://x".into());
        assert!(c.check().unwrap_err().to_string().contains("--model"));
        c.model = "m".into();
        c.base_url = Some("ftp://x".into());
        assert!(c.check().unwrap_err().to_string().contains("not an http"));
        assert!("gemini".parse::<ProviderKind>().unwrap_err().contains("anthropic"));
    }

    #[test]
    fn an_unreachable_server_is_an_outage_after_the_retries() {
        // A port nothing listens on: every attempt is refused.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut c = ModelConfig::new(ProviderKind::OpenAi, "m");
        c.base_url = Some(format!("http://127.0.0.1:{port}/v1"));
        c.retries = 2;
        c.backoff = Duration::from_millis(1);
        let mut seen = 0;
        let err = complete_with(&c, &Conversation::default(), &[], &mut |_| seen += 1).unwrap_err();
        assert!(matches!(err, LlmError::Unavailable { attempts: 3, .. }), "{err}");
        assert_eq!(seen, 2);
    }
}

//! An agent's state is its session's context log, read back: the log is
//! the only record, so a loop killed at any instant resumes from it.
//!
//! Entries the loop writes (with the role each has):
//! - `system` (role `agent`): the system prompt; `arguments` the [`AgentConfig`].
//! - `note` (role `agent`): a JSON [`Event`]: the base snapshots, a status change,
//!   raised limits, the lineage summary sent after a round of results.
//! - `user` (role `agent`): the first message (the goal and where to start).
//! - `assistant` (role `model`): a reply; `arguments` the [`Recorded`] reply with
//!   its cost, `tokens_in`/`tokens_out` its usage.
//! - `tool_result` (role `agent`): one per tool call of the reply before it;
//!   `arguments` [`ResultMeta`], `result` the text the model is given.
//!
//! Other entries (a session tool's own `tool_call`/`tool_result` records
//! under other roles) are the session's, not the conversation's.

use cairn_llm::{Conversation, ModelConfig, Price, Reply, ToolCall, ToolResult, Turn, Usage};
use cairn_session::{Entry, EntryKind};
use serde::{Deserialize, Serialize};

pub const AGENT_ROLE: &str = "agent";
pub const MODEL_ROLE: &str = "model";
/// The version of [`AgentConfig`] as recorded.
pub const CONFIG_VERSION: u32 = 1;

/// What `cairn agent run` was asked, as recorded in the first entry.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AgentConfig {
    pub version: u32,
    pub goal: String,
    pub model: ModelConfig,
    pub max_stages: u32,
    pub budget_usd: Option<f64>,
    /// `None`: the model's cost is not known (not in the price table, no
    /// price given); tokens are still counted.
    pub price: Option<Price>,
    /// The pipeline file run first, by its text, when one was given.
    pub pipeline: Option<PipelineStart>,
    /// The snapshot to start from, when one was given.
    pub snapshot: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PipelineStart {
    pub file: String,
    pub text: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Running,
    /// The model was unavailable after its retries: `cairn agent resume`.
    Paused,
    /// A budget or the stage limit was reached: resume with a higher one.
    Stopped,
    /// The model ended its turn: the goal is met, or it gave up.
    Completed,
    /// The provider refused the requests (a bad key, a bad model name).
    Failed,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Running => "running",
            Status::Paused => "paused",
            Status::Stopped => "stopped",
            Status::Completed => "completed",
            Status::Failed => "failed",
        }
    }
}

/// A `note` the loop writes.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The pipeline run the agent started from (recorded before it runs).
    Pipeline {
        run: String,
    },
    /// The snapshots the plan starts from.
    Base {
        snapshots: Vec<String>,
    },
    Status {
        status: Status,
        detail: String,
    },
    /// Limits raised by `cairn agent resume`.
    Limits {
        max_stages: u32,
        budget_usd: Option<f64>,
    },
    /// The lineage so far, sent after a round of tool results.
    Lineage {
        text: String,
    },
}

/// A reply as recorded: the reply and what it cost.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Recorded {
    pub reply: Reply,
    pub cost_usd: Option<f64>,
}

/// What the log keeps about one tool result besides its text.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ResultMeta {
    pub call_id: String,
    /// The run a stage tool started (its handle).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_run: Option<String>,
}

/// One round: a reply and the results of its calls recorded so far.
#[derive(Debug, Clone)]
pub struct Round {
    pub seq: u64,
    pub recorded: Recorded,
    pub results: Vec<(ToolResult, ResultMeta, String)>,
    pub lineage: Option<String>,
}

impl Round {
    /// The calls of this round's reply that have no result yet.
    pub fn pending(&self) -> Vec<ToolCall> {
        self.recorded
            .reply
            .calls
            .iter()
            .filter(|c| !self.results.iter().any(|(r, ..)| r.call_id == c.id))
            .cloned()
            .collect()
    }
}

/// An agent as its log says it is.
#[derive(Debug, Clone)]
pub struct AgentState {
    pub config: AgentConfig,
    pub system: String,
    pub first_message: Option<String>,
    pub pipeline_run: Option<String>,
    pub base: Vec<String>,
    pub status: Status,
    pub detail: String,
    pub max_stages: u32,
    pub budget_usd: Option<f64>,
    pub rounds: Vec<Round>,
    pub usage: Usage,
    /// `None` once any reply's cost is unknown.
    pub cost_usd: Option<f64>,
    pub model_calls: u32,
}

impl AgentState {
    /// Reads an agent's state from its log; `None` when the log is not an
    /// agent's.
    pub fn from_log(entries: &[Entry]) -> Result<Option<AgentState>, String> {
        let mut it = entries.iter();
        let Some(first) = it.next() else { return Ok(None) };
        if first.kind != EntryKind::System || first.role.as_deref() != Some(AGENT_ROLE) {
            return Ok(None);
        }
        let config: AgentConfig = serde_json::from_str(first.arguments.as_deref().unwrap_or(""))
            .map_err(|e| format!("entry {}: the agent's configuration cannot be read: {e}", first.seq))?;
        if config.version != CONFIG_VERSION {
            return Err(format!(
                "the agent was recorded by a Cairn whose agent format is {} (this one reads {CONFIG_VERSION})",
                config.version
            ));
        }
        let mut st = AgentState {
            system: first.content.clone().unwrap_or_default(),
            first_message: None,
            pipeline_run: None,
            base: Vec::new(),
            status: Status::Running,
            detail: String::new(),
            max_stages: config.max_stages,
            budget_usd: config.budget_usd,
            rounds: Vec::new(),
            usage: Usage::default(),
            cost_usd: Some(0.0),
            model_calls: 0,
            config,
        };
        for e in it {
            let role = e.role.as_deref();
            match (e.kind, role) {
                (EntryKind::User, Some(AGENT_ROLE)) => st.first_message = e.content.clone(),
                (EntryKind::Note, Some(AGENT_ROLE)) => {
                    let Ok(event) = serde_json::from_str::<Event>(e.content.as_deref().unwrap_or("")) else {
                        continue;
                    };
                    match event {
                        Event::Pipeline { run } => st.pipeline_run = Some(run),
                        Event::Base { snapshots } => st.base = snapshots,
                        Event::Status { status, detail } => {
                            st.status = status;
                            st.detail = detail;
                        }
                        Event::Limits { max_stages, budget_usd } => {
                            st.max_stages = max_stages;
                            st.budget_usd = budget_usd;
                        }
                        Event::Lineage { text } => {
                            if let Some(r) = st.rounds.last_mut() {
                                r.lineage = Some(text);
                            }
                        }
                    }
                }
                (EntryKind::Assistant, Some(MODEL_ROLE)) => {
                    let recorded: Recorded = serde_json::from_str(e.arguments.as_deref().unwrap_or(""))
                        .map_err(|err| format!("entry {}: a recorded reply cannot be read: {err}", e.seq))?;
                    st.usage.input_tokens += recorded.reply.usage.input_tokens;
                    st.usage.output_tokens += recorded.reply.usage.output_tokens;
                    st.cost_usd = match (st.cost_usd, recorded.cost_usd) {
                        (Some(a), Some(b)) => Some(a + b),
                        _ => None,
                    };
                    st.model_calls += 1;
                    st.rounds.push(Round {
                        seq: e.seq,
                        recorded,
                        results: Vec::new(),
                        lineage: None,
                    });
                }
                (EntryKind::ToolResult, Some(AGENT_ROLE)) => {
                    let meta: ResultMeta = serde_json::from_str(e.arguments.as_deref().unwrap_or(""))
                        .map_err(|err| format!("entry {}: a tool result cannot be read: {err}", e.seq))?;
                    let Some(round) = st.rounds.last_mut() else { continue };
                    let result = ToolResult {
                        call_id: meta.call_id.clone(),
                        content: e.result.clone().unwrap_or_default(),
                        is_error: e.exit_status.unwrap_or(0) != 0,
                    };
                    round.results.push((result, meta, e.tool.clone().unwrap_or_default()));
                }
                _ => {}
            }
        }
        Ok(Some(st))
    }

    /// Stages started so far (each stage tool call that started a run).
    pub fn stages_used(&self) -> u32 {
        self.rounds
            .iter()
            .flat_map(|r| &r.results)
            .filter(|(_, m, _)| m.stage_run.is_some())
            .count() as u32
    }

    /// Rounds the model was asked for while the stage limit was already
    /// reached (its wrap-up: it may select, inspect and summarise).
    pub fn rounds_at_limit(&self) -> u32 {
        let mut used = 0;
        let mut at_limit = 0;
        for r in &self.rounds {
            if used >= self.max_stages {
                at_limit += 1;
            }
            used += r.results.iter().filter(|(_, m, _)| m.stage_run.is_some()).count() as u32;
        }
        at_limit
    }

    /// The conversation to send the model: the first message, then each
    /// reply with its results and the lineage note after them.
    pub fn conversation(&self) -> Conversation {
        let mut turns = Vec::new();
        if let Some(m) = &self.first_message {
            turns.push(Turn::User { text: m.clone() });
        }
        for r in &self.rounds {
            turns.push(Turn::Assistant {
                reply: r.recorded.reply.clone(),
            });
            if !r.recorded.reply.calls.is_empty() {
                turns.push(Turn::ToolResults {
                    results: r.results.iter().map(|(t, ..)| t.clone()).collect(),
                    note: r.lineage.clone(),
                });
            }
        }
        Conversation {
            system: self.system.clone(),
            turns,
        }
    }
}

/// An agent entry of `kind` under the loop's role.
pub fn entry(kind: EntryKind, role: &str) -> Entry {
    let mut e = Entry::new(kind);
    e.role = Some(role.to_string());
    e
}

pub fn event(ev: &Event) -> Entry {
    let mut e = entry(EntryKind::Note, AGENT_ROLE);
    e.content = Some(serde_json::to_string(ev).expect("serialisable"));
    e
}

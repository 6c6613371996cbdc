//! Decide stages: at a stage boundary the model, given the stage's prompt
//! and what the stage before it left (its log's tail, metrics, artifacts),
//! the parameters and the next stage's definition, answers through one tool
//! (`decide`) whose schema follows what the stage may choose. The answer is
//! checked (an invalid one is asked again with the error, twice at most,
//! then the stage goes to the dead letters) and recorded in one transaction
//! with its effect before anything acts on it: a recorded decision is never
//! asked for again, by a resume or by another run with the same stage key.
//! An outage leaves the run interrupted; `cairn pipeline resume` asks again.

use std::collections::BTreeSet;
use std::io::{Read, Seek, SeekFrom};

use cairn_llm::{Conversation, ModelConfig, ProviderKind, ToolDef, ToolResult, Turn};

use crate::decision::{self, Action, Answer, Rules};
use crate::error::RunError;
use crate::lineage::EventData;
use crate::prelude::*;
use crate::records::{DeadLetter, DecisionEffect, DecisionRecord, NewEvent, RunRecord, StageRecord};
use crate::render::{new_id, render};
use crate::spec::{Decide, Metric, ModelSpec, Pipeline, Selection, Stage};
use crate::watch::RunWatcher;
use cairn_engine::{now_ms, Engine, EngineError};

/// Model calls for one decision: the first and two more after invalid answers.
pub const MAX_CALLS: u32 = 3;
/// Retries of the stage before that decisions of one decide stage may ask
/// for in a row; one more `retry` sends that stage to the dead letters (and
/// `cairn dlq retry` starts the count again).
pub const MAX_DECIDED_RETRIES: u32 = 2;
/// Bytes of the previous stage's log the model sees (its end).
pub const LOG_TAIL: u64 = 8 << 10;
/// Bytes of each branch's log the model sees, for a branch group.
pub const BRANCH_LOG_TAIL: u64 = 2 << 10;

/// What the orchestrator does after a decide stage.
pub(super) enum Step {
    /// Apply the (new or recorded) answer and go on.
    Apply(Answer),
    /// The stage before runs again: start over from the records.
    Restart,
    /// The run failed here (a dead letter); its record says why.
    Stop,
}

/// Decide stages: a model asked, its answer recorded and checked.
pub trait RunDecisions {
    /// Sets the model decide stages ask, over what pipeline files say.
    fn set_model_override(&mut self, model: ModelSpec);

    /// Every decision recorded in a run.
    fn run_decisions(&self, run: &str) -> Result<Vec<DecisionRecord>, EngineError>;
}

impl RunDecisions for Engine {
    fn set_model_override(&mut self, model: ModelSpec) {
        self.set_extension(model);
    }

    fn run_decisions(&self, run: &str) -> Result<Vec<DecisionRecord>, EngineError> {
        Ok(self.db().decisions_of(run)?)
    }
}

pub(crate) trait DecideSteps {
    /// Before anything runs: a pipeline with a decide stage still to decide
    /// (in `run`, when given) needs a usable model configuration.
    fn check_model_for(&self, run: Option<&str>, p: &Pipeline) -> Result<(), EngineError>;

    fn model_config(&self, p: &Pipeline, stage: &str) -> Result<ModelConfig, RunError>;

    /// A decide stage: reuses a recorded decision (this run's, or its key's
    /// from another run), or asks the model and records the answer.
    fn decide_stage(
        &mut self,
        run: &RunRecord,
        p: &Pipeline,
        stage: &Stage,
        d: &Decide,
        input: Option<&str>,
        watch: &dyn RunWatcher,
    ) -> Result<Step, EngineError>;

    /// Records a new decision with what it does to the stage before: the
    /// decide stage completes (`continue`, or no action to choose), the
    /// stage before runs again (`retry`, within the limit), or it goes to
    /// the dead letters (`dlq`, or one `retry` too many).
    #[allow(clippy::too_many_arguments)]
    fn act(
        &mut self,
        run: &RunRecord,
        stage: &Stage,
        rec: StageRecord,
        record: &DecisionRecord,
        answer: Answer,
        decided: EventData,
        retries_asked: u32,
        watch: &dyn RunWatcher,
    ) -> Result<Step, EngineError>;

    fn complete(&mut self, rec: &mut StageRecord, d: &DecisionRecord, event: NewEvent) -> Result<(), EngineError>;

    /// The decide stage goes to the dead letters; `cairn dlq retry` asks again.
    fn dead_decision(
        &mut self,
        run: &RunRecord,
        rec: &mut StageRecord,
        error: &str,
        input: Option<&str>,
        watch: &dyn RunWatcher,
    ) -> Result<(), EngineError>;

    fn rules(&self, p: &Pipeline, d: &Decide) -> Rules;

    /// What the model is told: the prompt, the stage before (status,
    /// metrics, artifacts, its log's tail), the parameters, the next stage.
    fn context(&self, run: &RunRecord, p: &Pipeline, stage: &Stage, d: &Decide) -> Result<String, EngineError>;
}

impl DecideSteps for Engine {
    fn check_model_for(&self, run: Option<&str>, p: &Pipeline) -> Result<(), EngineError> {
        for s in p.stages.iter().filter(|s| s.decide.is_some()) {
            let done = match run {
                Some(run) => self
                    .db()
                    .stage(run, &s.name, "")?
                    .is_some_and(|r| r.status == "completed"),
                None => false,
            };
            if !done {
                self.model_config(p, &s.name)?;
                return Ok(());
            }
        }
        Ok(())
    }

    fn model_config(&self, p: &Pipeline, stage: &str) -> Result<ModelConfig, RunError> {
        let o = self.extension::<ModelSpec>().cloned().unwrap_or_default();
        let provider = o.provider.clone().or(p.model.provider.clone());
        let model = o.model.clone().or(p.model.model.clone());
        let (Some(provider), Some(model)) = (provider, model) else {
            return Err(RunError::NoModel(format!(
                "decide stage {stage} needs a model: add [pipeline] model = {{ provider = \"anthropic\", model = \"...\" }} \
                 or pass --provider and --model"
            )));
        };
        let kind: ProviderKind = provider
            .parse()
            .map_err(|_| RunError::NoModel(format!("model provider {provider:?} is not one of anthropic, openai")))?;
        let mut cfg = ModelConfig::new(kind, &model);
        cfg.base_url = o.base_url.clone().or(p.model.base_url.clone());
        if let Some(r) = o.retries.or(p.model.retries) {
            cfg.retries = r;
        }
        cfg.check().map_err(|e| RunError::NoModel(e.to_string()))?;
        Ok(cfg)
    }

    fn decide_stage(
        &mut self,
        run: &RunRecord,
        p: &Pipeline,
        stage: &Stage,
        d: &Decide,
        input: Option<&str>,
        watch: &dyn RunWatcher,
    ) -> Result<Step, EngineError> {
        let key = render(&stage.key, p, stage, None);
        let row = self.db().stage(&run.id, &stage.name, "")?;
        let mine: Vec<DecisionRecord> = self
            .db()
            .decisions_of(&run.id)?
            .into_iter()
            .filter(|x| x.stage == stage.name)
            .collect();
        match row.as_ref().map(|r| r.status.as_str()) {
            Some("completed") => {
                let last = mine.iter().max_by_key(|x| x.round).ok_or_else(|| {
                    RunError::Lost(format!(
                        "decide stage {} completed without a recorded decision",
                        stage.name
                    ))
                })?;
                return Ok(Step::Apply(Answer::from_stored(&last.answer).map_err(RunError::Lost)?));
            }
            Some("dead") => return Ok(Step::Stop),
            _ => {}
        }
        let round = mine.iter().map(|x| x.round).max().unwrap_or(0) + 1;
        let mut rec = row.unwrap_or_else(|| StageRecord::pending(&run.id, &stage.name, "", &key, input));
        rec.stage_key = key.clone();
        rec.input_snapshot = input.map(str::to_string);
        rec.attempts = round;
        // A key decided (and completed) before is decided: its answer is reused.
        if let Some(done) = self.db().decision_by_key(&key)? {
            let answer = Answer::from_stored(&done.answer).map_err(RunError::Lost)?;
            let detail = format!(
                "stage key {key} was decided in run {}; its decision is reused: {} — {}",
                done.run_id,
                answer.summary(),
                answer.reason
            );
            let copy = DecisionRecord {
                run_id: run.id.clone(),
                stage: stage.name.clone(),
                round,
                input_tokens: 0,
                output_tokens: 0,
                calls: 0,
                created_at: now_ms(),
                ..done
            };
            self.complete(&mut rec, &copy, NewEvent::text("reused", &detail, None))?;
            watch.stage(&stage.name, "", "reused", &detail);
            return Ok(Step::Apply(answer));
        }
        let cfg = self.model_config(p, &stage.name)?;
        let model = format!("{}/{}", cfg.provider, cfg.model);
        watch.stage(&stage.name, "", "deciding", &format!("asking {model}"));
        let rules = self.rules(p, d);
        let context = self.context(run, p, stage, d)?;
        let asked = match ask(&cfg, &context, &rules) {
            Ok(a) => a,
            Err(e) => {
                let msg = format!(
                    "decide stage {}: {e}; the run is interrupted, and `cairn pipeline resume {}` asks again",
                    stage.name, run.id
                );
                self.db()
                    .event(&run.id, Some(&stage.name), Some(""), "model-unavailable", &msg, None)?;
                watch.stage(&stage.name, "", "interrupted", &msg);
                return Err(RunError::Model(msg).into());
            }
        };
        let (answer, usage) = match asked {
            Asked::Valid { answer, usage } => (answer, usage),
            Asked::Invalid { error, usage } => {
                let error = format!(
                    "the model gave no valid decision in {MAX_CALLS} calls ({} tokens in, {} out); the last answer: {error}",
                    usage.0, usage.1
                );
                self.dead_decision(run, &mut rec, &error, input, watch)?;
                return Ok(Step::Stop);
            }
        };
        let record = DecisionRecord {
            run_id: run.id.clone(),
            stage: stage.name.clone(),
            round,
            stage_key: key.clone(),
            model: model.clone(),
            answer: answer.to_stored(),
            reason: answer.reason.clone(),
            input_tokens: usage.0,
            output_tokens: usage.1,
            calls: usage.2,
            created_at: now_ms(),
        };
        // At list price, when the model's is known.
        let cost_usd = cairn_llm::price_for(&cfg.model).map(|p| {
            p.cost(&cairn_llm::Usage {
                input_tokens: usage.0,
                output_tokens: usage.1,
            })
        });
        let decided = EventData::Decided {
            round,
            model: model.clone(),
            chose: answer.summary(),
            reason: answer.reason.clone(),
            input_tokens: usage.0,
            output_tokens: usage.1,
            calls: usage.2,
            cost_usd,
            then: None,
        };
        // Retries asked for since the stage before last went to the dead
        // letters: a retry from there starts the count again.
        let mut retries_asked = 0;
        let mut earlier: Vec<&DecisionRecord> = mine.iter().collect();
        earlier.sort_by_key(|x| x.round);
        for x in earlier {
            match Answer::from_stored(&x.answer).ok().and_then(|a| a.action) {
                Some(Action::Retry) if retries_asked < MAX_DECIDED_RETRIES => retries_asked += 1,
                Some(Action::Retry | Action::Dlq) => retries_asked = 0,
                _ => {}
            }
        }
        self.act(run, stage, rec, &record, answer, decided, retries_asked, watch)
    }

    #[allow(clippy::too_many_arguments)]
    fn act(
        &mut self,
        run: &RunRecord,
        stage: &Stage,
        mut rec: StageRecord,
        record: &DecisionRecord,
        answer: Answer,
        decided: EventData,
        retries_asked: u32,
        watch: &dyn RunWatcher,
    ) -> Result<Step, EngineError> {
        let previous = &stage.after[0];
        let detail = decided.sentence();
        let then = |t: String| {
            let mut d = decided.clone();
            if let EventData::Decided { then, .. } = &mut d {
                *then = Some(t);
            }
            NewEvent::typed(d, None)
        };
        match answer.action {
            None | Some(Action::Continue) => {
                self.complete(&mut rec, record, NewEvent::typed(decided.clone(), None))?;
                watch.stage(&stage.name, "", "decided", &detail);
                Ok(Step::Apply(answer))
            }
            Some(Action::Retry) if retries_asked < MAX_DECIDED_RETRIES => {
                let mut prev = self
                    .db()
                    .stage(&run.id, previous, "")?
                    .ok_or_else(|| RunError::Lost(format!("stage {previous} has no record")))?;
                prev.status = "pending".into();
                prev.output_snapshot = None;
                prev.metric = None;
                prev.ended_at = None;
                prev.error = Some(format!(
                    "decide stage {} asked for a retry: {}",
                    stage.name, answer.reason
                ));
                rec.status = "pending".into();
                self.db_mut().record_decision(
                    record,
                    &rec,
                    then(format!("stage {previous} runs again")),
                    DecisionEffect::Retry { previous: &prev },
                )?;
                watch.stage(&stage.name, "", "decided", &detail);
                Ok(Step::Restart)
            }
            Some(action) => {
                let why = if action == Action::Retry {
                    format!(
                        "decide stage {} asked for a retry after {MAX_DECIDED_RETRIES} already: {}",
                        stage.name, answer.reason
                    )
                } else {
                    format!(
                        "decide stage {} sent it to the dead-letter queue: {}",
                        stage.name, answer.reason
                    )
                };
                let mut prev = self
                    .db()
                    .stage(&run.id, previous, "")?
                    .ok_or_else(|| RunError::Lost(format!("stage {previous} has no record")))?;
                let dl = DeadLetter {
                    id: new_id(12),
                    run_id: run.id.clone(),
                    stage: previous.clone(),
                    branch: String::new(),
                    error: why.clone(),
                    failure_snapshot: prev.output_snapshot.clone(),
                    input_snapshot: prev.input_snapshot.clone(),
                    created_at: now_ms(),
                    retried_at: None,
                };
                prev.status = "dead".into();
                prev.error = Some(why.clone());
                prev.output_snapshot = None;
                prev.ended_at = Some(now_ms());
                rec.status = "pending".into();
                let run_error = format!("stage {previous} went to the dead-letter queue: {why}");
                self.db_mut().record_decision(
                    record,
                    &rec,
                    then(format!("stage {previous} is dead letter {}", dl.id)),
                    DecisionEffect::Dlq {
                        previous: &prev,
                        dead_letter: &dl,
                        run_error: &run_error,
                    },
                )?;
                watch.stage(previous, "", "dead", &why);
                Ok(Step::Stop)
            }
        }
    }

    fn complete(&mut self, rec: &mut StageRecord, d: &DecisionRecord, event: NewEvent) -> Result<(), EngineError> {
        rec.status = "completed".into();
        rec.output_snapshot = rec.input_snapshot.clone();
        rec.ended_at = Some(now_ms());
        rec.error = None;
        self.db_mut().record_decision(d, rec, event, DecisionEffect::Complete)?;
        Ok(())
    }

    fn dead_decision(
        &mut self,
        run: &RunRecord,
        rec: &mut StageRecord,
        error: &str,
        input: Option<&str>,
        watch: &dyn RunWatcher,
    ) -> Result<(), EngineError> {
        let dl = DeadLetter {
            id: new_id(12),
            run_id: run.id.clone(),
            stage: rec.stage.clone(),
            branch: String::new(),
            error: error.to_string(),
            failure_snapshot: None,
            input_snapshot: input.map(str::to_string),
            created_at: now_ms(),
            retried_at: None,
        };
        self.db().insert_dead_letter(&dl)?;
        rec.status = "dead".into();
        rec.error = Some(error.to_string());
        rec.ended_at = Some(now_ms());
        let detail = format!("{error}; dead letter {}", dl.id);
        self.db_mut().put_stage(rec, Some(("dead", &detail, None)))?;
        watch.stage(&rec.stage, "", "dead", &detail);
        Ok(())
    }

    fn rules(&self, p: &Pipeline, d: &Decide) -> Rules {
        let fields = d
            .next
            .as_ref()
            .and_then(|n| p.stages.iter().find(|s| &s.name == n))
            .and_then(|s| s.branches.as_ref())
            .map(|b| b.fields.clone())
            .unwrap_or_default();
        Rules {
            choose: d.choose.clone(),
            fields,
            params: p.params.keys().cloned().collect::<BTreeSet<_>>(),
        }
    }

    fn context(&self, run: &RunRecord, p: &Pipeline, stage: &Stage, d: &Decide) -> Result<String, EngineError> {
        use std::fmt::Write;
        let prev = &stage.after[0];
        let mut t = String::new();
        let _ = writeln!(
            t,
            "Pipeline {:?}, run {}. You are its decide stage {:?}.\n",
            p.name, run.id, stage.name
        );
        let _ = writeln!(t, "## What to decide\n{}\n", d.prompt);
        let rows: Vec<StageRecord> = self
            .db()
            .stages_of(&run.id)?
            .into_iter()
            .filter(|s| &s.stage == prev)
            .collect();
        let _ = writeln!(t, "## The stage before: {prev}");
        for r in rows.iter().take(1 + decision::MAX_HYPOTHESES) {
            let who = if r.branch.is_empty() {
                "stage".to_string()
            } else {
                format!("branch {}", r.branch)
            };
            let _ = writeln!(
                t,
                "- {who}: {}, {} attempt(s){}{}",
                r.status,
                r.attempts,
                r.metric.map(|m| format!(", metric {m}")).unwrap_or_default(),
                r.error
                    .as_deref()
                    .map(|e| format!(", error: {}", cairn_llm::clip(e, 500)))
                    .unwrap_or_default()
            );
        }
        let artifacts = self.db().artifacts(Some(&run.id))?;
        for a in artifacts.iter().filter(|a| &a.stage == prev).take(32) {
            let _ = writeln!(t, "- artifact {} ({} bytes)", a.path, a.size_bytes);
        }
        let logs: Vec<(String, u64)> = if rows.iter().any(|r| !r.branch.is_empty()) {
            rows.iter()
                .filter(|r| !r.branch.is_empty())
                .take(decision::MAX_HYPOTHESES)
                .map(|r| (format!("{prev}.{}.log", r.branch), BRANCH_LOG_TAIL))
                .collect()
        } else {
            vec![(format!("{prev}.log"), LOG_TAIL)]
        };
        for (name, max) in logs {
            let tail = log_tail(&self.run_dir(&run.id).join(&name), max);
            let _ = writeln!(t, "\nLast lines of {name} (at most {max} bytes):\n```\n{tail}\n```");
        }
        let _ = writeln!(t, "\n## Parameters");
        for (k, v) in &p.params {
            let _ = writeln!(t, "- {k} = {v:?}");
        }
        if let Some(next) = p.stages.iter().find(|s| s.after.contains(&stage.name)) {
            let _ = writeln!(t, "\n## The stage after: {} (its current definition)", next.name);
            let _ = writeln!(t, "key = {:?}", next.key);
            for cmd in &next.run {
                let _ = writeln!(t, "run: {cmd}");
            }
            if let Some(b) = &next.branches {
                let _ = writeln!(
                    t,
                    "It runs a branch group: each hypothesis forks the same input, and the winner is {}; \
                     commands use {{hypothesis}} (the name) and {}.",
                    match &b.select {
                        Selection::FirstSuccess => "the first to succeed".to_string(),
                        Selection::Min(m) => format!("the least {}", metric_text(m)),
                        Selection::Max(m) => format!("the greatest {}", metric_text(m)),
                        Selection::Deferred => "chosen later, by whoever started the group".to_string(),
                    },
                    b.fields
                        .iter()
                        .map(|f| format!("{{hypothesis.{f}}}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                for h in &b.hypotheses {
                    let _ = writeln!(t, "current hypothesis: {h:?}");
                }
            }
        }
        let _ = writeln!(t, "\nAnswer by calling the decide tool once.");
        Ok(t)
    }
}

fn metric_text(m: &Metric) -> String {
    match m {
        Metric::Output => "last number printed".into(),
        Metric::File(path) => format!("number in {path}"),
    }
}

/// The end of a log, at most `max` bytes, as text.
fn log_tail(path: &std::path::Path, max: u64) -> String {
    let Ok(mut f) = std::fs::File::open(path) else {
        return "(no log)".into();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut buf = Vec::with_capacity(max as usize);
    let _ = f.take(max).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// How asking went: (input tokens, output tokens, calls) with each.
enum Asked {
    Valid { answer: Answer, usage: (u64, u64, u32) },
    Invalid { error: String, usage: (u64, u64, u32) },
}

/// Asks the model, feeding an invalid answer's error back, [`MAX_CALLS`]
/// calls at most. An outage (or a refused request) is an error.
fn ask(cfg: &ModelConfig, context: &str, rules: &Rules) -> Result<Asked, cairn_llm::LlmError> {
    let tools = [ToolDef {
        name: "decide".into(),
        description: "Record the decision at this stage boundary. Call it exactly once.".into(),
        input_schema: decision::schema(rules),
    }];
    let mut conv = Conversation {
        system: "You are a decision point in a Cairn pipeline: stages run in sandboxes, and at this boundary you \
                 choose what runs next from the evidence given. Answer only by calling the `decide` tool, with \
                 arguments that fit its schema, and say briefly why in `reason`."
            .into(),
        turns: vec![Turn::User {
            text: context.to_string(),
        }],
    };
    let mut usage = (0u64, 0u64, 0u32);
    let mut last_error = String::new();
    while usage.2 < MAX_CALLS {
        let reply = cairn_llm::complete(cfg, &conv, &tools)?;
        usage.0 += reply.usage.input_tokens;
        usage.1 += reply.usage.output_tokens;
        usage.2 += 1;
        let decide = reply.calls.iter().find(|c| c.name == "decide");
        let verdict = match decide {
            None => Err("no decide call: answer by calling the decide tool".to_string()),
            Some(c) if c.raw.is_some() => Err("the decide call's arguments were not JSON".to_string()),
            Some(c) => decision::check(&c.arguments, rules),
        };
        match verdict {
            Ok(answer) => return Ok(Asked::Valid { answer, usage }),
            Err(e) => {
                last_error = e.clone();
                let calls = reply.calls.clone();
                conv.turns.push(Turn::Assistant { reply });
                if calls.is_empty() {
                    conv.turns.push(Turn::User {
                        text: format!("{e}. Call the decide tool now."),
                    });
                } else {
                    let results = calls
                        .iter()
                        .map(|c| ToolResult {
                            call_id: c.id.clone(),
                            content: if c.name == "decide" {
                                format!("invalid: {e}. Call decide again with corrected arguments.")
                            } else {
                                format!("there is no tool {:?}; call decide", cairn_llm::clip(&c.name, 64))
                            },
                            is_error: true,
                        })
                        .collect();
                    conv.turns.push(Turn::ToolResults { results, note: None });
                }
            }
        }
    }
    Ok(Asked::Invalid {
        error: last_error,
        usage,
    })
}

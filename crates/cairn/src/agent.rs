//! Agent commands: run, resume, show, ls (the loop is `cairn-agent`).

use anyhow::{bail, Context, Result};
use cairn_agent::{AgentState, NewAgent, Outcome, PipelineStart, Start, Status, Watch};
use cairn_engine::{Engine, Home};
use cairn_llm::{ModelConfig, Price, ProviderKind};
use cairn_session::SessionRecord;
use serde_json::json;

use crate::cli::{AgentCommand, ModelArgs};

/// Progress lines on stderr, so that stdout keeps the result.
struct Lines;

impl Watch for Lines {
    fn say(&self, line: &str) {
        eprintln!("{line}");
    }
}

pub fn agent(home: &Home, cmd: AgentCommand) -> Result<i32> {
    match cmd {
        AgentCommand::Run {
            goal,
            pipeline,
            snapshot,
            image,
            model,
            max_stages,
            budget_usd,
            json,
        } => {
            let (config, price) = model_config(&model)?;
            let start = match (pipeline, snapshot) {
                (Some(file), _) => Start::Pipeline(PipelineStart {
                    text: std::fs::read_to_string(&file)
                        .with_context(|| format!("cannot read the pipeline file {}", file.display()))?,
                    file: file.display().to_string(),
                }),
                (None, Some(s)) => Start::Snapshot(s),
                (None, None) => Start::Image(image),
            };
            let new = NewAgent {
                goal,
                model: config,
                max_stages,
                budget_usd,
                price,
                start,
            };
            let session = {
                let mut engine = Engine::open(home.clone())?;
                cairn_agent::create(&mut engine, new)?
            };
            eprintln!("agent {} started", session.name);
            let out = cairn_agent::drive(home, &session.id, &Lines)?;
            report(&out, json)
        }
        AgentCommand::Resume {
            agent,
            max_stages,
            budget_usd,
            json,
        } => {
            {
                let mut engine = Engine::open(home.clone())?;
                cairn_agent::raise_limits(&mut engine, &agent, max_stages, budget_usd)?;
            }
            let out = cairn_agent::drive(home, &agent, &Lines)?;
            report(&out, json)
        }
        AgentCommand::Show { agent, json } => {
            let engine = Engine::open(home.clone())?;
            let (s, st) = cairn_agent::find(&engine, &agent)?;
            show(home, &s, &st, json)?;
            Ok(0)
        }
        AgentCommand::Ls { json } => {
            let engine = Engine::open(home.clone())?;
            let all = cairn_agent::list(&engine)?;
            if json {
                let v: Vec<_> = all.iter().map(|(s, st)| summary(home, s, st)).collect();
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                for (s, st) in &all {
                    println!(
                        "{}  {:<9} {} stages  {} calls  {}  {}",
                        s.name,
                        cairn_agent::shown_status(home, s, st),
                        st.stages_used(),
                        st.model_calls,
                        cost(st.cost_usd),
                        cairn_llm::clip(&st.config.goal.replace('\n', " "), 60)
                    );
                }
            }
            Ok(0)
        }
    }
}

fn model_config(m: &ModelArgs) -> Result<(ModelConfig, Option<Price>)> {
    let provider = match &m.provider {
        Some(p) => p.parse::<ProviderKind>().map_err(anyhow::Error::msg)?,
        None if std::env::var_os("ANTHROPIC_API_KEY").is_some() => ProviderKind::Anthropic,
        None if std::env::var_os("OPENAI_API_KEY").is_some() || m.base_url.is_some() => ProviderKind::OpenAi,
        None => bail!(
            "no provider: set ANTHROPIC_API_KEY or OPENAI_API_KEY, or give --provider and --base-url for a local server"
        ),
    };
    let model = m.model.clone().unwrap_or_else(|| {
        match provider {
            ProviderKind::Anthropic => "claude-sonnet-4-5",
            ProviderKind::OpenAi => "gpt-4.1",
        }
        .to_string()
    });
    let mut config = ModelConfig::new(provider, &model);
    config.base_url = m.base_url.clone();
    config.max_tokens = m.max_tokens;
    config.timeout = std::time::Duration::from_secs(m.timeout.max(1));
    config.retries = m.retries;
    config.backoff = std::time::Duration::from_millis(m.backoff_ms);
    let price = match (m.price_in, m.price_out) {
        (Some(i), Some(o)) => {
            if !(i.is_finite() && o.is_finite() && i >= 0.0 && o >= 0.0) {
                bail!("--price-in and --price-out are dollars per million tokens, 0 or more");
            }
            Some(Price {
                input_per_mtok: i,
                output_per_mtok: o,
            })
        }
        _ => cairn_llm::price_for(&model),
    };
    Ok((config, price))
}

fn cost(c: Option<f64>) -> String {
    c.map(|c| format!("${c:.4}")).unwrap_or_else(|| "cost unknown".into())
}

fn report(out: &Outcome, json: bool) -> Result<i32> {
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "agent": out.agent, "session": out.session, "status": out.status.as_str(),
                "detail": out.detail, "stages": out.stages, "model_calls": out.model_calls,
                "input_tokens": out.input_tokens, "output_tokens": out.output_tokens, "cost_usd": out.cost_usd,
            }))?
        );
    } else {
        println!("agent {}: {}", out.agent, out.status.as_str());
        if !out.detail.is_empty() {
            println!("{}", out.detail.trim());
        }
        println!(
            "{} stages, {} model calls, {} tokens in, {} out, {}",
            out.stages,
            out.model_calls,
            out.input_tokens,
            out.output_tokens,
            cost(out.cost_usd)
        );
    }
    Ok(match out.status {
        Status::Completed => 0,
        Status::Failed => 1,
        Status::Stopped => 3,
        Status::Paused | Status::Running => 75,
    })
}

fn summary(home: &Home, s: &SessionRecord, st: &AgentState) -> serde_json::Value {
    json!({
        "agent": s.name, "session": s.id, "status": cairn_agent::shown_status(home, s, st), "detail": st.detail,
        "driver_pid": cairn_agent::driven_by(home, &s.id),
        "goal": st.config.goal, "provider": st.config.model.provider.as_str(), "model": st.config.model.model,
        "base_url": st.config.model.base_url, "max_stages": st.max_stages, "budget_usd": st.budget_usd,
        "stages": st.stages_used(), "model_calls": st.model_calls, "input_tokens": st.usage.input_tokens,
        "output_tokens": st.usage.output_tokens, "cost_usd": st.cost_usd, "pipeline_run": st.pipeline_run,
        "base_snapshots": st.base, "created_at": s.created_at,
    })
}

fn show(home: &Home, s: &SessionRecord, st: &AgentState, json: bool) -> Result<()> {
    if json {
        let mut v = summary(home, s, st);
        v["rounds"] = st
            .rounds
            .iter()
            .map(|r| {
                json!({
                    "seq": r.seq, "text": r.recorded.reply.text, "stop": r.recorded.reply.stop,
                    "input_tokens": r.recorded.reply.usage.input_tokens,
                    "output_tokens": r.recorded.reply.usage.output_tokens, "cost_usd": r.recorded.cost_usd,
                    "calls": r.recorded.reply.calls.iter().map(|c| {
                        let result = r.results.iter().find(|(t, ..)| t.call_id == c.id);
                        json!({"id": c.id, "tool": c.name, "arguments": c.arguments, "raw_arguments": c.raw,
                               "result": result.map(|(t, ..)| &t.content), "is_error": result.map(|(t, ..)| t.is_error),
                               "stage_run": result.and_then(|(_, m, _)| m.stage_run.clone())})
                    }).collect::<Vec<_>>(),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("agent      {} (session {})", s.name, s.id);
    println!("goal       {}", st.config.goal);
    println!(
        "model      {} {}{}",
        st.config.model.provider,
        st.config.model.model,
        st.config
            .model
            .base_url
            .as_deref()
            .map(|u| format!(" at {u}"))
            .unwrap_or_default()
    );
    let status = cairn_agent::shown_status(home, s, st);
    let detail = if status == "interrupted" {
        format!("no process drives it; `cairn agent resume {}` continues", s.name)
    } else {
        st.detail.trim().to_string()
    };
    let sep = if detail.is_empty() { "" } else { ": " };
    println!("status     {status}{sep}{detail}");
    println!(
        "used       {} of {} stages, {} model calls, {} tokens in, {} out, {}{}",
        st.stages_used(),
        st.max_stages,
        st.model_calls,
        st.usage.input_tokens,
        st.usage.output_tokens,
        cost(st.cost_usd),
        st.budget_usd.map(|b| format!(" of ${b:.2}")).unwrap_or_default()
    );
    if let Some(r) = &st.pipeline_run {
        println!("pipeline   run {r}");
    }
    println!("base       {}", st.base.join(", "));
    for (i, r) in st.rounds.iter().enumerate() {
        let reply = &r.recorded.reply;
        println!(
            "\nround {} ({} in, {} out, {}):",
            i + 1,
            reply.usage.input_tokens,
            reply.usage.output_tokens,
            cost(r.recorded.cost_usd)
        );
        if !reply.text.trim().is_empty() {
            for line in reply.text.trim().lines() {
                println!("  {line}");
            }
        }
        for c in &reply.calls {
            let reason = c.arguments.get("reason").and_then(|v| v.as_str()).unwrap_or("");
            println!("  → {} {}", c.name, reason);
            match r.results.iter().find(|(t, ..)| t.call_id == c.id) {
                Some((t, m, _)) => {
                    let head = if t.is_error { "error" } else { "result" };
                    let stage = m
                        .stage_run
                        .as_deref()
                        .map(|h| format!(" (run {h})"))
                        .unwrap_or_default();
                    println!("    {head}{stage}: {}", cairn_llm::clip(&t.content, 300));
                }
                None => println!("    (no result yet: `cairn agent resume {}` runs it)", s.name),
            }
        }
    }
    Ok(())
}

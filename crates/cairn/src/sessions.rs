//! Session commands: create, ls, show, log, append, exec, recover,
//! suspend, resume, fork, rewind, verify, rm.

use std::io::{self, Write};

use anyhow::{bail, Context, Result};
use cairn_engine::Engine;
use cairn_session::prelude::*;
use cairn_session::{Entry, EntryKind, LogRange, SessionOptions, SessionRecord};

use crate::cli::SessionCommand;
use crate::progress::Steps;

/// `90s`, `5m`, `1h` or plain seconds, in milliseconds.
fn duration_ms(text: &str) -> Result<u64> {
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let n: u64 = number
        .parse()
        .with_context(|| format!("--idle takes a duration like 90s, 5m or 1h, got {text:?}"))?;
    let scale = match unit {
        "" | "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => bail!("--idle takes a duration like 90s, 5m or 1h, got {text:?}"),
    };
    if n == 0 {
        bail!("--idle must be more than zero, got {text:?}");
    }
    Ok(n * scale)
}

pub fn session(engine: &mut Engine, cmd: SessionCommand) -> Result<i32> {
    match cmd {
        SessionCommand::Create {
            image,
            driver,
            name,
            idle,
            network,
        } => {
            let opts = SessionOptions {
                name,
                image,
                driver,
                idle_timeout_ms: idle.as_deref().map(duration_ms).transpose()?,
                network: network.policy()?,
            };
            let s = engine.create_session(&opts, &Steps::new())?;
            println!("{}", s.id);
        }
        SessionCommand::Ls { tree, json } => {
            let mut all = engine.sessions()?;
            engine.keep_mine(cairn_engine::tenants::Owned::Session, &mut all, |s| &s.id)?;
            if tree {
                crate::lineage::print_tree(
                    &all,
                    |s| &s.id,
                    |s| s.parent_id.as_deref(),
                    |s| {
                        let fork = match (s.fork_seq, &s.fork_reason) {
                            (Some(at), Some(why)) => format!("  forked at {at}: {why}"),
                            _ => String::new(),
                        };
                        format!("{} {} {} {} entries{fork}", s.id, s.name, s.state, s.head_seq)
                    },
                );
            } else if json {
                println!("{}", serde_json::to_string_pretty(&all)?);
            } else {
                println!(
                    "{:<14} {:<24} {:<11} {:>7} {:<14} PARENT",
                    "ID", "NAME", "STATE", "ENTRIES", "SANDBOX"
                );
                for s in all {
                    println!(
                        "{:<14} {:<24} {:<11} {:>7} {:<14} {}",
                        s.id,
                        s.name,
                        s.state,
                        s.head_seq,
                        s.sandbox_id.as_deref().unwrap_or("-"),
                        lineage(&s)
                    );
                }
            }
        }
        SessionCommand::Show { id, json } => {
            let s = engine.session(&id)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                println!("session   {} ({})", s.id, s.name);
                println!("state     {}", s.state);
                println!("image     {} on {}", s.image, s.driver);
                println!("sandbox   {}", s.sandbox_id.as_deref().unwrap_or("-"));
                match (&s.snapshot_id, s.snapshot_seq) {
                    (Some(id), Some(seq)) => println!("snapshot  {id} (entry {seq})"),
                    _ => println!("snapshot  -"),
                }
                println!("entries   {} (head {})", s.head_seq, s.head_hash);
                println!("rewinds   {}", s.rewinds);
                if let Some(ms) = s.idle_timeout_ms {
                    println!("idle      {}s", ms / 1000);
                }
                println!("parent    {}", lineage(&s));
                if let Some(reason) = &s.fork_reason {
                    println!("reason    {reason}");
                }
                if let Some(e) = &s.error {
                    println!("error     {e}");
                }
            }
        }
        SessionCommand::Log { id, from, tail, json } => {
            let s = engine.session(&id)?;
            let range = match tail {
                Some(n) => LogRange::Tail(n),
                None => LogRange::From {
                    from: from.unwrap_or(1),
                    count: usize::MAX >> 1,
                },
            };
            let mut out = io::stdout().lock();
            for e in engine.session_log(&s, range)? {
                if json {
                    writeln!(out, "{}", serde_json::to_string(&e)?)?;
                } else {
                    writeln!(out, "{}", line(&e))?;
                }
            }
        }
        SessionCommand::Append {
            id,
            role,
            content,
            json,
        } => {
            let s = engine.session(&id)?;
            let entry = match json {
                Some(text) => serde_json::from_str::<Entry>(&text).with_context(|| {
                    "--json takes an entry like {\"kind\": \"note\", \"content\": \"…\"} (docs/sessions.md)"
                })?,
                None => {
                    let role = role.unwrap_or_default();
                    let mut e = Entry::new(match role.as_str() {
                        "user" => EntryKind::User,
                        "assistant" => EntryKind::Assistant,
                        _ => EntryKind::System,
                    });
                    e.role = Some(role);
                    e.content = content;
                    e
                }
            };
            let e = engine.append_entry(&s.id, entry)?;
            println!("{}", e.seq);
        }
        SessionCommand::Exec { id, process, cmd } => {
            let req = crate::process::request(&process, cmd, false)?;
            let outcome = engine.session_exec_request(&id, req, &mut io::stdout().lock(), &mut io::stderr().lock())?;
            if let Some(r) = &outcome.recovered {
                eprintln!("cairn: {}", r.content.as_deref().unwrap_or("the sandbox was recovered"));
            }
            return Ok(outcome.status);
        }
        SessionCommand::Recover { id, replay, json } => {
            let mut out = io::stdout().lock();
            let mut err = io::stderr().lock();
            let report = if json {
                // The report owns stdout; the commands' output goes to stderr.
                let mut replay_out = io::stderr().lock();
                engine.recover_session(&id, replay, &mut replay_out, &mut err)?
            } else {
                engine.recover_session(&id, replay, &mut out, &mut err)?
            };
            if json {
                writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?;
            } else {
                match &report.recovered {
                    Some(r) => eprintln!("cairn: {}", r.content.as_deref().unwrap_or("recovered")),
                    None if !replay => eprintln!("cairn: its sandbox runs; nothing to recover"),
                    None => {}
                }
                for r in &report.replayed {
                    eprintln!(
                        "cairn: replayed entry {} as entry {}: exit {} (the log says {})",
                        r.call,
                        r.call_seq,
                        r.status,
                        r.expected
                            .map_or("nothing: it never finished".to_string(), |x| x.to_string())
                    );
                }
                if let Some(why) = &report.stopped {
                    eprintln!("cairn: replay stopped: {why}");
                }
            }
            return Ok(i32::from(report.stopped.is_some()));
        }
        SessionCommand::Suspend { id } => {
            let s = engine.suspend_session(&id)?;
            eprintln!(
                "cairn: session {} suspended in snapshot {}",
                s.id,
                s.snapshot_id.as_deref().unwrap_or("-")
            );
        }
        SessionCommand::Resume { id } => {
            let s = engine.resume_session(&id)?;
            eprintln!(
                "cairn: session {} active in sandbox {}",
                s.id,
                s.sandbox_id.as_deref().unwrap_or("-")
            );
        }
        SessionCommand::Fork { id, at, reason, name } => {
            let s = engine.fork_session(&id, at, &reason, name)?;
            eprintln!(
                "cairn: forked at entry {at} from {}",
                s.snapshot_id
                    .as_deref()
                    .map_or("the image (no snapshot at or before it)".to_string(), |id| format!(
                        "snapshot {id}"
                    ))
            );
            println!("{}", s.id);
        }
        SessionCommand::Rewind { id, to } => {
            let r = engine.rewind_session(&id, to)?;
            eprintln!(
                "cairn: entries {}..={} abandoned; the log continues after entry {to}",
                r.to_seq + 1,
                r.head_seq
            );
        }
        SessionCommand::Verify { id } => {
            let s = engine.session(&id)?;
            let v = engine.verify_session(&s)?;
            match v.first_bad {
                None => println!("ok: {} entries, head {}", v.entries, v.head_hash),
                Some((seq, why)) => {
                    println!(
                        "bad: entry {seq} is {why}; the {} entries before it are intact",
                        v.entries
                    );
                    return Ok(1);
                }
            }
        }
        SessionCommand::Export { id, output } => crate::bundle::export(engine, &id, output.as_deref())?,
        SessionCommand::Import { file, name, json } => crate::bundle::import(engine, &file, name, json)?,
        SessionCommand::Rm { id, purge } => {
            let s = engine.close_session(&id, purge)?;
            eprintln!(
                "cairn: session {} closed{}",
                s.id,
                if purge {
                    " and its log deleted"
                } else {
                    "; its log stays"
                }
            );
        }
    }
    Ok(0)
}

fn lineage(s: &SessionRecord) -> String {
    match (&s.parent_id, s.fork_seq) {
        (Some(p), Some(at)) => format!("{p}@{at}"),
        _ => "-".into(),
    }
}

/// One entry as a line of text.
fn line(e: &Entry) -> String {
    let mut text = format!("{:>5} {:<11}", e.seq, e.kind);
    if let Some(r) = &e.role {
        text.push_str(&format!(" {r}:"));
    }
    if let Some(t) = &e.tool {
        text.push_str(&format!(" {t}"));
    }
    if let Some(a) = &e.arguments {
        text.push_str(&format!(" {a}"));
    }
    if let Some(c) = &e.content {
        text.push_str(&format!(" {}", c.replace('\n', "\\n")));
    }
    if let Some(x) = e.exit_status {
        text.push_str(&format!(" exit={x}"));
    }
    if let Some(s) = &e.snapshot_id {
        text.push_str(&format!(" snapshot={s}"));
    }
    text
}

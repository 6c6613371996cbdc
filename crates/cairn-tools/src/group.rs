//! fork_from with `hypotheses`: one run whose one stage is a branch group
//! (`select = "deferred"`, docs/pipelines.md), every hypothesis a branch
//! forked from the same snapshot in parallel. The run's id is the group's
//! handle; stage_status reports each branch, and select over the handle
//! records the winner and the losers in that run's events.

use std::collections::BTreeMap;

use cairn_engine::Engine;
use cairn_pipeline::lineage::EventData;
use cairn_pipeline::prelude::*;
use serde::Serialize;
use serde_json::{json, Value};

use crate::args::{Choice, HypothesisArgs, Metric, StageArgs};
use crate::{random_hex, ToolError, Tools};

/// The group's stage in its run, and the run's pipeline name.
pub(crate) const GROUP_STAGE: &str = "hypotheses";
pub(crate) const GROUP_PIPELINE: &str = "tool-hypotheses";

/// One branch of a group, as stage_status reports it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct BranchState {
    pub name: String,
    /// running, completed or failed.
    pub status: String,
    pub stage_key: Option<String>,
    pub output_snapshot: Option<String>,
    pub error: Option<String>,
    /// "won" or "lost" once select chose.
    pub selected: Option<String>,
    #[serde(skip)]
    pub ended_at: Option<i64>,
}

/// Each branch of group run `run` (still running or not), in the order the
/// hypotheses were given.
pub(crate) fn branch_states(
    e: &Engine,
    run: &cairn_pipeline::records::RunRecord,
) -> Result<Vec<BranchState>, ToolError> {
    let rows = e.run_stages(&run.id)?;
    let events = e.run_events(&run.id)?;
    let mut named: Vec<String> = Vec::new();
    for ev in events.iter().filter(|ev| ev.kind == "hypothesis") {
        if let Some(b) = ev.branch.as_ref().filter(|b| !named.contains(b)) {
            named.push(b.clone());
        }
    }
    Ok(named
        .into_iter()
        .map(|name| {
            let row = rows.iter().find(|r| r.stage == GROUP_STAGE && r.branch == name);
            let status = match row.map(|r| r.status.as_str()) {
                Some("completed") => "completed",
                Some("dead") => "failed",
                _ if run.status == "running" => "running",
                _ => "failed",
            };
            let selected = events
                .iter()
                .rev()
                .find(|ev| ev.branch.as_deref() == Some(&name) && (ev.kind == "won" || ev.kind == "lost"))
                .map(|ev| ev.kind.clone());
            BranchState {
                status: status.into(),
                stage_key: row.map(|r| r.stage_key.clone()),
                output_snapshot: row
                    .and_then(|r| r.output_snapshot.clone())
                    .filter(|_| status == "completed"),
                error: row.and_then(|r| r.error.clone()),
                selected,
                ended_at: row.and_then(|r| r.ended_at),
                name,
            }
        })
        .collect())
}

impl Tools {
    /// Records the group's run and starts its orchestrator; returns the handle.
    pub(crate) fn start_group(
        &self,
        s: &StageArgs,
        group: &[HypothesisArgs],
        detail: &str,
        run_id: Option<&str>,
    ) -> Result<String, ToolError> {
        let run = self.with_engine(|e| {
            let snap = e.snapshot_record(&s.snapshot_id)?;
            let text = group_pipeline_text(&snap.id, s, group)?;
            let file = format!("tool {GROUP_STAGE}");
            let run = match run_id {
                Some(id) => e.start_run_text_as(id, &file, text, &Default::default())?,
                None => e.start_run_text(&file, text, &Default::default())?,
            };
            for h in group {
                e.record_branch_event(&run.id, GROUP_STAGE, &h.name, "hypothesis", &h.name, None)?;
            }
            e.record_run_event(&run.id, Some(GROUP_STAGE), "asked", detail, Some(&snap.id))?;
            Ok(run)
        })?;
        self.execute_in_background(&run.id)?;
        Ok(run.id)
    }

    /// Chooses the winner among a group's completed branches and records
    /// it, and every other branch as lost, in the group's run.
    pub(crate) fn select_group(
        &self,
        handle: &str,
        choice: &Choice,
        reason: &str,
        caller: &str,
    ) -> Result<Value, ToolError> {
        let (run, branches) = self.with_engine(|e| {
            let run = e.run_record(handle)?;
            if run.pipeline != GROUP_PIPELINE {
                return Err(ToolError::Failed(format!(
                    "{} is not a fork_from group's handle; name single stages' handles in branches",
                    run.id
                )));
            }
            let branches = branch_states(e, &run)?;
            Ok((run, branches))
        })?;
        if let Some(chosen) = branches.iter().find(|b| b.selected.as_deref() == Some("won")) {
            return Err(ToolError::Failed(format!(
                "group {} has its winner already ({}); fork from its output_snapshot to go on",
                run.id, chosen.name
            )));
        }
        let completed: Vec<&BranchState> = branches.iter().filter(|b| b.status == "completed").collect();
        let none_completed = || {
            ToolError::Failed(format!(
                "no branch of group {} has completed yet; poll it with stage_status",
                run.id
            ))
        };
        let mut metrics = serde_json::Map::new();
        let (winner, how) = match choice {
            Choice::Winner(name) => {
                let Some(b) = branches.iter().find(|b| &b.name == name) else {
                    let names: Vec<&str> = branches.iter().map(|b| b.name.as_str()).collect();
                    return Err(ToolError::Failed(format!(
                        "group {} has no branch {name:?}; its branches are {}",
                        run.id,
                        names.join(", ")
                    )));
                };
                if b.status != "completed" {
                    return Err(ToolError::Failed(format!(
                        "branch {name} is {}, not completed; poll the group with stage_status, or choose a completed branch",
                        b.status
                    )));
                }
                (b, String::new())
            }
            Choice::FirstSuccess => {
                let first = completed
                    .iter()
                    .min_by_key(|b| b.ended_at.unwrap_or(i64::MAX))
                    .ok_or_else(none_completed)?;
                (*first, " by first_success".to_string())
            }
            Choice::Rule { max, metric } => {
                let mut best: Option<(f64, &BranchState)> = None;
                for b in &completed {
                    let Some(v) = self.metric(&run.id, Some(&b.name), b.output_snapshot.as_deref(), metric)? else {
                        continue;
                    };
                    metrics.insert(b.name.clone(), v.into());
                    if best.is_none_or(|(x, _)| if *max { v > x } else { v < x }) {
                        best = Some((v, b));
                    }
                }
                let (v, b) = best.ok_or_else(|| {
                    ToolError::Failed(format!(
                        "no completed branch of group {} has a number for this metric; check their output with \
                         inspect_logs (with branch), or choose a winner by name",
                        run.id
                    ))
                })?;
                let rule = if *max { "max" } else { "min" };
                (b, format!(" by {rule} of {} ({v})", metric_name(metric)))
            }
        };
        let output = winner.output_snapshot.clone().ok_or_else(none_completed)?;
        let lost: Vec<&BranchState> = branches.iter().filter(|b| b.name != winner.name).collect();
        self.with_engine(|e| {
            let others = if lost.is_empty() {
                "no other branch".to_string()
            } else {
                lost.iter().map(|b| b.name.as_str()).collect::<Vec<_>>().join(", ")
            };
            let rule = match how.trim() {
                "" => "by name".to_string(),
                h => h.to_string(),
            };
            let metric = |name: &str| metrics.get(name).and_then(serde_json::Value::as_f64);
            let chosen = EventData::Won {
                branch: winner.name.clone(),
                rule: rule.clone(),
                metric: metric(&winner.name),
                runner_up: None,
                runner_up_metric: None,
                chosen_by: Some(caller.to_string()),
                reason: Some(format!("over {others}: {reason}")),
            };
            e.record_typed_event(&run.id, Some(GROUP_STAGE), Some(&winner.name), chosen, Some(&output))?;
            for b in &lost {
                let lost = EventData::Lost {
                    branch: b.name.clone(),
                    winner: winner.name.clone(),
                    rule: rule.clone(),
                    ended: b.status.clone(),
                    metric: metric(&b.name),
                    winner_metric: metric(&winner.name),
                    chosen_by: Some(caller.to_string()),
                    reason: Some(reason.to_string()),
                };
                e.record_typed_event(
                    &run.id,
                    Some(GROUP_STAGE),
                    Some(&b.name),
                    lost,
                    b.output_snapshot.as_deref(),
                )?;
            }
            Ok(())
        })?;
        let mut out = json!({"handle": run.id, "winner": winner.name, "output_snapshot": output,
                             "lost": lost.iter().map(|b| &b.name).collect::<Vec<_>>()});
        if !metrics.is_empty() {
            out["metrics"] = Value::Object(metrics);
        }
        Ok(out)
    }
}

pub(crate) fn metric_name(metric: &Metric) -> String {
    match metric {
        Metric::Output => "output".to_string(),
        Metric::File(p) => format!("file {p}"),
    }
}

/// The group's pipeline: one stage, a deferred branch group. The shared
/// edits and commands come first; each hypothesis's own are placeholders
/// (`{hypothesis.run_K}`, `{hypothesis.edit_K_path}`, `{hypothesis.edit_K}`)
/// filled from its values, empty where a hypothesis has fewer (an empty
/// command does nothing, an empty edit path writes nothing). Values are
/// put in as they are; text of the model's in the template is brace-doubled.
fn group_pipeline_text(snapshot: &str, s: &StageArgs, group: &[HypothesisArgs]) -> Result<String, ToolError> {
    #[derive(Serialize)]
    struct File<'a> {
        pipeline: Header<'a>,
        stage: Vec<StageOut<'a>>,
    }
    #[derive(Serialize)]
    struct Header<'a> {
        name: &'a str,
        snapshot: &'a str,
    }
    #[derive(Serialize)]
    struct StageOut<'a> {
        name: &'a str,
        key: String,
        run: Vec<String>,
        edits: Vec<EditOut>,
        #[serde(skip_serializing_if = "Option::is_none")]
        timeout: Option<&'a str>,
        branches: BranchesOut,
    }
    #[derive(Serialize)]
    struct EditOut {
        path: String,
        content: String,
        mode: u32,
    }
    #[derive(Serialize)]
    struct BranchesOut {
        select: &'static str,
        hypotheses: Vec<BTreeMap<String, String>>,
    }
    let brace = |t: &str| t.replace('{', "{{").replace('}', "}}");
    let commands = group.iter().map(|h| h.commands.len()).max().unwrap_or(0);
    // An edit slot per (position, mode): the mode is the template's.
    let mut slots: Vec<(usize, u32)> = Vec::new();
    for h in group {
        for (j, e) in h.edits.iter().enumerate() {
            let slot = (j, e.mode.unwrap_or(0o644));
            if !slots.contains(&slot) {
                slots.push(slot);
            }
        }
    }
    let mut run: Vec<String> = s.commands.iter().map(|c| brace(c)).collect();
    run.extend((0..commands).map(|k| format!("{{hypothesis.run_{k}}}")));
    let mut edits: Vec<EditOut> = s
        .edits
        .iter()
        .map(|e| EditOut {
            path: brace(&e.path),
            content: brace(&e.content),
            mode: e.mode.unwrap_or(0o644),
        })
        .collect();
    edits.extend(slots.iter().enumerate().map(|(i, (_, mode))| EditOut {
        path: format!("{{hypothesis.edit_{i}_path}}"),
        content: format!("{{hypothesis.edit_{i}}}"),
        mode: *mode,
    }));
    let hypotheses = group
        .iter()
        .map(|h| {
            let mut values = BTreeMap::from([("name".to_string(), h.name.clone())]);
            for k in 0..commands {
                values.insert(format!("run_{k}"), h.commands.get(k).cloned().unwrap_or_default());
            }
            for (i, (j, mode)) in slots.iter().enumerate() {
                let edit = h.edits.get(*j).filter(|e| e.mode.unwrap_or(0o644) == *mode);
                values.insert(
                    format!("edit_{i}_path"),
                    edit.map(|e| e.path.clone()).unwrap_or_default(),
                );
                values.insert(format!("edit_{i}"), edit.map(|e| e.content.clone()).unwrap_or_default());
            }
            values
        })
        .collect();
    let key = match &s.stage_key {
        Some(k) => format!("{k}-{{hypothesis}}"),
        None => format!("tool-{}-{{hypothesis}}", random_hex(8)),
    };
    let file = File {
        pipeline: Header {
            name: GROUP_PIPELINE,
            snapshot,
        },
        stage: vec![StageOut {
            name: GROUP_STAGE,
            key,
            run,
            edits,
            timeout: s.timeout.as_deref(),
            branches: BranchesOut {
                select: "deferred",
                hypotheses,
            },
        }],
    };
    toml::to_string(&file).map_err(|e| ToolError::Failed(format!("cannot write the group's pipeline: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::Edit;

    fn args(commands: &[&str], edits: Vec<Edit>) -> StageArgs {
        StageArgs {
            snapshot_id: "ab".into(),
            hypothesis: None,
            hypotheses: None,
            edits,
            commands: commands.iter().map(|c| c.to_string()).collect(),
            stage_key: None,
            timeout: None,
            checkpoint_every: None,
            wait_secs: None,
            reason: "r".into(),
        }
    }

    fn edit(path: &str, content: &str, mode: Option<u32>) -> Edit {
        Edit {
            path: path.into(),
            content: content.into(),
            mode,
        }
    }

    #[test]
    fn a_group_becomes_a_deferred_branch_group_the_engine_parses() {
        let group = vec![
            HypothesisArgs {
                name: "a".into(),
                edits: vec![edit("/w/in", "{x} a", None)],
                commands: vec!["echo {a}".into(), "echo 2".into()],
            },
            HypothesisArgs {
                name: "b".into(),
                edits: vec![edit("/w/run.sh", "b", Some(0o755))],
                commands: vec![],
            },
            HypothesisArgs {
                name: "c".into(),
                edits: vec![],
                commands: vec!["echo c".into()],
            },
        ];
        let text = group_pipeline_text(
            "ab12",
            &args(&["mkdir -p /w {x}"], vec![edit("/w/{s}", "{s}", None)]),
            &group,
        )
        .unwrap();
        let p = cairn_pipeline::spec::parse("group.toml", &text, &Default::default()).unwrap();
        let stage = &p.stages[0];
        let b = stage.branches.as_ref().unwrap();
        assert_eq!(b.select, cairn_pipeline::spec::Selection::Deferred);
        assert_eq!(
            stage.run,
            ["mkdir -p /w {{x}}", "{hypothesis.run_0}", "{hypothesis.run_1}"]
        );
        assert_eq!(stage.edits.len(), 3);
        assert_eq!((stage.edits[0].path.as_str(), stage.edits[2].mode), ("/w/{{s}}", 0o755));
        let a = &b.hypotheses[0];
        assert_eq!((a["run_0"].as_str(), a["run_1"].as_str()), ("echo {a}", "echo 2"));
        assert_eq!(
            (
                a["edit_0_path"].as_str(),
                a["edit_0"].as_str(),
                a["edit_1_path"].as_str()
            ),
            ("/w/in", "{x} a", "")
        );
        assert_eq!(
            (
                b.hypotheses[1]["edit_1_path"].as_str(),
                b.hypotheses[1]["run_0"].as_str()
            ),
            ("/w/run.sh", "")
        );
        assert!(stage.key.ends_with("-{hypothesis}"));
    }
}

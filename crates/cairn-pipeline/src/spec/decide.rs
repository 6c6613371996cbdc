//! Decide stages and the model they ask, in the pipeline file: a decide
//! stage's own checks, and the checks against the stages around it.

use std::collections::BTreeMap;

use toml::Spanned;

use super::{Lines, PipelineError, RawDecide, RawModel, RawStage, Stage};

/// `[pipeline] model = { provider = "anthropic", model = "...", base_url = "..." }`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelSpec {
    pub provider: Option<String>,
    pub model: Option<String>,
    pub base_url: Option<String>,
    /// Attempts after the first one when the model is unavailable (at most 10).
    pub retries: Option<u32>,
}

/// A decide stage: the model, given `prompt` and what the stage before it
/// left, chooses what `choose` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decide {
    pub prompt: String,
    pub choose: Vec<Choice>,
    /// The stage after this one, which runs the chosen hypotheses (when
    /// `choose` has them).
    pub next: Option<String>,
}

/// What a decide stage may choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Choice {
    /// The hypotheses the next stage runs as its branch group.
    Hypotheses,
    /// Values for the pipeline's declared parameters.
    Params,
    /// Whether the stage before goes on, runs again, or goes to the dead letters.
    RetryOrDlq,
}

impl Choice {
    pub fn name(self) -> &'static str {
        match self {
            Choice::Hypotheses => "hypotheses",
            Choice::Params => "params",
            Choice::RetryOrDlq => "retry-or-dlq",
        }
    }
}

/// The longest prompt a decide stage may have, in bytes.
pub const MAX_PROMPT: usize = 16 << 10;

/// A decide stage's own checks: a prompt, known choices, and none of a
/// running stage's fields.
pub(super) fn check_decide(
    lines: &Lines,
    name: &str,
    s: &RawStage,
    d: &Spanned<RawDecide>,
    params: &BTreeMap<String, String>,
) -> Result<Decide, PipelineError> {
    let raw = d.get_ref();
    let at = d.span().start;
    let prompt = raw.prompt.get_ref();
    if prompt.trim().is_empty() || prompt.len() > MAX_PROMPT {
        return Err(lines.err(
            raw.prompt.span().start,
            format!("decide stage {name:?}: the prompt must say what to decide, in at most {MAX_PROMPT} bytes"),
        ));
    }
    let mut choose = Vec::new();
    for c in raw.choose.get_ref() {
        let choice = match c.as_str() {
            "hypotheses" => Choice::Hypotheses,
            "params" => Choice::Params,
            "retry-or-dlq" => Choice::RetryOrDlq,
            other => {
                return Err(lines.err(
                    raw.choose.span().start,
                    format!("decide stage {name:?} cannot choose {other:?}: choose from \"hypotheses\", \"params\", \"retry-or-dlq\""),
                ))
            }
        };
        if choose.contains(&choice) {
            return Err(lines.err(
                raw.choose.span().start,
                format!("decide stage {name:?} names {c:?} twice"),
            ));
        }
        choose.push(choice);
    }
    if choose.is_empty() {
        return Err(lines.err(
            raw.choose.span().start,
            format!("decide stage {name:?} chooses nothing: choose = [\"hypotheses\", \"params\", \"retry-or-dlq\"] or some of them"),
        ));
    }
    if choose.contains(&Choice::Params) && params.is_empty() {
        return Err(lines.err(
            raw.choose.span().start,
            format!("decide stage {name:?} chooses params, but the pipeline declares none: add them under [params]"),
        ));
    }
    let extra = [
        (!s.run.is_empty(), "run"),
        (!s.edits.is_empty(), "edits"),
        (!s.artifacts.is_empty(), "artifacts"),
        (s.timeout.is_some(), "timeout"),
        (s.retries != 0, "retries"),
        (s.checkpoint_every.is_some(), "checkpoint_every"),
        (s.branches.is_some(), "branches"),
    ];
    if let Some((_, field)) = extra.iter().find(|(set, _)| *set) {
        return Err(lines.err(
            at,
            format!("decide stage {name:?} runs no commands, so it takes no {field}: move that to a stage of its own"),
        ));
    }
    if s.after.is_none() {
        return Err(lines.err(
            at,
            format!("decide stage {name:?} needs after = \"STAGE\": it decides on what that stage left"),
        ));
    }
    choose.sort();
    Ok(Decide {
        prompt: prompt.clone(),
        choose,
        next: None,
    })
}

/// A decide stage choosing hypotheses has exactly one stage after it, a
/// branch group; a decide stage choosing retry-or-dlq comes after a single
/// stage that runs commands.
pub(super) fn check_decide_neighbours(
    file: &str,
    stages: &mut [(Stage, Vec<Spanned<String>>)],
) -> Result<(), PipelineError> {
    let err = |line: usize, message: String| PipelineError {
        file: file.to_string(),
        line,
        message,
    };
    for i in 0..stages.len() {
        let Some(d) = stages[i].0.decide.clone() else { continue };
        let name = stages[i].0.name.clone();
        let line = stages[i].0.line;
        if d.choose.contains(&Choice::Hypotheses) {
            let next: Vec<&Stage> = stages
                .iter()
                .map(|(s, _)| s)
                .filter(|s| s.after.contains(&name))
                .collect();
            match next.as_slice() {
                [one] if one.branches.is_some() => {
                    let next = one.name.clone();
                    stages[i].0.decide.as_mut().expect("a decide stage").next = Some(next);
                }
                [one] => {
                    return Err(err(
                        one.line,
                        format!(
                            "stage {:?} comes after decide stage {name:?}, which chooses hypotheses for it: give it                              [stage.branches] (select, metric) and {{hypothesis}} in its key",
                            one.name
                        ),
                    ))
                }
                _ => {
                    return Err(err(
                        line,
                        format!(
                            "decide stage {name:?} chooses hypotheses for the stage after it, so exactly one stage                              must come after it (found {})",
                            next.len()
                        ),
                    ))
                }
            }
        }
        if d.choose.contains(&Choice::RetryOrDlq) {
            let before = stages[i].0.after[0].clone();
            if let Some((b, _)) = stages.iter().find(|(s, _)| s.name == before) {
                if b.branches.is_some() || b.decide.is_some() {
                    return Err(err(
                        line,
                        format!(
                            "decide stage {name:?} chooses retry-or-dlq for {before:?}, which must be a single stage                              that runs commands (not a branch group or a decide stage)"
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

pub(super) fn check_model(lines: &Lines, m: Spanned<RawModel>) -> Result<ModelSpec, PipelineError> {
    let m = m.into_inner();
    if let Some(p) = &m.provider {
        if !["anthropic", "openai"].contains(&p.get_ref().as_str()) {
            return Err(lines.err(
                p.span().start,
                format!("model provider {:?} is not one of anthropic, openai", p.get_ref()),
            ));
        }
    }
    if let Some(u) = &m.base_url {
        let url = u.get_ref();
        if !(url.starts_with("http://") || url.starts_with("https://")) || url.len() > 2048 {
            return Err(lines.err(
                u.span().start,
                format!("base_url {url:?} is not an http:// or https:// URL"),
            ));
        }
    }
    if let Some(name) = &m.model {
        if name.get_ref().trim().is_empty() || name.get_ref().len() > 256 {
            return Err(lines.err(name.span().start, "the model's name is empty or too long"));
        }
    }
    if let Some(r) = &m.retries {
        if *r.get_ref() > 10 {
            return Err(lines.err(r.span().start, "model retries is at most 10"));
        }
    }
    Ok(ModelSpec {
        retries: m.retries.map(Spanned::into_inner),
        provider: m.provider.map(Spanned::into_inner),
        model: m.model.map(Spanned::into_inner),
        base_url: m.base_url.map(Spanned::into_inner),
    })
}

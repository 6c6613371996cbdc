//! A stage's text: templates filled from a run's parameters, stage and
//! hypothesis; `k=v` parameters parsed; ids.

use std::collections::BTreeMap;

use crate::error::RunError;
use crate::spec::{self, Pipeline, Stage};

/// Parses `k=v` overrides.
pub fn parse_params(raw: &[String]) -> Result<BTreeMap<String, String>, RunError> {
    raw.iter()
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => Err(RunError::BadParam(kv.clone())),
        })
        .collect()
}

pub(crate) fn new_id(len: usize) -> String {
    cairn_engine::random_hex(len / 2)
}

/// Fills `{params.X}`, `{stage}`, `{pipeline}`, `{hypothesis}` and
/// `{hypothesis.K}` (checked by the parser, so every name resolves); `{{`
/// and `}}` become braces, other braces stay as they are.
pub(crate) fn render(
    template: &str,
    p: &Pipeline,
    stage: &Stage,
    hypothesis: Option<&BTreeMap<String, String>>,
) -> String {
    let mut out = String::with_capacity(template.len());
    let mut i = 0;
    let bytes = template.as_bytes();
    while i < bytes.len() {
        let rest = &template[i..];
        if rest.starts_with("{{") || rest.starts_with("}}") {
            out.push_str(&rest[..1]);
            i += 2;
            continue;
        }
        if let Some(after) = rest.strip_prefix('{') {
            if let Some(len) = after.find('}') {
                let name = &after[..len];
                if spec::is_ident(name) {
                    let value = match name.split_once('.') {
                        Some(("params", k)) => p.params.get(k).cloned(),
                        Some(("hypothesis", k)) => hypothesis.and_then(|h| h.get(k).cloned()),
                        None if name == "stage" => Some(stage.name.clone()),
                        None if name == "pipeline" => Some(p.name.clone()),
                        None if name == "hypothesis" => hypothesis.and_then(|h| h.get("name").cloned()),
                        _ => None,
                    };
                    out.push_str(&value.unwrap_or_else(|| rest[..len + 2].to_string()));
                    i += len + 2;
                    continue;
                }
            }
        }
        let ch = rest.chars().next().expect("not at the end");
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

//! The pipeline file (TOML), parsed and checked before anything runs.
//!
//! ```toml
//! [pipeline]
//! name = "variant-calling"
//! image = "busybox"                 # where the first stages start
//! driver = "native"                 # or "gvisor": checkpoints keep memory too
//! network = "egress"                # or "none" (the default): loopback only
//! allow = ["pypi.org:443"]          # with any, everything else is refused
//!
//! [params]
//! sample = "NA12878"
//!
//! [[stage]]
//! name = "prepare"
//! key = "prepare-{params.sample}-v1"   # a completed key is never run again
//! run = ["mkdir -p /work", "seq 1 1000 > /work/reference"]
//! artifacts = ["/work/reference"]
//! timeout = "6h"
//! retries = 2
//! checkpoint_every = "10m"
//! checkpoint_share = "10%"            # checkpoints take at most this share of the stage's time
//!
//! [[stage]]
//! name = "fit"
//! after = "prepare"
//! key = "fit-{params.sample}-{hypothesis}"
//! run = ["solve --ff {hypothesis.ff} > /work/energy"]
//! [stage.branches]
//! select = "min"                    # first_success | min | max | deferred
//! metric = "file:/work/energy"      # or "output": the last number printed
//! hypotheses = [{ name = "amber", ff = "amber99" }, { name = "charmm", ff = "charmm36" }]
//! ```
//!
//! Every error names the line at fault.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use cairn_sandbox::net::NetPolicy;
use serde::Deserialize;
use toml::Spanned;

mod decide;

use decide::{check_decide, check_decide_neighbours, check_model};
pub use decide::{Choice, Decide, ModelSpec, MAX_PROMPT};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{file}:{line}: {message}")]
pub struct PipelineError {
    pub file: String,
    pub line: usize,
    pub message: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    pipeline: RawHeader,
    #[serde(default)]
    params: BTreeMap<String, String>,
    #[serde(default, rename = "stage")]
    stages: Vec<Spanned<RawStage>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHeader {
    name: Spanned<String>,
    image: Option<String>,
    /// A snapshot the first stages fork instead of starting from the image.
    snapshot: Option<String>,
    driver: Option<Spanned<String>>,
    /// The model decide stages ask.
    model: Option<Spanned<RawModel>>,
    /// `none` or `egress`, and what egress may reach.
    network: Option<Spanned<String>>,
    allow: Option<Spanned<Vec<String>>>,
    /// `all` (the default) or `winners`: what of a branch group outlives it.
    keep: Option<Spanned<String>>,
    /// With `keep = "winners"`: how long losers' snapshots stay after the run ends.
    keep_losers_for: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    provider: Option<Spanned<String>>,
    model: Option<Spanned<String>>,
    base_url: Option<Spanned<String>>,
    /// Attempts after the first one when the model is unavailable.
    retries: Option<Spanned<u32>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDecide {
    prompt: Spanned<String>,
    choose: Spanned<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStage {
    name: Spanned<String>,
    key: Spanned<String>,
    /// The stage whose output snapshot this one forks (one input).
    after: Option<Spanned<String>>,
    #[serde(default)]
    run: Vec<String>,
    #[serde(default)]
    edits: Vec<RawEdit>,
    #[serde(default)]
    artifacts: Vec<String>,
    timeout: Option<Spanned<String>>,
    #[serde(default)]
    retries: u32,
    checkpoint_every: Option<Spanned<String>>,
    checkpoint_share: Option<Spanned<String>>,
    branches: Option<Spanned<RawBranches>>,
    /// Pause before the stage until `cairn pipeline approve RUN STAGE`.
    #[serde(default)]
    approve: bool,
    /// A decision point: the model chooses, the stage runs no command.
    decide: Option<Spanned<RawDecide>>,
    /// This stage's network instead of the pipeline's.
    network: Option<Spanned<String>>,
    allow: Option<Spanned<Vec<String>>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEdit {
    path: String,
    content: String,
    #[serde(default = "default_mode")]
    mode: u32,
}

fn default_mode() -> u32 {
    0o644
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBranches {
    select: Spanned<String>,
    metric: Option<Spanned<String>>,
    /// May be left out when a decide stage before this one chooses them.
    #[serde(default)]
    hypotheses: Vec<Spanned<BTreeMap<String, String>>>,
}

/// A checked pipeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pipeline {
    pub name: String,
    pub image: Option<String>,
    /// The snapshot stages without `after` fork (the planner's stages
    /// start from one); when absent they start from `image`.
    pub snapshot: Option<String>,
    /// The driver stage sandboxes run on (`native` when absent); with
    /// `gvisor`, checkpoints keep memory and processes too.
    pub driver: Option<String>,
    /// The network of stage sandboxes (loopback only unless `egress`).
    pub network: NetPolicy,
    pub params: BTreeMap<String, String>,
    /// The model decide stages ask, as the file names it (flags on `cairn
    /// pipeline run|resume` override each part).
    pub model: ModelSpec,
    /// In an order where every stage comes after the stages it needs.
    pub stages: Vec<Stage>,
    /// With `keep = "winners"`: how long after the run ends its losing
    /// branches' snapshots stay (`keep_losers_for`, 0 when not given);
    /// `None` keeps everything (`keep = "all"`, the default).
    pub keep_losers_for: Option<Duration>,
}

/// The most of a stage's wall time its checkpoints take unless the file
/// says otherwise (`checkpoint_share`), in percent.
pub const DEFAULT_CHECKPOINT_SHARE: u8 = 10;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    pub name: String,
    /// The key template, e.g. `fit-{params.sample}-{hypothesis}`.
    pub key: String,
    pub after: Vec<String>,
    pub run: Vec<String>,
    pub edits: Vec<Edit>,
    pub artifacts: Vec<String>,
    pub timeout: Option<Duration>,
    pub retries: u32,
    pub checkpoint_every: Option<Duration>,
    /// The most of the stage's wall time its checkpoints may take, in
    /// percent (1 to 50): after a checkpoint that took `d`, the next waits
    /// at least `d * (100 - share) / share`, however short
    /// `checkpoint_every` is.
    pub checkpoint_share: u8,
    pub branches: Option<Branches>,
    /// The run pauses before this stage (once its input is ready) until a
    /// person approves it: `cairn pipeline approve RUN STAGE`.
    pub approve: bool,
    /// A decision point: no commands; the model chooses (`run` is empty).
    pub decide: Option<Decide>,
    /// The stage's own network, instead of the pipeline's.
    pub network: Option<NetPolicy>,
    /// Line of the stage in the file, for later messages.
    pub line: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edit {
    pub path: String,
    pub content: String,
    pub mode: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Branches {
    pub select: Selection,
    /// Each hypothesis: a name and its values (`{hypothesis.KEY}`). Empty
    /// until a decide stage before this one chooses them.
    pub hypotheses: Vec<BTreeMap<String, String>>,
    /// The `{hypothesis.KEY}` keys the stage uses: a chosen hypothesis must
    /// give each of them.
    pub fields: Vec<String>,
}

/// How a branch group picks its winner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    FirstSuccess,
    Min(Metric),
    Max(Metric),
    /// No winner when the branches end: one is chosen later, from outside
    /// (the `select` tool), and recorded in the run's events. Such a group
    /// ends its pipeline.
    Deferred,
}

/// Where a branch's number comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Metric {
    /// The first number in a file inside the sandbox.
    File(String),
    /// The last number the stage printed.
    Output,
}

/// `network = "..."` and `allow = [...]`, checked as `--network` and
/// `--allow` are; neither given: `None`.
fn network_of(
    lines: &Lines,
    network: &Option<Spanned<String>>,
    allow: &Option<Spanned<Vec<String>>>,
) -> Result<Option<NetPolicy>, PipelineError> {
    if network.is_none() && allow.is_none() {
        return Ok(None);
    }
    let at = network
        .as_ref()
        .map(|n| n.span().start)
        .or(allow.as_ref().map(|a| a.span().start))
        .unwrap_or(0);
    let allows = allow.as_ref().map(|a| a.get_ref().clone()).unwrap_or_default();
    NetPolicy::parse(network.as_ref().map(|n| n.get_ref().as_str()), &allows, &[])
        .map(Some)
        .map_err(|e| lines.err(at, e.to_string()))
}

/// Parses a duration such as `6h`, `30m`, `1h30m`, `45s` or `500ms`.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let mut total = Duration::ZERO;
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        if digits == 0 {
            return None;
        }
        let n: u64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let unit = match &rest[..unit_len] {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n.checked_mul(60)?),
            "h" => Duration::from_secs(n.checked_mul(3600)?),
            "d" => Duration::from_secs(n.checked_mul(86400)?),
            _ => return None,
        };
        total = total.checked_add(unit)?;
        rest = &rest[unit_len..];
    }
    Some(total)
}

struct Lines<'a> {
    file: &'a str,
    starts: Vec<usize>,
}

impl Lines<'_> {
    fn line(&self, offset: usize) -> usize {
        self.starts.partition_point(|&s| s <= offset)
    }
    fn err(&self, offset: usize, message: impl Into<String>) -> PipelineError {
        PipelineError {
            file: self.file.to_string(),
            line: self.line(offset),
            message: message.into(),
        }
    }
}

/// The placeholders of a template: `{name}` where name is an identifier
/// (letters, digits, `_`, `.`, `-`). `{{` and `}}` stand for literal braces,
/// and braces around anything else (awk programs, shell) are literal too.
pub fn placeholders(template: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let bytes = template.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'{' {
            if bytes.get(i + 1) == Some(&b'{') {
                i += 2;
                continue;
            }
            if let Some(len) = template[i + 1..].find('}') {
                let name = &template[i + 1..i + 1 + len];
                if is_ident(name) {
                    out.push(name);
                    i += len + 2;
                    continue;
                }
            }
        }
        i += 1;
    }
    out
}

pub(crate) fn is_ident(name: &str) -> bool {
    name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// Checks that every placeholder in `template` names a parameter, the stage,
/// the pipeline or (in a branch group) the hypothesis.
fn check_template(
    template: &str,
    params: &BTreeMap<String, String>,
    hypothesis_keys: Option<&HashSet<String>>,
) -> Result<(), String> {
    for name in placeholders(template) {
        let known = match name.split_once('.') {
            Some(("params", p)) => params.contains_key(p),
            Some(("hypothesis", k)) => hypothesis_keys.is_some_and(|keys| keys.contains(k)),
            None => matches!(name, "stage" | "pipeline") || (name == "hypothesis" && hypothesis_keys.is_some()),
            _ => false,
        };
        if !known {
            let hint = match name.split_once('.') {
                Some(("params", p)) => format!("there is no parameter {p:?}; add it under [params] or pass --param {p}=..."),
                _ if hypothesis_keys.is_none() && name.starts_with("hypothesis") => {
                    "{hypothesis...} is only defined in a stage with [stage.branches]".into()
                }
                _ => "use {params.NAME}, {stage}, {pipeline}, in branches {hypothesis} and {hypothesis.KEY}; write {{ and }} for literal braces".into(),
            };
            return Err(format!("{{{name}}} in {template:?} does not resolve: {hint}"));
        }
    }
    Ok(())
}

/// Largest pipeline file accepted, in bytes: far above any real pipeline,
/// and it bounds what parsing a hostile file can cost.
pub const MAX_FILE_LEN: usize = 1 << 20;

/// Reads a pipeline file as [`parse`] takes it: at most one byte past
/// [`MAX_FILE_LEN`], so a file of any size costs no more than the cap.
pub fn read_file(path: &std::path::Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MAX_FILE_LEN as u64 + 1)
        .read_to_string(&mut text)?;
    Ok(text)
}

/// Parses and checks a pipeline file. `overrides` (from `--param k=v`)
/// replace or add parameters.
pub fn parse(file: &str, text: &str, overrides: &BTreeMap<String, String>) -> Result<Pipeline, PipelineError> {
    if text.len() > MAX_FILE_LEN {
        return Err(PipelineError {
            file: file.to_string(),
            line: 1,
            message: format!(
                "the file is over the {MAX_FILE_LEN}-byte limit for a pipeline file; split it or move data into the stages' inputs"
            ),
        });
    }
    let lines = Lines {
        file,
        starts: std::iter::once(0)
            .chain(text.match_indices('\n').map(|(i, _)| i + 1))
            .collect(),
    };
    let raw: RawFile = toml::from_str(text).map_err(|e| {
        let offset = e.span().map(|s| s.start).unwrap_or(0);
        // Some syntax errors (a key with no value at the end of the file)
        // come without a message.
        let message = match e.message().trim() {
            "" => "this is not valid TOML: a value, key or bracket is missing or out of place",
            message => message,
        };
        lines.err(offset, message)
    })?;
    let mut params = raw.params;
    params.extend(overrides.iter().map(|(k, v)| (k.clone(), v.clone())));
    if raw.pipeline.name.get_ref().trim().is_empty() {
        return Err(lines.err(raw.pipeline.name.span().start, "the pipeline needs a name"));
    }
    if raw.stages.is_empty() {
        return Err(lines.err(text.len(), "the pipeline has no [[stage]]"));
    }

    // Stages whose hypotheses a decide stage before them chooses.
    let deciders: HashSet<&str> = raw
        .stages
        .iter()
        .filter(|s| {
            s.get_ref()
                .decide
                .as_ref()
                .is_some_and(|d| d.get_ref().choose.get_ref().iter().any(|c| c == "hypotheses"))
        })
        .map(|s| s.get_ref().name.get_ref().as_str())
        .collect();
    let mut stages = Vec::new();
    let mut by_name: HashMap<String, usize> = HashMap::new();
    for spanned in &raw.stages {
        let s = spanned.get_ref();
        let at = |sp: &std::ops::Range<usize>| sp.start;
        let name = s.name.get_ref().clone();
        if let Err(rule) = cairn_engine::names::check("stage name", &name) {
            return Err(lines.err(at(&s.name.span()), rule));
        }
        if by_name.insert(name.clone(), stages.len()).is_some() {
            return Err(lines.err(at(&s.name.span()), format!("a stage named {name:?} already exists")));
        }
        let decide = match &s.decide {
            None => None,
            Some(d) => Some(check_decide(&lines, &name, s, d, &params)?),
        };
        if s.run.is_empty() && decide.is_none() {
            return Err(lines.err(
                at(&spanned.span()),
                format!("stage {name:?} has nothing to run: add run = [\"command\", ...]"),
            ));
        }
        let duration = |field: &Option<Spanned<String>>, what: &str| -> Result<Option<Duration>, PipelineError> {
            match field {
                None => Ok(None),
                Some(d) => parse_duration(d.get_ref())
                    .filter(|d| !d.is_zero())
                    .map(Some)
                    .ok_or_else(|| {
                        lines.err(
                            at(&d.span()),
                            format!(
                                "{what} {:?} is not a duration: write e.g. 6h, 30m, 1h30m, 45s",
                                d.get_ref()
                            ),
                        )
                    }),
            }
        };
        let timeout = duration(&s.timeout, "timeout")?;
        let checkpoint_every = duration(&s.checkpoint_every, "checkpoint_every")?;
        let checkpoint_share = match &s.checkpoint_share {
            None => DEFAULT_CHECKPOINT_SHARE,
            Some(v) => v
                .get_ref()
                .trim()
                .strip_suffix('%')
                .and_then(|n| n.trim().parse::<u8>().ok())
                .filter(|p| (1..=50).contains(p))
                .ok_or_else(|| {
                    lines.err(
                        at(&v.span()),
                        format!(
                            "checkpoint_share {:?} is not a share of the stage's time: write a whole \
                             percentage from 1% to 50%, e.g. \"10%\"",
                            v.get_ref()
                        ),
                    )
                })?,
        };
        let branches = match &s.branches {
            None => None,
            Some(b) => {
                let raw_b = b.get_ref();
                let metric = match raw_b.metric.as_ref().map(|m| (m.get_ref().as_str(), m.span())) {
                    None => None,
                    Some(("output", _)) => Some(Metric::Output),
                    Some((m, sp)) => match m.strip_prefix("file:") {
                        Some(path) if path.starts_with('/') => Some(Metric::File(path.to_string())),
                        _ => {
                            return Err(lines.err(
                                sp.start,
                                format!("metric {m:?}: write \"output\" or \"file:/absolute/path\""),
                            ))
                        }
                    },
                };
                let select = match (raw_b.select.get_ref().as_str(), metric) {
                    ("first_success", _) => Selection::FirstSuccess,
                    ("deferred", None) => Selection::Deferred,
                    ("deferred", Some(_)) => {
                        return Err(lines.err(
                            at(&raw_b.select.span()),
                            "select = deferred takes no metric: whoever chooses later names its own rule",
                        ))
                    }
                    ("min", Some(m)) => Selection::Min(m),
                    ("max", Some(m)) => Selection::Max(m),
                    ("min" | "max", None) => {
                        return Err(lines.err(
                            at(&raw_b.select.span()),
                            "select = min or max needs a metric (\"output\" or \"file:/path\")",
                        ))
                    }
                    (other, _) => {
                        return Err(lines.err(
                            at(&raw_b.select.span()),
                            format!("select {other:?}: use first_success, min, max or deferred"),
                        ))
                    }
                };
                let decided = s
                    .after
                    .as_ref()
                    .is_some_and(|a| deciders.contains(a.get_ref().as_str()));
                if raw_b.hypotheses.len() < 2 && !(decided && raw_b.hypotheses.is_empty()) {
                    return Err(lines.err(
                        at(&b.span()),
                        "a branch group needs at least two hypotheses (or none, when a decide stage before it chooses them)",
                    ));
                }
                let mut names = HashSet::new();
                for h in &raw_b.hypotheses {
                    match h.get_ref().get("name") {
                        Some(n) if !cairn_engine::names::valid(n) => {
                            let rule = cairn_engine::names::check("hypothesis name", n).unwrap_err();
                            return Err(lines.err(at(&h.span()), format!("{rule} (it names the branch and its log)")));
                        }
                        Some(n) if names.insert(n.clone()) => {}
                        Some(n) => return Err(lines.err(at(&h.span()), format!("two hypotheses are named {n:?}"))),
                        None => return Err(lines.err(at(&h.span()), "every hypothesis needs a name = \"...\"")),
                    }
                }
                let mut fields: Vec<String> = std::iter::once(s.key.get_ref())
                    .chain(&s.run)
                    .chain(s.edits.iter().map(|e| &e.content))
                    .flat_map(|t| placeholders(t))
                    .filter_map(|p| p.strip_prefix("hypothesis."))
                    .map(str::to_string)
                    .collect();
                fields.sort();
                fields.dedup();
                Some(Branches {
                    select,
                    hypotheses: raw_b.hypotheses.iter().map(|h| h.get_ref().clone()).collect(),
                    fields,
                })
            }
        };
        if branches.is_none() {
            if let Some(a) = s.after.as_ref().filter(|a| deciders.contains(a.get_ref().as_str())) {
                return Err(lines.err(
                    at(&spanned.span()),
                    format!(
                        "stage {name:?} comes after decide stage {:?}, which chooses hypotheses for it: give it \
                         [stage.branches] (select, metric) and {{hypothesis}} in its key",
                        a.get_ref()
                    ),
                ));
            }
        }
        let hypothesis_keys: Option<HashSet<String>> = branches.as_ref().map(|b| {
            // Chosen hypotheses must give every key the stage uses.
            if b.hypotheses.is_empty() {
                return b.fields.iter().cloned().collect();
            }
            // Only keys every hypothesis defines are safe to use.
            let mut keys: HashSet<String> = b.hypotheses[0].keys().cloned().collect();
            for h in &b.hypotheses[1..] {
                keys.retain(|k| h.contains_key(k));
            }
            keys
        });
        check_template(s.key.get_ref(), &params, hypothesis_keys.as_ref())
            .map_err(|m| lines.err(at(&s.key.span()), m))?;
        if branches.is_some() && !s.key.get_ref().contains("{hypothesis") {
            return Err(lines.err(
                at(&s.key.span()),
                "a branching stage's key must contain {hypothesis}, or every branch would share one key",
            ));
        }
        for cmd in &s.run {
            check_template(cmd, &params, hypothesis_keys.as_ref()).map_err(|m| lines.err(at(&spanned.span()), m))?;
        }
        let after: Vec<Spanned<String>> = s.after.iter().cloned().collect();
        stages.push((
            Stage {
                name,
                key: s.key.get_ref().clone(),
                after: after.iter().map(|a| a.get_ref().clone()).collect(),
                run: s.run.clone(),
                edits: s
                    .edits
                    .iter()
                    .map(|e| Edit {
                        path: e.path.clone(),
                        content: e.content.clone(),
                        mode: e.mode,
                    })
                    .collect(),
                artifacts: s.artifacts.clone(),
                timeout,
                retries: s.retries,
                checkpoint_every,
                checkpoint_share,
                branches,
                approve: s.approve,
                decide,
                network: network_of(&lines, &s.network, &s.allow)?,
                line: lines.line(at(&spanned.span())),
            },
            after,
        ));
    }
    for (stage, after) in &stages {
        for a in after {
            if !by_name.contains_key(a.get_ref()) {
                return Err(lines.err(
                    a.span().start,
                    format!(
                        "stage {:?} comes after {:?}, which is not a stage",
                        stage.name,
                        a.get_ref()
                    ),
                ));
            }
        }
        for e in &stage.edits {
            // In a branch group a hypothesis may name an edit's file.
            let per_hypothesis = stage.branches.as_ref().is_some_and(|b| {
                let key = e.path.strip_prefix("{hypothesis.").and_then(|k| k.strip_suffix('}'));
                key.is_some_and(|k| is_ident(k) && b.hypotheses.iter().all(|h| h.contains_key(k)))
            });
            if !e.path.starts_with('/') && !per_hypothesis {
                return Err(PipelineError {
                    file: file.into(),
                    line: stage.line,
                    message: format!(
                        "edit path {:?} must be absolute (or, in a branch group, {{hypothesis.KEY}} with KEY set by every hypothesis)",
                        e.path
                    ),
                });
            }
        }
        let deferred = stage.branches.as_ref().is_some_and(|b| b.select == Selection::Deferred);
        if let Some(next) = stages.iter().find(|(s, _)| deferred && s.after.contains(&stage.name)) {
            return Err(PipelineError {
                file: file.into(),
                line: next.0.line,
                message: format!(
                    "stage {:?} comes after {:?}, whose select = deferred ends the pipeline with no winner",
                    next.0.name, stage.name
                ),
            });
        }
    }
    check_decide_neighbours(file, &mut stages)?;
    if raw.pipeline.image.is_none() && raw.pipeline.snapshot.is_none() {
        if let Some((root, _)) = stages.iter().find(|(s, _)| s.after.is_empty()) {
            return Err(PipelineError {
                file: file.into(),
                line: root.line,
                message: format!(
                    "stage {:?} starts the pipeline but [pipeline] names no image = \"...\" (or snapshot = \"...\")",
                    root.name
                ),
            });
        }
    }
    let keep_losers_for = retention_of(&lines, &raw.pipeline.keep, &raw.pipeline.keep_losers_for)?;
    if let Some(d) = &raw.pipeline.driver {
        if !["native", "gvisor"].contains(&d.get_ref().as_str()) {
            return Err(lines.err(
                d.span().start,
                format!("driver {:?} is not one of native, gvisor", d.get_ref()),
            ));
        }
    }
    // Order: Kahn's algorithm; what is left over is a cycle.
    let mut order = Vec::with_capacity(stages.len());
    let mut placed: HashSet<String> = HashSet::new();
    while order.len() < stages.len() {
        let before = order.len();
        for (stage, _) in &stages {
            if !placed.contains(&stage.name) && stage.after.iter().all(|a| placed.contains(a)) {
                placed.insert(stage.name.clone());
                order.push(stage.clone());
            }
        }
        if order.len() == before {
            let stuck: Vec<&Stage> = stages
                .iter()
                .map(|(s, _)| s)
                .filter(|s| !placed.contains(&s.name))
                .collect();
            let names: Vec<&str> = stuck.iter().map(|s| s.name.as_str()).collect();
            return Err(PipelineError {
                file: file.into(),
                line: stuck[0].line,
                message: format!("stages {} depend on each other in a cycle", names.join(", ")),
            });
        }
    }
    Ok(Pipeline {
        name: raw.pipeline.name.into_inner(),
        image: raw.pipeline.image,
        snapshot: raw.pipeline.snapshot,
        network: network_of(&lines, &raw.pipeline.network, &raw.pipeline.allow)?.unwrap_or_default(),
        driver: raw.pipeline.driver.map(Spanned::into_inner),
        model: match raw.pipeline.model {
            None => ModelSpec::default(),
            Some(m) => check_model(&lines, m)?,
        },
        params,
        stages: order,
        keep_losers_for,
    })
}

/// `keep` and `keep_losers_for` of `[pipeline]`.
fn retention_of(
    lines: &Lines<'_>,
    keep: &Option<Spanned<String>>,
    losers_for: &Option<Spanned<String>>,
) -> Result<Option<Duration>, PipelineError> {
    let winners = match keep {
        None => false,
        Some(k) => match k.get_ref().as_str() {
            "all" => false,
            "winners" => true,
            other => {
                return Err(lines.err(
                    k.span().start,
                    format!("keep = {other:?} is not one of \"all\" (the default), \"winners\""),
                ))
            }
        },
    };
    match (winners, losers_for) {
        (false, None) => Ok(None),
        (false, Some(f)) => Err(lines.err(
            f.span().start,
            "keep_losers_for needs keep = \"winners\" (with keep = \"all\" nothing is collected)",
        )),
        (true, None) => Ok(Some(Duration::ZERO)),
        (true, Some(f)) => parse_duration(f.get_ref()).map(Some).ok_or_else(|| {
            lines.err(
                f.span().start,
                format!(
                    "keep_losers_for = {:?} is not a duration such as \"30m\", \"24h\" or \"7d\"",
                    f.get_ref()
                ),
            )
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"[pipeline]
name = "demo"
image = "busybox"

[params]
sample = "s1"

[[stage]]
name = "prepare"
key = "prepare-{params.sample}"
run = ["seq 1 10 > /work/ref"]
timeout = "6h"
checkpoint_every = "10m"
retries = 2

[[stage]]
name = "fit"
after = "prepare"
key = "fit-{hypothesis}"
run = ["echo {hypothesis.ff} > /work/energy"]
[stage.branches]
select = "min"
metric = "file:/work/energy"
hypotheses = [{ name = "a", ff = "1" }, { name = "b", ff = "2" }]
"#;

    fn bad(text: &str) -> PipelineError {
        parse("p.toml", text, &BTreeMap::new()).unwrap_err()
    }

    #[test]
    fn a_good_pipeline_parses_in_dependency_order() {
        let p = parse("p.toml", GOOD, &BTreeMap::new()).unwrap();
        assert_eq!(
            p.stages.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
            ["prepare", "fit"]
        );
        assert_eq!(p.stages[0].timeout, Some(Duration::from_secs(6 * 3600)));
        assert_eq!(p.stages[0].line, 8);
        let b = p.stages[1].branches.as_ref().unwrap();
        assert_eq!(b.select, Selection::Min(Metric::File("/work/energy".into())));
        assert_eq!(b.hypotheses.len(), 2);
    }

    #[test]
    fn a_deferred_group_ends_the_pipeline_and_its_hypotheses_may_name_edit_paths() {
        let deferred = GOOD
            .replace(
                "select = \"min\"\nmetric = \"file:/work/energy\"\n",
                "select = \"deferred\"\n",
            )
            .replace(
                "hypotheses = [{ name = \"a\", ff = \"1\" }, { name = \"b\", ff = \"2\" }]",
                "hypotheses = [{ name = \"a\", ff = \"1\", p = \"/a\" }, { name = \"b\", ff = \"2\", p = \"\" }]",
            )
            .replace(
                "run = [\"echo {hypothesis.ff}",
                "edits = [{ path = \"{hypothesis.p}\", content = \"x\" }]\nrun = [\"echo {hypothesis.ff}",
            );
        let p = parse("p.toml", &deferred, &BTreeMap::new()).unwrap();
        assert_eq!(p.stages[1].branches.as_ref().unwrap().select, Selection::Deferred);
        assert_eq!(p.stages[1].edits[0].path, "{hypothesis.p}");
        let unknown_key = deferred.replace("{hypothesis.p}", "{hypothesis.q}");
        assert!(bad(&unknown_key).message.contains("must be absolute"));
        let with_metric = deferred.replace(
            "select = \"deferred\"\n",
            "select = \"deferred\"\nmetric = \"output\"\n",
        );
        assert!(bad(&with_metric).message.contains("takes no metric"));
        let followed =
            format!("{deferred}\n[[stage]]\nname = \"after\"\nafter = \"fit\"\nkey = \"k\"\nrun = [\"true\"]\n");
        assert!(
            bad(&followed).message.contains("ends the pipeline"),
            "{}",
            bad(&followed)
        );
    }

    #[test]
    fn an_unknown_key_is_refused_with_its_line() {
        let e = bad(&GOOD.replace("retries = 2", "retries = 2\nretry_forever = true"));
        assert_eq!(e.line, 15, "{e}");
        assert!(e.message.contains("retry_forever"), "{e}");
    }

    #[test]
    fn a_missing_field_is_refused() {
        let e = bad(&GOOD.replace("key = \"prepare-{params.sample}\"\n", ""));
        assert!(e.message.contains("key"), "{e}");
        assert!(e.line >= 8, "{e}");
    }

    #[test]
    fn a_cycle_is_refused_with_the_stages_named() {
        let text = GOOD.replace("name = \"prepare\"\n", "name = \"prepare\"\nafter = \"fit\"\n");
        let e = bad(&text);
        assert!(
            e.message.contains("cycle") && e.message.contains("prepare") && e.message.contains("fit"),
            "{e}"
        );
        assert_eq!(e.line, 8);
    }

    #[test]
    fn an_unresolvable_key_template_is_refused_at_its_line() {
        let e = bad(&GOOD.replace("prepare-{params.sample}", "prepare-{params.genome}"));
        assert_eq!(e.line, 10, "{e}");
        assert!(e.message.contains("genome"), "{e}");
        // A --param makes it resolve.
        let overrides = BTreeMap::from([("genome".to_string(), "hg38".to_string())]);
        assert!(parse(
            "p.toml",
            &GOOD.replace("prepare-{params.sample}", "prepare-{params.genome}"),
            &overrides
        )
        .is_ok());
        let e = bad(&GOOD.replace("prepare-{params.sample}", "prepare-{hypothesis}"));
        assert!(e.message.contains("branches"), "{e}");
    }

    #[test]
    fn bad_values_are_refused_with_a_hint() {
        assert!(bad(&GOOD.replace("\"6h\"", "\"six hours\""))
            .message
            .contains("not a duration"));
        assert!(bad(&GOOD.replace("after = \"prepare\"", "after = \"nope\""))
            .message
            .contains("not a stage"));
        assert!(bad(&GOOD.replace("select = \"min\"", "select = \"best\""))
            .message
            .contains("first_success"));
        assert!(bad(&GOOD.replace("metric = \"file:/work/energy\"\n", ""))
            .message
            .contains("needs a metric"));
        assert!(bad(&GOOD.replace("image = \"busybox\"\n", ""))
            .message
            .contains("no image"));
        let forked = GOOD.replace("image = \"busybox\"\n", "snapshot = \"0123abcd\"\n");
        let p = parse("f.toml", &forked, &BTreeMap::new()).expect("a snapshot stands in for the image");
        assert_eq!((p.image, p.snapshot.as_deref()), (None, Some("0123abcd")));
        let e = bad(&GOOD.replace("image = \"busybox\"\n", "image = \"busybox\"\ndriver = \"kvm\"\n"));
        assert!(e.message.contains("not one of native, gvisor"), "{e}");
        assert_eq!(e.line, 4);
        assert!(bad("[pipeline]\nname = \"x\"\n").message.contains("no [[stage]]"));
        assert!(bad("not toml at all [").line >= 1);
        let e = bad("[pipeline]\nname = ");
        assert_eq!(e.line, 2, "{e}");
        assert!(e.message.contains("not valid TOML"), "{e}");
    }

    #[test]
    fn names_that_become_paths_are_refused_with_the_rule() {
        let long = "x".repeat(300);
        for name in ["../../..", "a/b", long.as_str(), "", "-a", "a.b"] {
            let e = bad(&GOOD.replace("{ name = \"a\",", &format!("{{ name = {name:?},")));
            assert!(e.message.contains(cairn_engine::names::RULE), "{name:?}: {e}");
            assert_eq!(e.line, 24, "{name:?}: {e}");
            let e = bad(&GOOD.replace("name = \"fit\"", &format!("name = {name:?}")));
            assert!(e.message.contains(cairn_engine::names::RULE), "{name:?}: {e}");
        }
    }

    const DECIDED: &str = r#"[pipeline]
name = "d"
image = "busybox"
model = { provider = "anthropic", model = "m", base_url = "http://127.0.0.1:9" }

[params]
steps = "10"

[[stage]]
name = "prepare"
key = "prepare"
run = ["true"]

[[stage]]
name = "choose"
after = "prepare"
key = "choose-{params.steps}"
decide = { prompt = "pick force fields", choose = ["hypotheses", "params", "retry-or-dlq"] }

[[stage]]
name = "fit"
after = "choose"
key = "fit-{hypothesis}"
run = ["echo {hypothesis.ff} {params.steps}"]
[stage.branches]
select = "first_success"
"#;

    #[test]
    fn a_decide_stage_parses_and_names_the_stage_it_chooses_for() {
        let p = parse("d.toml", DECIDED, &BTreeMap::new()).unwrap();
        let d = p.stages[1].decide.as_ref().unwrap();
        assert_eq!(d.choose, [Choice::Hypotheses, Choice::Params, Choice::RetryOrDlq]);
        assert_eq!(d.next.as_deref(), Some("fit"));
        assert!(p.stages[1].run.is_empty());
        let b = p.stages[2].branches.as_ref().unwrap();
        assert!(b.hypotheses.is_empty());
        assert_eq!(b.fields, ["ff"]);
        assert_eq!(p.model.provider.as_deref(), Some("anthropic"));
    }

    #[test]
    fn bad_decide_stages_are_refused_with_what_to_do() {
        let cases = [
            (DECIDED.replace("\"retry-or-dlq\"]", "\"retry-or-dlq\", \"magic\"]"), "cannot choose \"magic\""),
            (DECIDED.replace("choose = [\"hypotheses\", \"params\", \"retry-or-dlq\"]", "choose = []"), "chooses nothing"),
            (DECIDED.replace("prompt = \"pick force fields\"", "prompt = \" \""), "the prompt"),
            (DECIDED.replace("key = \"choose-{params.steps}\"", "key = \"c\"\nrun = [\"true\"]"), "takes no run"),
            (DECIDED.replace("after = \"prepare\"\nkey = \"choose", "key = \"choose"), "needs after"),
            (DECIDED.replace("[stage.branches]\nselect = \"first_success\"\n", ""), "give it [stage.branches]"),
            (DECIDED.replace("[params]\nsteps = \"10\"\n", "").replace("{params.steps}", "x"), "declares none"),
            (DECIDED.replace("provider = \"anthropic\"", "provider = \"acme\""), "not one of anthropic, openai"),
            (DECIDED.replace("\"http://127.0.0.1:9\"", "\"ftp://x\""), "not an http"),
            (DECIDED.to_string() + "\n[[stage]]\nname = \"other\"\nafter = \"choose\"\nkey = \"o-{hypothesis}\"\nrun = [\"true\"]\n[stage.branches]\nselect = \"first_success\"\n", "exactly one stage"),
        ];
        for (text, says) in cases {
            assert_ne!(text, DECIDED);
            let e = bad(&text);
            assert!(e.message.contains(says), "{says}: {e}");
        }
        // Hypotheses still needed where no decide stage chooses them.
        let e = bad(&DECIDED.replace("[\"hypotheses\", ", "["));
        assert!(e.message.contains("at least two hypotheses"), "{e}");
    }

    #[test]
    fn networks_are_the_pipelines_unless_a_stage_names_its_own() {
        let p = parse("p.toml", GOOD, &BTreeMap::new()).unwrap();
        assert!(!p.network.egress && p.stages.iter().all(|s| s.network.is_none()));
        let text = GOOD.replace(
            "image = \"busybox\"\n",
            "image = \"busybox\"\nnetwork = \"egress\"\nallow = [\"pypi.org:443\"]\n",
        );
        let p = parse("p.toml", &text, &BTreeMap::new()).unwrap();
        assert!(p.network.egress && p.network.restricted());
        let text = GOOD.replace(
            "checkpoint_every = \"10m\"",
            "checkpoint_every = \"10m\"\nnetwork = \"egress\"",
        );
        let p = parse("p.toml", &text, &BTreeMap::new()).unwrap();
        assert!(p
            .stages
            .iter()
            .any(|s| s.network.as_ref().is_some_and(|n| n.egress && !n.restricted())));
        for (wrong, says) in [
            ("network = \"bridge\"", "unknown network"),
            ("network = \"none\"\nallow = [\"pypi.org\"]", "--network egress"),
            ("allow = [\"10.0.0.1/8\"]", "host bits"),
        ] {
            let e = bad(&GOOD.replace("image = \"busybox\"\n", &format!("image = \"busybox\"\n{wrong}\n")));
            assert!(e.message.contains(says), "{wrong}: {e}");
            assert_eq!(e.line, 4, "{e}");
        }
    }

    #[test]
    fn a_checkpoint_share_is_a_whole_percentage_up_to_half() {
        let p = parse("p.toml", GOOD, &BTreeMap::new()).unwrap();
        assert_eq!(p.stages[0].checkpoint_share, DEFAULT_CHECKPOINT_SHARE);
        let set = GOOD.replace(
            "checkpoint_every = \"10m\"",
            "checkpoint_every = \"10m\"\ncheckpoint_share = \"5%\"",
        );
        assert_eq!(
            parse("p.toml", &set, &BTreeMap::new()).unwrap().stages[0].checkpoint_share,
            5
        );
        for wrong in ["75%", "0%", "10", "ten%", "2.5%"] {
            let text = GOOD.replace(
                "checkpoint_every = \"10m\"",
                &format!("checkpoint_every = \"10m\"\ncheckpoint_share = \"{wrong}\""),
            );
            let e = bad(&text);
            assert!(e.message.contains("from 1% to 50%"), "{wrong}: {e}");
            assert_eq!(e.line, 14, "the line of checkpoint_share: {e}");
        }
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("1h30m"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("10"), None);
        assert_eq!(parse_duration("h"), None);
        // Past what a Duration holds: refused, not a panic or a wrap.
        assert_eq!(parse_duration("18446744073709551615h"), None);
        assert_eq!(parse_duration("18446744073709551615s1s"), None);
    }
}

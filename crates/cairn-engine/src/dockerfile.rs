//! `cairn image build --file`: a Dockerfile's subset read into the steps
//! of [`crate::build`]. FROM names a base Cairn can make (a Cairn image,
//! `busybox`, `debian[:SUITE]`, `e2bdev/base`); RUN, COPY, ADD of local
//! files, ENV, WORKDIR, USER and ARG are steps or their variables; CMD and
//! ENTRYPOINT become the image's start command; LABEL and EXPOSE are
//! accepted and change nothing. Anything else is refused naming the
//! instruction and its line. COPY's sources are packed from the build
//! context, which they cannot leave, without following a link.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

/// The most bytes a Dockerfile may have.
const MAX_BYTES: usize = 1 << 20;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DockerfileError {
    #[error(
        "line {line}: {instruction} is not supported; Cairn builds FROM, RUN, COPY, ADD (local files), ENV, WORKDIR, \
         USER, ARG, CMD, ENTRYPOINT, LABEL and EXPOSE"
    )]
    Unsupported { line: usize, instruction: String },
    #[error("line {line}: {why}")]
    Bad { line: usize, why: String },
    #[error("{0}")]
    File(String),
}

/// One instruction that becomes a build step, with its line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Instruction {
    Run(String),
    /// Sources (relative to the context), destination, owner, mode.
    Copy {
        srcs: Vec<String>,
        dest: String,
        chown: Option<String>,
        chmod: Option<u32>,
    },
    Env(Vec<(String, String)>),
    Workdir(String),
    User(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dockerfile {
    /// What FROM names, variables substituted.
    pub from: String,
    /// (line, instruction), in order.
    pub steps: Vec<(usize, Instruction)>,
    /// ENTRYPOINT then CMD, as one shell command.
    pub start_cmd: Option<String>,
    /// The ARGs in force, for RUN's environment while building.
    pub args: BTreeMap<String, String>,
}

/// CMD or ENTRYPOINT as written.
enum StartForm {
    Exec(Vec<String>),
    Shell(String),
}

fn bad(line: usize, why: impl Into<String>) -> DockerfileError {
    DockerfileError::Bad { line, why: why.into() }
}

/// The logical lines of `text`: comments and blank lines dropped, lines
/// ending in `\` joined to the next; each with the number of its first line.
fn logical_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let trimmed = raw.trim();
        if current.is_none() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        // A comment inside a continued instruction is dropped too.
        if current.is_some() && trimmed.starts_with('#') {
            continue;
        }
        let (body, continued) = match trimmed.strip_suffix('\\') {
            Some(b) => (b, true),
            None => (trimmed, false),
        };
        let entry = current.get_or_insert_with(|| (n, String::new()));
        if !entry.1.is_empty() {
            entry.1.push(' ');
        }
        entry.1.push_str(body.trim_end());
        if !continued {
            out.extend(current.take());
        }
    }
    out.extend(current);
    out
}

/// `$NAME` and `${NAME}` replaced from `vars` (unknown ones by nothing, as
/// Docker does); `\$` stays a dollar.
fn substitute(text: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'$') => {
                out.push('$');
                chars.next();
            }
            '$' => {
                let braced = chars.peek() == Some(&'{');
                if braced {
                    chars.next();
                }
                let mut name = String::new();
                while let Some(&n) = chars.peek() {
                    if n.is_ascii_alphanumeric() || n == '_' {
                        name.push(n);
                        chars.next();
                    } else {
                        break;
                    }
                }
                if braced {
                    // `${NAME:-default}` and friends are kept simple: the
                    // default when unset.
                    let mut rest = String::new();
                    for n in chars.by_ref() {
                        if n == '}' {
                            break;
                        }
                        rest.push(n);
                    }
                    match (vars.get(&name), rest.strip_prefix(":-")) {
                        (Some(v), _) => out.push_str(v),
                        (None, Some(default)) => out.push_str(default),
                        (None, None) => {}
                    }
                } else if name.is_empty() {
                    out.push('$');
                } else if let Some(v) = vars.get(&name) {
                    out.push_str(v);
                }
            }
            _ => out.push(c),
        }
    }
    out
}

/// A JSON array of strings (exec form), or `None` for shell form.
fn exec_form(args: &str, line: usize) -> Result<Option<Vec<String>>, DockerfileError> {
    let t = args.trim();
    if !t.starts_with('[') {
        return Ok(None);
    }
    serde_json::from_str::<Vec<String>>(t)
        .map(Some)
        .map_err(|e| bad(line, format!("{t} is not a JSON array of strings: {e}")))
}

/// `argv` as one shell command, each word quoted.
fn shell_join(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Words of shell-form arguments, honouring double and single quotes.
fn words(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quote: Option<char> = None;
    let mut any = false;
    for c in text.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => cur.push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                any = true;
            }
            (None, c) if c.is_whitespace() => {
                if !cur.is_empty() || any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            (None, c) => cur.push(c),
        }
    }
    if !cur.is_empty() || any {
        out.push(cur);
    }
    out
}

/// `KEY=VALUE ...` pairs, or the older `KEY VALUE` form.
fn pairs(args: &str, line: usize, what: &str) -> Result<Vec<(String, String)>, DockerfileError> {
    let ws = words(args);
    if ws.is_empty() {
        return Err(bad(line, format!("{what} needs a name")));
    }
    if !ws[0].contains('=') {
        let value = args.trim()[ws[0].len()..].trim().to_string();
        return Ok(vec![(ws[0].clone(), value)]);
    }
    ws.iter()
        .map(|w| match w.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => Err(bad(line, format!("{what} {w:?} is not NAME=VALUE"))),
        })
        .collect()
}

/// Reads a Dockerfile; `build_args` override its ARGs' defaults.
pub fn parse(text: &str, build_args: &BTreeMap<String, String>) -> Result<Dockerfile, DockerfileError> {
    if text.len() > MAX_BYTES {
        return Err(DockerfileError::File(format!(
            "the Dockerfile is larger than {MAX_BYTES} bytes"
        )));
    }
    let mut from: Option<String> = None;
    let mut steps = Vec::new();
    let mut args: BTreeMap<String, String> = BTreeMap::new();
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    // Each as (exec form's words, or the shell form's command).
    let (mut entrypoint, mut cmd): (Option<StartForm>, Option<StartForm>) = (None, None);
    for (line, text) in logical_lines(text) {
        let (word, rest) = match text.split_once(char::is_whitespace) {
            Some((w, r)) => (w.to_string(), r.trim().to_string()),
            None => (text.clone(), String::new()),
        };
        let instruction = word.to_ascii_uppercase();
        // Variables as Docker has them at this point: ARGs under ENVs.
        let vars: BTreeMap<String, String> = args.clone().into_iter().chain(env.clone()).collect();
        if from.is_none() && instruction != "FROM" && instruction != "ARG" {
            return Err(bad(
                line,
                format!("{instruction} before FROM; a Dockerfile starts with FROM"),
            ));
        }
        match instruction.as_str() {
            "FROM" => {
                if from.is_some() {
                    return Err(bad(line, "a second FROM: multi-stage builds are not supported"));
                }
                let ws = words(&substitute(&rest, &vars));
                let image = ws
                    .iter()
                    .find(|w| !w.starts_with("--"))
                    .ok_or_else(|| bad(line, "FROM needs an image"))?;
                if ws.iter().any(|w| w.starts_with("--")) {
                    return Err(bad(line, "FROM takes no flags (--platform is not supported)"));
                }
                from = Some(image.clone());
            }
            "ARG" => {
                for (k, v) in pairs(&rest, line, "ARG")
                    .or_else(|_| Ok::<_, DockerfileError>(vec![(rest.clone(), String::new())]))?
                {
                    let value = build_args.get(&k).cloned().unwrap_or(v);
                    args.insert(k, value);
                }
            }
            "RUN" => {
                let command = match exec_form(&rest, line)? {
                    Some(argv) if argv.is_empty() => return Err(bad(line, "RUN [] runs nothing")),
                    Some(argv) => shell_join(&argv),
                    None => rest.clone(),
                };
                if command.trim().is_empty() {
                    return Err(bad(line, "RUN needs a command"));
                }
                if command.trim_start().starts_with("--") {
                    return Err(bad(line, "RUN takes no flags (--mount, --network are not supported)"));
                }
                steps.push((line, Instruction::Run(command)));
            }
            "COPY" | "ADD" => {
                let mut ws = match exec_form(&rest, line)? {
                    Some(argv) => argv,
                    None => words(&rest),
                };
                let (mut chown, mut chmod) = (None, None);
                while ws.first().is_some_and(|w| w.starts_with("--")) {
                    let flag = ws.remove(0);
                    match flag.split_once('=') {
                        Some(("--chown", v)) => chown = Some(substitute(v, &vars)),
                        Some(("--chmod", v)) => {
                            chmod = Some(
                                u32::from_str_radix(v, 8)
                                    .ok()
                                    .filter(|m| *m <= 0o7777)
                                    .ok_or_else(|| bad(line, format!("--chmod={v} is not an octal mode")))?,
                            )
                        }
                        _ => {
                            return Err(bad(
                                line,
                                format!("{instruction} {flag}: only --chown and --chmod are supported"),
                            ))
                        }
                    }
                }
                if ws.len() < 2 {
                    return Err(bad(line, format!("{instruction} needs a source and a destination")));
                }
                let dest = substitute(&ws.pop().expect("two or more"), &vars);
                let srcs: Vec<String> = ws.iter().map(|w| substitute(w, &vars)).collect();
                for src in &srcs {
                    if src.contains("://") {
                        return Err(bad(
                            line,
                            format!(
                                "{instruction} {src}: Cairn copies files from the build context only, not from URLs"
                            ),
                        ));
                    }
                    if instruction == "ADD"
                        && [".tar", ".tar.gz", ".tgz", ".tar.xz", ".tar.bz2", ".tar.zst"]
                            .iter()
                            .any(|ext| src.ends_with(ext))
                    {
                        return Err(bad(
                            line,
                            format!("ADD {src}: unpacking archives is not supported; COPY it and RUN tar"),
                        ));
                    }
                }
                let dest = if srcs.len() > 1 && !dest.ends_with('/') {
                    format!("{dest}/")
                } else {
                    dest
                };
                steps.push((
                    line,
                    Instruction::Copy {
                        srcs,
                        dest,
                        chown,
                        chmod,
                    },
                ));
            }
            "ENV" => {
                let set: Vec<(String, String)> = pairs(&rest, line, "ENV")?
                    .into_iter()
                    .map(|(k, v)| (k, substitute(&v, &vars)))
                    .collect();
                env.extend(set.iter().cloned());
                steps.push((line, Instruction::Env(set)));
            }
            "WORKDIR" => {
                let dir = substitute(&rest, &vars);
                if dir.is_empty() {
                    return Err(bad(line, "WORKDIR needs a directory"));
                }
                steps.push((line, Instruction::Workdir(dir)));
            }
            "USER" => {
                let user = substitute(&rest, &vars);
                if user.is_empty() || user.contains(char::is_whitespace) {
                    return Err(bad(line, "USER needs one user (NAME, UID or UID:GID)"));
                }
                steps.push((line, Instruction::User(user)));
            }
            "CMD" | "ENTRYPOINT" => {
                let form = match exec_form(&rest, line)? {
                    Some(argv) => StartForm::Exec(argv),
                    None => StartForm::Shell(rest.clone()),
                };
                if instruction == "CMD" {
                    cmd = Some(form);
                } else {
                    entrypoint = Some(form);
                }
            }
            "LABEL" | "EXPOSE" | "MAINTAINER" => {}
            _ => {
                return Err(DockerfileError::Unsupported {
                    line,
                    instruction: word,
                })
            }
        }
    }
    let from = from.ok_or_else(|| DockerfileError::File("the Dockerfile has no FROM".into()))?;
    // Docker's rules: an exec-form ENTRYPOINT takes CMD as arguments (a
    // shell-form CMD as `/bin/sh -c CMD`), a shell-form one ignores CMD.
    let start_cmd = match (entrypoint, cmd) {
        (Some(StartForm::Exec(mut words)), cmd) => {
            match cmd {
                Some(StartForm::Exec(args)) => words.extend(args),
                Some(StartForm::Shell(c)) => words.extend(["/bin/sh".to_string(), "-c".to_string(), c]),
                None => {}
            }
            (!words.is_empty()).then(|| shell_join(&words))
        }
        (Some(StartForm::Shell(e)), _) => Some(e),
        (None, Some(StartForm::Exec(words))) => (!words.is_empty()).then(|| shell_join(&words)),
        (None, Some(StartForm::Shell(c))) => Some(c),
        (None, None) => None,
    }
    .filter(|c| !c.trim().is_empty());
    Ok(Dockerfile {
        from,
        steps,
        start_cmd,
        args,
    })
}

/// `src`, relative to the build context, checked not to leave it.
pub fn context_path(context: &Path, src: &str, line: usize) -> Result<PathBuf, DockerfileError> {
    let rel = Path::new(src.trim_start_matches("./"));
    if rel.is_absolute() || rel.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(bad(line, format!("{src} is outside the build context")));
    }
    Ok(context.join(rel))
}

/// Whether `name` matches the glob `pattern` (`*`, `?`; no `/`).
pub fn glob_match(pattern: &str, name: &str) -> bool {
    fn go(p: &[u8], n: &[u8]) -> bool {
        match (p.first(), n.first()) {
            (None, None) => true,
            (Some(b'*'), _) => go(&p[1..], n) || (!n.is_empty() && go(p, &n[1..])),
            (Some(b'?'), Some(_)) => go(&p[1..], &n[1..]),
            (Some(a), Some(b)) if a == b => go(&p[1..], &n[1..]),
            _ => false,
        }
    }
    go(pattern.as_bytes(), name.as_bytes())
}

/// Packs the context's `srcs` into a tar archive at `out`, entries named by
/// their path in the context (what [`crate::build::Step::Copy`] reads);
/// links are stored as links (and skipped by the copy), never followed.
pub fn pack(context: &Path, srcs: &[String], out: &Path, line: usize) -> Result<usize, DockerfileError> {
    let file = std::fs::File::create(out).map_err(|e| DockerfileError::File(format!("{}: {e}", out.display())))?;
    let mut tar = tar::Builder::new(file);
    tar.follow_symlinks(false);
    let mut count = 0;
    for src in srcs {
        let path = context_path(context, src, line)?;
        let rel = src.trim_start_matches("./").trim_end_matches('/').to_string();
        let (dir, pattern) = match rel.rsplit_once('/') {
            Some((d, p)) => (d.to_string(), p.to_string()),
            None => (String::new(), rel.clone()),
        };
        let matches: Vec<(PathBuf, String)> = if pattern.contains(['*', '?']) {
            if dir.contains(['*', '?']) {
                return Err(bad(line, format!("{src}: a glob is supported in the last name only")));
            }
            let base = context.join(&dir);
            let mut found: Vec<(PathBuf, String)> = std::fs::read_dir(&base)
                .map_err(|e| bad(line, format!("{src}: {e}")))?
                .flatten()
                .filter(|e| glob_match(&pattern, &e.file_name().to_string_lossy()))
                .map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let rel = if dir.is_empty() { name } else { format!("{dir}/{name}") };
                    (e.path(), rel)
                })
                .collect();
            found.sort();
            found
        } else {
            vec![(path, rel)]
        };
        if matches.is_empty() {
            return Err(bad(line, format!("nothing in the build context matches {src}")));
        }
        for (abs, rel) in matches {
            let meta =
                std::fs::symlink_metadata(&abs).map_err(|e| bad(line, format!("{rel} in the build context: {e}")))?;
            let appended = if meta.is_dir() {
                tar.append_dir_all(&rel, &abs)
            } else {
                tar.append_path_with_name(&abs, &rel)
            };
            appended.map_err(|e| bad(line, format!("cannot pack {rel}: {e}")))?;
            count += 1;
        }
    }
    tar.finish()
        .map_err(|e| DockerfileError::File(format!("{}: {e}", out.display())))?;
    Ok(count)
}

/// Where a Dockerfile build's log goes: each step and line of output to
/// stderr, as `cairn image build` shows them.
struct Stderr<'a> {
    lines: &'a [usize],
}

impl crate::build::BuildLog for Stderr<'_> {
    fn log(&self, step: Option<usize>, _level: &str, message: &str) {
        match step.and_then(|s| s.checked_sub(1)).and_then(|i| self.lines.get(i)) {
            Some(line) => eprintln!("[line {line}] {message}"),
            None => eprintln!("{message}"),
        }
    }
}

impl crate::Engine {
    /// Builds image `name` from the Dockerfile at `file` with the build
    /// context `context`; `build_args` set its ARGs, `network` is what its
    /// RUN steps reach (`None`: nothing).
    pub fn build_dockerfile(
        &mut self,
        name: &str,
        file: &Path,
        context: &Path,
        build_args: &BTreeMap<String, String>,
        network: Option<cairn_sandbox::net::NetPolicy>,
        progress: &dyn crate::Progress,
    ) -> Result<crate::state::ImageRecord, crate::EngineError> {
        use crate::build::{Base, Plan, Step};
        use crate::images::ImageError;
        let failed = |detail: String| -> crate::EngineError {
            ImageError::Command {
                what: format!("building {name} from {}", file.display()),
                detail,
            }
            .into()
        };
        let text = std::fs::read(file).map_err(|e| failed(format!("cannot read it: {e}")))?;
        let text = String::from_utf8(text).map_err(|_| failed("it is not UTF-8".into()))?;
        let parsed = parse(&text, build_args).map_err(|e| failed(e.to_string()))?;
        if !context.is_dir() {
            return Err(failed(format!(
                "the build context {} is not a directory",
                context.display()
            )));
        }
        progress.step(&format!("FROM {}", parsed.from));
        let base = self.dockerfile_base(&parsed.from, progress)?;
        let scratch = self.scratch_dir()?;
        let exports: String = parsed
            .args
            .iter()
            .map(|(k, v)| format!("export {k}='{}'; ", v.replace('\'', "'\\''")))
            .collect();
        let mut steps = Vec::new();
        let mut lines = Vec::new();
        for (i, (line, instruction)) in parsed.steps.iter().enumerate() {
            match instruction {
                Instruction::Run(command) => steps.push(Step::Run {
                    command: format!("{exports}{command}"),
                    user: None,
                }),
                Instruction::Copy {
                    srcs,
                    dest,
                    chown,
                    chmod,
                } => {
                    let archive = scratch.path().join(format!("copy-{i}.tar"));
                    pack(context, srcs, &archive, *line).map_err(|e| failed(e.to_string()))?;
                    for src in srcs {
                        steps.push(Step::Copy {
                            archive: archive.clone(),
                            src: src.clone(),
                            dest: dest.clone(),
                            user: chown.clone(),
                            mode: *chmod,
                        });
                        lines.push(*line);
                    }
                    continue;
                }
                Instruction::Env(vars) => steps.push(Step::Env(vars.clone())),
                Instruction::Workdir(dir) => steps.push(Step::Workdir(dir.clone())),
                Instruction::User(user) => steps.push(Step::User(user.clone())),
            }
            lines.push(*line);
        }
        let plan = Plan {
            base: Base::Image(Some(base)),
            config: crate::build::ImageConfig {
                start_cmd: parsed.start_cmd.clone(),
                ..Default::default()
            },
            steps,
            network,
            step_timeout: std::time::Duration::from_secs(6 * 3600),
            ready_timeout: std::time::Duration::from_secs(60),
            setup: None,
        };
        let sandbox = format!("build-{}", crate::random_hex(4));
        let source = format!("Dockerfile {}", file.display());
        let log = Stderr { lines: &lines };
        self.build_image(name, source, &sandbox, &plan, &log)
            .map(|(rec, _)| rec)
            .map_err(|f| {
                let at = f
                    .step
                    .and_then(|s| s.checked_sub(1))
                    .and_then(|i| lines.get(i))
                    .map(|l| format!(" (Dockerfile line {l})"))
                    .unwrap_or_default();
                failed(format!("{}{at}", f.message))
            })
    }

    /// The Cairn image a Dockerfile's FROM names, built from Debian's
    /// packages first where that is what it names.
    fn dockerfile_base(&mut self, from: &str, progress: &dyn crate::Progress) -> Result<String, crate::EngineError> {
        use crate::images::{ImageError, E2B_BASE};
        if self.db.image(from)?.is_some() {
            return Ok(from.to_string());
        }
        let (repo, tag) = from.split_once(':').unwrap_or((from, ""));
        match repo {
            "busybox" => Ok(self.image_or_default(crate::images::DEFAULT_IMAGE, progress)?.name),
            "debian" => {
                let suite = crate::images::debian_suite(tag).ok_or_else(|| ImageError::Command {
                    what: format!("FROM {from}"),
                    detail: format!("{tag:?} is not a Debian suite"),
                })?;
                self.debian_image(suite, progress)
            }
            "e2bdev/base" => {
                if self.db.image(E2B_BASE)?.is_none() {
                    // Shared with every tenant, whoever asked first.
                    self.as_administrator(|e| e.build_e2b_base(E2B_BASE, None, &[], progress))?;
                }
                Ok(E2B_BASE.to_string())
            }
            _ => Err(ImageError::Command {
                what: format!("FROM {from}"),
                detail: "Cairn pulls from no registry: use a Cairn image (`cairn image ls`), busybox, \
                         debian[:SUITE] (built from Debian's packages) or e2bdev/base"
                    .into(),
            }
            .into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_args() -> BTreeMap<String, String> {
        BTreeMap::new()
    }

    #[test]
    fn the_subset_is_read_with_continuations_variables_and_both_forms() {
        let text = "# a comment\nARG SUITE=bookworm\nFROM debian:${SUITE}\nARG APP=/app\nENV GREETING=\"hello there\" \\\n    MODE=prod\nWORKDIR $APP\nRUN apt-get update && \\\n    # not a step\n    echo done\nRUN [\"echo\", \"it's\"]\nCOPY --chown=user:user --chmod=640 a.txt b/ $APP/\nUSER user\nLABEL x=y\nEXPOSE 8080\nENTRYPOINT [\"python3\", \"-m\"]\nCMD [\"http.server\", \"8080\"]\n";
        let d = parse(text, &no_args()).unwrap();
        assert_eq!(d.from, "debian:bookworm");
        assert_eq!(
            d.steps,
            vec![
                (
                    5,
                    Instruction::Env(vec![
                        ("GREETING".into(), "hello there".into()),
                        ("MODE".into(), "prod".into())
                    ])
                ),
                (7, Instruction::Workdir("/app".into())),
                (8, Instruction::Run("apt-get update && echo done".into())),
                (11, Instruction::Run("echo 'it'\\''s'".into())),
                (
                    12,
                    Instruction::Copy {
                        srcs: vec!["a.txt".into(), "b/".into()],
                        dest: "/app/".into(),
                        chown: Some("user:user".into()),
                        chmod: Some(0o640),
                    }
                ),
                (13, Instruction::User("user".into())),
            ]
        );
        assert_eq!(d.start_cmd.as_deref(), Some("python3 -m http.server 8080"));
        for (tail, start) in [
            ("ENTRYPOINT [\"serve\"]\nCMD run it\n", "serve /bin/sh -c 'run it'"),
            ("ENTRYPOINT serve --now\nCMD [\"ignored\"]\n", "serve --now"),
            ("CMD [\"a b\", \"c\"]\n", "'a b' c"),
        ] {
            let d = parse(&format!("FROM x\n{tail}"), &no_args()).unwrap();
            assert_eq!(d.start_cmd.as_deref(), Some(start), "{tail}");
        }
        let over: BTreeMap<String, String> = [("SUITE".to_string(), "trixie".to_string())].into();
        assert_eq!(parse(text, &over).unwrap().from, "debian:trixie", "--build-arg wins");
    }

    #[test]
    fn what_is_not_supported_is_named_with_its_line() {
        let err = parse("FROM busybox\nRUN true\nHEALTHCHECK CMD true\n", &no_args()).unwrap_err();
        assert_eq!(
            err,
            DockerfileError::Unsupported {
                line: 3,
                instruction: "HEALTHCHECK".into()
            }
        );
        assert!(
            err.to_string().starts_with("line 3: HEALTHCHECK is not supported"),
            "{err}"
        );
        for (text, line, words) in [
            ("RUN true\n", 1, "before FROM"),
            ("FROM a\nFROM b\n", 2, "multi-stage"),
            ("FROM a\nADD https://x/y /\n", 2, "not from URLs"),
            ("FROM a\nADD x.tar.gz /\n", 2, "unpacking archives"),
            ("FROM a\nCOPY --from=b x /\n", 2, "--chown and --chmod"),
            ("FROM a\nCOPY x\n", 2, "a source and a destination"),
            ("FROM a\nRUN --mount=type=cache true\n", 2, "no flags"),
            ("FROM a\nRUN [\"x\"\n", 2, "JSON array"),
        ] {
            match parse(text, &no_args()) {
                Err(DockerfileError::Bad { line: l, why }) => {
                    assert_eq!(l, line, "{text}");
                    assert!(why.contains(words), "{text}: {why}");
                }
                other => panic!("{text}: {other:?}"),
            }
        }
        assert!(parse("# nothing\n", &no_args()).is_err());
    }

    #[test]
    fn sources_cannot_leave_the_context_and_globs_match_names() {
        let ctx = Path::new("/ctx");
        assert!(context_path(ctx, "../etc/passwd", 1).is_err());
        assert!(context_path(ctx, "/etc/passwd", 1).is_err());
        assert_eq!(context_path(ctx, "./a/b", 1).unwrap(), Path::new("/ctx/a/b"));
        assert!(glob_match("*.py", "app.py") && !glob_match("*.py", "app.pyc") && glob_match("a?c", "abc"));
    }
}

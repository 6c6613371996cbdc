//! Images built from steps run in a sandbox: what E2B's template builder
//! sends (`Template().run_cmd(...).copy(...)`) and what `cairn image build
//! --file` reads from a Dockerfile. The base starts as a sandbox, each
//! step runs in it (commands as the step's user, files unpacked from an
//! archive through init, so no path from the archive is followed on the
//! host), and the result is snapshotted and recorded as an image whole,
//! or not at all: a failed or killed build leaves no image and, once its
//! sandbox is removed, nothing else.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cairn_protocol::{ExecRequest, FileKind, FileMeta, Ids};
use cairn_sandbox::net::NetPolicy;

use crate::images::{valid_image_name, ImageError};
use crate::sandboxes::CreateOptions;
use crate::state::e2b_templates::BuildFailure;
use crate::state::{ImageRecord, SandboxRecord};
use crate::{now_ms, Engine, EngineError};

pub use crate::state::ImageConfig;

/// Where a build starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Base {
    /// A Cairn image (`None`: the default one).
    Image(Option<String>),
    /// A snapshot's files.
    Snapshot(String),
}

/// One step of a build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// `sh -c COMMAND` as `user` (else the build's user so far).
    Run {
        command: String,
        user: Option<String>,
    },
    /// The entries of a tar archive (plain or gzip) under `src` (a path
    /// or a glob relative to the build context), copied to `dest`.
    Copy {
        archive: PathBuf,
        src: String,
        dest: String,
        user: Option<String>,
        mode: Option<u32>,
    },
    Env(Vec<(String, String)>),
    Workdir(String),
    User(String),
}

impl Step {
    /// The step as a Dockerfile would say it (a long command cut short).
    pub fn describe(&self) -> String {
        let text = match self {
            Step::Run { command, .. } => format!("RUN {command}"),
            Step::Copy { src, dest, .. } => format!("COPY {src} {dest}"),
            Step::Env(vars) => format!(
                "ENV {}",
                vars.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>().join(" ")
            ),
            Step::Workdir(dir) => format!("WORKDIR {dir}"),
            Step::User(user) => format!("USER {user}"),
        };
        match text.char_indices().nth(80) {
            Some((i, _)) => format!("{}...", &text[..i]),
            None => text,
        }
    }
}

/// A build: its base, what the base's sandboxes started with, its steps,
/// and the network its commands get.
#[derive(Debug, Clone)]
pub struct Plan {
    pub base: Base,
    pub config: ImageConfig,
    pub steps: Vec<Step>,
    pub network: Option<NetPolicy>,
    /// How long one command may run.
    pub step_timeout: Duration,
    /// How long `ready_cmd` may take to succeed once `start_cmd` started.
    pub ready_timeout: Duration,
    /// A shell script run as root on the base before the steps (E2B's
    /// builds add E2B's user where the base lacks it).
    pub setup: Option<String>,
}

/// Where a build's log goes, line by line. `step` counts from 1 (E2B's
/// numbering: 0 is the base, `steps.len() + 1` the start command).
pub trait BuildLog: Sync {
    fn log(&self, step: Option<usize>, level: &str, message: &str);
}

/// The most bytes of one line of a command's output a log keeps.
const LINE_MAX: usize = 4096;
/// The most output lines a failure's message quotes.
const TAIL_LINES: usize = 20;

fn fail(step: Option<usize>, message: impl Into<String>) -> BuildFailure {
    BuildFailure {
        message: message.into(),
        step,
    }
}

/// The step numbering of the start command (after every step).
pub fn finalize_step(plan: &Plan) -> usize {
    plan.steps.len() + 1
}

impl Engine {
    /// Builds image `name` from `plan`; its record and the config its
    /// sandboxes start with. `source` is what `cairn image ls` says of it.
    /// The sandbox it ran in (named `sandbox_name`) is removed either way.
    pub fn build_image(
        &mut self,
        name: &str,
        source: String,
        sandbox_name: &str,
        plan: &Plan,
        log: &dyn BuildLog,
    ) -> Result<(ImageRecord, ImageConfig), BuildFailure> {
        if !valid_image_name(name) {
            return Err(fail(None, ImageError::BadName(name.to_string()).to_string()));
        }
        log.log(Some(0), "info", &format!("starting from {}", describe(&plan.base)));
        let opts = CreateOptions {
            name: Some(sandbox_name.to_string()),
            network: plan.network.clone(),
            driver: Some("native".into()),
            ..CreateOptions::default()
        };
        let created = match &plan.base {
            Base::Image(image) => self.create_sandbox(
                &CreateOptions {
                    image: image.clone(),
                    ..opts
                },
                &crate::Silent,
            ),
            Base::Snapshot(id) => self.snapshot_record(id).and_then(|snap| self.restore(&snap, &opts)),
        };
        let rec = created.map_err(|e| fail(Some(0), format!("cannot start the base: {e}")))?;
        let built = self.run_steps(&rec, plan, log).and_then(|config| {
            log.log(None, "info", "saving the image");
            let snap = self
                .snapshot(&rec, Some(&format!("build of {name}")))
                .map_err(|e| fail(None, format!("cannot snapshot the built sandbox: {e}")))?;
            let image = self
                .image_from_snapshot(&snap, name, source.clone(), Some(config.clone()))
                .map_err(|e| fail(None, format!("cannot record image {name}: {e}")));
            if let Err(e) = self.remove_snapshot(&snap) {
                tracing::warn!("build of {name}: cannot remove its snapshot {}: {e}", snap.id);
            }
            Ok((image?, config))
        });
        if let Err(e) = self.sandbox(&rec.id).and_then(|r| self.remove_sandbox(&r, true)) {
            tracing::warn!("build of {name}: cannot remove its sandbox {}: {e}", rec.id);
        }
        built
    }

    /// Records image `name` with the layers of `snap` (no copy) and
    /// `config`.
    pub fn image_from_snapshot(
        &mut self,
        snap: &crate::state::SnapshotRecord,
        name: &str,
        source: String,
        config: Option<ImageConfig>,
    ) -> Result<ImageRecord, EngineError> {
        if !valid_image_name(name) {
            return Err(ImageError::BadName(name.to_string()).into());
        }
        let _lock = self.lock_store(false)?;
        let mut size = 0;
        for l in &snap.layers {
            size += self.layers.size(&crate::layer_id(l)?);
        }
        let rec = ImageRecord {
            name: name.to_string(),
            source,
            size_bytes: size,
            created_at: now_ms(),
            layers: snap.layers.clone(),
            config,
        };
        self.put_image_replacing(rec)
    }

    fn run_steps(&mut self, rec: &SandboxRecord, plan: &Plan, log: &dyn BuildLog) -> Result<ImageConfig, BuildFailure> {
        let mut config = plan.config.clone();
        if let Some(setup) = &plan.setup {
            let argv = vec!["/bin/sh".to_string(), "-c".to_string(), setup.clone()];
            self.run_logged(
                rec,
                argv,
                &ImageConfig::default(),
                None,
                plan.step_timeout,
                Some(0),
                log,
            )
            .map_err(|mut f| {
                f.message = format!("setting up the base failed: {}", f.message);
                f
            })?;
        }
        // The base's own start command is not run while building.
        for (i, step) in plan.steps.iter().enumerate() {
            let n = i + 1;
            self.run_step(rec, plan, n, step, &mut config, log).map_err(|mut f| {
                f.message = format!("step {n} ({}) failed: {}", step.describe(), f.message);
                f
            })?;
        }
        if let Some(start) = &config.start_cmd {
            let at = Some(finalize_step(plan));
            log.log(at, "info", &format!("checking the start command: {start}"));
            let ids = self.ids_of(rec, config.user.as_deref()).map_err(|e| fail(at, e))?;
            let mut req = self.request(vec!["/bin/sh".into(), "-c".into(), start.clone()], &config, ids);
            req.detach = true;
            match self.exec(rec, req) {
                Ok(Ok(_)) => {}
                Ok(Err(why)) => return Err(fail(at, format!("the start command did not start: {}", why.message))),
                Err(e) => return Err(fail(at, format!("the start command did not start: {e}"))),
            }
            if let Some(ready) = &config.ready_cmd {
                self.wait_ready(rec, ready, &config, ids, plan.ready_timeout)
                    .map_err(|e| fail(at, e))?;
                log.log(at, "info", "the ready command succeeded");
            }
        }
        Ok(config)
    }

    /// Runs step `n` of `plan`, changing `config` as it says.
    fn run_step(
        &mut self,
        rec: &SandboxRecord,
        plan: &Plan,
        n: usize,
        step: &Step,
        config: &mut ImageConfig,
        log: &dyn BuildLog,
    ) -> Result<(), BuildFailure> {
        let at = Some(n);
        match step {
            Step::Run { command, user } => {
                log.log(at, "info", &format!("RUN {command}"));
                let user = user.as_deref().or(config.user.as_deref());
                let ids = self.ids_of(rec, user).map_err(|e| fail(at, e))?;
                let argv = vec!["/bin/sh".to_string(), "-c".to_string(), command.clone()];
                self.run_logged(rec, argv, config, ids, plan.step_timeout, at, log)?;
            }
            Step::Copy {
                archive,
                src,
                dest,
                user,
                mode,
            } => {
                log.log(at, "info", &format!("COPY {src} {dest}"));
                let user = user.as_deref().or(config.user.as_deref());
                let ids = self.ids_of(rec, user).map_err(|e| fail(at, e))?;
                let dest = absolute(dest, config.workdir.as_deref());
                let copied = self
                    .copy_archive(rec, archive, src, &dest, ids, *mode)
                    .map_err(|e| fail(at, e))?;
                log.log(at, "info", &format!("copied {copied} entries"));
            }
            Step::Env(vars) => {
                for (k, v) in vars {
                    if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                        return Err(fail(at, format!("ENV {k:?}: not a variable name and value")));
                    }
                    config.env.insert(k.clone(), v.clone());
                }
                log.log(
                    at,
                    "info",
                    &format!(
                        "ENV {}",
                        vars.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>().join(" ")
                    ),
                );
            }
            Step::Workdir(dir) => {
                let dir = absolute(dir, config.workdir.as_deref());
                log.log(at, "info", &format!("WORKDIR {dir}"));
                let ids = self.ids_of(rec, config.user.as_deref()).map_err(|e| fail(at, e))?;
                let argv = vec!["mkdir".to_string(), "-p".to_string(), dir.clone()];
                self.run_logged(rec, argv, &ImageConfig::default(), ids, plan.step_timeout, at, log)?;
                config.workdir = Some(dir);
            }
            Step::User(user) => {
                log.log(at, "info", &format!("USER {user}"));
                self.ids_of(rec, Some(user)).map_err(|e| fail(at, e))?;
                config.user = Some(user.clone());
            }
        }
        Ok(())
    }

    /// Runs `ready` (as the image's user) until it exits 0, or `within`
    /// passes: why not, then.
    pub fn wait_ready(
        &self,
        rec: &SandboxRecord,
        ready: &str,
        config: &ImageConfig,
        ids: Option<Ids>,
        within: Duration,
    ) -> Result<(), String> {
        let deadline = Instant::now() + within;
        loop {
            let mut req = self.request(vec!["/bin/sh".into(), "-c".into(), ready.to_string()], config, ids);
            req.timeout_ms = Some(within.as_millis().max(1) as u64);
            let mut out = Vec::new();
            let code = match self.exec(rec, req) {
                Ok(Ok(started)) => started
                    .session
                    .wait(&mut out, &mut std::io::sink())
                    .map_err(|e| e.to_string())?
                    .map(|s| s.shell_code()),
                Ok(Err(why)) => return Err(format!("the ready command cannot start: {}", why.message)),
                Err(e) => return Err(e.to_string()),
            };
            if code == Some(0) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the ready command `{ready}` did not succeed within {}s (last exit {})",
                    within.as_secs(),
                    code.map_or("none".to_string(), |c| c.to_string())
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A request for `argv` with the config's environment and directory.
    pub fn request(&self, argv: Vec<String>, config: &ImageConfig, ids: Option<Ids>) -> ExecRequest {
        ExecRequest {
            argv,
            env: config.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            cwd: config.workdir.clone(),
            user: ids,
            ..ExecRequest::default()
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn run_logged(
        &self,
        rec: &SandboxRecord,
        argv: Vec<String>,
        config: &ImageConfig,
        ids: Option<Ids>,
        timeout: Duration,
        at: Option<usize>,
        log: &dyn BuildLog,
    ) -> Result<(), BuildFailure> {
        let mut req = self.request(argv, config, ids);
        if let Some((_, home)) = self.home_env(rec, ids) {
            req.env.insert(0, ("HOME".into(), home));
        }
        req.timeout_ms = Some(timeout.as_millis() as u64);
        let started = match self.exec(rec, req) {
            Ok(Ok(s)) => s,
            Ok(Err(why)) => return Err(fail(at, format!("cannot start: {}", why.message))),
            Err(e) => return Err(fail(at, format!("cannot start: {e}"))),
        };
        let mut lines = Lines::new(at, log);
        let mut errs = Lines::new(at, log);
        let status = started.session.wait(&mut lines, &mut errs);
        lines.flush_line();
        errs.flush_line();
        let status = status.map_err(|e| fail(at, format!("lost the command: {e}")))?;
        match status {
            Some(s) if s.shell_code() == 0 => Ok(()),
            Some(s) => {
                let mut tail: Vec<String> = lines.tail.into_iter().chain(errs.tail).collect();
                tail.truncate(TAIL_LINES * 2);
                let how = if s.timed_out {
                    format!("did not finish within {}s", timeout.as_secs())
                } else {
                    format!("exited with code {}", s.shell_code())
                };
                Err(fail(at, format!("the command {how}:\n{}", tail.join("\n"))))
            }
            None => Err(fail(at, "the sandbox ended during the command")),
        }
    }

    /// The home of `ids` from the sandbox's /etc/passwd.
    fn home_env(&self, rec: &SandboxRecord, ids: Option<Ids>) -> Option<(u32, String)> {
        let ids = ids?;
        let passwd = self.read_small(rec, "/etc/passwd").ok()?;
        passwd.lines().find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.len() >= 7 && f[2].parse::<u32>().ok() == Some(ids.uid)).then(|| (ids.uid, f[5].to_string()))
        })
    }

    /// Reads a small file of the sandbox (at most 1 MiB).
    fn read_small(&self, rec: &SandboxRecord, path: &str) -> Result<String, String> {
        small_file(&self.client(rec).map_err(|e| e.to_string())?, path)
    }

    /// The ids of `user` (a name from the sandbox's /etc/passwd, or a
    /// number); `None` for root.
    pub fn ids_of(&self, rec: &SandboxRecord, user: Option<&str>) -> Result<Option<Ids>, String> {
        let Some(user) = user.filter(|u| !u.is_empty() && *u != "root" && *u != "0") else {
            return Ok(None);
        };
        let (name, group) = match user.split_once(':') {
            Some((n, g)) => (n, Some(g)),
            None => (user, None),
        };
        let passwd = self.read_small(rec, "/etc/passwd").unwrap_or_default();
        let found = passwd.lines().find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.len() >= 4 && (f[0] == name || f[2] == name))
                .then(|| Some((f[2].parse::<u32>().ok()?, f[3].parse::<u32>().ok()?)))
                .flatten()
        });
        let (uid, mut gid) = match (found, name.parse::<u32>()) {
            (Some(ids), _) => ids,
            (None, Ok(uid)) => (uid, uid),
            (None, Err(_)) => {
                return Err(format!(
                    "no user {name:?} in the image's /etc/passwd; add one with `useradd` in a RUN step first"
                ))
            }
        };
        if let Some(g) = group {
            gid = match g.parse::<u32>() {
                Ok(n) => n,
                Err(_) => {
                    let groups = self.read_small(rec, "/etc/group").unwrap_or_default();
                    groups
                        .lines()
                        .find_map(|l| {
                            let f: Vec<&str> = l.split(':').collect();
                            (f.len() >= 3 && f[0] == g).then(|| f[2].parse::<u32>().ok()).flatten()
                        })
                        .ok_or_else(|| format!("no group {g:?} in the image's /etc/group"))?
                }
            };
        }
        if uid >= 65536 || gid >= 65536 {
            return Err(format!("user {user:?}: ids above 65535 are not mapped in a sandbox"));
        }
        Ok(Some(Ids { uid, gid }))
    }

    /// Copies the entries of `archive` under `src` to `dest` in the
    /// sandbox, owned by `ids` (else root), files with `mode` when given;
    /// how many. Entries are names in the archive, never followed: each is
    /// written through init, which resolves it inside the sandbox.
    fn copy_archive(
        &self,
        rec: &SandboxRecord,
        archive: &Path,
        src: &str,
        dest: &str,
        ids: Option<Ids>,
        mode: Option<u32>,
    ) -> Result<usize, String> {
        let client = self.client(rec).map_err(|e| e.to_string())?;
        let file = std::fs::File::open(archive).map_err(|e| format!("cannot open the uploaded files: {e}"))?;
        let mut head = [0u8; 2];
        let gz = {
            use std::io::Seek;
            let mut f = &file;
            let n = f.read(&mut head).map_err(|e| e.to_string())?;
            f.seek(std::io::SeekFrom::Start(0)).map_err(|e| e.to_string())?;
            n == 2 && head == [0x1f, 0x8b]
        };
        let reader: Box<dyn Read> = if gz {
            Box::new(flate2::read::GzDecoder::new(file))
        } else {
            Box::new(file)
        };
        let mut tar = tar::Archive::new(reader);
        let src = src.trim_start_matches("./").trim_end_matches('/');
        let globbed = src.contains(['*', '?', '[']);
        // A glob's entries keep their path below the glob's fixed part.
        let fixed = if globbed {
            let parts: Vec<&str> = src.split('/').collect();
            let n = parts
                .iter()
                .position(|p| p.contains(['*', '?', '[']))
                .unwrap_or(parts.len());
            parts[..n].join("/")
        } else {
            src.to_string()
        };
        // As Docker has it: a destination ending in `/` (or `.`) or that is
        // a directory already takes the source by its name.
        let dotted = dest == "." || dest.ends_with("/.");
        let dest = dest.strip_suffix('.').unwrap_or(dest);
        let trimmed = dest.trim_end_matches('/');
        let trimmed = if trimmed.is_empty() { "/" } else { trimmed };
        let is_dir = matches!(client.stat(trimmed), Ok(Some(m)) if m.kind == FileKind::Dir);
        let into_dir = dest.ends_with('/') || dotted || globbed || is_dir;
        let dest = trimmed;
        let (uid, gid) = ids.map_or((0, 0), |i| (i.uid, i.gid));
        let mut count = 0;
        let mut made_dest = false;
        for entry in tar
            .entries()
            .map_err(|e| format!("the uploaded files are not a tar archive: {e}"))?
        {
            let mut entry = entry.map_err(|e| format!("the uploaded archive is damaged: {e}"))?;
            let path = entry.path().map_err(|e| e.to_string())?.to_string_lossy().into_owned();
            let path = path.trim_start_matches("./").trim_end_matches('/').to_string();
            if path.split('/').any(|p| p == "..") || path.starts_with('/') {
                return Err(format!(
                    "the uploaded archive names {path:?}, outside the build context"
                ));
            }
            let rest = if path == fixed {
                None
            } else if fixed.is_empty() {
                Some(path.as_str())
            } else if let Some(r) = path.strip_prefix(&format!("{fixed}/")) {
                Some(r)
            } else {
                continue;
            };
            let kind = entry.header().entry_type();
            let target = match rest {
                // The source itself: a directory is copied as its contents;
                // a file into `dest/` or as `dest`.
                None if kind.is_dir() => dest.to_string(),
                None if into_dir => format!("{dest}/{}", path.rsplit('/').next().unwrap_or(&path)),
                None => dest.to_string(),
                Some(r) => format!("{}/{r}", dest.trim_end_matches('/')),
            };
            if !made_dest {
                let parent = if kind.is_dir() || into_dir {
                    dest.to_string()
                } else {
                    target.rsplit_once('/').map_or(
                        "/".into(),
                        |(p, _)| if p.is_empty() { "/".into() } else { p.to_string() },
                    )
                };
                client
                    .make_dir_as(&parent, true, ids)
                    .map_err(|e| format!("cannot make {parent}: {e}"))?;
                made_dest = true;
            }
            let header_mode = entry.header().mode().unwrap_or(0o644) & 0o7777;
            if kind.is_dir() {
                client
                    .make_dir_as(&target, true, ids)
                    .map_err(|e| format!("cannot make {target}: {e}"))?;
                count += 1;
            } else if kind.is_file() {
                if let Some((parent, _)) = target.rsplit_once('/') {
                    if !parent.is_empty() {
                        client
                            .make_dir_as(parent, true, ids)
                            .map_err(|e| format!("cannot make {parent}: {e}"))?;
                    }
                }
                let size = entry.header().size().map_err(|e| e.to_string())?;
                let meta = FileMeta {
                    path: target.clone(),
                    kind: FileKind::File,
                    mode: mode.unwrap_or(header_mode),
                    uid,
                    gid,
                    size,
                    mtime_ns: entry.header().mtime().unwrap_or(0) as i128 * 1_000_000_000,
                };
                client
                    .put_file(meta, &mut entry)
                    .map_err(|e| format!("cannot write {target}: {e}"))?;
                count += 1;
            } else {
                // Links and devices are not copied: a link could point
                // anywhere, and the SDK resolves them by default.
                continue;
            }
        }
        if count == 0 {
            return Err(format!("nothing in the uploaded files matches {src:?}"));
        }
        Ok(count)
    }
}

/// `dir` made absolute against the working directory so far.
fn absolute(dir: &str, workdir: Option<&str>) -> String {
    if dir.starts_with('/') {
        dir.to_string()
    } else {
        format!("{}/{dir}", workdir.unwrap_or("").trim_end_matches('/'))
    }
}

fn describe(base: &Base) -> String {
    match base {
        Base::Image(None) => "the default image".into(),
        Base::Image(Some(name)) => format!("image {name}"),
        Base::Snapshot(id) => format!("snapshot {id}"),
    }
}

/// A small file of a sandbox (at most 1 MiB; a larger one is refused
/// unread), as text: its accounts, say.
pub fn small_file(client: &cairn_sandbox::client::InitClient, path: &str) -> Result<String, String> {
    let file = client.open_file(path).map_err(|e| e.to_string())?;
    if file.meta().size > 1 << 20 {
        return Err(format!("{path} is larger than 1 MiB"));
    }
    let mut out = Vec::new();
    file.copy_to(&mut out).map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Output split into log lines (each at most [`LINE_MAX`] bytes), the last
/// few kept for a failure's message.
struct Lines<'a> {
    step: Option<usize>,
    log: &'a dyn BuildLog,
    partial: Vec<u8>,
    tail: Vec<String>,
}

impl<'a> Lines<'a> {
    fn new(step: Option<usize>, log: &'a dyn BuildLog) -> Lines<'a> {
        Lines {
            step,
            log,
            partial: Vec::new(),
            tail: Vec::new(),
        }
    }

    fn emit(&mut self, line: &[u8]) {
        let text = String::from_utf8_lossy(line).trim_end_matches('\r').to_string();
        self.log.log(self.step, "info", &text);
        self.tail.push(text);
        if self.tail.len() > TAIL_LINES {
            self.tail.remove(0);
        }
    }

    fn flush_line(&mut self) {
        if !self.partial.is_empty() {
            let line = std::mem::take(&mut self.partial);
            self.emit(&line);
        }
    }
}

impl Write for Lines<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        for &b in buf {
            if b == b'\n' {
                let line = std::mem::take(&mut self.partial);
                self.emit(&line);
            } else if self.partial.len() < LINE_MAX {
                self.partial.push(b);
            }
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

//! Images: named stacks of read-only layers that sandboxes start from.
//!
//! `busybox` (the default, built on first use from Debian's static busybox),
//! `debian` (debootstrap minbase plus packages) and imports of a directory or
//! a tarball (`docker export` output, plain, gzip or zstd).

use std::fs;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use cairn_layers::PendingLayer;

use crate::state::ImageRecord;
use crate::{now_ms, Engine, EngineError, Progress};

pub const DEFAULT_IMAGE: &str = "busybox";

/// Modes of what Cairn itself puts in an image (the root, directories,
/// files it writes), set explicitly: the `cairn` process runs with umask
/// 077, which would leave them to root alone, and a non-root user of the
/// sandbox could not reach `/bin/sh`. Executables are 0755 like
/// directories; what a package or an imported archive sets is kept.
const DIR_MODE: u32 = 0o755;
const FILE_MODE: u32 = 0o644;

/// The server of E2B's code interpreter (port 49999, Jupyter kernels),
/// put in `code-interpreter` images at [`CODE_INTERPRETER_PATH`].
pub const CODE_INTERPRETER_SERVER: &str = include_str!("../../../images/code-interpreter/server.py");
/// Where a code-interpreter image holds its server, under the root.
pub const CODE_INTERPRETER_PATH: &str = "usr/local/lib/cairn/code-interpreter/server.py";
/// Debian's packages the server and its kernels need.
pub const CODE_INTERPRETER_PACKAGES: &[&str] = &[
    "python3-ipykernel",
    "python3-jupyter-client",
    "python3-numpy",
    "python3-pandas",
    "python3-matplotlib",
];
/// The port the server listens on (E2B's code interpreter SDK's), in
/// [`CODE_INTERPRETER_COMMAND`].
pub const CODE_INTERPRETER_PORT: u16 = 49999;
/// The first word of a code-interpreter image's source.
pub const CODE_INTERPRETER_SOURCE: &str = "code-interpreter";
/// What E2B's base template has beyond Debian's minimal system (bash,
/// coreutils, passwd): Python with pip, git, curl.
pub const E2B_BASE_PACKAGES: &[&str] = &[
    "python3",
    "python3-pip",
    "python3-venv",
    "git",
    "curl",
    "ca-certificates",
];
/// The image name and source of E2B's base template as Cairn builds it.
pub const E2B_BASE: &str = "e2b-base";
/// Run in the new root: E2B's user `user` (uid and gid 1000, home
/// /home/user, bash, no sudo), and pip allowed to install beside Debian's
/// packages, as in E2B's base.
const E2B_BASE_SETUP: &str = "useradd --uid 1000 --user-group --create-home --shell /bin/bash user && \
     chmod 0755 /home/user && printf '[global]\nbreak-system-packages = true\n' > /etc/pip.conf && chmod 0644 /etc/pip.conf";
/// The command that serves the code interpreter in a sandbox of such an
/// image, on the sandbox's loopback (the E2B gateway reaches it through
/// init), in the E2B user's home.
pub const CODE_INTERPRETER_COMMAND: &str = "mkdir -p /home/user && cd /home/user && \
     CODEINT_CWD=/home/user exec python3 /usr/local/lib/cairn/code-interpreter/server.py 127.0.0.1 49999";

/// The umask of the programs that build an image (debootstrap and the
/// package scripts it runs), as on a usual host.
const BUILD_UMASK: &str = "022";

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("no image named {0:?}; `cairn image ls` lists them, `cairn image build busybox|debian` or `cairn image import` makes one")]
    NotFound(String),
    #[error("image {0:?} is the administrator's, shared with every tenant; a tenant removes its own images only")]
    Shared(String),
    #[error("invalid image name {0:?}: use lowercase letters, digits, '.', '_' and '-', at most 64, starting with a letter or digit")]
    BadName(String),
    #[error("{tool} is not installed; install it with `apt-get install {package}`")]
    MissingTool { tool: &'static str, package: &'static str },
    #[error("{what} failed: {detail}")]
    Command { what: String, detail: String },
    #[error("cannot import {path}: {reason}")]
    Import { path: PathBuf, reason: String },
    #[error("image build I/O on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    move |source| ImageError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The suite a `debian[:TAG]` reference's tag names: `stable` for none or
/// `latest`, `bookworm` for `bookworm-slim`; `None` when it names no suite.
pub fn debian_suite(tag: &str) -> Option<&str> {
    let suite = if tag.is_empty() || tag == "latest" {
        "stable"
    } else {
        tag
    };
    let suite = suite.split('-').next().unwrap_or(suite);
    (!suite.is_empty() && suite.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())).then_some(suite)
}

pub fn valid_image_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"._-".contains(c))
}

/// Runs a command, returning its stdout; a failure carries its stderr.
fn run(cmd: &mut Command, what: &str) -> Result<Vec<u8>, ImageError> {
    let out = cmd.stdin(Stdio::null()).output().map_err(|e| ImageError::Command {
        what: what.into(),
        detail: e.to_string(),
    })?;
    if !out.status.success() {
        let detail = String::from_utf8_lossy(&out.stderr).trim().to_string();
        return Err(ImageError::Command {
            what: what.into(),
            detail: format!("{} ({})", detail, out.status),
        });
    }
    Ok(out.stdout)
}

fn set_mode(path: &Path, mode: u32) -> Result<(), ImageError> {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(io_err(path))
}

/// Creates the directories of `rel` under `root` that are missing, each
/// [`DIR_MODE`]. Makes nothing for a path with `..` in it, and stops at
/// the first name that is there but is not a directory (a symbolic link
/// included), following no link: what comes next is left to the caller,
/// which refuses or replaces it.
fn make_dirs(root: &Path, rel: &Path) -> Result<(), ImageError> {
    use std::path::Component;
    if rel.components().any(|c| c == Component::ParentDir) {
        return Ok(());
    }
    let mut path = root.to_path_buf();
    for part in rel.components() {
        let Component::Normal(name) = part else {
            continue;
        };
        path.push(name);
        match fs::symlink_metadata(&path) {
            Ok(meta) if meta.is_dir() => continue,
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fs::create_dir(&path).map_err(io_err(&path))?;
                set_mode(&path, DIR_MODE)?;
            }
            Err(e) => return Err(io_err(&path)(e)),
        }
    }
    Ok(())
}

fn have(tool: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        .unwrap_or(false)
}

/// Whether `path` is an ELF executable without an interpreter (static).
fn is_static_elf(path: &Path) -> bool {
    let Ok(bytes) = fs::read(path) else {
        return false;
    };
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 {
        return false;
    }
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().unwrap()) as usize;
    let (phoff, phentsize, phnum) = (u64_at(32), u16_at(54), u16_at(56));
    (0..phnum).all(|i| {
        let o = phoff + i * phentsize;
        // PT_INTERP = 3
        o + 4 <= bytes.len() && u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap()) != 3
    })
}

impl Engine {
    /// Looks up an image; the default image is built on first use.
    pub(crate) fn image_or_default(&mut self, name: &str, progress: &dyn Progress) -> Result<ImageRecord, EngineError> {
        if let Some(img) = self.db.image(name)? {
            return Ok(img);
        }
        if name == DEFAULT_IMAGE {
            progress.step("building the default busybox image (first use)");
            // Shared with every tenant, whoever asked first.
            return self.as_administrator(|e| e.build_busybox(DEFAULT_IMAGE, progress));
        }
        Err(ImageError::NotFound(name.to_string()).into())
    }

    pub fn images(&self) -> Result<Vec<ImageRecord>, EngineError> {
        Ok(self.db.images()?)
    }

    pub fn image(&self, name: &str) -> Result<ImageRecord, EngineError> {
        self.db
            .image(name)?
            .ok_or_else(|| ImageError::NotFound(name.to_string()).into())
    }

    /// Whether the image's top layer, present locally, holds `rel` (a
    /// relative path) as a regular file. No link is followed on the way: a
    /// link anywhere on the path answers no.
    pub fn image_has_file(&self, image: &ImageRecord, rel: &str) -> bool {
        let Some(top) = image.layers.first().and_then(|l| crate::layer_id(l).ok()) else {
            return false;
        };
        let Ok(mut path) = self.layers.path(&top) else {
            return false;
        };
        let parts: Vec<&str> = rel.split('/').filter(|p| !p.is_empty()).collect();
        for (i, part) in parts.iter().enumerate() {
            if *part == ".." || *part == "." {
                return false;
            }
            path.push(part);
            let Ok(md) = fs::symlink_metadata(&path) else {
                return false;
            };
            let last = i + 1 == parts.len();
            if (last && !md.is_file()) || (!last && !md.is_dir()) {
                return false;
            }
        }
        !parts.is_empty()
    }

    /// Gives image `src` a second name, `name`: the same layers and source,
    /// no copy. An image already called `name` is replaced (its layers go
    /// when nothing else uses them); removing either name keeps the other.
    pub fn tag_image(&mut self, src: &str, name: &str) -> Result<ImageRecord, EngineError> {
        if !valid_image_name(name) {
            return Err(ImageError::BadName(name.to_string()).into());
        }
        let _lock = self.lock_store(false)?;
        let from = self.image(src)?;
        if src == name {
            return Ok(from);
        }
        let rec = ImageRecord {
            name: name.to_string(),
            created_at: now_ms(),
            ..from
        };
        self.put_image_replacing(rec)
    }

    /// Removes an image; layers no image or sandbox uses go with it.
    pub fn remove_image(&mut self, name: &str) -> Result<(), EngineError> {
        let img = self.image(name)?;
        if let Some(t) = self.db.acting_for() {
            if !self.db.owns(crate::tenants::Owned::Image, &t, &img.name)? {
                return Err(ImageError::Shared(name.to_string()).into());
            }
        }
        self.db.delete_image(&img.name)?;
        let referenced = self.db.referenced_layers()?;
        for l in img.layers.iter().filter(|l| !referenced.contains(*l)) {
            self.layers.remove(&crate::layer_id(l)?)?;
        }
        Ok(())
    }

    fn commit_image(&mut self, name: &str, source: String, layer: PendingLayer) -> Result<ImageRecord, EngineError> {
        let _lock = self.lock_store(false)?;
        let committed = layer.commit(&self.store)?;
        warn_devices_left_out(name, committed.dropped_devices);
        let id = committed.id;
        let rec = ImageRecord {
            name: name.to_string(),
            source,
            size_bytes: self.layers.size(&id),
            created_at: now_ms(),
            layers: vec![id.to_string()],
            config: None,
        };
        self.put_image_replacing(rec)
    }

    /// Records `rec`; the layers of an image it replaces go when nothing
    /// else uses them.
    pub(crate) fn put_image_replacing(&mut self, rec: ImageRecord) -> Result<ImageRecord, EngineError> {
        let replaced = self.db.image(&rec.name)?;
        self.db.put_image(&rec)?;
        if let Some(old) = replaced {
            let referenced = self.db.referenced_layers()?;
            for l in old.layers.iter().filter(|l| !referenced.contains(*l)) {
                self.layers.remove(&crate::layer_id(l)?)?;
            }
        }
        Ok(rec)
    }

    pub fn scratch_dir(&self) -> Result<ScratchDir, EngineError> {
        tempfile_dir::ScratchDir::new(&self.home.scratch()).map_err(|source| EngineError::Home {
            path: self.home.scratch(),
            source,
        })
    }

    /// A minimal root from Debian's static busybox: the binary, a link per
    /// applet, /etc/passwd and friends.
    pub fn build_busybox(&mut self, name: &str, progress: &dyn Progress) -> Result<ImageRecord, EngineError> {
        if !valid_image_name(name) {
            return Err(ImageError::BadName(name.to_string()).into());
        }
        let scratch = self.scratch_dir()?;
        let busybox = find_static_busybox(scratch.path(), progress)?;
        progress.step("laying out the busybox root");
        let layer = self.layers.prepare()?;
        let root = layer.path();
        set_mode(root, DIR_MODE)?;
        for d in [
            "bin", "sbin", "usr/bin", "usr/sbin", "etc", "root", "home", "proc", "sys", "dev", "run", "var/tmp", "tmp",
        ] {
            make_dirs(root, Path::new(d))?;
        }
        for d in ["tmp", "var/tmp"] {
            set_mode(&root.join(d), 0o1777)?;
        }
        set_mode(&root.join("root"), 0o700)?;
        let target = root.join("bin/busybox");
        fs::copy(&busybox, &target).map_err(io_err(&target))?;
        set_mode(&target, DIR_MODE)?;
        let list = run(Command::new(&target).arg("--list-full"), "listing busybox applets")?;
        for applet in String::from_utf8_lossy(&list)
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
        {
            let link = root.join(applet);
            if link.exists() || applet == "bin/busybox" {
                continue;
            }
            let depth = applet.matches('/').count();
            let rel = format!("{}bin/busybox", "../".repeat(depth));
            symlink(&rel, &link).map_err(io_err(&link))?;
        }
        let etc = root.join("etc");
        for (file, content) in [
            (
                "passwd",
                "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
            ),
            ("group", "root:x:0:\nnogroup:x:65534:\n"),
            ("hosts", "127.0.0.1\tlocalhost\n::1\tlocalhost\n"),
            ("nsswitch.conf", "hosts: files dns\n"),
        ] {
            fs::write(etc.join(file), content).map_err(io_err(&etc.join(file)))?;
            set_mode(&etc.join(file), FILE_MODE)?;
        }
        self.commit_image(name, "busybox (Debian busybox-static)".into(), layer)
    }

    /// Debian minbase from debootstrap, plus `packages`.
    pub fn build_debian(
        &mut self,
        name: &str,
        suite: Option<&str>,
        packages: &[String],
        progress: &dyn Progress,
    ) -> Result<ImageRecord, EngineError> {
        self.debootstrap_image(name, suite, packages, &[], &[], None, "debian", progress)
    }

    /// The Cairn image of Debian `suite` (`debian-SUITE`), built from
    /// Debian's packages first when it is missing.
    pub fn debian_image(&mut self, suite: &str, progress: &dyn Progress) -> Result<String, EngineError> {
        let name = format!("debian-{suite}");
        if self.db.image(&name)?.is_none() {
            // Shared with every tenant, whoever asked first.
            self.as_administrator(|e| e.build_debian(&name, Some(suite), &[], progress))?;
        }
        Ok(name)
    }

    /// E2B's base template as Cairn builds it: Debian with bash, python3,
    /// pip, git and curl (plus `packages`), and the user `user` (uid 1000)
    /// E2B runs commands as.
    pub fn build_e2b_base(
        &mut self,
        name: &str,
        suite: Option<&str>,
        packages: &[String],
        progress: &dyn Progress,
    ) -> Result<ImageRecord, EngineError> {
        let mut all: Vec<String> = E2B_BASE_PACKAGES.iter().map(|p| p.to_string()).collect();
        all.extend(packages.iter().cloned());
        self.debootstrap_image(name, suite, &[], &all, &[], Some(E2B_BASE_SETUP), E2B_BASE, progress)
    }

    /// A Debian image for E2B's code interpreter: Jupyter's Python kernel
    /// with numpy, pandas and matplotlib from Debian's packages (plus
    /// `packages`), and the port 49999 server
    /// ([`CODE_INTERPRETER_SERVER`]) that E2B sandboxes of this image run
    /// (`cairn serve --e2b`, docs/e2b.md).
    pub fn build_code_interpreter(
        &mut self,
        name: &str,
        suite: Option<&str>,
        packages: &[String],
        progress: &dyn Progress,
    ) -> Result<ImageRecord, EngineError> {
        // Installed by apt-get in the new root, not by debootstrap: some of
        // them (python3-zmq) fail to configure inside debootstrap's stage.
        let mut all: Vec<String> = CODE_INTERPRETER_PACKAGES.iter().map(|p| p.to_string()).collect();
        all.extend(packages.iter().cloned());
        let files = [(CODE_INTERPRETER_PATH, CODE_INTERPRETER_SERVER)];
        self.debootstrap_image(name, suite, &[], &all, &files, None, CODE_INTERPRETER_SOURCE, progress)
    }

    /// Debian minbase from debootstrap, plus `packages` (installed by
    /// debootstrap), `apt_packages` (by apt-get in the new root, after it),
    /// `setup` (a shell script run in the new root last) and `files` (paths
    /// under the root, mode 0644); its source says `kind`, the suite and
    /// the packages.
    #[allow(clippy::too_many_arguments)]
    fn debootstrap_image(
        &mut self,
        name: &str,
        suite: Option<&str>,
        packages: &[String],
        apt_packages: &[String],
        files: &[(&str, &str)],
        setup: Option<&str>,
        kind: &str,
        progress: &dyn Progress,
    ) -> Result<ImageRecord, EngineError> {
        if !valid_image_name(name) {
            return Err(ImageError::BadName(name.to_string()).into());
        }
        if let Some(bad) = packages
            .iter()
            .chain(apt_packages)
            .find(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_alphanumeric() || b"+-.:".contains(&b)))
        {
            return Err(ImageError::Command {
                what: "debian image".into(),
                detail: format!("{bad:?} is not a Debian package name"),
            }
            .into());
        }
        if !have("debootstrap") {
            return Err(ImageError::MissingTool {
                tool: "debootstrap",
                package: "debootstrap",
            }
            .into());
        }
        let suite = suite.map(str::to_string).unwrap_or_else(host_suite);
        let mirror = host_mirror();
        let layer = self.layers.prepare()?;
        set_mode(layer.path(), DIR_MODE)?;
        // debootstrap and the package scripts create files with the
        // umask they inherit; `cairn`'s own 077 would make the image's
        // directories and files root's alone.
        let mut cmd = Command::new("sh");
        cmd.args(["-c", &format!("umask {BUILD_UMASK} && exec \"$@\""), "sh"]);
        // A private mount namespace: whatever debootstrap mounts inside the
        // target goes away with it, even if it is killed.
        cmd.args([
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "debootstrap",
            "--variant=minbase",
        ]);
        if !packages.is_empty() {
            cmd.arg(format!("--include={}", packages.join(",")));
        }
        cmd.arg(&suite).arg(layer.path()).arg(&mirror);
        progress.step(&format!("debootstrap {suite} from {mirror}"));
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| ImageError::Command {
                what: "debootstrap".into(),
                detail: e.to_string(),
            })?;
        let stderr = child.stderr.take();
        let err_reader = std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut e) = stderr {
                let _ = e.read_to_string(&mut s);
            }
            s
        });
        let mut last = Vec::new();
        if let Some(out) = child.stdout.take() {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(msg) = line.strip_prefix("I: ") {
                    progress.step(msg);
                }
                last.push(line);
                if last.len() > 20 {
                    last.remove(0);
                }
            }
        }
        let status = child.wait().map_err(|e| ImageError::Command {
            what: "debootstrap".into(),
            detail: e.to_string(),
        })?;
        let stderr = err_reader.join().unwrap_or_default();
        if !status.success() {
            let detail = format!(
                "{}\n{}\n(see {}/debootstrap/debootstrap.log)",
                last.join("\n"),
                stderr.trim(),
                layer.path().display()
            );
            return Err(ImageError::Command {
                what: format!("debootstrap {suite}"),
                detail,
            }
            .into());
        }
        if !apt_packages.is_empty() {
            progress.step(&format!("apt-get install {}", apt_packages.join(" ")));
            // In a private mount namespace (its /proc goes with it), with
            // the host's resolver, and no service started by a package.
            let script = format!(
                "umask {BUILD_UMASK} && root=$1 && shift && mount -t proc proc \"$root/proc\" && \
                 cp /etc/resolv.conf \"$root/etc/resolv.conf\" && \
                 printf '#!/bin/sh\\nexit 101\\n' > \"$root/usr/sbin/policy-rc.d\" && \
                 chmod 755 \"$root/usr/sbin/policy-rc.d\" && \
                 chroot \"$root\" apt-get update -q && \
                 DEBIAN_FRONTEND=noninteractive chroot \"$root\" apt-get install -y -q --no-install-recommends \"$@\"; \
                 rc=$?; rm -f \"$root/usr/sbin/policy-rc.d\"; umount \"$root/proc\"; exit $rc"
            );
            let mut apt = Command::new("unshare");
            apt.args(["--mount", "--propagation", "private", "sh", "-c", &script, "sh"])
                .arg(layer.path())
                .args(apt_packages);
            run(&mut apt, "apt-get install in the new image")?;
        }
        if let Some(setup) = setup {
            progress.step("setting up the image");
            // In the new root, in a private mount namespace (its /proc goes
            // with it).
            let script = format!(
                "umask {BUILD_UMASK} && root=$1 && mount -t proc proc \"$root/proc\" && \
                 chroot \"$root\" /bin/sh -c \"$2\"; rc=$?; umount \"$root/proc\"; exit $rc"
            );
            let mut cmd = Command::new("unshare");
            cmd.args(["--mount", "--propagation", "private", "sh", "-c", &script, "sh"])
                .arg(layer.path())
                .arg(setup);
            run(&mut cmd, "setting up the new image")?;
        }
        progress.step("cleaning the package cache");
        for d in ["var/cache/apt/archives", "var/lib/apt/lists"] {
            if let Ok(entries) = fs::read_dir(layer.path().join(d)) {
                for e in entries.flatten() {
                    if e.path().is_file() {
                        let _ = fs::remove_file(e.path());
                    }
                }
            }
        }
        for (path, content) in files {
            let at = layer.path().join(path);
            let written = at
                .parent()
                .map_or(Ok(()), fs::create_dir_all)
                .and_then(|()| fs::write(&at, content))
                .and_then(|()| fs::set_permissions(&at, fs::Permissions::from_mode(0o644)));
            written.map_err(|e| ImageError::Command {
                what: format!("{kind} image"),
                detail: format!("cannot write {}: {e}", at.display()),
            })?;
        }
        let all: Vec<&str> = packages.iter().chain(apt_packages).map(String::as_str).collect();
        let source = if all.is_empty() {
            format!("{kind} {suite}")
        } else {
            format!("{kind} {suite} +{}", all.join(","))
        };
        self.commit_image(name, source, layer)
    }

    /// Imports a directory tree or a tarball (plain, gzip or zstd) as an image.
    pub fn import_image(
        &mut self,
        path: &Path,
        name: &str,
        progress: &dyn Progress,
    ) -> Result<ImageRecord, EngineError> {
        if !valid_image_name(name) {
            return Err(ImageError::BadName(name.to_string()).into());
        }
        let md = fs::metadata(path).map_err(|e| ImageError::Import {
            path: path.into(),
            reason: e.to_string(),
        })?;
        let layer = self.layers.prepare()?;
        // The root's mode when the directory or archive does not give one.
        set_mode(layer.path(), DIR_MODE)?;
        if md.is_dir() {
            progress.step(&format!("copying {}", path.display()));
            let mut src = path.as_os_str().to_owned();
            src.push("/.");
            run(
                Command::new("cp")
                    .args(["-a", "--reflink=auto"])
                    .arg(src)
                    .arg(layer.path()),
                "copying the directory",
            )?;
        } else {
            progress.step(&format!("unpacking {}", path.display()));
            warn_devices_left_out(name, unpack(path, layer.path())?);
        }
        self.commit_image(name, format!("import {}", path.display()), layer)
    }
}

fn warn_devices_left_out(image: &str, count: usize) {
    if count > 0 {
        tracing::warn!("image {image}: left out {count} device node(s); images never hold block or character devices");
    }
}

/// Unpacks the tarball at `path` into `dest`, but device nodes (the tar
/// crate would make them empty files); returns how many were left out.
fn unpack(path: &Path, dest: &Path) -> Result<usize, ImageError> {
    let bad = |reason: String| ImageError::Import {
        path: path.into(),
        reason,
    };
    let mut file = fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let mut magic = [0u8; 4];
    let n = file.read(&mut magic).map_err(|e| bad(e.to_string()))?;
    let file = fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let reader: Box<dyn Read> = match &magic[..n] {
        [0x1f, 0x8b, ..] => Box::new(flate2::read::GzDecoder::new(file)),
        [0x28, 0xb5, 0x2f, 0xfd] => Box::new(zstd::Decoder::new(file).map_err(|e| bad(e.to_string()))?),
        _ => Box::new(file),
    };
    let mut archive = tar::Archive::new(reader);
    archive.set_preserve_permissions(true);
    archive.set_preserve_ownerships(true);
    archive.set_preserve_mtime(true);
    archive.set_unpack_xattrs(true);
    archive.set_overwrite(true);
    let mut entries = 0usize;
    let mut devices = 0usize;
    for entry in archive.entries().map_err(|e| bad(format!("not a tar archive: {e}")))? {
        let mut entry = entry.map_err(|e| bad(format!("corrupt tar archive: {e}")))?;
        entries += 1;
        let kind = entry.header().entry_type();
        if kind.is_block_special() || kind.is_character_special() {
            devices += 1;
            continue;
        }
        // Directories the archive leaves out are made 0755, not by the
        // umask as the tar crate would.
        let path = entry.path().map_err(|e| bad(format!("corrupt tar archive: {e}")))?;
        if let Some(parent) = path.parent() {
            make_dirs(dest, parent)?;
        }
        // unpack_in refuses entries that would land outside `dest`.
        entry
            .unpack_in(dest)
            .map_err(|e| bad(format!("cannot unpack {:?}: {e}", entry.path().unwrap_or_default())))?;
    }
    if entries == 0 {
        return Err(bad("the archive is empty or not a tar archive".into()));
    }
    Ok(devices)
}

/// The static busybox: the host's when it is static, else Debian's
/// `busybox-static` package fetched with `apt-get download`.
fn find_static_busybox(scratch: &Path, progress: &dyn Progress) -> Result<PathBuf, ImageError> {
    for p in ["/bin/busybox", "/usr/bin/busybox"] {
        if is_static_elf(Path::new(p)) {
            return Ok(PathBuf::from(p));
        }
    }
    if !have("apt-get") || !have("dpkg-deb") {
        return Err(ImageError::MissingTool {
            tool: "a static busybox",
            package: "busybox-static",
        });
    }
    progress.step("downloading busybox-static with apt-get");
    let download = || {
        run(
            Command::new("apt-get")
                .args(["download", "-q", "busybox-static"])
                .current_dir(scratch),
            "apt-get download busybox-static",
        )
    };
    download()
        .or_else(|first| {
            // A fresh machine has no package lists yet, an old one stale
            // lists whose versions the mirror no longer has: update once.
            progress.step(&format!(
                "apt-get download failed ({}); updating the package lists with apt-get update and trying again",
                first.to_string().lines().last().unwrap_or_default()
            ));
            run(Command::new("apt-get").args(["update", "-q"]), "apt-get update")?;
            download()
        })
        .map_err(|e| ImageError::Command {
            what: "fetching busybox-static".into(),
            detail: format!("{e}; run `apt-get update` or `apt-get install busybox-static`"),
        })?;
    let deb = fs::read_dir(scratch)
        .map_err(io_err(scratch))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| ImageError::Command {
            what: "apt-get download".into(),
            detail: "no .deb was downloaded".into(),
        })?;
    let unpacked = scratch.join("deb");
    run(
        Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpacked),
        "unpacking busybox-static",
    )?;
    for p in ["bin/busybox", "usr/bin/busybox"] {
        if is_static_elf(&unpacked.join(p)) {
            return Ok(unpacked.join(p));
        }
    }
    Err(ImageError::Command {
        what: "busybox-static".into(),
        detail: "the package holds no static busybox".into(),
    })
}

fn host_suite() -> String {
    fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("VERSION_CODENAME=")
                    .map(|v| v.trim_matches('"').to_string())
            })
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "bookworm".into())
}

/// The Debian mirror the host's apt uses.
fn host_mirror() -> String {
    let mut texts = vec![fs::read_to_string("/etc/apt/sources.list").unwrap_or_default()];
    if let Ok(entries) = fs::read_dir("/etc/apt/sources.list.d") {
        texts.extend(entries.flatten().filter_map(|e| fs::read_to_string(e.path()).ok()));
    }
    for text in texts {
        for line in text.lines().map(str::trim).filter(|l| !l.starts_with('#')) {
            let url = line.strip_prefix("URIs:").map(str::trim).or_else(|| {
                line.strip_prefix("deb ")
                    .and_then(|r| r.split_whitespace().find(|w| w.starts_with("http")))
            });
            if let Some(url) = url.and_then(|u| u.split_whitespace().next()) {
                let debian = url.trim_end_matches('/').ends_with("/debian") || url.contains("debian.org/debian");
                if url.starts_with("http") && debian && !url.contains("security") {
                    return url.to_string();
                }
            }
        }
    }
    "http://deb.debian.org/debian".into()
}

pub use tempfile_dir::ScratchDir;

/// A scratch directory under `$CAIRN_HOME/tmp`, removed on drop, named
/// `<writer>-<ms>-<n>` after the process that owns it (`<pid>+<start time>`,
/// see `cairn_store::process`), so `cairn gc` removes it only once that
/// process is dead.
mod tempfile_dir {
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicU64, Ordering};

    use cairn_store::process::WriterId;

    #[derive(Debug)]
    pub struct ScratchDir(PathBuf);

    impl ScratchDir {
        pub fn new(parent: &Path) -> std::io::Result<ScratchDir> {
            static NEXT: AtomicU64 = AtomicU64::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let dir = parent.join(format!("{}-{}-{n}", WriterId::current(), crate::now_ms()));
            std::fs::create_dir_all(&dir)?;
            Ok(ScratchDir(dir))
        }
        /// A scratch directory at `dir` (created if missing), removed when
        /// dropped like the others.
        pub fn at(dir: PathBuf) -> std::io::Result<ScratchDir> {
            std::fs::create_dir_all(&dir)?;
            Ok(ScratchDir(dir))
        }
        pub fn path(&self) -> &Path {
            &self.0
        }
        /// Moves the directory to `to` (same file system) and keeps it.
        pub fn persist(self, to: &Path) -> std::io::Result<()> {
            std::fs::rename(&self.0, to)?;
            std::mem::forget(self);
            Ok(())
        }
    }

    impl Drop for ScratchDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_code_interpreter_serves_where_the_gateway_waits() {
        let port = format!(" {CODE_INTERPRETER_PORT}");
        assert!(CODE_INTERPRETER_COMMAND.ends_with(&port), "{CODE_INTERPRETER_COMMAND}");
        assert!(CODE_INTERPRETER_COMMAND.contains(&format!("/{CODE_INTERPRETER_PATH}")));
    }

    #[test]
    fn image_names_are_checked() {
        assert!(valid_image_name("busybox"));
        assert!(valid_image_name("deb-12.1_x"));
        assert!(!valid_image_name("Busybox"));
        assert!(!valid_image_name("-x"));
        assert!(!valid_image_name("a/b"));
        assert!(!valid_image_name(""));
    }

    #[test]
    fn static_and_dynamic_executables_are_told_apart() {
        assert!(!is_static_elf(Path::new("/bin/sh")));
        assert!(!is_static_elf(Path::new("/etc/passwd")));
    }
}

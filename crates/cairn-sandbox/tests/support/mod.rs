//! Test support: a busybox root file system built once per host, and a
//! native sandbox on it.

#![allow(dead_code)]

pub mod file_attacks;
pub mod sockets;

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;

use cairn_protocol::ExecRequest;
use cairn_sandbox::client::InitClient;
use cairn_sandbox::native::NativeDriver;
use cairn_sandbox::{init_binary, Driver, Limits, SandboxProcess, SandboxSpec};

/// Says loudly that a test is skipped, and why; under CI (`CI=true`) a
/// missing part fails the test instead.
pub fn skipped(message: &str) {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{message} (CI=true: a missing part fails the test)");
    }
    eprintln!("SKIPPED {message}");
}

/// Compiles `tests/support/<name>.c` statically into `dir` (so that it
/// runs in any sandbox); None (and says why) without a C compiler, which
/// fails the test under CI=true.
pub fn compile(name: &str, dir: &Path) -> Option<PathBuf> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/support/{name}.c"));
    let binary = dir.join(name);
    let install = "install a C compiler and a static libc: apt-get install gcc libc6-dev";
    let why = match Command::new("cc")
        .args(["-static", "-O1", "-pthread", "-o"])
        .arg(&binary)
        .arg(&source)
        .output()
    {
        Ok(out) if out.status.success() => return Some(binary),
        Ok(out) => format!(
            "cc -static failed ({install}):\n{}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => format!("cannot run cc ({e}); {install}"),
    };
    skipped(&why);
    None
}

/// A root with a static busybox and its applet links: `/bin/busybox` when
/// the host's is static, else the `busybox-static` Debian package fetched
/// with `apt-get download`. Built once under the temp directory.
pub fn busybox_root() -> Result<PathBuf, String> {
    let root = std::env::temp_dir().join(format!("cairn-test-busybox-{}", nix::unistd::getuid()));
    if root.join("bin/busybox").is_file() {
        return Ok(root);
    }
    let work = tempfile::tempdir().map_err(|e| e.to_string())?;
    let staged = work.path().join("root");
    fs::create_dir_all(staged.join("bin")).map_err(|e| e.to_string())?;
    if host_busybox_is_static() {
        fs::copy("/bin/busybox", staged.join("bin/busybox")).map_err(|e| e.to_string())?;
    } else {
        let ok = Command::new("apt-get")
            .args(["download", "busybox-static"])
            .current_dir(work.path())
            .status()
            .map_err(|e| format!("apt-get: {e}"))?
            .success();
        let deb = fs::read_dir(work.path())
            .map_err(|e| e.to_string())?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "deb"))
            .filter(|_| ok)
            .ok_or("`apt-get download busybox-static` failed; no busybox root for the test")?;
        let unpacked = work.path().join("pkg");
        let ok = Command::new("dpkg-deb")
            .arg("-x")
            .arg(&deb)
            .arg(&unpacked)
            .status()
            .map_err(|e| format!("dpkg-deb: {e}"))?
            .success();
        if !ok {
            return Err("dpkg-deb -x failed on the busybox package".into());
        }
        fs::copy(unpacked.join("bin/busybox"), staged.join("bin/busybox")).map_err(|e| e.to_string())?;
    }
    let list = Command::new(staged.join("bin/busybox"))
        .arg("--list-full")
        .output()
        .map_err(|e| format!("busybox --list-full: {e}"))?;
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        let link = staged.join(applet);
        if applet == "bin/busybox" || link.exists() {
            continue;
        }
        if let Some(parent) = link.parent() {
            fs::create_dir_all(parent).map_err(|e| e.to_string())?;
        }
        symlink("/bin/busybox", &link).map_err(|e| e.to_string())?;
    }
    for d in ["proc", "sys", "dev", "tmp", "root", "etc", "run"] {
        fs::create_dir_all(staged.join(d)).map_err(|e| e.to_string())?;
    }
    fs::write(staged.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").map_err(|e| e.to_string())?;
    // Another test process may have won the race; either copy is complete.
    match fs::rename(&staged, &root) {
        Ok(()) => Ok(root),
        Err(_) if root.join("bin/busybox").is_file() => Ok(root),
        Err(e) => Err(format!("install the busybox root at {}: {e}", root.display())),
    }
}

fn host_busybox_is_static() -> bool {
    let Ok(bytes) = fs::read("/bin/busybox") else {
        return false;
    };
    // A dynamic executable names its interpreter.
    !bytes.windows(b"ld-linux".len()).any(|w| w == b"ld-linux")
}

/// A running native sandbox on a busybox root, stopped on drop.
pub struct Native {
    pub driver: NativeDriver,
    pub spec: SandboxSpec,
    pub process: SandboxProcess,
    pub client: InitClient,
    _tmp: tempfile::TempDir,
}

impl Native {
    /// Starts one, or says why it cannot (then the test passes, loudly).
    pub fn start(test: &str) -> Option<Native> {
        Native::start_with(test, |driver| driver)
    }

    /// [`Native::start`] with a driver `configure` made (a test's own
    /// seccomp filter, say).
    pub fn start_with(test: &str, configure: impl FnOnce(NativeDriver) -> NativeDriver) -> Option<Native> {
        Native::start_after(test, configure, |_, _| {})
    }

    /// [`Native::start_with`], calling `before` with the driver and the
    /// init binary just before the sandbox starts.
    pub fn start_after(
        test: &str,
        configure: impl FnOnce(NativeDriver) -> NativeDriver,
        before: impl FnOnce(&NativeDriver, &std::path::Path),
    ) -> Option<Native> {
        Native::start_full(test, Limits::default(), configure, before)
    }

    /// [`Native::start`] under `limits`.
    pub fn start_limited(test: &str, limits: Limits) -> Option<Native> {
        Native::start_full(test, limits, |driver| driver, |_, _| {})
    }

    fn start_full(
        test: &str,
        limits: Limits,
        configure: impl FnOnce(NativeDriver) -> NativeDriver,
        before: impl FnOnce(&NativeDriver, &std::path::Path),
    ) -> Option<Native> {
        if !nix::unistd::geteuid().is_root() {
            skipped(&format!("{test}: the native driver test needs root"));
            return None;
        }
        let base = match busybox_root() {
            Ok(b) => b,
            Err(e) => {
                skipped(&format!("{test}: no busybox root: {e}"));
                return None;
            }
        };
        let tmp = tempfile::Builder::new().prefix("nvt").tempdir_in("/tmp").unwrap();
        // A scope per test: tests run in parallel, and a scope goes with its
        // last sandbox.
        let driver =
            configure(NativeDriver::new(&format!("native-test-{}-{test}", std::process::id()), tmp.path()).unwrap());
        let spec = SandboxSpec {
            id: format!("nvt{}{test}", std::process::id()),
            hostname: "native".into(),
            dir: tmp.path().join("s"),
            layers: vec![base],
            limits,
            init_binary: init_binary::install(&tmp.path().join("bin")).unwrap(),
            network: None,
        };
        std::fs::create_dir_all(&spec.dir).unwrap();
        before(&driver, &spec.init_binary);
        let process = driver.start(&spec).unwrap();
        let client = InitClient::new(spec.socket_path());
        Some(Native {
            driver,
            spec,
            process,
            client,
            _tmp: tmp,
        })
    }

    pub fn exec(&self, argv: &[&str], detach: bool) -> cairn_sandbox::client::ExecSession {
        self.client
            .exec(ExecRequest {
                argv: argv.iter().map(|a| a.to_string()).collect(),
                timeout_ms: Some(60_000),
                detach,
                ..ExecRequest::default()
            })
            .unwrap()
            .unwrap()
    }

    /// Runs a command to its end; returns its stdout.
    pub fn run(&self, argv: &[&str]) -> String {
        let mut out = Vec::new();
        self.exec(argv, false).wait(&mut out, &mut Vec::new()).unwrap();
        String::from_utf8(out).unwrap()
    }

    pub fn stop(&self) {
        self.driver.stop(&self.spec.id, Some(self.process)).unwrap();
    }
}

impl Drop for Native {
    fn drop(&mut self) {
        let _ = self.driver.stop(&self.spec.id, Some(self.process));
        // The test's scope goes with the cgroup its sandbox left pooled.
        self.driver.cgroups().drain_pool();
    }
}

//! Test support: a busybox root file system built once per host.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::PathBuf;
use std::process::Command;

/// Says loudly that a test is skipped, and why; under CI (`CI=true`) a
/// missing part fails the test instead.
#[allow(dead_code)]
pub fn skipped(message: &str) {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{message} (CI=true: a missing part fails the test)");
    }
    eprintln!("SKIPPED {message}");
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

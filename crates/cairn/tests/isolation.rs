//! End-to-end: what a sandboxed process can reach, tried as an attacker
//! inside the sandbox would: PID 1 and its control channel, host ids, the
//! host's paths and hardware, the state directory.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use cairn_protocol::{write_frame, ExitStatus, FromInit, PROTOCOL_VERSION};
use common::{skip, stderr, stdout, Home};

/// Host id of a native sandbox's root (its user namespace's map).
const SANDBOX_ROOT_ON_HOST: u32 = 0x7000_0000;

/// Compiles the C program `attacks/<name>.c` statically (so that it runs in
/// any image); None (after saying why) when no C compiler is here, which
/// fails the test under CI.
fn compile(name: &str, dir: &Path) -> Option<PathBuf> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/attacks/{name}.c"));
    let binary = dir.join(name);
    match Command::new("cc")
        .args(["-static", "-O1", "-o"])
        .arg(&binary)
        .arg(&source)
        .output()
    {
        Ok(out) if out.status.success() => Some(binary),
        result => {
            let why = match result {
                Ok(out) => String::from_utf8_lossy(&out.stderr).into_owned(),
                Err(e) => e.to_string(),
            };
            common::skipped(&format!(
                "cannot compile {name}.c ({why}); apt-get install gcc libc6-dev"
            ));
            None
        }
    }
}

/// Waits until the sandbox's log (background output) has a line ending the
/// attacker's attempts.
fn attacker_report(home: &Home, id: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = stdout(&home.cairn(&["logs", id]));
        if log.contains("took the socket") || log.contains("no socket") || Instant::now() > deadline {
            return log;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_process_in_the_sandbox_cannot_take_over_init_or_forge_what_exec_reports() {
    if skip("a_process_in_the_sandbox_cannot_take_over_init_or_forge_what_exec_reports") {
        return;
    }
    let home = Home::new();
    let Some(attacker) = compile("takeover", home.path()) else {
        return;
    };
    // What the attacker answers in init's place: `false` "exited 0" and
    // printed "forged".
    let mut forged = Vec::new();
    for frame in [
        FromInit::Welcome {
            version: PROTOCOL_VERSION,
            init_pid: 1,
        },
        FromInit::Started { pid: 4242 },
        FromInit::Stdout(b"forged\n".to_vec()),
        FromInit::Exited(ExitStatus {
            code: Some(0),
            signal: None,
            timed_out: false,
        }),
    ] {
        write_frame(&mut forged, &frame).unwrap();
    }
    let frames = home.path().join("frames");
    std::fs::write(&frames, forged).unwrap();

    let id = home.ok(&["create"]);
    let target = format!("{id}:/tmp/");
    home.ok(&["cp", attacker.to_str().unwrap(), &target]);
    home.ok(&["cp", frames.to_str().unwrap(), &target]);
    home.ok(&["exec", "-d", &id, "--", "/tmp/takeover", "/tmp/frames"]);
    let report = attacker_report(&home, &id);
    assert!(
        report.contains("no socket"),
        "the attacker took init's socket:\n{report}"
    );
    for attempt in [
        "pidfd_getfd",
        "open_proc_fd",
        "ptrace_seize",
        "process_vm_readv",
        "kcmp",
        "open_proc_mem",
        "open_proc_environ",
    ] {
        let line = report
            .lines()
            .find(|l| l.starts_with(&format!("{attempt} ")))
            .unwrap_or_else(|| panic!("no {attempt} attempt in\n{report}"));
        assert!(!line.ends_with(" ok"), "{line}");
    }
    // Whatever the attacker still runs, every answer is init's.
    for _ in 0..20 {
        let out = home.cairn(&["exec", &id, "--", "false"]);
        assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
        assert_eq!(stdout(&out), "");
    }
    assert_eq!(home.ok(&["exec", &id, "--", "echo", "real"]), "real");
    home.ok(&["rm", "-f", &id]);
}

#[test]
fn sandbox_root_is_an_unprivileged_host_id_and_snapshots_keep_sandbox_ids() {
    if skip("sandbox_root_is_an_unprivileged_host_id_and_snapshots_keep_sandbox_ids") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    let map = home.ok(&["exec", &id, "--", "cat", "/proc/self/uid_map"]);
    let map: Vec<&str> = map.split_whitespace().collect();
    assert_eq!(map, ["0", &SANDBOX_ROOT_ON_HOST.to_string(), "65536"]);
    assert_eq!(home.ok(&["exec", &id, "--", "id", "-u"]), "0");
    // Files the sandbox writes belong on the host to its unprivileged ids.
    home.sh(&id, "echo x > /root-file; touch /user-file; chown 1000:1000 /user-file");
    let upper = home.path().join("sandboxes").join(&id).join("upper");
    let owner = |p: &Path| {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(p).unwrap();
        (m.uid(), m.gid())
    };
    let base = SANDBOX_ROOT_ON_HOST;
    assert_eq!(owner(&upper.join("root-file")), (base, base));
    assert_eq!(owner(&upper.join("user-file")), (base + 1000, base + 1000));
    // The image's files, owned by root in the layer, are root's inside.
    assert_eq!(
        home.ok(&["exec", &id, "--", "stat", "-c", "%u:%g", "/bin/busybox"]),
        "0:0"
    );
    // A snapshot records the ids the sandbox saw, and a restore shows them.
    let snap = home.ok(&["snapshot", &id]);
    let restored = home.ok(&["restore", &snap]);
    let ids = home.sh(&restored, "stat -c %u:%g /root-file /user-file");
    assert_eq!(ids, "0:0\n1000:1000");
    // Host root's own files stay out of the sandbox's reach, even where a
    // path to them exists (the state directory is not traversable).
    let out = home.cairn(&["exec", &id, "--", "cat", "/proc/1/root/etc/shadow"]);
    assert_ne!(out.status.code(), Some(0));
    home.ok(&["rm", "-f", &id, &restored]);
}

#[test]
fn the_sandbox_sees_no_host_path_or_firmware_and_its_root_is_nosuid_nodev() {
    if skip("the_sandbox_sees_no_host_path_or_firmware_and_its_root_is_nosuid_nodev") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    let mountinfo = home.ok(&["exec", &id, "--", "cat", "/proc/self/mountinfo"]);
    let home_path = home.path().to_str().unwrap();
    assert!(
        !mountinfo.contains(home_path),
        "the mount table shows the state directory:\n{mountinfo}"
    );
    let root = mount_options(&mountinfo, "/").unwrap_or_else(|| panic!("no root mount in\n{mountinfo}"));
    for flag in ["nosuid", "nodev"] {
        assert!(root.split(',').any(|o| o == flag), "root mount without {flag}: {root}");
    }
    // Host-wide knobs are read-only mounts of their own; kernel memory,
    // keys and timers read as empty.
    for path in [
        "/sys",
        "/proc/sys",
        "/proc/sysrq-trigger",
        "/proc/irq",
        "/proc/bus",
        "/proc/fs",
    ] {
        if !Path::new(path).exists() {
            continue;
        }
        let options =
            mount_options(&mountinfo, path).unwrap_or_else(|| panic!("{path} is not a mount of its own:\n{mountinfo}"));
        assert!(options.split(',').any(|o| o == "ro"), "{path} is writable: {options}");
    }
    for file in [
        "/proc/kcore",
        "/proc/keys",
        "/proc/timer_list",
        "/proc/sched_debug",
        "/proc/latency_stats",
    ] {
        if !Path::new(file).exists() {
            continue;
        }
        let size = home.sh(&id, &format!("wc -c < {file}"));
        assert_eq!(size, "0", "{file} shows the host's inside the sandbox");
    }
    // The host's hardware: firmware tables, power counters, ACPI and SCSI.
    for dir in [
        "/sys/firmware",
        "/sys/devices/virtual/powercap",
        "/proc/acpi",
        "/proc/scsi",
    ] {
        if !Path::new(dir).is_dir() {
            continue;
        }
        let listing = home.sh(&id, &format!("ls -A {dir} 2>/dev/null | wc -l"));
        assert_eq!(listing, "0", "{dir} is readable inside the sandbox");
    }
    home.ok(&["rm", "-f", &id]);
}

/// The mount options of the mount at `path` in `mountinfo`.
fn mount_options<'a>(mountinfo: &'a str, path: &str) -> Option<&'a str> {
    let fields = mountinfo
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.get(4) == Some(&path))?;
    fields.get(5).copied()
}

#[test]
fn the_state_directory_is_private_to_root() {
    if skip("the_state_directory_is_private_to_root") {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let home = Home::new();
    let id = home.ok(&["create"]);
    home.sh(&id, "echo x > /f");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    // A state directory made by Cairn, and one made open beforehand.
    for open in [false, true] {
        let fresh = home.path().join(format!("fresh-{open}"));
        if open {
            std::fs::create_dir(&fresh).unwrap();
            std::fs::set_permissions(&fresh, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let out = Command::new(common::CAIRN)
            .arg("ps")
            .env("CAIRN_HOME", &fresh)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(mode(&fresh), 0o700, "{}", fresh.display());
    }
    for entry in ["state.db", "sandboxes"] {
        let p = home.path().join(entry);
        assert_eq!(mode(&p) & 0o077, 0, "{} is open to other users", p.display());
    }
    home.ok(&["rm", "-f", &id]);
}

#[test]
fn an_image_whose_mount_points_are_symlinks_is_refused_clearly() {
    if skip("an_image_whose_mount_points_are_symlinks_is_refused_clearly") {
        return;
    }
    let home = Home::new();
    let busybox = home.busybox_layer();
    for (mount_point, target) in [("dev", "/"), ("proc", "/etc"), ("sys", "../../..")] {
        let dir = home.path().join(format!("evil-{mount_point}"));
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        std::fs::copy(busybox.join("bin/busybox"), dir.join("bin/busybox")).unwrap();
        std::os::unix::fs::symlink(target, dir.join(mount_point)).unwrap();
        let name = format!("evil-{mount_point}");
        home.ok(&["image", "import", dir.to_str().unwrap(), "--name", &name]);
        let out = home.cairn(&["create", "--image", &name]);
        assert_eq!(out.status.code(), Some(125), "{}", stderr(&out));
        assert!(
            stderr(&out).contains(&format!("the image's /{mount_point} is not a directory")),
            "{}",
            stderr(&out)
        );
    }
    assert!(home.ps().is_empty(), "a refused create left a sandbox");
    assert!(home.host_mounts().is_empty(), "a refused create left a mount");
}

#[test]
fn a_file_capability_set_inside_survives_a_snapshot_as_the_sandboxs_own() {
    if skip("a_file_capability_set_inside_survives_a_snapshot_as_the_sandboxs_own") {
        return;
    }
    let home = Home::new();
    let Some(tool) = compile("fcaps", home.path()) else {
        return;
    };
    let id = home.ok(&["create"]);
    home.ok(&["cp", tool.to_str().unwrap(), &format!("{id}:/bin/")]);
    home.sh(&id, "cp /bin/busybox /bin/server; /bin/fcaps set /bin/server");
    assert_eq!(home.sh(&id, "/bin/fcaps get /bin/server"), "rev 2 permitted 400");
    let snap = home.ok(&["snapshot", &id]);
    let restored = home.ok(&["restore", &snap]);
    assert_eq!(home.sh(&restored, "/bin/fcaps get /bin/server"), "rev 2 permitted 400");
    home.ok(&["rm", "-f", &id, &restored]);
}

/// Bytes a file takes on the host's disk (its allocated blocks).
fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map(|m| m.blocks() * 512).unwrap_or(0)
}

/// The sandbox's disk image on the host.
fn disk_image(home: &Home, id: &str) -> PathBuf {
    home.path().join("sandboxes").join(id).join("disk.img")
}

#[test]
fn a_sandbox_fills_its_own_disk_never_the_hosts_and_stays_usable() {
    if common::skip_without_disks("a_sandbox_fills_its_own_disk_never_the_hosts_and_stays_usable") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create", "--disk", "64M"]);
    let image = disk_image(&home, &id);
    assert!(image.is_file(), "no disk image at {}", image.display());
    // The disk is the host's mount; the sandbox's mount table still names
    // no host path.
    let mountinfo = home.ok(&["exec", &id, "--", "cat", "/proc/self/mountinfo"]);
    assert!(!mountinfo.contains(home.path().to_str().unwrap()), "{mountinfo}");
    // 200 MB onto a 64M disk: the write fails inside, and the host gives
    // the sandbox no more than the image's size.
    let out = home.cairn(&["exec", &id, "--", "sh", "-c", "dd if=/dev/zero of=/big bs=1M count=200"]);
    assert_ne!(out.status.code(), Some(0));
    assert!(stderr(&out).contains("No space left on device"), "{}", stderr(&out));
    let written: u64 = home.sh(&id, "wc -c < /big").parse().unwrap();
    let used = allocated(&image);
    eprintln!("wrote {written} bytes; the image takes {used} bytes on the host");
    assert!(written > 40 << 20, "only {written} bytes fit on a 64M disk");
    assert!(used <= 64 << 20, "a 64M disk takes {used} bytes of the host");
    // Full, it still runs commands, snapshots and frees files.
    assert_eq!(home.sh(&id, "echo alive"), "alive");
    let snap = home.ok(&["snapshot", &id]);
    home.sh(&id, "rm /big");
    home.sh(&id, "echo after > /after");
    // The file system gives deleted blocks back to the host (at its
    // journal's next commit, within seconds).
    let deadline = Instant::now() + Duration::from_secs(15);
    while allocated(&image) > 16 << 20 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        allocated(&image) <= 16 << 20,
        "the deleted file's blocks stayed taken on the host: {}",
        allocated(&image)
    );
    // A fork of it has its files and a disk of the same size.
    let fork = home.ok(&["fork", &id]);
    assert_eq!(home.sh(&fork, "cat /after"), "after");
    let ps = home.ps();
    let seen = ps.iter().find(|s| s["id"] == fork.as_str()).unwrap();
    assert_eq!(seen["disk_bytes"], 64 << 20, "{seen}");
    let out = home.cairn(&[
        "exec",
        &fork,
        "--",
        "sh",
        "-c",
        "dd if=/dev/zero of=/big2 bs=1M count=200",
    ]);
    assert!(stderr(&out).contains("No space left on device"), "{}", stderr(&out));
    assert!(allocated(&disk_image(&home, &fork)) <= 64 << 20);
    // A restore of the full snapshot gets the file back on a disk of its own.
    let restored = home.ok(&["restore", &snap, "--disk", "128M"]);
    let size: u64 = home.sh(&restored, "wc -c < /big").parse().unwrap();
    assert_eq!(size, written);
    // Removal unmounts every disk and deletes its image.
    for sandbox in [&id, &fork, &restored] {
        home.ok(&["rm", "-f", sandbox]);
    }
    assert!(home.host_mounts().is_empty(), "{:?}", home.host_mounts());
    assert_eq!(std::fs::read_dir(home.path().join("sandboxes")).unwrap().count(), 0);
}

#[test]
fn a_disk_left_mounted_by_a_crash_is_cleaned_by_gc() {
    if common::skip_without_disks("a_disk_left_mounted_by_a_crash_is_cleaned_by_gc") {
        return;
    }
    let home = Home::new();
    // A sandbox whose init was killed: its row says exited, its disk is
    // still mounted (a snapshot could read it).
    let id = home.ok(&["create", "--disk", "32M"]);
    let pid = common::init_pid(&home, &id);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while cairn_sandbox::pid_start_time(pid).is_some() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    // A directory no row accounts for, with a mounted disk: what a crash
    // between the mount and the row's removal would leave.
    let orphan = home.path().join("sandboxes").join("0123456789ab");
    std::fs::create_dir_all(orphan.join("disk")).unwrap();
    let image = orphan.join("disk.img");
    std::fs::File::create(&image).unwrap().set_len(16 << 20).unwrap();
    let mkfs = Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&image)
        .output()
        .unwrap();
    assert!(mkfs.status.success(), "{}", String::from_utf8_lossy(&mkfs.stderr));
    let mount = Command::new("mount")
        .args(["-o", "loop"])
        .arg(&image)
        .arg(orphan.join("disk"))
        .output()
        .unwrap();
    assert!(mount.status.success(), "{}", String::from_utf8_lossy(&mount.stderr));
    assert_eq!(home.host_mounts().len(), 2, "{:?}", home.host_mounts());
    let report: serde_json::Value = serde_json::from_str(&home.ok(&["gc", "--json"])).unwrap();
    assert!(
        report["sandboxes_removed"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v == id.as_str()),
        "{report}"
    );
    assert!(
        report["directories_removed"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v == "0123456789ab"),
        "{report}"
    );
    assert!(home.host_mounts().is_empty(), "{:?}", home.host_mounts());
    assert_eq!(std::fs::read_dir(home.path().join("sandboxes")).unwrap().count(), 0);
}

#[test]
fn filling_dev_shm_never_kills_init_and_exec_goes_on() {
    if skip("filling_dev_shm_never_kills_init_and_exec_goes_on") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create", "--memory", "64M"]);
    let pid = common::init_pid(&home, &id);
    // /dev/shm is half the memory limit: 200 MB end in ENOSPC.
    let out = home.cairn(&[
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "dd if=/dev/zero of=/dev/shm/fill bs=1M count=200",
    ]);
    assert!(
        stderr(&out).contains("No space left on device") || out.status.code() == Some(137),
        "{}",
        stderr(&out)
    );
    let shm: u64 = home.sh(&id, "wc -c < /dev/shm/fill").parse().unwrap();
    assert!(shm <= 32 << 20, "/dev/shm took {shm} bytes of a 64M sandbox");
    // With it full, a process that wants the rest is the OOM killer's
    // pick, never init.
    let out = home.cairn(&["exec", &id, "--", "sh", "-c", "x=aaaaaaaa; while true; do x=$x$x; done"]);
    assert_eq!(out.status.code(), Some(137), "{}", stderr(&out));
    assert!(stderr(&out).contains("killed by the OOM killer"), "{}", stderr(&out));
    assert_eq!(common::init_pid(&home, &id), pid);
    assert!(cairn_sandbox::pid_start_time(pid).is_some(), "init died");
    assert_eq!(home.sh(&id, "echo alive"), "alive");
    // Commands start with a higher score than init's (-1000 and 0 where
    // Cairn holds CAP_SYS_RESOURCE, else init's own and 1000).
    let init_score: i32 = std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let command_score: i32 = home.sh(&id, "cat /proc/self/oom_score_adj").parse().unwrap();
    assert!(
        command_score > init_score,
        "a command's oom_score_adj {command_score} is not above init's {init_score}"
    );
    // /dev itself holds no data.
    let out = home.cairn(&[
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "dd if=/dev/zero of=/dev/fill bs=1M count=8",
    ]);
    assert!(stderr(&out).contains("No space left on device"), "{}", stderr(&out));
    home.ok(&["rm", "-f", &id]);
}

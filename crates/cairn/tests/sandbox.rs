//! End-to-end: the sandbox lifecycle, the CLI contract, limits, isolation
//! and cleanup, on real namespaces, cgroups and overlay mounts.

mod common;

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{skip, stderr, stdout, Home};

#[test]
fn run_streams_output_and_exits_with_the_commands_status() {
    if skip("run_streams_output_and_exits_with_the_commands_status") {
        return;
    }
    let home = Home::new();
    let out = home.cairn(&["run", "--", "sh", "-c", "echo out; echo err >&2; exit 7"]);
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(stdout(&out), "out\n");
    assert!(stderr(&out).contains("err"));
    // Killed by a signal: 128 + N.
    let out = home.cairn(&["run", "--", "sh", "-c", "kill -TERM $$"]);
    assert_eq!(out.status.code(), Some(143));
}

#[test]
fn run_removes_its_sandbox_and_leaves_nothing_on_the_host() {
    if skip("run_removes_its_sandbox_and_leaves_nothing_on_the_host") {
        return;
    }
    let home = Home::new();
    let out = home.cairn(&["run", "--", "sh", "-c", "cat /proc/self/cgroup; hostname"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Its own cgroup namespace: the sandbox's cgroups are its roots.
    let seen = stdout(&out);
    let (cgroups, hostname) = seen.trim_end().rsplit_once('\n').unwrap();
    assert!(
        cgroups.lines().all(|l| l.ends_with(":/")),
        "the sandbox sees cgroup paths of the host:\n{cgroups}"
    );
    let host_name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert_ne!(hostname, host_name.trim(), "the sandbox has the host's hostname");
    assert!(home.ps().is_empty());
    assert!(home.host_mounts().is_empty());
    assert_eq!(std::fs::read_dir(home.path().join("sandboxes")).unwrap().count(), 0);
    assert!(
        home.sandbox_cgroups_left().is_empty(),
        "cgroups left: {:?}",
        home.sandbox_cgroups_left()
    );
    // What the scope still holds is the sandbox's emptied memory cgroup,
    // kept for the next sandbox (v1); gc removes it and the scope with it.
    assert_eq!(home.cgroups().pooled(), usize::from(home.cgroups().pools()));
    assert!(
        home.cgroup_scopes_after_gc().is_empty(),
        "scope cgroups left behind after gc: {:?}",
        home.cgroup_scopes_left()
    );
}

#[test]
fn bad_input_gets_a_clear_error_and_creates_nothing() {
    if skip("bad_input_gets_a_clear_error_and_creates_nothing") {
        return;
    }
    let home = Home::new();
    let out = home.cairn(&["run", "--image", "nosuchimage", "--", "true"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(
        stderr(&out).contains("no image named \"nosuchimage\""),
        "{}",
        stderr(&out)
    );

    // An unknown sandbox is Cairn's own failure, named in the message.
    let copied = home.path().join("copied");
    let copy_from = "feedfacecafe:/etc/passwd".to_string();
    for args in [
        vec!["exec", "feedfacecafe", "--", "true"],
        vec!["rm", "feedfacecafe"],
        vec!["rm", "-f", "feedfacecafe"],
        vec!["logs", "feedfacecafe"],
        vec!["cp", &copy_from, copied.to_str().unwrap()],
    ] {
        let out = home.cairn(&args);
        assert_eq!(out.status.code(), Some(125), "cairn {args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("no sandbox matches \"feedfacecafe\""),
            "cairn {args:?}: {}",
            stderr(&out)
        );
    }
    assert!(
        !copied.exists(),
        "a copy from an unknown sandbox wrote {}",
        copied.display()
    );

    let out = home.cairn(&["run", "--memory", "lots", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("512M"), "{}", stderr(&out));
    let out = home.cairn(&["create", "--cpus", "zero"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("invalid CPU count \"zero\"") && stderr(&out).contains("0.5"),
        "{}",
        stderr(&out)
    );

    let out = home.cairn(&["run", "--", "no-such-command", "arg"]);
    assert_eq!(out.status.code(), Some(127));
    assert!(
        stderr(&out).contains("no-such-command: command not found"),
        "{}",
        stderr(&out)
    );

    let out = home.cairn(&["create", "--name", "bad_name!"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(stderr(&out).contains("invalid sandbox name"), "{}", stderr(&out));

    assert!(home.ps().is_empty(), "a refused command left a sandbox");
    assert!(home.host_mounts().is_empty());
    assert_eq!(std::fs::read_dir(home.path().join("sandboxes")).unwrap().count(), 0);
    assert!(
        home.sandbox_cgroups_left().is_empty(),
        "a refused command left cgroups: {:?}",
        home.sandbox_cgroups_left()
    );
    assert!(
        home.cgroup_scopes_after_gc().is_empty(),
        "cgroups left after gc: {:?}",
        home.cgroup_scopes_left()
    );
}

#[test]
fn exceeding_the_memory_limit_is_an_oom_kill_reported_as_such() {
    if skip("exceeding_the_memory_limit_is_an_oom_kill_reported_as_such") {
        return;
    }
    let home = Home::new();
    let out = home.cairn(&[
        "run",
        "--memory",
        "32M",
        "--",
        "sh",
        "-c",
        "x=aaaaaaaa; while true; do x=$x$x; done",
    ]);
    assert_eq!(out.status.code(), Some(137));
    assert!(
        stderr(&out).contains("killed by the OOM killer (out of memory): the sandbox's memory limit is 32M"),
        "{}",
        stderr(&out)
    );
    // `ps` counts the kills of a running sandbox.
    let id = home.ok(&["create", "--memory", "32M"]);
    assert_eq!(home.ps()[0]["oom_kills"], 0);
    let out = home.cairn(&["exec", &id, "--", "sh", "-c", "x=aaaaaaaa; while true; do x=$x$x; done"]);
    assert_eq!(out.status.code(), Some(137));
    assert!(stderr(&out).contains("raise --memory"), "{}", stderr(&out));
    assert_eq!(home.ps()[0]["oom_kills"], 1);
    let table = home.ok(&["ps"]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    let row: Vec<&str> = table.lines().nth(1).unwrap().split_whitespace().collect();
    let oom = header.iter().position(|h| *h == "OOM").unwrap();
    assert_eq!(row[oom], "1", "{table}");
}

#[test]
fn a_fork_bomb_stops_at_the_pids_limit() {
    if skip("a_fork_bomb_stops_at_the_pids_limit") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create", "--pids", "32"]);
    // The shell gives up when fork fails; the command must end, not hang.
    let script = "i=0; while [ $i -lt 200 ]; do sleep 30 & i=$((i+1)); done";
    let out = home.cairn(&["exec", &id, "--", "sh", "-c", script]);
    assert_ne!(out.status.code(), Some(125), "{}", stderr(&out));
    let pids_dir = home
        .cgroup_dirs(&id)
        .into_iter()
        .find(|d| d.join("pids.events").exists())
        .unwrap();
    let events = std::fs::read_to_string(pids_dir.join("pids.events")).unwrap();
    let refused: u64 = events.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(refused > 0, "no fork was refused: {events}");
    for dir in home.cgroup_dirs(&id) {
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap();
        assert!(
            procs.lines().count() <= 32,
            "{} holds {} processes",
            dir.display(),
            procs.lines().count()
        );
    }
    home.ok(&["rm", "-f", &id]);
    assert!(home.cgroup_dirs(&id).iter().all(|d| !d.exists()));
}

#[test]
fn a_sandbox_sees_only_its_own_processes_network_and_files() {
    if skip("a_sandbox_sees_only_its_own_processes_network_and_files") {
        return;
    }
    let home = Home::new();
    let secret = home.path().join("host-secret");
    std::fs::write(&secret, "secret").unwrap();
    let id = home.ok(&["create", "--name", "iso"]);
    home.ok(&["exec", "-d", &id, "--", "sleep", "1000"]);

    // Processes: init, the sleeper, and the shell asking.
    let pids = home.sh(&id, "ls -d /proc/[0-9]* | wc -l; cat /proc/1/cmdline");
    let mut lines = pids.lines();
    let count: usize = lines.next().unwrap().trim().parse().unwrap();
    // init, the sleeper, the shell, and the ls and wc it forked.
    assert!(count <= 5, "the sandbox sees {count} processes");
    assert!(lines.next().unwrap().starts_with("cairn-init"));

    // Network: loopback only, and it is up.
    assert_eq!(home.ok(&["exec", &id, "--", "ls", "/sys/class/net"]), "lo");
    assert_eq!(home.ok(&["exec", &id, "--", "hostname"]), "iso");

    // Host files stay out of reach.
    let out = home.cairn(&["exec", &id, "--", "cat", secret.to_str().unwrap()]);
    assert_ne!(out.status.code(), Some(0));
    assert!(!stdout(&out).contains("secret"));

    // Writes land in the sandbox's upper directory only.
    home.sh(&id, "echo new > /etc/added; rm /bin/vi; mkdir -p /opt/x");
    let sandbox_dir = home.path().join("sandboxes").join(&id);
    assert_eq!(
        std::fs::read_to_string(sandbox_dir.join("upper/etc/added")).unwrap(),
        "new\n"
    );
    assert!(sandbox_dir.join("upper/opt/x").is_dir());
    let image = home.ok(&["image", "ls", "--json"]);
    let image: serde_json::Value = serde_json::from_str(&image).unwrap();
    let layer = home.path().join("layers").join(image[0]["layers"][0].as_str().unwrap());
    assert!(!layer.join("etc/added").exists());
    assert!(
        layer.join("bin/vi").exists(),
        "a delete inside the sandbox reached the image layer"
    );

    // No mounting, no kernel modules, no dangerous capabilities.
    let out = home.cairn(&["exec", &id, "--", "mount", "-t", "tmpfs", "none", "/mnt"]);
    assert_ne!(out.status.code(), Some(0));
    // Loading a module is refused by the kernel, not just absent from the caps.
    let out = home.cairn(&[
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "head -c 4096 /dev/zero > /tmp/m.ko; insmod /tmp/m.ko",
    ]);
    assert_ne!(out.status.code(), Some(0), "insmod worked inside the sandbox");
    assert!(stderr(&out).contains("Operation not permitted"), "{}", stderr(&out));
    let caps = home.ok(&["exec", &id, "--", "grep", "CapBnd", "/proc/self/status"]);
    let bnd = u64::from_str_radix(caps.split_whitespace().last().unwrap(), 16).unwrap();
    for (cap, bit) in [
        ("SYS_ADMIN", 21),
        ("SYS_MODULE", 16),
        ("SYS_TIME", 25),
        ("NET_ADMIN", 12),
        ("MKNOD", 27),
    ] {
        assert_eq!(bnd & (1 << bit), 0, "CAP_{cap} is in the bounding set");
    }
    let nnp = home.ok(&["exec", &id, "--", "grep", "NoNewPrivs", "/proc/self/status"]);
    assert!(nnp.ends_with('1'), "{nnp}");
    let seccomp = home.ok(&["exec", &id, "--", "grep", "^Seccomp:", "/proc/self/status"]);
    assert!(seccomp.ends_with('2'), "no seccomp filter: {seccomp}");
    let out = home.cairn(&["exec", &id, "--", "unshare", "-n", "true"]);
    assert_ne!(out.status.code(), Some(0), "unshare worked inside the sandbox");
    // Host-wide kernel knobs are read-only.
    let out = home.cairn(&["exec", &id, "--", "sh", "-c", "echo 1 > /proc/sys/vm/drop_caches"]);
    assert_ne!(out.status.code(), Some(0));
    assert!(home.host_mounts().is_empty(), "sandbox mounts leaked to the host");
}

#[test]
fn a_sandbox_outlives_the_cli_and_rm_leaves_no_mount_cgroup_or_process() {
    if skip("a_sandbox_outlives_the_cli_and_rm_leaves_no_mount_cgroup_or_process") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create", "--name", "keeper"]);
    let pid = home.ok(&["exec", "-d", "keeper", "--", "sleep", "1000"]);
    assert!(pid.parse::<i32>().is_ok());
    // The creating CLI is long gone; ps finds the sandbox and exec works.
    let ps = home.ps();
    assert_eq!(ps.len(), 1);
    assert_eq!(ps[0]["state"], "running");
    assert_eq!(ps[0]["name"], "keeper");
    let init_pid = ps[0]["pid"].as_i64().unwrap() as i32;
    assert_eq!(home.ok(&["exec", &id[..6], "--", "echo", "again"]), "again");
    assert_eq!(home.ok(&["ps", "-q"]), id);

    // rm without -f refuses a running sandbox and changes nothing.
    let out = home.cairn(&["rm", &id]);
    assert_eq!(out.status.code(), Some(125));
    assert!(stderr(&out).contains("cairn rm -f"), "{}", stderr(&out));
    assert_eq!(home.ps().len(), 1);

    assert_eq!(home.ok(&["rm", "-f", &id]), id);
    assert!(home.ps().is_empty());
    // Gone, or a zombie until the host's init reaps it.
    let state = std::fs::read_to_string(format!("/proc/{init_pid}/stat")).unwrap_or_default();
    let state = state.rsplit_once(") ").map(|(_, rest)| &rest[..1]).unwrap_or("gone");
    assert!(
        state == "gone" || state == "Z" || state == "X",
        "init survived rm (state {state})"
    );
    assert!(home.cgroup_dirs(&id).iter().all(|d| !d.exists()), "cgroups survived rm");
    assert!(home.host_mounts().is_empty());
    assert!(!home.path().join("sandboxes").join(&id).exists());
}

#[test]
fn gc_cleans_up_after_everything_was_killed() {
    if skip("gc_cleans_up_after_everything_was_killed") {
        return;
    }
    let home = Home::new();
    let a = home.ok(&["create"]);
    let b = home.ok(&["create"]);
    home.ok(&["exec", "-d", &a, "--", "sleep", "1000"]);
    // A `cairn run` whose CLI is killed mid-command.
    let mut run = home
        .command(&["run", "--", "sleep", "1000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while home.ps().len() < 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let ps = home.ps();
    assert_eq!(ps.len(), 3);
    let ids: Vec<String> = ps.iter().map(|s| s["id"].as_str().unwrap().to_string()).collect();
    run.kill().unwrap();
    run.wait().unwrap();
    // kill -9 every process of every sandbox.
    for id in &ids {
        for dir in home.cgroup_dirs(id) {
            if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
                for pid in procs.lines() {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid.parse().unwrap()),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    let out = home.ok(&["gc", "--json"]);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let removed: Vec<&str> = report["sandboxes_removed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    for id in &ids {
        assert!(removed.contains(&id.as_str()), "gc did not remove {id}: {out}");
        assert!(home.cgroup_dirs(id).iter().all(|d| !d.exists()), "cgroup of {id} left");
    }
    assert!(home.ps().is_empty());
    assert!(home.host_mounts().is_empty());
    assert_eq!(std::fs::read_dir(home.path().join("sandboxes")).unwrap().count(), 0);
    let _ = (a, b);
}

#[test]
fn exec_forwards_stdin_env_workdir_and_honours_timeouts() {
    if skip("exec_forwards_stdin_env_workdir_and_honours_timeouts") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    let mut child = home
        .command(&["exec", "-i", &id, "--", "sh", "-c", "tr a-z A-Z"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"hello sandbox\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(stdout(&out), "HELLO SANDBOX\n");

    let out = home.ok(&[
        "exec",
        "-e",
        "GREETING=hi there",
        "-w",
        "/etc",
        &id,
        "--",
        "sh",
        "-c",
        "echo $GREETING; pwd",
    ]);
    assert_eq!(out, "hi there\n/etc");
    let out = home.cairn(&["exec", "-w", "/nowhere", &id, "--", "true"]);
    assert_ne!(out.status.code(), Some(0));
    assert!(stderr(&out).contains("/nowhere does not exist"), "{}", stderr(&out));

    let started = Instant::now();
    let out = home.cairn(&["exec", "--timeout", "0.3", &id, "--", "sleep", "30"]);
    assert_eq!(out.status.code(), Some(124));
    assert!(started.elapsed() < Duration::from_secs(20));
    assert!(stderr(&out).contains("timed out"));
}

#[test]
fn detached_processes_keep_running_and_log_their_output() {
    if skip("detached_processes_keep_running_and_log_their_output") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    home.sh_detached(&id, "echo started; sleep 0.2; echo finished");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut logs = String::new();
    while !logs.contains("ended with status 0") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        logs = home.ok(&["logs", &id]);
    }
    assert!(logs.contains("started\nfinished\n"), "{logs}");
    assert!(logs.contains("ended with status 0"), "{logs}");
    assert_eq!(home.ok(&["logs", "--tail", "1", &id]).lines().count(), 1);
}

#[test]
fn files_copy_in_and_out_with_content_mode_and_mtime() {
    if skip("files_copy_in_and_out_with_content_mode_and_mtime") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("data.bin");
    let mut data = vec![0u8; 9 << 20];
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(2654435761).to_le_bytes()[3];
    }
    std::fs::write(&src, &data).unwrap();
    std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o750)).unwrap();
    home.ok(&["cp", src.to_str().unwrap(), &format!("{id}:/tmp/")]);
    let listing = home.ok(&["exec", &id, "--", "ls", "-l", "/tmp/data.bin"]);
    assert!(listing.starts_with("-rwxr-x---"), "{listing}");
    let back = work.path().join("back.bin");
    home.ok(&["cp", &format!("{id}:/tmp/data.bin"), back.to_str().unwrap()]);
    assert!(
        std::fs::read(&back).unwrap() == data,
        "content changed in the round trip"
    );
    let (a, b) = (std::fs::metadata(&src).unwrap(), std::fs::metadata(&back).unwrap());
    assert_eq!(b.permissions().mode() & 0o7777, 0o750);
    assert_eq!(a.modified().unwrap(), b.modified().unwrap());

    let out = home.cairn(&["cp", &format!("{id}:/no/such/file"), back.to_str().unwrap()]);
    assert_ne!(out.status.code(), Some(0));
    assert!(stderr(&out).contains("/no/such/file"), "{}", stderr(&out));
    assert_eq!(
        std::fs::read(&back).unwrap().len(),
        data.len(),
        "a failed copy clobbered the target"
    );
    let out = home.cairn(&["cp", src.to_str().unwrap(), &format!("{id}:/no/such/dir/f")]);
    assert_ne!(out.status.code(), Some(0));
    assert!(stderr(&out).contains("does not exist"), "{}", stderr(&out));
}

#[test]
fn a_file_copied_out_is_never_setuid_follows_the_umask_and_no_planted_link() {
    if skip("a_file_copied_out_is_never_setuid_follows_the_umask_and_no_planted_link") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    home.sh(&id, "echo copied > /tmp/s && chmod 6777 /tmp/s");
    let work = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let victim = elsewhere.path().join("victim");
    std::fs::write(&victim, "precious").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
    // A symlink at the destination itself, and one at the temporary name a
    // copy used to write through first (`.<name>.cairn-<pid>`): the shell
    // plants it under its own pid, then becomes cairn.
    let out = work.path().join("out");
    std::os::unix::fs::symlink(&victim, &out).unwrap();
    let copy = std::process::Command::new("sh")
        .current_dir(work.path())
        .env("CAIRN_HOME", home.path())
        .env_remove("CAIRN_STATE")
        .args([
            "-c",
            "umask 027; ln -s \"$0\" .out.cairn-$$; exec \"$1\" cp \"$2\" out",
            victim.to_str().unwrap(),
            common::CAIRN,
            &format!("{id}:/tmp/s"),
        ])
        .output()
        .unwrap();
    assert!(copy.status.success(), "{}", stderr(&copy));
    let md = std::fs::symlink_metadata(&out).unwrap();
    assert!(md.is_file(), "the destination is not a file of its own");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "copied\n");
    assert_eq!(
        md.permissions().mode() & 0o7777,
        0o750,
        "mode 6777 copied out under umask 027"
    );
    assert_eq!(
        std::fs::read_to_string(&victim).unwrap(),
        "precious",
        "a planted link was written through"
    );
    assert_eq!(std::fs::metadata(&victim).unwrap().permissions().mode() & 0o7777, 0o600);
    home.ok(&["rm", "-f", &id]);
}

#[test]
fn a_sandbox_whose_init_died_shows_as_exited_and_refuses_exec_clearly() {
    if skip("a_sandbox_whose_init_died_shows_as_exited_and_refuses_exec_clearly") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    let pid = home.ps()[0]["pid"].as_i64().unwrap() as i32;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while cairn_sandbox::pid_start_time(pid).is_some() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let ps = home.ps();
    assert_eq!(ps[0]["state"], "exited", "{ps:?}");
    assert_eq!(ps[0]["ended_reason"], "init exited");
    assert!(
        home.cgroup_dirs(&id).iter().all(|d| !d.exists()),
        "an exited sandbox keeps its cgroups"
    );
    let out = home.cairn(&["exec", &id, "--", "true"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(
        stderr(&out).contains("is exited (init exited), not running"),
        "{}",
        stderr(&out)
    );
    // Its files are still there to snapshot, and plain rm removes it.
    home.ok(&["snapshot", &id]);
    assert_eq!(home.ok(&["rm", &id]), id);
    assert!(home.ps().is_empty());
}

#[test]
fn the_default_image_is_built_on_first_use() {
    if skip("the_default_image_is_built_on_first_use") {
        return;
    }
    let home = Home::empty();
    assert_eq!(home.ok(&["image", "ls", "--json"]), "[]");
    let out = home.cairn(&["run", "--", "echo", "hi"]);
    if !out.status.success() && stderr(&out).contains("apt-get") {
        common::skipped(&format!(
            "the_default_image_is_built_on_first_use: busybox-static cannot be fetched here: {}",
            stderr(&out)
        ));
        return;
    }
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "hi\n");
    assert!(
        stderr(&out).contains("building the default busybox image"),
        "no progress on stderr: {}",
        stderr(&out)
    );
    let images: serde_json::Value = serde_json::from_str(&home.ok(&["image", "ls", "--json"])).unwrap();
    let names: Vec<&str> = images
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i["name"].as_str())
        .collect();
    assert_eq!(names, ["busybox"]);
    // Built once: the next run uses it as it is.
    let out = home.cairn(&["run", "--", "echo", "again"]);
    assert_eq!(stdout(&out), "again\n");
    assert!(!stderr(&out).contains("building"), "{}", stderr(&out));
}

#[test]
fn a_sandbox_has_its_own_namespaces_and_a_minimal_dev_fresh_proc_and_writable_tmp() {
    if skip("a_sandbox_has_its_own_namespaces_and_a_minimal_dev_fresh_proc_and_writable_tmp") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    let kinds = ["ipc", "cgroup", "uts", "net", "pid", "mnt"];
    let inside = home.sh(
        &id,
        "for n in ipc cgroup uts net pid mnt; do readlink /proc/self/ns/$n; done",
    );
    assert_eq!(inside.lines().count(), kinds.len(), "{inside}");
    for (kind, seen) in kinds.iter().zip(inside.lines()) {
        let host = std::fs::read_link(format!("/proc/self/ns/{kind}")).unwrap();
        assert!(seen.starts_with(&format!("{kind}:[")), "{seen}");
        assert_ne!(
            seen,
            host.to_str().unwrap(),
            "the sandbox shares the host's {kind} namespace"
        );
    }
    let cgroups = home.ok(&["exec", &id, "--", "cat", "/proc/self/cgroup"]);
    assert!(
        cgroups.lines().all(|l| l.ends_with(":/")),
        "the sandbox sees cgroup paths of the host:\n{cgroups}"
    );

    // /dev holds the usual nodes and nothing of the host's.
    let dev = home.ok(&["exec", &id, "--", "ls", "-A", "/dev"]);
    let dev: Vec<&str> = dev.split_whitespace().collect();
    assert_eq!(
        dev,
        ["fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty", "urandom", "zero"],
        "unexpected /dev"
    );
    let nodes = home.sh(
        &id,
        "for d in full null random tty urandom zero; do stat -c '%n %F %t:%T' /dev/$d; done",
    );
    assert_eq!(
        nodes,
        "/dev/full character special file 1:7\n/dev/null character special file 1:3\n\
         /dev/random character special file 1:8\n/dev/tty character special file 5:0\n\
         /dev/urandom character special file 1:9\n/dev/zero character special file 1:5"
    );
    assert_eq!(home.ok(&["exec", &id, "--", "ls", "-A", "/dev/pts"]), "ptmx");

    // /proc is the sandbox's own: its pid 1 is cairn-init.
    let proc_mount = home.sh(&id, "grep ' /proc ' /proc/mounts; tr '\\0' ' ' < /proc/1/cmdline");
    assert!(proc_mount.starts_with("proc /proc proc "), "{proc_mount}");
    assert!(
        proc_mount.lines().nth(1).unwrap().starts_with("cairn-init"),
        "{proc_mount}"
    );

    // /tmp is there for everyone, sticky, and takes writes.
    let tmp = home.sh(&id, "echo written > /tmp/probe && cat /tmp/probe && stat -c %a /tmp");
    assert_eq!(tmp, "written\n1777");
}

#[test]
fn limits_apply_to_the_cgroup_and_default_when_none_are_given() {
    if skip("limits_apply_to_the_cgroup_and_default_when_none_are_given") {
        return;
    }
    let home = Home::new();
    let v2 = home.cgroup_dirs("x").len() == 1;
    let cgroup_of = |id: &str| {
        if v2 {
            let (quota, period) = home
                .cgroup_file(id, "cpu.max")
                .split_once(' ')
                .map(|(q, p)| (q.to_string(), p.to_string()))
                .unwrap();
            (
                home.cgroup_file(id, "memory.max"),
                home.cgroup_file(id, "pids.max"),
                quota,
                period,
            )
        } else {
            (
                home.cgroup_file(id, "memory.limit_in_bytes"),
                home.cgroup_file(id, "pids.max"),
                home.cgroup_file(id, "cpu.cfs_quota_us"),
                home.cgroup_file(id, "cpu.cfs_period_us"),
            )
        }
    };
    let id = home.ok(&["create", "--cpus", "0.5", "--memory", "64M", "--pids", "100"]);
    let (memory, pids, quota, period) = cgroup_of(&id);
    assert_eq!(memory, (64u64 << 20).to_string());
    assert_eq!(pids, "100");
    assert_eq!((quota.as_str(), period.as_str()), ("50000", "100000"), "--cpus 0.5");

    // No flags: 1G of memory, 1024 processes, every core of the host.
    let id = home.ok(&["create"]);
    let (memory, pids, quota, period) = cgroup_of(&id);
    assert_eq!(memory, (1u64 << 30).to_string());
    assert_eq!(pids, "1024");
    let cores = std::thread::available_parallelism().unwrap().get() as u64;
    assert_eq!(period, "100000");
    assert_eq!(
        quota,
        (cores * 100_000).to_string(),
        "default CPU quota on {cores} cores"
    );
}

/// The state letter of every process in a sandbox, by pid.
fn process_states(home: &Home, id: &str) -> Vec<(String, char)> {
    home.sh(id, "for f in /proc/[0-9]*/stat; do cat $f 2>/dev/null; echo; done")
        .lines()
        .filter_map(|l| {
            let (pid, rest) = l.split_once(' ')?;
            let state = rest.rsplit_once(") ")?.1.chars().next()?;
            Some((pid.to_string(), state))
        })
        .collect()
}

#[test]
fn init_reaps_orphaned_zombies() {
    if skip("init_reaps_orphaned_zombies") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    // A parent that never waits: its children stay zombies while it lives.
    let parent = home.sh_detached(&id, "for i in 1 2 3 4 5; do true & done; exec sleep 1000");
    let mut zombies = 0;
    for _ in 0..200 {
        zombies = process_states(&home, &id).iter().filter(|(_, s)| *s == 'Z').count();
        if zombies == 5 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        zombies,
        5,
        "the setup made no zombies: {:?}",
        process_states(&home, &id)
    );
    // Its death hands the zombies to init, which must collect them.
    home.ok(&["exec", &id, "--", "kill", &parent]);
    let mut states = process_states(&home, &id);
    for _ in 0..200 {
        if states.iter().all(|(_, s)| *s != 'Z') {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
        states = process_states(&home, &id);
    }
    assert!(states.iter().all(|(_, s)| *s != 'Z'), "zombies left: {states:?}");
    assert!(
        !states.iter().any(|(pid, _)| *pid == parent),
        "the parent survived kill"
    );
}

/// Starts `cairn` with both output streams piped.
fn spawn_piped(home: &Home, args: &[&str]) -> std::process::Child {
    home.command(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// A script that prints `first` on `stream`, waits (at most 60s) for
/// /tmp/go, then prints `second` there, or `gave up` when it never came.
const SPEAK_WAIT_SPEAK: &str = "echo first >&$1; i=0; while [ ! -e /tmp/go ] && [ $i -lt 600 ]; do sleep 0.1; \
     i=$((i+1)); done; if [ -e /tmp/go ]; then echo second >&$1; else echo gave up >&$1; fi";

#[test]
fn output_is_streamed_while_the_command_runs() {
    if skip("output_is_streamed_while_the_command_runs") {
        return;
    }
    use std::io::{BufRead, BufReader, Read};
    let home = Home::new();
    // `cairn run`, stdout: the file appears only once the test saw the
    // first line, so output held back until exit would say `gave up`.
    let mut run = spawn_piped(&home, &["run", "--", "sh", "-c", SPEAK_WAIT_SPEAK, "sh", "1"]);
    let mut out = BufReader::new(run.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "first\n");
    let ps = home.ps();
    assert_eq!(ps.len(), 1, "the run ended before its first line was read: {ps:?}");
    home.ok(&["exec", ps[0]["id"].as_str().unwrap(), "--", "touch", "/tmp/go"]);
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    assert_eq!(rest, "second\n");
    assert!(run.wait().unwrap().success());

    // `cairn exec`, stderr.
    let id = home.ok(&["create"]);
    let mut exec = spawn_piped(&home, &["exec", &id, "--", "sh", "-c", SPEAK_WAIT_SPEAK, "sh", "2"]);
    let mut err = BufReader::new(exec.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    assert_eq!(line, "first\n");
    home.ok(&["exec", &id, "--", "touch", "/tmp/go"]);
    let mut rest = String::new();
    err.read_to_string(&mut rest).unwrap();
    assert_eq!(rest, "second\n");
    assert!(exec.wait().unwrap().success());
}

#[test]
fn signals_to_the_exec_cli_reach_the_command() {
    if skip("signals_to_the_exec_cli_reach_the_command") {
        return;
    }
    use nix::sys::signal::{kill, Signal};
    use std::io::{BufRead, BufReader};
    let home = Home::new();
    let id = home.ok(&["create"]);
    for (signal, code) in [(Signal::SIGTERM, 143), (Signal::SIGINT, 130), (Signal::SIGHUP, 129)] {
        let mut exec = spawn_piped(&home, &["exec", &id, "--", "sh", "-c", "echo ready; exec sleep 300"]);
        let mut line = String::new();
        BufReader::new(exec.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line, "ready\n");
        kill(nix::unistd::Pid::from_raw(exec.id() as i32), signal).unwrap();
        let status = exec.wait().unwrap();
        assert_eq!(status.code(), Some(code), "after {signal}: {status}");
    }
    let left = home.ok(&["exec", &id, "--", "ps"]);
    assert!(!left.contains("sleep 300"), "a signalled command lives on:\n{left}");
}

#[test]
fn a_service_that_cannot_start_leaves_no_sandbox_behind() {
    if skip("a_service_that_cannot_start_leaves_no_sandbox_behind") {
        return;
    }
    let home = Home::new();
    // An image without /bin/sh: no service can start in it.
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(root.path().join("etc")).unwrap();
    std::fs::write(root.path().join("etc/hostname"), "bare\n").unwrap();
    home.ok(&["image", "import", root.path().to_str().unwrap(), "--name", "bare"]);
    let out = home.cairn(&["create", "--image", "bare", "--service", "sleep 1000"]);
    assert_eq!(out.status.code(), Some(125), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("service \"sleep 1000\" did not start"),
        "{}",
        stderr(&out)
    );
    assert!(
        home.ps().is_empty(),
        "a sandbox whose service failed lives on: {:?}",
        home.ps()
    );
    assert!(home.host_mounts().is_empty());
    assert_eq!(std::fs::read_dir(home.path().join("sandboxes")).unwrap().count(), 0);
    assert!(
        home.sandbox_cgroups_left().is_empty(),
        "{:?}",
        home.sandbox_cgroups_left()
    );
    assert!(
        home.cgroup_scopes_after_gc().is_empty(),
        "{:?}",
        home.cgroup_scopes_left()
    );
}

#[test]
fn bench_exec_gives_the_round_trip_beside_its_parts_each_over_every_run() {
    if skip("bench_exec_gives_the_round_trip_beside_its_parts_each_over_every_run") {
        return;
    }
    let home = Home::new();
    let out = home.cairn(&["bench", "exec", "--runs", "5", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let figures: Vec<serde_json::Value> = serde_json::from_str(&stdout(&out)).unwrap();
    let figure = |prefix: &str| {
        figures
            .iter()
            .find(|f| f["name"].as_str().is_some_and(|n| n.starts_with(prefix)))
            .unwrap_or_else(|| panic!("no figure {prefix:?} in {figures:#?}"))
    };
    // The process alone is timed inside the sandbox by a copy of init: one
    // sample per run, each a real duration.
    for name in [
        "exec: round trip of `true`",
        "exec: a ping to init alone",
        "exec: `true` started as init starts it",
    ] {
        let f = figure(name);
        assert_eq!(f["runs"], 5, "{f}");
        assert!(f["median"].as_f64().unwrap() > 0.0, "{f}");
    }
    assert_eq!(figure("exec: round trip of `true`")["target"], 0.5);
}

//! The gVisor driver against the real runsc: start, exec and files through
//! init, memory checkpoints that processes continue from, divergent forks,
//! and a clean stop after the sentry was killed.
//!
//! Needs root and runsc; otherwise each test prints `SKIPPED: <reason>` and
//! passes.

mod support;

use std::cell::RefCell;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cairn_protocol::{ExecRequest, FileKind, FileMeta};
use cairn_sandbox::cgroup::Hierarchy;
use cairn_sandbox::client::InitClient;
use cairn_sandbox::gvisor::window::Window;
use cairn_sandbox::gvisor::{GvisorDriver, GvisorError, Recovery};
use cairn_sandbox::{init_binary, Driver, Limits, SandboxError, SandboxProcess, SandboxSpec};

struct Env {
    tmp: tempfile::TempDir,
    driver: GvisorDriver,
    init: PathBuf,
    base: PathBuf,
    started: RefCell<Vec<String>>,
}

impl Drop for Env {
    fn drop(&mut self) {
        for id in self.started.borrow().iter() {
            let _ = self.driver.stop(id, None);
        }
        // Stopped sandboxes' memory cgroups wait in the scope's pool.
        if let Ok(cgroups) = Hierarchy::detect("gvisor-test") {
            cgroups.drain_pool();
        }
    }
}

fn env() -> Option<Env> {
    if !nix::unistd::geteuid().is_root() {
        support::skipped("the gVisor driver tests need root (runsc, cgroups and mounts)");
        return None;
    }
    // Short paths: the init socket path must fit in 108 bytes.
    let tmp = tempfile::Builder::new().prefix("gvt").tempdir_in("/tmp").unwrap();
    let driver = match GvisorDriver::new(tmp.path().join("state"), "gvisor-test") {
        Ok(d) => d,
        Err(SandboxError::Gvisor(GvisorError::RunscMissing)) => {
            support::skipped("runsc (gVisor) is not installed; apt-get install runsc");
            return None;
        }
        Err(e) => panic!("cannot create the gVisor driver: {e}"),
    };
    let base = match support::busybox_root() {
        Ok(b) => b,
        Err(e) => {
            support::skipped(&format!("no busybox root: {e}"));
            return None;
        }
    };
    let init = init_binary::install(&tmp.path().join("bin")).unwrap();
    Some(Env {
        tmp,
        driver,
        init,
        base,
        started: RefCell::default(),
    })
}

impl Env {
    fn spec(&self, name: &str, layers: Vec<PathBuf>) -> SandboxSpec {
        let dir = self.tmp.path().join(name);
        fs::create_dir_all(&dir).unwrap();
        SandboxSpec {
            id: format!("gvt{}-{name}", std::process::id()),
            hostname: name.into(),
            dir,
            layers,
            limits: Limits::default(),
            init_binary: self.init.clone(),
            network: None,
        }
    }

    fn start(&self, spec: &SandboxSpec) -> InitClient {
        self.started.borrow_mut().push(spec.id.clone());
        self.driver
            .start(spec)
            .unwrap_or_else(|e| panic!("start {}: {e}", spec.id));
        self.driver.client(&spec.dir)
    }

    fn restore(&self, spec: &SandboxSpec, image: &Path) -> InitClient {
        self.started.borrow_mut().push(spec.id.clone());
        self.driver
            .restore(spec, image)
            .unwrap_or_else(|e| panic!("restore {}: {e}", spec.id));
        self.driver.client(&spec.dir)
    }

    /// Asserts that nothing of sandbox `spec` is left on the host.
    fn assert_nothing_left(&self, spec: &SandboxSpec) {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let dir = spec.dir.to_str().unwrap();
        assert!(!mountinfo.contains(dir), "a mount under {dir} is left:\n{mountinfo}");
        // runsc's processes name their state directory, which names the id.
        let marker = format!("/{}/runsc", spec.id);
        let procs: Vec<String> = fs::read_dir("/proc")
            .unwrap()
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().chars().all(|c| c.is_ascii_digit()))
            .filter_map(|e| fs::read(e.path().join("cmdline")).ok())
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
            .filter(|c| c.contains(&marker))
            .collect();
        assert!(procs.is_empty(), "processes of {} are left: {procs:?}", spec.id);
        for d in Hierarchy::detect("gvisor-test").unwrap().dirs(&spec.id) {
            assert!(!d.exists(), "cgroup {} is left", d.display());
        }
        assert!(
            !self.driver.leftovers().contains(&spec.id),
            "the driver still lists {} as a leftover",
            spec.id
        );
    }
}

/// Runs `script` with `sh -c` and returns its exit code and stdout.
fn sh(client: &InitClient, script: &str) -> (Option<i32>, String) {
    let session = client
        .exec(ExecRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            env: vec![],
            cwd: None,
            stdin: false,
            timeout_ms: Some(20_000),
            detach: false,
            user: None,
        })
        .unwrap()
        .unwrap_or_else(|f| panic!("spawn failed: {f:?}"));
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let status = session.wait(&mut out, &mut err).unwrap().unwrap();
    assert!(
        err.is_empty(),
        "stderr of {script:?}: {}",
        String::from_utf8_lossy(&err)
    );
    (status.code, String::from_utf8(out).unwrap())
}

fn detach(client: &InitClient, script: &str) {
    client
        .exec(ExecRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            env: vec![],
            cwd: None,
            stdin: false,
            timeout_ms: None,
            detach: true,
            user: None,
        })
        .unwrap()
        .unwrap_or_else(|f| panic!("spawn failed: {f:?}"));
}

fn read_file(client: &InitClient, path: &str) -> String {
    let mut buf = Vec::new();
    client.get_file(path, &mut buf).unwrap();
    String::from_utf8(buf).unwrap()
}

/// A counter whose nonce exists only in the shell's memory; it writes
/// `<nonce> <count>` to `/root/count` ten times a second.
const COUNTER: &str = "n=$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \\n'); i=0; \
    while true; do i=$((i+1)); echo \"$n $i\" > /root/count.tmp; mv /root/count.tmp /root/count; sleep 0.1; done";

/// Waits until `/root/count` holds a count above `above`; returns (nonce, count).
fn count_above(client: &InitClient, above: u64) -> (String, u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, text) = sh(client, "cat /root/count 2>/dev/null || true");
        if let Some((nonce, n)) = text.trim().split_once(' ') {
            let n: u64 = n.parse().unwrap();
            if n > above {
                return (nonce.to_string(), n);
            }
        }
        assert!(Instant::now() < deadline, "the counter did not pass {above}: {text:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn now_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

fn fresh_entropy() -> Vec<u8> {
    let mut e = vec![0u8; 64];
    getrandom(&mut e);
    e
}

fn getrandom(buf: &mut [u8]) {
    use std::io::Read;
    fs::File::open("/dev/urandom").unwrap().read_exact(buf).unwrap();
}

#[test]
fn init_runs_commands_and_moves_files_inside_gvisor() {
    let Some(env) = env() else { return };
    let spec = env.spec("files", vec![env.base.clone()]);
    let client = env.start(&spec);

    let (code, out) = sh(&client, "echo hello from $(hostname)");
    assert_eq!(code, Some(0));
    assert_eq!(out, "hello from files\n");
    // Really gVisor: its kernel answers dmesg with its own boot story.
    let (_, dmesg) = sh(&client, "dmesg | head -1");
    assert!(dmesg.contains("gVisor"), "not running under gVisor: {dmesg:?}");

    // Init keeps CAP_SYS_ADMIN to remount /proc; commands must not get it.
    let (_, bounding) = sh(&client, "grep CapBnd /proc/self/status");
    let bounding = u64::from_str_radix(bounding.split_whitespace().nth(1).unwrap(), 16).unwrap();
    assert_eq!(bounding & (1 << 21), 0, "commands may use CAP_SYS_ADMIN: {bounding:x}");
    assert_ne!(bounding & (1 << 0), 0, "commands lost CAP_CHOWN: {bounding:x}");

    let content = b"some bytes\nfor the sandbox\n".repeat(5000);
    let meta = FileMeta {
        path: "/root/put.txt".into(),
        kind: FileKind::File,
        mode: 0o640,
        uid: 0,
        gid: 0,
        size: content.len() as u64,
        mtime_ns: 0,
    };
    client.put_file(meta, &mut content.as_slice()).unwrap();
    let (_, sum) = sh(&client, "wc -c < /root/put.txt");
    assert_eq!(sum.trim(), content.len().to_string());
    let mut back = Vec::new();
    client.get_file("/root/put.txt", &mut back).unwrap();
    assert_eq!(back, content);
    // Files land in the private upper directory on the host.
    assert_eq!(fs::read(spec.upper_dir().join("root/put.txt")).unwrap(), content);

    env.driver.stop(&spec.id, None).unwrap();
    env.assert_nothing_left(&spec);
    assert!(client.ping(Duration::from_secs(1)).is_err());
}

/// gVisor's own kernel answers the `*at` calls init lists and removes with.
#[test]
fn directories_are_listed_made_renamed_and_removed_inside_gvisor_without_following_symlinks() {
    let Some(env) = env() else { return };
    let spec = env.spec("tree", vec![env.base.clone()]);
    let client = env.start(&spec);
    let (code, _) = sh(
        &client,
        "mkdir -p /tmp/keep /tmp/t/a/b && echo precious > /tmp/keep/file && ln -s /tmp/keep /tmp/t/a/out && \
         echo x > /tmp/t/a/b/f",
    );
    assert_eq!(code, Some(0));

    let listing = client.list_dir("/tmp/t", 16, 100).unwrap();
    let paths: Vec<_> = listing.entries.iter().map(|e| e.meta.path.as_str()).collect();
    assert_eq!(paths, ["/tmp/t/a", "/tmp/t/a/b", "/tmp/t/a/b/f", "/tmp/t/a/out"]);
    assert_eq!(listing.entries[3].symlink_target.as_deref(), Some("/tmp/keep"));
    let listing = client.list_dir("/tmp/t", 1, 100).unwrap();
    assert_eq!(listing.entries.len(), 1);

    assert!(client.make_dir("/tmp/t/m/n", true).unwrap());
    assert!(!client.make_dir("/tmp/t/m/n", false).unwrap());
    client.rename("/tmp/t/m", "/tmp/t/renamed").unwrap();
    assert!(client.stat("/tmp/t/renamed/n").unwrap().is_some());

    client.remove("/tmp/t", true).unwrap();
    assert_eq!(client.stat("/tmp/t").unwrap(), None);
    assert_eq!(read_file(&client, "/tmp/keep/file"), "precious\n");
    env.driver.stop(&spec.id, None).unwrap();
}

/// The attacks on file operations, on gVisor's kernel, which may have no
/// `openat2` (init then walks each path name by name).
#[test]
fn file_operations_refuse_symlinks_special_files_and_inits_proc_inside_gvisor() {
    let Some(env) = env() else { return };
    let spec = env.spec("fileattacks", vec![env.base.clone()]);
    let client = env.start(&spec);
    support::file_attacks::symlinks_on_the_way_are_refused(&client);
    support::file_attacks::special_files_are_refused_by_name(&client);
    support::file_attacks::inits_own_proc_entries_are_refused(&client);
    env.driver.stop(&spec.id, None).unwrap();
}

#[test]
fn a_fifo_swapped_with_a_file_in_a_loop_never_hangs_a_download_inside_gvisor() {
    let Some(env) = env() else { return };
    let Some(helper) = support::compile("swap", env.tmp.path()) else {
        return;
    };
    let spec = env.spec("fiforace", vec![env.base.clone()]);
    let client = env.start(&spec);
    support::file_attacks::a_fifo_swapped_in_never_hangs_a_download(&client, &helper, 400);
    env.driver.stop(&spec.id, None).unwrap();
}

#[test]
fn only_tcp_udp_and_ping_sockets_are_made_inside_gvisor() {
    let Some(env) = env() else { return };
    let Some(program) = support::compile("sockets", env.tmp.path()) else {
        return;
    };
    let spec = env.spec("ipsockets", vec![env.base.clone()]);
    let client = env.start(&spec);
    let attempts = support::sockets::attempts(&client, &program);
    env.driver.stop(&spec.id, None).unwrap();
    // gVisor's network stack has no MPTCP, UDP-Lite or SCTP (EINVAL or
    // EPROTONOSUPPORT), and runsc leaves raw sockets out (EPERM).
    for &socket in support::sockets::REFUSED {
        assert_ne!(attempts[socket], 0, "{socket}: {attempts:?}");
    }
    for &socket in support::sockets::KEPT.iter().chain(support::sockets::PING) {
        assert_eq!(attempts[socket], 0, "{socket}: {attempts:?}");
    }
}

#[test]
fn a_restored_sandbox_continues_its_processes_from_memory_with_the_host_clock() {
    let Some(env) = env() else { return };
    let spec = env.spec("cont", vec![env.base.clone()]);
    let client = env.start(&spec);
    detach(&client, COUNTER);
    let (nonce, _) = count_above(&client, 5);

    let image = env.tmp.path().join("cont-image");
    let cp = env.driver.checkpoint(&spec.id, &image).unwrap();
    assert!(cp.image_bytes > 0);
    assert!(
        client.ping(Duration::from_secs(1)).is_err(),
        "the checkpointed sandbox still answers"
    );
    let at_checkpoint = fs::read_to_string(spec.upper_dir().join("root/count")).unwrap();
    let (saved_nonce, saved) = at_checkpoint.trim().split_once(' ').unwrap();
    let saved: u64 = saved.parse().unwrap();
    assert_eq!(saved_nonce, nonce);
    // Long enough that a clock restored from the image would be visibly off.
    std::thread::sleep(Duration::from_millis(1500));

    let client = env.restore(&spec, &image);
    client.restored(now_ns(), fresh_entropy()).unwrap();
    let (after_nonce, after) = count_above(&client, saved);
    assert_eq!(after_nonce, nonce, "the counter restarted instead of continuing");
    assert!(after <= saved + 50, "count jumped from {saved} to {after}");

    // /proc was remounted while quiescing; it still works.
    let (_, status) = sh(&client, "grep -c ^Pid: /proc/self/status");
    assert_eq!(status.trim(), "1");

    let (_, inside) = sh(&client, "date +%s");
    let inside: i64 = inside.trim().parse().unwrap();
    let host = (now_ns() / 1_000_000_000) as i64;
    assert!((inside - host).abs() <= 1, "sandbox clock {inside}, host {host}");

    env.driver.stop(&spec.id, None).unwrap();
    env.assert_nothing_left(&spec);
}

/// Checkpoints `spec` (running [`COUNTER`]) into `NAME-image` and freezes
/// its files as the layer `NAME-layer`, as the engine does; returns both
/// and the count the files held at the checkpoint.
fn checkpoint_as_layer(env: &Env, spec: &SandboxSpec, name: &str) -> (PathBuf, PathBuf, u64) {
    let image = env.tmp.path().join(format!("{name}-image"));
    env.driver.checkpoint(&spec.id, &image).unwrap();
    let layer = env.tmp.path().join(format!("{name}-layer"));
    copy_tree(&spec.upper_dir(), &layer);
    let saved: u64 = fs::read_to_string(layer.join("root/count"))
        .unwrap()
        .trim()
        .split_once(' ')
        .unwrap()
        .1
        .parse()
        .unwrap();
    (image, layer, saved)
}

#[test]
fn a_sandbox_prepared_ahead_restores_its_image_and_one_not_wanted_leaves_nothing() {
    let Some(env) = env() else { return };
    if !env.driver.restores_into_created() {
        // Debian 12's runsc: preparing is refused, saying so.
        let spec = env.spec("prep-old", vec![env.base.clone()]);
        let err = env.driver.prepare_restore(&spec, &spec.dir).unwrap_err();
        assert!(err.to_string().contains("restore without preparing"), "{err}");
        return;
    }
    let spec = env.spec("prep", vec![env.base.clone()]);
    let client = env.start(&spec);
    detach(&client, COUNTER);
    let (nonce, _) = count_above(&client, 3);
    let (image, layer, saved) = checkpoint_as_layer(&env, &spec, "prep");
    env.driver.stop(&spec.id, None).unwrap();

    // Prepared: runsc's processes wait in the sandbox's cgroup, init does
    // not answer, nothing counts.
    let warm = env.spec("prep-warm", vec![layer.clone(), env.base.clone()]);
    env.started.borrow_mut().push(warm.id.clone());
    let prepared = env.driver.prepare_restore(&warm, &image).unwrap();
    assert!(prepared.alive());
    let warm_client = env.driver.client(&warm.dir);
    assert!(
        warm_client.ping(Duration::from_millis(300)).is_err(),
        "a prepared sandbox answers"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !warm.upper_dir().join("root/count").exists(),
        "the prepared sandbox counted before its restore"
    );
    let restored = env.driver.restore_prepared(&warm, &image).unwrap();
    assert_eq!(
        restored, prepared,
        "the restore ran in another sandbox than the prepared one"
    );
    warm_client.restored(now_ns(), fresh_entropy()).unwrap();
    let (n, after) = count_above(&warm_client, saved);
    assert_eq!(n, nonce, "the prepared sandbox lost the checkpointed memory");
    assert!(after <= saved + 50, "count jumped from {saved} to {after}");
    env.driver.stop(&warm.id, None).unwrap();
    env.assert_nothing_left(&warm);

    // One prepared and never restored stops like any other.
    let unwanted = env.spec("prep-unwanted", vec![layer.clone(), env.base.clone()]);
    env.started.borrow_mut().push(unwanted.id.clone());
    env.driver.prepare_restore(&unwanted, &image).unwrap();
    env.driver.stop(&unwanted.id, None).unwrap();
    env.assert_nothing_left(&unwanted);

    // A restore into a sandbox that was never prepared fails and leaves nothing.
    let never = env.spec("prep-never", vec![layer, env.base.clone()]);
    assert!(env.driver.restore_prepared(&never, &image).is_err());
    env.assert_nothing_left(&never);
}

#[test]
fn two_restores_of_one_checkpoint_diverge_and_reseed() {
    let Some(env) = env() else { return };
    let spec = env.spec("orig", vec![env.base.clone()]);
    let client = env.start(&spec);
    detach(&client, COUNTER);
    let (nonce, _) = count_above(&client, 3);
    let (image, layer, saved) = checkpoint_as_layer(&env, &spec, "orig");

    let a = env.spec("fork-a", vec![layer.clone(), env.base.clone()]);
    let b = env.spec("fork-b", vec![layer.clone(), env.base.clone()]);
    let ca = env.restore(&a, &image);
    let cb = env.restore(&b, &image);
    for c in [&ca, &cb] {
        c.restored(now_ns(), fresh_entropy()).unwrap();
        let (n, _) = count_above(c, saved);
        assert_eq!(n, nonce, "a fork lost the checkpointed memory");
    }
    assert_eq!(sh(&ca, "echo a > /root/mine").0, Some(0));
    assert_eq!(sh(&cb, "echo b > /root/mine").0, Some(0));
    assert_eq!(read_file(&ca, "/root/mine"), "a\n");
    assert_eq!(read_file(&cb, "/root/mine"), "b\n");
    assert!(!layer.join("root/mine").exists(), "a fork wrote into the shared layer");

    let random = |c: &InitClient| sh(c, "head -c 16 /dev/urandom | od -An -tx1").1;
    let (ra, rb) = (random(&ca), random(&cb));
    assert_eq!(ra.split_whitespace().count(), 16);
    assert_ne!(ra, rb, "two forks produce the same random bytes");

    for s in [&spec, &a, &b] {
        env.driver.stop(&s.id, None).unwrap();
        env.assert_nothing_left(s);
    }
}

#[test]
fn stop_after_the_sentry_was_killed_leaves_nothing_behind() {
    let Some(env) = env() else { return };
    let spec = env.spec("killed", vec![env.base.clone()]);
    let process = env.driver.start(&spec).unwrap();
    env.started.borrow_mut().push(spec.id.clone());
    let client = env.driver.client(&spec.dir);
    detach(&client, "sleep 1000");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(process.pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while process.alive() {
        assert!(Instant::now() < deadline, "the sentry survived SIGKILL");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(env.driver.leftovers().contains(&spec.id));
    env.driver.stop(&spec.id, Some(process)).unwrap();
    env.assert_nothing_left(&spec);
    // Stopping again is harmless.
    env.driver.stop(&spec.id, Some(process)).unwrap();
}

#[test]
fn a_checkpoint_with_a_command_still_attached_is_refused_and_the_sandbox_keeps_serving() {
    let Some(env) = env() else { return };
    let spec = env.spec("busy", vec![env.base.clone()]);
    let client = env.start(&spec);
    let session = client
        .exec(ExecRequest {
            argv: vec!["/bin/sleep".into(), "60".into()],
            env: vec![],
            cwd: None,
            stdin: false,
            timeout_ms: None,
            detach: false,
            user: None,
        })
        .unwrap()
        .unwrap();
    let image = env.tmp.path().join("busy-image");
    let err = env.driver.checkpoint(&spec.id, &image).unwrap_err();
    assert!(
        matches!(err, GvisorError::Quiesce(_)) && err.to_string().contains("attached command"),
        "{err}"
    );
    let pid = session.pid;
    drop(session);
    // Init listens again and the sandbox is whole.
    let (code, out) = sh(&client, "echo still here");
    assert_eq!((code, out.as_str()), (Some(0), "still here\n"));
    // Once the command is gone, a checkpoint goes through and restores.
    client.kill(pid, 9).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match env.driver.checkpoint(&spec.id, &image) {
            Ok(_) => break,
            Err(e) if Instant::now() < deadline => eprintln!("retrying: {e}"),
            Err(e) => panic!("checkpoint after the command ended: {e}"),
        }
    }
    let client = env.restore(&spec, &image);
    let (code, out) = sh(&client, "echo restored");
    assert_eq!((code, out.as_str()), (Some(0), "restored\n"));
    env.driver.stop(&spec.id, None).unwrap();
    env.assert_nothing_left(&spec);
}

/// Copies `src` into `dst` with ownership, modes and times (`cp -a`), as the
/// engine's layer capture would freeze an upper directory.
pub fn copy_tree(src: &Path, dst: &Path) {
    let ok = std::process::Command::new("cp")
        .arg("-a")
        .arg(src)
        .arg(dst)
        .status()
        .expect("run cp")
        .success();
    assert!(ok, "cp -a {} {}", src.display(), dst.display());
}

/// A started counting sandbox, its process, and the count it reached.
fn counting(env: &Env, name: &str) -> (SandboxSpec, SandboxProcess, InitClient, String, u64) {
    let spec = env.spec(name, vec![env.base.clone()]);
    env.started.borrow_mut().push(spec.id.clone());
    let process = env.driver.start(&spec).unwrap();
    let client = env.driver.client(&spec.dir);
    detach(&client, COUNTER);
    let (nonce, at) = count_above(&client, 3);
    (spec, process, client, nonce, at)
}

#[test]
fn a_window_left_after_its_checkpoint_is_restored_from_its_complete_image() {
    let Some(env) = env() else { return };
    let (spec, process, client, nonce, at) = counting(&env, "wdone");
    // The owner dies right after `runsc checkpoint`: no sandbox runs.
    let w = Window::open(&spec.dir, &spec.id, Some(process)).unwrap();
    env.driver.checkpoint_in(&spec.id, &w).unwrap();
    assert!(
        w.is_complete(),
        "the checkpoint's shell did not mark the image complete"
    );
    assert_eq!(w.live_ops().unwrap(), vec![], "the checkpoint's shell is still running");
    let restored = match env.driver.recover(&spec, Some(process)).unwrap() {
        Recovery::Restored(p) => p,
        other => panic!("expected a restore from the image, got {other:?}"),
    };
    assert!(restored.alive() && restored != process);
    let (after_nonce, _) = count_above(&client, at);
    assert_eq!(after_nonce, nonce, "the counter restarted instead of continuing");
    env.driver.stop(&spec.id, None).unwrap();
    env.assert_nothing_left(&spec);
}

#[test]
fn a_window_left_after_its_restore_adopts_the_restored_sandbox() {
    let Some(env) = env() else { return };
    let (spec, process, client, nonce, at) = counting(&env, "wadopt");
    // The owner dies after the restore, before recording its process.
    let w = Window::open(&spec.dir, &spec.id, Some(process)).unwrap();
    env.driver.checkpoint_in(&spec.id, &w).unwrap();
    let restored = env.driver.restore_in(&spec, &w).unwrap();
    assert_eq!(
        w.read()
            .unwrap()
            .unwrap()
            .ops
            .iter()
            .map(|o| o.what.as_str())
            .collect::<Vec<_>>(),
        ["checkpoint", "restore"]
    );
    assert_eq!(
        env.driver.recover(&spec, Some(process)).unwrap(),
        Recovery::Adopted(restored)
    );
    // Recorded meanwhile: only the window was left.
    assert_eq!(env.driver.recover(&spec, Some(restored)).unwrap(), Recovery::Finished);
    let (after_nonce, _) = count_above(&client, at);
    assert_eq!(after_nonce, nonce);
    env.driver.stop(&spec.id, None).unwrap();
    env.assert_nothing_left(&spec);
}

#[test]
fn a_window_whose_checkpoint_never_stopped_the_sandbox_makes_its_init_listen_again() {
    let Some(env) = env() else { return };
    let (spec, process, client, nonce, at) = counting(&env, "wquiet");
    // The owner dies after init quiesced, before `runsc checkpoint`.
    let _w = Window::open(&spec.dir, &spec.id, Some(process)).unwrap();
    client.quiesce(Duration::from_secs(10)).unwrap();
    assert!(
        client.ping(Duration::from_millis(200)).is_err(),
        "a quiesced init still answers"
    );
    assert_eq!(env.driver.recover(&spec, Some(process)).unwrap(), Recovery::NotTaken);
    let (after_nonce, _) = count_above(&client, at);
    assert_eq!(after_nonce, nonce);
    env.driver.stop(&spec.id, None).unwrap();
    env.assert_nothing_left(&spec);
}

#[test]
fn a_window_without_a_complete_image_or_a_sandbox_is_lost_and_leaves_nothing() {
    let Some(env) = env() else { return };
    let (spec, process, _client, _, _) = counting(&env, "wlost");
    // An image written without the completion mark (as by a checkpoint
    // that did not finish): nothing trusts it.
    let w = Window::open(&spec.dir, &spec.id, Some(process)).unwrap();
    env.driver.checkpoint(&spec.id, &w.image_dir()).unwrap();
    assert!(!w.is_complete());
    match env.driver.recover(&spec, Some(process)).unwrap() {
        Recovery::Lost(reason) => assert!(reason.contains("not complete"), "{reason}"),
        other => panic!("expected the sandbox lost, got {other:?}"),
    }
    env.driver.stop(&spec.id, None).unwrap();
    env.assert_nothing_left(&spec);
}

#[test]
fn a_window_whose_restored_sandbox_died_is_lost_rather_than_restored_again() {
    let Some(env) = env() else { return };
    let (spec, process, _client, _, _) = counting(&env, "wdied");
    // The owner dies after the restore; the restored sandbox, which may
    // have written files since the image, dies too.
    let w = Window::open(&spec.dir, &spec.id, Some(process)).unwrap();
    env.driver.checkpoint_in(&spec.id, &w).unwrap();
    let restored = env.driver.restore_in(&spec, &w).unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(restored.pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while restored.alive() {
        assert!(Instant::now() < deadline, "the killed sandbox did not die");
        std::thread::sleep(Duration::from_millis(20));
    }
    match env.driver.recover(&spec, Some(process)).unwrap() {
        Recovery::Lost(reason) => assert!(reason.contains("died"), "{reason}"),
        other => panic!("expected the sandbox lost, got {other:?}"),
    }
    env.driver.stop(&spec.id, None).unwrap();
    env.assert_nothing_left(&spec);
}

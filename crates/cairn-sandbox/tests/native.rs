//! The native driver's init path (the listening socket passed on fd 3),
//! which shares cairn-init's accept loop with the gVisor driver, and the
//! protocol as a client sees it: ping, hello, signals, kill, and the file
//! tree operations (list, make a directory, rename, remove).
//!
//! Needs root; otherwise prints `SKIPPED: <reason>` and passes.

mod support;

use std::os::unix::net::UnixStream;
use std::time::Duration;

use cairn_protocol::{
    read_frame, write_frame, FileKind, FromInit, FsErrorKind, ToInit, LIST_ENTRIES_MAX, MAGIC, PROTOCOL_VERSION,
};
use cairn_sandbox::client::{ClientError, DirListing, FsFailure};
use cairn_sandbox::Driver;
use support::Native;

#[test]
fn a_native_sandbox_answers_and_refuses_to_quiesce() {
    let Some(sandbox) = Native::start("quiesce") else {
        return;
    };
    assert_eq!(sandbox.run(&["/bin/echo", "native"]), "native\n");
    // Init cannot reopen a socket it was handed, so it refuses and serves on.
    let err = sandbox.client.quiesce(Duration::from_secs(5)).unwrap_err();
    assert!(matches!(err, ClientError::Refused(_)), "{err}");
    assert_eq!(sandbox.run(&["/bin/echo", "native"]), "native\n");
    sandbox.stop();
    assert!(!sandbox.process.alive());
}

/// Whether process `pid` is alive and not yet reaped (a zombie counts as
/// gone: it only waits for its parent).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| !stat.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
        .unwrap_or(false)
}

/// A sandbox started by an init started ahead, after `meanwhile` was
/// given the waiting init's pid.
fn start_ahead(test: &str, meanwhile: impl FnOnce(u32)) -> Option<Native> {
    Native::start_after(
        test,
        |d| d,
        |driver, init| {
            driver.start_init_ahead(init);
            meanwhile(driver.waiting_init().expect("an init waits after start_init_ahead"));
        },
    )
}

fn signal(pid: u32, signal: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal).unwrap();
}

#[test]
fn an_init_started_ahead_becomes_the_sandbox_and_a_killed_one_is_replaced() {
    use nix::sys::signal::Signal::{SIGKILL, SIGSTOP};
    let mut ahead = None;
    let Some(sandbox) = start_ahead("ahead", |pid| ahead = Some(pid)) else {
        return;
    };
    let ahead = ahead.unwrap();
    assert_eq!(sandbox.run(&["/bin/echo", "ahead"]), "ahead\n");
    // The waiting init was the setup parent: it exited once PID 1 took
    // the setup.
    assert!(!alive(ahead), "the init started ahead is still running");
    assert_eq!(sandbox.driver.waiting_init(), None);
    sandbox.stop();

    // One killed while it waits, with the PID 1 it forked: nothing takes
    // the setup, nothing is reported, and the start uses a fresh one.
    let Some(sandbox) = start_ahead("ahead-killed", |pid| {
        let forked = forked_pid1(pid);
        signal(pid, SIGKILL);
        signal(forked, SIGKILL);
    }) else {
        return;
    };
    assert_eq!(sandbox.run(&["/bin/echo", "fresh"]), "fresh\n");
    sandbox.stop();

    // Its setup process alone killed while it waits: the PID 1 it forked
    // still takes the setup and becomes the sandbox.
    let mut pid1 = None;
    let Some(sandbox) = start_ahead("ahead-orphaned", |pid| {
        pid1 = Some(forked_pid1(pid));
        signal(pid, SIGKILL);
    }) else {
        return;
    };
    assert_eq!(sandbox.run(&["/bin/echo", "orphan"]), "orphan\n");
    assert_eq!(
        Some(sandbox.process.pid as u32),
        pid1,
        "the sandbox is not the PID 1 forked ahead"
    );
    sandbox.stop();

    // One stopped, then killed while the start waits for it: the PID 1 it
    // forked takes the setup and reports itself, and the start goes on.
    let Some(sandbox) = start_ahead("ahead-dies", |pid| {
        signal(pid, SIGSTOP);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), SIGKILL);
        });
    }) else {
        return;
    };
    assert_eq!(sandbox.run(&["/bin/echo", "again"]), "again\n");
    sandbox.stop();
}

#[test]
fn a_driver_that_keeps_an_init_waiting_has_a_new_one_after_each_start() {
    let mut first = None;
    let Some(sandbox) = Native::start_after(
        "keep-waiting",
        |d| d,
        |driver, init| {
            driver.keep_init_waiting(init);
            first = driver.waiting_init();
        },
    ) else {
        return;
    };
    let first = first.expect("an init waits once kept");
    let next = sandbox
        .driver
        .waiting_init()
        .expect("another init waits after the start");
    assert_ne!(first, next);
    assert!(alive(next) && !alive(first));
    assert_eq!(sandbox.run(&["/bin/echo", "kept"]), "kept\n");
    sandbox.stop();
    drop(sandbox);
    assert!(!alive(next), "the waiting init outlived its driver");
}

#[test]
fn an_init_started_ahead_and_never_used_is_gone_with_its_driver() {
    let Some(sandbox) = Native::start("ahead-unused") else {
        return;
    };
    sandbox.driver.start_init_ahead(&sandbox.spec.init_binary);
    let pid = sandbox.driver.waiting_init().unwrap();
    assert!(alive(pid));
    // It forks the sandbox's PID 1 while it waits; that one waits too.
    let forked = forked_pid1(pid);
    sandbox.stop();
    drop(sandbox);
    assert!(!alive(pid), "an unused init outlived its driver");
    // PID 1 goes with it: the host's end of the socket it waits on closed.
    assert!(gone(forked), "the PID 1 an unused init forked outlived it");
}

/// Waits up to ten seconds for `pid` to be gone; whether it is.
fn gone(pid: u32) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while alive(pid) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    !alive(pid)
}

#[test]
fn a_start_given_up_before_init_is_told_to_go_leaves_no_process() {
    let Some(sandbox) = Native::start("given-up") else {
        return;
    };
    let driver = &sandbox.driver;
    driver.start_init_ahead(&sandbox.spec.init_binary);
    let waiting = driver.waiting_init().unwrap();
    let pid1 = forked_pid1(waiting);
    let spec = cairn_sandbox::SandboxSpec {
        id: format!("{}b", sandbox.spec.id),
        dir: sandbox.spec.dir.with_file_name("given-up"),
        ..sandbox.spec.clone()
    };
    let starting = driver.start_begin(&spec, None).unwrap();
    // The setup process exits once PID 1 has the setup: PID 1 builds the
    // root and waits to be told that its cgroups exist.
    assert!(gone(waiting), "PID 1 never took its setup");
    assert!(alive(pid1));
    // The host goes without telling it (dropped, as by a crash): PID 1,
    // which has run nothing of the sandbox's, exits.
    drop(starting);
    assert!(gone(pid1), "PID 1 outlived a start given up before its go-ahead");
    driver.stop(&spec.id, None).unwrap();
    assert_eq!(sandbox.run(&["/bin/echo", "still"]), "still\n");
    sandbox.stop();
}

#[test]
fn an_init_started_first_is_taken_by_the_driver_of_its_binary_only() {
    let Some(sandbox) = Native::start("first") else {
        return;
    };
    let binary = &sandbox.spec.init_binary;
    let before = children(std::process::id());
    cairn_sandbox::native::start_init_first(binary);
    let first = children(std::process::id())
        .into_iter()
        .find(|pid| {
            !before.contains(pid) && std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|exe| &exe == binary)
        })
        .expect("start_init_first started no init");
    // A driver for another init binary leaves it alone and starts its own.
    let other = sandbox.spec.dir.with_file_name("other-bin");
    let other_init = cairn_sandbox::init_binary::install(&other).unwrap();
    let elsewhere =
        cairn_sandbox::native::NativeDriver::new(&format!("native-test-{}-first2", std::process::id()), &other)
            .unwrap();
    elsewhere.start_init_ahead(&other_init);
    assert_ne!(elsewhere.waiting_init(), Some(first));
    drop(elsewhere);
    assert!(alive(first), "another binary's driver took the init started first");
    // The driver of its binary takes it, and it becomes the next sandbox.
    sandbox.driver.start_init_ahead(binary);
    assert_eq!(sandbox.driver.waiting_init(), Some(first));
    let spec = cairn_sandbox::SandboxSpec {
        id: format!("{}b", sandbox.spec.id),
        dir: sandbox.spec.dir.with_file_name("first-b"),
        ..sandbox.spec.clone()
    };
    let process = sandbox.driver.start(&spec).unwrap();
    let client = cairn_sandbox::client::InitClient::new(spec.socket_path());
    client.ping(Duration::from_secs(10)).unwrap();
    assert!(gone(first), "the init started first did not hand over to its PID 1");
    sandbox.driver.stop(&spec.id, Some(process)).unwrap();
    sandbox.stop();
}

/// The PID 1 the waiting init `pid` forks (its one child besides the
/// short-lived holder of the user namespace), once it is there.
fn forked_pid1(pid: u32) -> u32 {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        // The namespace's holder exits at once; PID 1 waits for its setup.
        let kids = children(pid);
        if kids.len() == 1 {
            std::thread::sleep(Duration::from_millis(20));
            if children(pid) == kids {
                return kids[0];
            }
        }
        assert!(std::time::Instant::now() < deadline, "the waiting init forked no PID 1");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The live processes whose parent is `pid`.
fn children(pid: u32) -> Vec<u32> {
    let ppid = format!("PPid:\t{pid}\n");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| std::fs::read_to_string(format!("/proc/{p}/status")).is_ok_and(|s| s.contains(&ppid)))
        .filter(|&p| alive(p))
        .collect()
}

#[test]
fn a_running_native_sandbox_answers_ping_and_a_stopped_one_does_not() {
    let Some(sandbox) = Native::start("ping") else {
        return;
    };
    sandbox.client.ping(Duration::from_secs(10)).unwrap();
    sandbox.stop();
    let err = sandbox.client.ping(Duration::from_secs(10)).unwrap_err();
    assert!(matches!(err, ClientError::NotRunning(_)), "{err}");
}

/// Sends one hello on a fresh connection and returns init's answer.
fn answer_to_hello(socket: &std::path::Path, magic: u32, version: u16) -> FromInit {
    let mut stream = UnixStream::connect(socket).unwrap();
    write_frame(&mut stream, &ToInit::Hello { magic, version }).unwrap();
    read_frame(&mut stream).unwrap()
}

#[test]
fn init_refuses_a_hello_of_another_protocol_version_or_magic_clearly() {
    let Some(sandbox) = Native::start("hello") else {
        return;
    };
    let socket = sandbox.spec.socket_path();
    for version in [PROTOCOL_VERSION + 1, PROTOCOL_VERSION.wrapping_sub(1), u16::MAX] {
        match answer_to_hello(&socket, MAGIC, version) {
            FromInit::Error(msg) => {
                assert!(
                    msg.contains(&format!("protocol version {version} is not supported"))
                        && msg.contains(&format!("version {PROTOCOL_VERSION}")),
                    "{msg}"
                );
            }
            other => panic!("init accepted protocol version {version}: {other:?}"),
        }
    }
    match answer_to_hello(&socket, MAGIC ^ 1, PROTOCOL_VERSION) {
        FromInit::Error(msg) => assert!(msg.contains("bad magic"), "{msg}"),
        other => panic!("init accepted a bad magic: {other:?}"),
    }
    assert!(matches!(
        answer_to_hello(&socket, MAGIC, PROTOCOL_VERSION),
        FromInit::Welcome {
            version: PROTOCOL_VERSION,
            ..
        }
    ));
    // Refusals end only their own connection.
    sandbox.client.ping(Duration::from_secs(10)).unwrap();
}

#[test]
fn signals_and_kill_reach_processes_in_a_native_sandbox() {
    let Some(sandbox) = Native::start("signals") else {
        return;
    };
    // A signal on the process's own connection.
    let session = sandbox.exec(&["/bin/sleep", "300"], false);
    session.control().signal(libc::SIGTERM).unwrap();
    let status = session.wait(&mut Vec::new(), &mut Vec::new()).unwrap().unwrap();
    assert_eq!((status.code, status.signal), (None, Some(libc::SIGTERM)));

    // Kill by pid from another connection.
    let session = sandbox.exec(&["/bin/sleep", "300"], false);
    sandbox.client.kill(session.pid, libc::SIGKILL).unwrap();
    let status = session.wait(&mut Vec::new(), &mut Vec::new()).unwrap().unwrap();
    assert_eq!((status.code, status.signal), (None, Some(libc::SIGKILL)));

    // A detached process, which no connection follows.
    let pid = sandbox.exec(&["/bin/sleep", "300"], true).pid;
    assert!(sandbox.run(&["/bin/ps"]).contains("sleep 300"));
    sandbox.client.kill(pid, libc::SIGKILL).unwrap();
    let mut left = String::new();
    for _ in 0..200 {
        left = sandbox.run(&["/bin/ps"]);
        if !left.contains("sleep 300") {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!left.contains("sleep 300"), "kill left the process running:\n{left}");

    // Bad requests are refused with a reason.
    let err = sandbox.client.kill(999_999, libc::SIGTERM).unwrap_err();
    assert!(
        matches!(&err, ClientError::Refused(m) if m.contains("cannot signal process 999999")),
        "{err}"
    );
    let err = sandbox.client.kill(pid, 4096).unwrap_err();
    assert!(
        matches!(&err, ClientError::Refused(m) if m.contains("4096 is not a signal number")),
        "{err}"
    );
}

/// Runs a shell script in the sandbox; panics when it fails.
fn sh(sandbox: &Native, script: &str) {
    let mut err = Vec::new();
    let status = sandbox
        .exec(&["/bin/sh", "-ec", script], false)
        .wait(&mut Vec::new(), &mut err)
        .unwrap()
        .unwrap();
    assert_eq!(status.code, Some(0), "{script}: {}", String::from_utf8_lossy(&err));
}

fn fs_kind(err: ClientError) -> FsErrorKind {
    match err {
        ClientError::Fs(FsFailure { kind, .. }) => kind,
        other => panic!("expected a file operation error, got {other}"),
    }
}

fn paths(listing: &DirListing) -> Vec<&str> {
    listing.entries.iter().map(|e| e.meta.path.as_str()).collect()
}

#[test]
fn list_dir_shows_children_without_following_symlinks() {
    let Some(sandbox) = Native::start("listdir") else {
        return;
    };
    sh(
        &sandbox,
        "mkdir -p /tmp/t/a/b/c /tmp/outside/secret; printf hi > /tmp/t/a/f; chmod 640 /tmp/t/a/f; \
         ln -s /tmp/outside /tmp/t/out; ln -s a /tmp/t/a-link; mkfifo /tmp/t/fifo",
    );
    let client = &sandbox.client;

    let listing = client.list_dir("/tmp/t", 1, 100).unwrap();
    assert_eq!(
        paths(&listing),
        ["/tmp/t/a", "/tmp/t/a-link", "/tmp/t/fifo", "/tmp/t/out"]
    );
    assert!(!listing.truncated);
    let by_path = |l: &DirListing, p: &str| l.entries.iter().find(|e| e.meta.path == p).unwrap().clone();
    let out = by_path(&listing, "/tmp/t/out");
    assert_eq!(out.meta.kind, FileKind::Symlink);
    assert_eq!(out.symlink_target.as_deref(), Some("/tmp/outside"));
    assert_eq!(by_path(&listing, "/tmp/t/a-link").symlink_target.as_deref(), Some("a"));
    assert_eq!(by_path(&listing, "/tmp/t/a").meta.kind, FileKind::Dir);
    assert_eq!(by_path(&listing, "/tmp/t/fifo").meta.kind, FileKind::Other);

    // Deeper: the tree below the directory, never through the symlinks.
    let listing = client.list_dir("/tmp/t/", 16, 100).unwrap();
    assert_eq!(
        paths(&listing),
        [
            "/tmp/t/a",
            "/tmp/t/a-link",
            "/tmp/t/a/b",
            "/tmp/t/a/b/c",
            "/tmp/t/a/f",
            "/tmp/t/fifo",
            "/tmp/t/out"
        ]
    );
    let f = by_path(&listing, "/tmp/t/a/f");
    assert_eq!((f.meta.kind, f.meta.size, f.meta.mode), (FileKind::File, 2, 0o640));
    assert_eq!(f.symlink_target, None);
    assert_eq!(paths(&client.list_dir("/tmp/t", 2, 100).unwrap()).len(), 6);

    // The listed path itself is not followed either.
    assert_eq!(
        fs_kind(client.list_dir("/tmp/t/out", 1, 100).unwrap_err()),
        FsErrorKind::NotADirectory
    );
    assert_eq!(
        fs_kind(client.list_dir("/tmp/t/a/f", 1, 100).unwrap_err()),
        FsErrorKind::NotADirectory
    );
    assert_eq!(
        fs_kind(client.list_dir("/tmp/none", 1, 100).unwrap_err()),
        FsErrorKind::NotFound
    );
    assert_eq!(
        fs_kind(client.list_dir("tmp/t", 1, 100).unwrap_err()),
        FsErrorKind::Invalid
    );
    // The root lists like any directory.
    assert!(paths(&client.list_dir("/", 1, 100).unwrap()).contains(&"/tmp"));
}

#[test]
fn list_dir_stops_at_the_entry_cap_and_says_so() {
    let Some(sandbox) = Native::start("listcap") else {
        return;
    };
    sh(
        &sandbox,
        "mkdir -p /tmp/many/sub && cd /tmp/many && seq 1 10005 | xargs touch && touch sub/x",
    );
    let client = &sandbox.client;
    let listing = client.list_dir("/tmp/many", 1, LIST_ENTRIES_MAX).unwrap();
    assert_eq!(listing.entries.len(), LIST_ENTRIES_MAX as usize);
    assert!(listing.truncated);

    let listing = client.list_dir("/tmp/many", 1, 20).unwrap();
    assert_eq!(listing.entries.len(), 20);
    assert!(listing.truncated);

    // Exactly as many as allowed is complete.
    sh(&sandbox, "mkdir /tmp/few && cd /tmp/few && touch 1 2 3");
    let listing = client.list_dir("/tmp/few", 1, 3).unwrap();
    assert_eq!((listing.entries.len(), listing.truncated), (3, false));
    let listing = client.list_dir("/tmp/few", 1, 2).unwrap();
    assert_eq!((listing.entries.len(), listing.truncated), (2, true));

    // Asking past the cap is refused, not quietly cut.
    let err = client.list_dir("/tmp/many", 1, LIST_ENTRIES_MAX + 1).unwrap_err();
    assert_eq!(fs_kind(err), FsErrorKind::Invalid);
}

#[test]
fn remove_recursive_does_not_follow_a_symlink_out_of_the_tree() {
    let Some(sandbox) = Native::start("remove") else {
        return;
    };
    sh(
        &sandbox,
        "mkdir -p /tmp/keep/inner /tmp/doomed/sub/deeper && echo precious > /tmp/keep/file && \
         touch /tmp/keep/inner/x && ln -s /tmp/keep /tmp/doomed/sub/to-keep && \
         ln -s /tmp/keep/file /tmp/doomed/file-link && ln -s ../../keep /tmp/doomed/sub/deeper/rel && \
         echo x > /tmp/doomed/sub/deeper/f",
    );
    let client = &sandbox.client;

    // Without recursive a directory that is not empty stays.
    assert_eq!(
        fs_kind(client.remove("/tmp/doomed", false).unwrap_err()),
        FsErrorKind::NotEmpty
    );
    assert!(client.stat("/tmp/doomed/sub/deeper/f").unwrap().is_some());

    client.remove("/tmp/doomed", true).unwrap();
    assert_eq!(client.stat("/tmp/doomed").unwrap(), None);
    assert_eq!(sandbox.run(&["/bin/cat", "/tmp/keep/file"]), "precious\n");
    assert!(client.stat("/tmp/keep/inner/x").unwrap().is_some());

    // A symlink to a directory goes, not what it points to, with or without
    // recursive; so do a file and an empty directory.
    sh(
        &sandbox,
        "ln -s /tmp/keep /tmp/link1 && ln -s /tmp/keep /tmp/link2 && mkdir /tmp/empty",
    );
    client.remove("/tmp/link1", false).unwrap();
    // A trailing slash does not make it reach through the link (as `rm -r
    // link/` would).
    client.remove("/tmp/link2/", true).unwrap();
    client.remove("/tmp/keep/inner/x", false).unwrap();
    client.remove("/tmp/empty", false).unwrap();
    for gone in ["/tmp/link1", "/tmp/link2", "/tmp/keep/inner/x", "/tmp/empty"] {
        assert_eq!(client.stat(gone).unwrap(), None, "{gone}");
    }
    assert!(client.stat("/tmp/keep/file").unwrap().is_some());

    assert_eq!(
        fs_kind(client.remove("/tmp/none", true).unwrap_err()),
        FsErrorKind::NotFound
    );
    assert_eq!(fs_kind(client.remove("/", true).unwrap_err()), FsErrorKind::Invalid);
    assert_eq!(
        fs_kind(client.remove("tmp/keep", true).unwrap_err()),
        FsErrorKind::Invalid
    );
    // A mount inside the tree is not crossed.
    let err = client.remove("/proc", true).unwrap_err();
    assert!(
        matches!(&err, ClientError::Fs(f) if f.message.contains("mount point")),
        "{err}"
    );
    assert!(client.stat("/proc/self").unwrap().is_some());
}

#[test]
fn make_dir_makes_parents_on_request_and_reports_what_was_there() {
    let Some(sandbox) = Native::start("mkdir") else {
        return;
    };
    let client = &sandbox.client;
    assert_eq!(
        fs_kind(client.make_dir("/tmp/m/a/b", false).unwrap_err()),
        FsErrorKind::NotFound
    );
    assert!(client.make_dir("/tmp/m/a/b", true).unwrap());
    assert_eq!(client.stat("/tmp/m/a").unwrap().unwrap().kind, FileKind::Dir);
    assert!(!client.make_dir("/tmp/m/a/b", true).unwrap());
    assert!(!client.make_dir("/tmp/m/a/b/", false).unwrap());
    assert!(client.make_dir("/tmp/m/c", false).unwrap());

    sh(&sandbox, "echo x > /tmp/m/file && ln -s /tmp/m/a /tmp/m/link");
    assert_eq!(
        fs_kind(client.make_dir("/tmp/m/file", true).unwrap_err()),
        FsErrorKind::Exists
    );
    assert_eq!(
        fs_kind(client.make_dir("/tmp/m/link", false).unwrap_err()),
        FsErrorKind::Exists
    );
    assert_eq!(
        fs_kind(client.make_dir("/tmp/m/file/x/y", true).unwrap_err()),
        FsErrorKind::NotADirectory
    );
    assert_eq!(
        fs_kind(client.make_dir("/tmp/m/file/x", false).unwrap_err()),
        FsErrorKind::NotADirectory
    );
    assert_eq!(fs_kind(client.make_dir("m/d", true).unwrap_err()), FsErrorKind::Invalid);
}

#[test]
fn rename_moves_and_refuses_to_replace_a_directory_that_is_not_empty() {
    let Some(sandbox) = Native::start("rename") else {
        return;
    };
    sh(
        &sandbox,
        "mkdir -p /tmp/r/full /tmp/r/empty /tmp/r/src && echo one > /tmp/r/one && echo two > /tmp/r/two && \
         touch /tmp/r/full/x /tmp/r/src/y",
    );
    let client = &sandbox.client;
    client.rename("/tmp/r/one", "/tmp/r/moved").unwrap();
    assert_eq!(client.stat("/tmp/r/one").unwrap(), None);
    assert_eq!(sandbox.run(&["/bin/cat", "/tmp/r/moved"]), "one\n");
    // A file is replaced, as rename(2) does.
    client.rename("/tmp/r/moved", "/tmp/r/two").unwrap();
    assert_eq!(sandbox.run(&["/bin/cat", "/tmp/r/two"]), "one\n");

    assert_eq!(
        fs_kind(client.rename("/tmp/r/src", "/tmp/r/full").unwrap_err()),
        FsErrorKind::NotEmpty
    );
    assert!(client.stat("/tmp/r/full/x").unwrap().is_some());
    client.rename("/tmp/r/src", "/tmp/r/empty").unwrap();
    assert!(client.stat("/tmp/r/empty/y").unwrap().is_some());

    assert_eq!(
        fs_kind(client.rename("/tmp/r/empty", "/tmp/r/two").unwrap_err()),
        FsErrorKind::NotADirectory
    );
    assert_eq!(
        fs_kind(client.rename("/tmp/r/two", "/tmp/r/full").unwrap_err()),
        FsErrorKind::IsADirectory
    );
    assert_eq!(
        fs_kind(client.rename("/tmp/r/none", "/tmp/r/x").unwrap_err()),
        FsErrorKind::NotFound
    );
    assert_eq!(
        fs_kind(client.rename("/", "/tmp/r/x").unwrap_err()),
        FsErrorKind::Invalid
    );
}

#[test]
fn file_operations_refuse_a_symlink_on_the_way_and_touch_nothing_it_points_to() {
    let Some(sandbox) = Native::start("symlinks") else {
        return;
    };
    support::file_attacks::symlinks_on_the_way_are_refused(&sandbox.client);
}

#[test]
fn downloads_refuse_fifos_devices_and_directories_by_name() {
    let Some(sandbox) = Native::start("special") else {
        return;
    };
    support::file_attacks::special_files_are_refused_by_name(&sandbox.client);
}

#[test]
fn file_operations_never_reach_inits_own_proc_entries() {
    let Some(sandbox) = Native::start("initproc") else {
        return;
    };
    support::file_attacks::inits_own_proc_entries_are_refused(&sandbox.client);
}

#[test]
fn a_fifo_swapped_with_a_file_in_a_loop_never_hangs_a_download() {
    let Some(sandbox) = Native::start("fiforace") else {
        return;
    };
    let Some(helper) = support::compile("swap", sandbox.spec.dir.parent().unwrap()) else {
        return;
    };
    support::file_attacks::a_fifo_swapped_in_never_hangs_a_download(&sandbox.client, &helper, 400);
}

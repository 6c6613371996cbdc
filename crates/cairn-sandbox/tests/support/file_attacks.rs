//! Attacks on init's file operations from inside a sandbox, run on each
//! driver (native.rs, gvisor.rs): symbolic links planted on the way, init's
//! own /proc entries reached through them or named outright, and a FIFO
//! swapped with a regular file while the file is downloaded over and over.

use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cairn_protocol::{ExecRequest, FileKind, FileMeta, FsErrorKind};
use cairn_sandbox::client::{ClientError, FsFailure, InitClient};

/// Runs `script` with `sh -c` in the sandbox; its stdout. Panics when it
/// fails.
pub fn sh(client: &InitClient, script: &str) -> String {
    let session = client
        .exec(ExecRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            timeout_ms: Some(60_000),
            ..ExecRequest::default()
        })
        .unwrap()
        .unwrap_or_else(|f| panic!("spawn failed: {f:?}"));
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let status = session.wait(&mut out, &mut err).unwrap().unwrap();
    assert_eq!(status.code, Some(0), "{script}: {}", String::from_utf8_lossy(&err));
    String::from_utf8(out).unwrap()
}

/// The file operation's failure `err` must be, with `kind` and a message
/// containing `saying`.
#[track_caller]
pub fn assert_refused(err: ClientError, kind: FsErrorKind, saying: &str) {
    match err {
        ClientError::Fs(FsFailure { kind: k, message }) => {
            assert_eq!(k, kind, "{message}");
            assert!(message.contains(saying), "{message:?} does not say {saying:?}");
        }
        other => panic!("expected a refused file operation, got {other}"),
    }
}

fn put(client: &InitClient, path: &str, content: &[u8]) -> Result<u64, ClientError> {
    let meta = FileMeta {
        path: path.into(),
        kind: FileKind::File,
        mode: 0o755,
        uid: 0,
        gid: 0,
        size: content.len() as u64,
        mtime_ns: 0,
    };
    client.put_file(meta, &mut &content[..])
}

fn get(client: &InitClient, path: &str) -> Result<Vec<u8>, ClientError> {
    let mut out = Vec::new();
    client.get_file(path, &mut out).map(|_| out)
}

/// A link planted on the way is refused by every operation, which touches
/// nothing where it points; a link at the end is described, not followed.
pub fn symlinks_on_the_way_are_refused(client: &InitClient) {
    sh(
        client,
        "mkdir -p /tmp/real/sub && echo secret > /tmp/real/f && ln -s /tmp/real /tmp/link && \
         ln -s real/f /tmp/file-link && ln -s /proc/1 /tmp/p1",
    );
    const LINK: &str = "/tmp/link is a symbolic link";
    assert_refused(get(client, "/tmp/link/f").unwrap_err(), FsErrorKind::Invalid, LINK);
    assert_refused(client.stat("/tmp/link/f").unwrap_err(), FsErrorKind::Invalid, LINK);
    assert_refused(
        client.list_dir("/tmp/link/sub", 1, 10).unwrap_err(),
        FsErrorKind::Invalid,
        LINK,
    );
    assert_refused(
        put(client, "/tmp/link/planted", b"x").unwrap_err(),
        FsErrorKind::Invalid,
        LINK,
    );
    assert_refused(
        client.make_dir("/tmp/link/sub/made", true).unwrap_err(),
        FsErrorKind::Invalid,
        LINK,
    );
    assert_refused(
        client.rename("/tmp/link/f", "/tmp/moved").unwrap_err(),
        FsErrorKind::Invalid,
        LINK,
    );
    assert_refused(
        client.rename("/tmp/real/sub", "/tmp/link/sub2").unwrap_err(),
        FsErrorKind::Invalid,
        LINK,
    );
    assert_refused(
        client.remove("/tmp/link/f", false).unwrap_err(),
        FsErrorKind::Invalid,
        LINK,
    );
    // The confused deputy: init's memory map through a planted link.
    assert_refused(
        get(client, "/tmp/p1/maps").unwrap_err(),
        FsErrorKind::Invalid,
        "/tmp/p1 is a symbolic link",
    );
    assert_refused(
        client.list_dir("/tmp/p1/fd", 1, 10).unwrap_err(),
        FsErrorKind::Invalid,
        "/tmp/p1 is a symbolic link",
    );
    // Nothing happened where the links point.
    assert_eq!(
        sh(client, "ls -A /tmp/real; ls -A /tmp/real/sub; cat /tmp/real/f"),
        "f\nsub\nsecret\n"
    );
    // A link at the end: described by stat, refused by a download, and
    // replaced (not written through) by an upload.
    let meta = client.stat("/tmp/file-link").unwrap().unwrap();
    assert_eq!(meta.kind, FileKind::Symlink);
    assert_refused(
        get(client, "/tmp/file-link").unwrap_err(),
        FsErrorKind::Invalid,
        "/tmp/file-link is a symbolic link",
    );
    put(client, "/tmp/file-link", b"replaced\n").unwrap();
    assert_eq!(
        sh(
            client,
            "cat /tmp/real/f; cat /tmp/file-link; test -L /tmp/file-link || echo no-longer-a-link"
        ),
        "secret\nreplaced\nno-longer-a-link\n"
    );
    // `..` is taken as a name of the path, never through a link: the link
    // before it is not even looked at.
    assert_eq!(get(client, "/tmp/real/sub/../f").unwrap(), b"secret\n");
    assert_eq!(get(client, "/tmp/link/../real/f").unwrap(), b"secret\n");
    assert_eq!(get(client, "/../../tmp/real/f").unwrap(), b"secret\n");
}

/// FIFOs, devices and directories are refused by a download, at once and
/// naming what they are.
pub fn special_files_are_refused_by_name(client: &InitClient) {
    sh(client, "mkfifo /tmp/fifo");
    assert_refused(
        get(client, "/tmp/fifo").unwrap_err(),
        FsErrorKind::Invalid,
        "/tmp/fifo is a FIFO; only regular files can be downloaded",
    );
    assert_refused(
        get(client, "/dev/null").unwrap_err(),
        FsErrorKind::Invalid,
        "/dev/null is a character device",
    );
    assert_refused(
        get(client, "/tmp").unwrap_err(),
        FsErrorKind::IsADirectory,
        "/tmp is a directory",
    );
    assert_refused(
        get(client, "/tmp/none").unwrap_err(),
        FsErrorKind::NotFound,
        "/tmp/none",
    );
    assert_eq!(client.stat("/tmp/fifo").unwrap().unwrap().kind, FileKind::Other);
}

/// Init's own /proc entries (PID 1 and each of its threads) are refused by
/// every operation and left out of listings; other processes' are not.
pub fn inits_own_proc_entries_are_refused(client: &InitClient) {
    const OWN: &str = "is the /proc entry of the sandbox's init";
    let threads = sh(client, "ls /proc/1/task");
    let threads: Vec<&str> = threads.split_whitespace().collect();
    assert!(threads.contains(&"1"), "init's threads: {threads:?}");
    for tid in &threads {
        let entry = format!("/proc/{tid}");
        assert_refused(client.stat(&entry).unwrap_err(), FsErrorKind::PermissionDenied, OWN);
        for file in ["maps", "environ", "status"] {
            assert_refused(
                get(client, &format!("{entry}/{file}")).unwrap_err(),
                FsErrorKind::PermissionDenied,
                OWN,
            );
        }
        assert_refused(
            client.list_dir(&format!("{entry}/fd"), 1, 100).unwrap_err(),
            FsErrorKind::PermissionDenied,
            OWN,
        );
        assert_refused(
            client.list_dir(&format!("/proc/1/task/{tid}/fd"), 1, 100).unwrap_err(),
            FsErrorKind::PermissionDenied,
            OWN,
        );
    }
    assert_refused(
        put(client, "/proc/1/attr", b"x").unwrap_err(),
        FsErrorKind::PermissionDenied,
        OWN,
    );
    assert_refused(
        client.remove("/proc/1", false).unwrap_err(),
        FsErrorKind::PermissionDenied,
        OWN,
    );
    // self and thread-self are links, to init when init reads them.
    for link in ["/proc/self", "/proc/thread-self"] {
        assert_refused(
            client.list_dir(&format!("{link}/fd"), 1, 100).unwrap_err(),
            FsErrorKind::Invalid,
            &format!("{link} is a symbolic link"),
        );
        assert_refused(
            get(client, &format!("{link}/maps")).unwrap_err(),
            FsErrorKind::Invalid,
            &format!("{link} is a symbolic link"),
        );
    }
    // Another process's entries are the sandbox's own business.
    let pid = sh(client, "sleep 600 >/dev/null 2>&1 & echo $!");
    let pid = pid.trim();
    let status = String::from_utf8(get(client, &format!("/proc/{pid}/status")).unwrap()).unwrap();
    assert!(status.contains(&format!("\nPid:\t{pid}\n")), "{status}");
    let listed = |path: &str| -> Vec<String> {
        let listing = client.list_dir(path, 1, 10_000).unwrap();
        listing.entries.into_iter().map(|e| e.meta.path).collect()
    };
    let proc = listed("/proc");
    assert!(proc.contains(&format!("/proc/{pid}")), "{proc:?}");
    assert!(
        !proc.contains(&"/proc/1".to_string()),
        "init's entry is listed: {proc:?}"
    );
    assert!(listed(&format!("/proc/{pid}")).contains(&format!("/proc/{pid}/status")));
    sh(client, &format!("kill {pid}"));
}

/// The attack that hung downloads for good: a loop in the sandbox swaps a
/// regular file and a FIFO at one name while the host downloads it `count`
/// times from four threads. Every download ends with the file or with the
/// FIFO refused; none may hang (a generous deadline fails the test rather
/// than waiting for ever). `helper` is support/swap.c, compiled.
pub fn a_fifo_swapped_in_never_hangs_a_download(client: &InitClient, helper: &Path, count: usize) {
    let bytes = std::fs::read(helper).unwrap();
    put(client, "/swap", &bytes).unwrap();
    sh(client, "mkdir /tmp/race");
    client
        .exec(ExecRequest {
            argv: vec!["/swap".into(), "/tmp/race".into()],
            detach: true,
            ..ExecRequest::default()
        })
        .unwrap()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while client.stat("/tmp/race/target").unwrap().is_none() {
        assert!(Instant::now() < deadline, "the swap loop never made its file");
        std::thread::sleep(Duration::from_millis(20));
    }

    let (tx, rx) = mpsc::channel();
    for _ in 0..4 {
        let (client, tx) = (client.clone(), tx.clone());
        std::thread::spawn(move || {
            for _ in 0..count / 4 {
                if tx.send(get(&client, "/tmp/race/target")).is_err() {
                    return;
                }
            }
        });
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let (mut files, mut fifos) = (0, 0);
    for done in 0..count / 4 * 4 {
        let left = deadline.saturating_duration_since(Instant::now());
        let got = rx
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("{done} of {count} downloads ended; the others hang"));
        match got {
            Ok(content) => {
                assert_eq!(content, b"file\n");
                files += 1;
            }
            Err(ClientError::Fs(FsFailure { kind, message })) => {
                assert_eq!(kind, FsErrorKind::Invalid, "{message}");
                assert!(message.contains("/tmp/race/target is a FIFO"), "{message}");
                fifos += 1;
            }
            Err(other) => panic!("a download failed otherwise: {other}"),
        }
    }
    eprintln!("downloads during the swap loop: {files} files, {fifos} FIFOs refused");
    sh(client, "killall swap; true");
}

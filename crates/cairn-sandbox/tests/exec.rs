//! Foreground execs as a host sees them when many run at once in one
//! sandbox, when one host does not read, and when the sandbox is at its
//! process limit: cairn-init follows every exec from one thread, so none
//! of these may mix up, hold up or refuse another's.
//!
//! Needs root; otherwise prints `SKIPPED: <reason>` and passes.

mod support;

use std::io::Write;
use std::time::Duration;

use cairn_protocol::{ExecRequest, SpawnErrorKind};
use cairn_sandbox::client::ExecSession;
use cairn_sandbox::Limits;
use support::Native;

fn request(argv: &[&str], stdin: bool, detach: bool) -> ExecRequest {
    ExecRequest {
        argv: argv.iter().map(|a| a.to_string()).collect(),
        stdin,
        detach,
        timeout_ms: Some(120_000),
        ..ExecRequest::default()
    }
}

fn start(sandbox: &Native, argv: &[&str], stdin: bool) -> ExecSession {
    sandbox.client.exec(request(argv, stdin, false)).unwrap().unwrap()
}

/// Each line of `seq 1 n` behind `tag-`.
fn tagged(tag: &str, n: usize) -> String {
    (1..=n).map(|i| format!("{tag}-{i}\n")).collect()
}

#[test]
fn concurrent_execs_each_get_their_own_stdin_output_and_status() {
    let Some(sandbox) = Native::start("concurrent") else {
        return;
    };
    let script = "cat; seq 1 3000 | sed \"s/^/$0-/\"; seq 1 700 | sed \"s/^/$0-/\" >&2; exit $1";
    std::thread::scope(|s| {
        let runs: Vec<_> = (0..24)
            .map(|k| {
                let sandbox = &sandbox;
                s.spawn(move || {
                    let tag = format!("x{k}");
                    let code = (k % 7).to_string();
                    let session = start(sandbox, &["sh", "-c", script, &tag, &code], true);
                    let control = session.control();
                    control.stdin(format!("stdin of {tag}\n").as_bytes()).unwrap();
                    control.close_stdin().unwrap();
                    let (mut out, mut err) = (Vec::new(), Vec::new());
                    let status = session.wait(&mut out, &mut err).unwrap().unwrap();
                    (k, tag, status, out, err)
                })
            })
            .collect();
        for run in runs {
            let (k, tag, status, out, err) = run.join().unwrap();
            assert_eq!(status.code, Some(k % 7), "{tag}: {}", String::from_utf8_lossy(&err));
            let out = String::from_utf8(out).unwrap();
            assert!(
                out == format!("stdin of {tag}\n{}", tagged(&tag, 3000)),
                "{tag}'s stdout is mixed up"
            );
            assert!(
                String::from_utf8(err).unwrap() == tagged(&tag, 700),
                "{tag}'s stderr is mixed up"
            );
        }
    });
}

#[test]
fn a_host_that_does_not_read_holds_up_only_its_own_command() {
    let Some(sandbox) = Native::start("slowhost") else {
        return;
    };
    const SIZE: usize = 16 << 20;
    // Far more output than init holds for a host that is not reading.
    let unread = start(&sandbox, &["head", "-c", &SIZE.to_string(), "/dev/zero"], false);
    for i in 0..20 {
        assert_eq!(sandbox.run(&["echo", &i.to_string()]), format!("{i}\n"));
    }
    sandbox.client.ping(Duration::from_secs(10)).unwrap();
    struct Count(usize);
    impl Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    let status = unread.wait(&mut count, &mut Vec::new()).unwrap().unwrap();
    assert_eq!((status.code, count.0), (Some(0), SIZE));
}

#[test]
fn execs_are_answered_while_the_sandbox_is_at_its_process_limit() {
    let limits = Limits {
        pids: 16,
        ..Limits::default()
    };
    let Some(sandbox) = Native::start_limited("pidlimit", limits) else {
        return;
    };
    // A subshell forks sleepers until the limit refuses one, and dies of it;
    // the host takes the pid it frees. Then the shell, which forks no more,
    // waits for a line on stdin and kills its sleepers.
    let script = "(while :; do sleep 1000 & done) 2>/dev/null; echo full; read line; \
                  trap '' TERM; kill 0; echo \"freed after $line\"";
    let filler = start(&sandbox, &["sh", "-c", script], true);
    let control = filler.control();
    let (tx, rx) = std::sync::mpsc::channel();
    let follower = std::thread::spawn(move || {
        let mut out = Vec::new();
        let status = filler.wait(&mut LineSender(tx, Vec::new()), &mut out).unwrap();
        (status, out)
    });
    assert_eq!(rx.recv_timeout(Duration::from_secs(60)).unwrap(), "full");
    let mut taken = Vec::new();
    let refusal = loop {
        match sandbox.client.exec(request(&["sleep", "1000"], false, true)).unwrap() {
            Ok(session) => taken.push(session.pid),
            Err(failure) => break failure,
        }
        assert!(taken.len() < 16, "the pids limit never refused a process");
    };
    // Full: every request is answered, several at once, none hangs.
    assert_eq!(refusal.kind, SpawnErrorKind::Other, "{}", refusal.message);
    assert!(refusal.message.contains("cannot start"), "{}", refusal.message);
    std::thread::scope(|s| {
        for _ in 0..6 {
            s.spawn(
                || match sandbox.client.exec(request(&["true"], false, false)).unwrap() {
                    Ok(_) => panic!("a process started in a full sandbox"),
                    Err(failure) => assert!(failure.message.contains("cannot start"), "{}", failure.message),
                },
            );
        }
    });
    sandbox.client.ping(Duration::from_secs(10)).unwrap();
    assert!(sandbox.client.stat("/bin").unwrap().is_some());
    // The command that filled the sandbox still takes stdin and streams.
    control.stdin(b"the line\n").unwrap();
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(60)).unwrap(),
        "freed after the line"
    );
    let (status, err) = follower.join().unwrap();
    assert_eq!(status.unwrap().code, Some(0), "{}", String::from_utf8_lossy(&err));
    for pid in taken {
        sandbox.client.kill(pid, libc::SIGKILL).unwrap();
    }
    // Room again: the next exec runs.
    let mut ran = None;
    for _ in 0..200 {
        match sandbox.client.exec(request(&["echo", "room"], false, false)).unwrap() {
            Ok(session) => {
                let mut out = Vec::new();
                session.wait(&mut out, &mut Vec::new()).unwrap();
                ran = Some(out);
                break;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    assert_eq!(ran.as_deref(), Some(&b"room\n"[..]));
}

/// Sends each whole line written to it.
struct LineSender(std::sync::mpsc::Sender<String>, Vec<u8>);

impl Write for LineSender {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.1.extend_from_slice(b);
        while let Some(end) = self.1.iter().position(|&c| c == b'\n') {
            let line: Vec<u8> = self.1.drain(..=end).collect();
            let _ = self.0.send(String::from_utf8_lossy(&line[..end]).into_owned());
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_command_run_as_a_user_has_its_ids_no_groups_and_no_capabilities() {
    let Some(sandbox) = Native::start("asuser") else {
        return;
    };
    let script = "id -u; id -g; id -G; grep CapEff /proc/self/status; touch /etc/mine 2>/dev/null && echo wrote || echo refused; \
                  mkdir -p /shared && chmod 1777 /shared 2>/dev/null; cd /shared && touch mine-$(id -u) && stat -c %u:%g mine-$(id -u)";
    let run = |user| {
        let mut req = request(&["sh", "-c", script], false, false);
        req.user = user;
        let session = sandbox.client.exec(req).unwrap().unwrap();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let status = session.wait(&mut out, &mut err).unwrap().unwrap();
        assert_eq!(status.code, Some(0), "{}", String::from_utf8_lossy(&err));
        String::from_utf8(out).unwrap()
    };
    // The sandbox's root first: it makes the directory the user writes in.
    let root = run(None);
    assert!(root.starts_with("0\n0\n") && root.contains("wrote\n0:0\n"), "{root}");
    let ids = cairn_protocol::Ids { uid: 1000, gid: 1001 };
    assert_eq!(
        run(Some(ids)),
        "1000\n1001\n1001\nCapEff:\t0000000000000000\nrefused\n1000:1001\n"
    );
}

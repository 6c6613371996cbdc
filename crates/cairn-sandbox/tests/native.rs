//! The native driver's init path (the listening socket passed on fd 3),
//! which shares cairn-init's accept loop with the gVisor driver, and the
//! protocol as a client sees it: ping, hello, signals, kill.
//!
//! Needs root; otherwise prints `SKIPPED: <reason>` and passes.

mod support;

use std::os::unix::net::UnixStream;
use std::time::Duration;

use cairn_protocol::{read_frame, write_frame, FromInit, ToInit, MAGIC, PROTOCOL_VERSION};
use cairn_sandbox::client::ClientError;
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

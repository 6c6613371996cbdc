//! The native driver's init path (the listening socket passed on fd 3),
//! which shares cairn-init's accept loop with the gVisor driver.
//!
//! Needs root; otherwise prints `SKIPPED: <reason>` and passes.

mod support;

use std::time::Duration;

use cairn_protocol::ExecRequest;
use cairn_sandbox::client::{ClientError, InitClient};
use cairn_sandbox::native::NativeDriver;
use cairn_sandbox::{init_binary, Driver, Limits, SandboxSpec};

#[test]
fn a_native_sandbox_answers_and_refuses_to_quiesce() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: the native driver test needs root");
        return;
    }
    let base = match support::busybox_root() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("SKIPPED: no busybox root: {e}");
            return;
        }
    };
    let tmp = tempfile::Builder::new().prefix("nvt").tempdir_in("/tmp").unwrap();
    let driver = NativeDriver::new("native-test").unwrap();
    let spec = SandboxSpec {
        id: format!("nvt{}", std::process::id()),
        hostname: "native".into(),
        dir: tmp.path().join("s"),
        layers: vec![base],
        limits: Limits::default(),
        init_binary: init_binary::install(&tmp.path().join("bin")).unwrap(),
    };
    std::fs::create_dir_all(&spec.dir).unwrap();
    let process = driver.start(&spec).unwrap();
    let client = InitClient::new(spec.socket_path());
    let run = || {
        let session = client
            .exec(ExecRequest {
                argv: vec!["/bin/echo".into(), "native".into()],
                env: vec![],
                cwd: None,
                stdin: false,
                timeout_ms: Some(10_000),
                detach: false,
            })
            .unwrap()
            .unwrap();
        let mut out = Vec::new();
        session.wait(&mut out, &mut Vec::new()).unwrap();
        out
    };
    assert_eq!(run(), b"native\n");
    // Init cannot reopen a socket it was handed, so it refuses and serves on.
    let err = client.quiesce(Duration::from_secs(5)).unwrap_err();
    assert!(matches!(err, ClientError::Refused(_)), "{err}");
    assert_eq!(run(), b"native\n");
    driver.stop(&spec.id, Some(process)).unwrap();
    assert!(!process.alive());
}

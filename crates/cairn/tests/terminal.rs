//! `cairn exec -t`: a command on a terminal of its own in the sandbox,
//! driven from a terminal on the host (a pseudo-terminal this test opens,
//! as a terminal emulator would).

mod common;

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use common::{skip, Home};

/// The host side of a terminal `cairn exec -t` runs on.
struct HostTerminal {
    master: std::fs::File,
    output: Receiver<Vec<u8>>,
    seen: String,
}

impl HostTerminal {
    /// Starts `cairn args` as the leader of a session whose controlling
    /// terminal is a new pseudo-terminal of `rows` x `cols`.
    fn start(home: &Home, args: &[&str], rows: u16, cols: u16) -> (HostTerminal, Child) {
        let size = nix::pty::Winsize {
            ws_row: rows,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        let pty = nix::pty::openpty(Some(&size), None).unwrap();
        let slave: OwnedFd = pty.slave;
        let mut cmd = home.command(args);
        cmd.stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave));
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                nix::unistd::setsid()?;
                if libc::ioctl(0, libc::TIOCSCTTY, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        let master = std::fs::File::from(pty.master);
        let mut reader = master.try_clone().unwrap();
        let (tx, output) = channel();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // EIO once every holder of the terminal side is gone.
            while let Ok(n @ 1..) = reader.read(&mut buf) {
                if tx.send(buf[..n].to_vec()).is_err() {
                    return;
                }
            }
        });
        let t = HostTerminal {
            master,
            output,
            seen: String::new(),
        };
        (t, child)
    }

    fn type_keys(&mut self, keys: &str) {
        self.master.write_all(keys.as_bytes()).unwrap();
    }

    /// Waits (at most a minute: a guard, not a speed check) until the
    /// output holds `want` after what earlier waits consumed; returns the
    /// output up to it.
    fn wait_for(&mut self, want: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(i) = self.seen.find(want) {
                let upto: String = self.seen[..i + want.len()].to_string();
                self.seen.drain(..i + want.len());
                return upto;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.output.recv_timeout(left) {
                Ok(chunk) => self.seen.push_str(&String::from_utf8_lossy(&chunk)),
                Err(_) => panic!("{want:?} never came; the terminal showed:\n{}", self.seen),
            }
        }
    }

    fn resize(&self, rows: u16, cols: u16) {
        let size = libc::winsize {
            ws_row: rows,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads a winsize from a valid pointer.
        let rc = unsafe { libc::ioctl(self.master.as_raw_fd(), libc::TIOCSWINSZ, &size) };
        assert_eq!(rc, 0);
    }
}

fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "cairn exec -t did not exit");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_shell_on_a_terminal_gets_keys_the_window_size_and_ctrl_c() {
    if skip("a_shell_on_a_terminal_gets_keys_the_window_size_and_ctrl_c") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    let (mut term, mut cairn) = HostTerminal::start(&home, &["exec", "-t", &id, "--", "sh"], 30, 100);
    // A terminal of its own, of this window's size.
    term.type_keys("tty; stty size; echo mark-$((6*7))\n");
    let shown = term.wait_for("mark-42");
    assert!(shown.contains("/dev/pts/"), "{shown}");
    assert!(shown.contains("30 100"), "{shown}");
    // The window's new size follows (SIGWINCH on the host).
    term.resize(50, 132);
    std::thread::sleep(Duration::from_millis(300));
    term.type_keys("stty size; echo mark-$((6*8))\n");
    let shown = term.wait_for("mark-48");
    assert!(shown.contains("50 132"), "{shown}");
    // Ctrl-C goes to the sandbox's terminal, which interrupts the command
    // in its foreground, not the shell.
    term.type_keys("sleep 300; echo slept-$((3*3))\n");
    std::thread::sleep(Duration::from_millis(500));
    term.type_keys("\x03");
    term.type_keys("echo mark-$((7*7))\n");
    let shown = term.wait_for("mark-49");
    assert!(!shown.contains("slept-9"), "{shown}");
    term.type_keys("exit 3\n");
    assert_eq!(wait_exit(&mut cairn).code(), Some(3));
    let left = home.ok(&["exec", &id, "--", "ps"]);
    assert!(!left.contains("sleep 300"), "{left}");
}

#[test]
fn a_terminal_whose_client_is_killed_hangs_up_its_processes() {
    if skip("a_terminal_whose_client_is_killed_hangs_up_its_processes") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    let (mut term, mut cairn) = HostTerminal::start(&home, &["exec", "-t", &id, "--", "sh"], 24, 80);
    term.type_keys("sleep 301 & echo mark-$((2*21))\n");
    term.wait_for("mark-42");
    assert!(home.ok(&["exec", &id, "--", "ps"]).contains("sleep 301"));
    cairn.kill().unwrap();
    cairn.wait().unwrap();
    // The shell and its background job get SIGHUP with their terminal.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ps = home.ok(&["exec", &id, "--", "ps"]);
        if !ps.lines().any(|l| l.ends_with(" sh") || l.contains("sleep 301")) {
            break;
        }
        assert!(Instant::now() < deadline, "left running:\n{ps}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_terminal_fed_from_a_pipe_is_80_by_24_and_its_output_one_stream() {
    if skip("a_terminal_fed_from_a_pipe_is_80_by_24_and_its_output_one_stream") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    let script = "stty size; tty; read line; echo got $line; echo to-stderr >&2";
    let mut cairn = home
        .command(&["exec", "-t", &id, "--", "sh", "-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    cairn.stdin.take().unwrap().write_all(b"typed\n").unwrap();
    let out = cairn.wait_with_output().unwrap();
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{shown}{}", String::from_utf8_lossy(&out.stderr));
    assert!(shown.contains("24 80"), "{shown}");
    assert!(shown.contains("/dev/pts/"), "{shown}");
    assert!(shown.contains("got typed"), "{shown}");
    // A terminal's output is one stream: its stderr came on stdout.
    assert!(shown.contains("to-stderr"), "{shown}");
    assert!(out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
}

//! `cairn serve` under hostile connections: half-open requests that trickle
//! headers from many addresses, on a server whose descriptor limit is
//! lowered so that the flood is larger than what it could hold, and
//! clients that never read their answer. Authenticated requests on TCP and
//! on the Unix socket must all succeed meanwhile, and the server must close
//! the slow connections itself.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{skip, Home};

/// A `cairn serve --listen` whose descriptor limit (soft and hard) is
/// `nofile`.
struct Server {
    child: Child,
    addr: SocketAddr,
    token: String,
    socket: std::path::PathBuf,
}

impl Server {
    fn start(home: &Home, nofile: u64, extra: &[&str]) -> Server {
        let token = home.ok(&["token", "create", "flood"]);
        let mut args = vec!["serve", "--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        let mut cmd = home.command(&args);
        cmd.stdout(Stdio::null()).stderr(Stdio::piped());
        // SAFETY: setrlimit is async-signal-safe; nothing else runs between
        // fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, nofile, nofile)
                    .map_err(std::io::Error::from)
            });
        }
        let mut child = cmd.spawn().unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let addr = loop {
            let line = lines.next().expect("the server prints where it listens").unwrap();
            if let Some(rest) = line.strip_prefix("cairn: serving on http://") {
                break rest.split_whitespace().next().unwrap().parse().unwrap();
            }
        };
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                eprintln!("server: {line}");
            }
        });
        let socket = home.path().join("cairn.sock");
        Server {
            child,
            addr,
            token,
            socket,
        }
    }

    /// An authenticated GET on a new TCP connection: (status, body).
    fn tcp_get(&self, path: &str) -> (u16, String) {
        let resp = ureq::get(&format!("http://{}{path}", self.addr))
            .set("authorization", &format!("Bearer {}", self.token))
            .timeout(Duration::from_secs(60))
            .call();
        match resp {
            Ok(r) => (r.status(), r.into_string().unwrap()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
            Err(e) => panic!("an authenticated request on TCP failed: {e}"),
        }
    }

    /// A GET on a new Unix socket connection: (status line, whole answer).
    fn unix_get(&self, path: &str) -> String {
        let mut conn = UnixStream::connect(&self.socket).expect("the Unix socket accepts");
        conn.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(conn, "GET {path} HTTP/1.1\r\nHost: cairn\r\nConnection: close\r\n\r\n").unwrap();
        let mut text = String::new();
        conn.read_to_string(&mut text).expect("the Unix socket answers");
        text
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A connection from `from` that sends the start of a request and no more.
fn half_open(from: std::net::Ipv4Addr, to: SocketAddr) -> Option<TcpStream> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
    socket.bind(&SocketAddr::new(from.into(), 0).into()).ok()?;
    socket.connect_timeout(&to.into(), Duration::from_secs(5)).ok()?;
    let mut stream: TcpStream = socket.into();
    stream
        .write_all(b"GET /v1/sandboxes HTTP/1.1\r\nHost: cairn\r\n")
        .ok()?;
    Some(stream)
}

/// Whether the server has closed `stream` (EOF or a reset), waiting up to
/// `within` while writing one more header line a second.
fn closed_by_server(stream: &mut TcpStream, within: Duration) -> bool {
    let until = Instant::now() + within;
    stream.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    let mut buf = [0u8; 512];
    while Instant::now() < until {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return true,
        }
        if stream.write_all(b"X-Slow: 1\r\n").is_err() {
            return true;
        }
    }
    false
}

fn raise_own_open_files() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
    }
}

/// The attack on `main`: more half-open connections than the server has
/// descriptors, some from the authenticated client's own address and most
/// from others. Every authenticated request still succeeds, on TCP and on
/// the Unix socket, and the server closes the slow connections itself.
#[test]
fn a_flood_of_half_open_connections_does_not_stop_the_api() {
    raise_own_open_files();
    let home = Home::new();
    // 512 descriptors: 256 reserved, so 128 TCP connections at most.
    let s = Server::start(
        &home,
        512,
        &["--header-timeout", "3s", "--max-connections-per-peer", "48"],
    );
    let mut flood = Vec::new();
    let mut attempted = 0;
    // 2 × 300 from the client's own address and from 127.0.0.2, 8 × 60
    // from 127.0.1.1-8: 1,080 connections against a server with 512
    // descriptors.
    let sources: Vec<(std::net::Ipv4Addr, usize)> = [([127, 0, 0, 1], 300), ([127, 0, 0, 2], 300)]
        .into_iter()
        .map(|(a, n)| (a.into(), n))
        .chain((1..=8).map(|i| (std::net::Ipv4Addr::new(127, 0, 1, i), 60)))
        .collect();
    for (from, n) in &sources {
        for _ in 0..*n {
            attempted += 1;
            if let Some(c) = half_open(*from, s.addr) {
                flood.push(c);
            }
        }
    }
    assert!(
        flood.len() > 512,
        "the flood opened {} of {attempted} connections",
        flood.len()
    );
    // Meanwhile, authenticated requests on both listeners, interleaved with
    // more half-open connections.
    for round in 0..40 {
        let (status, body) = s.tcp_get("/v1/sandboxes");
        assert_eq!(status, 200, "round {round}: {body}");
        let text = s.unix_get("/v1/sandboxes");
        assert!(text.starts_with("HTTP/1.1 200"), "round {round}: {text}");
        for (from, _) in &sources {
            if let Some(c) = half_open(*from, s.addr) {
                flood.push(c);
            }
        }
    }
    // A request without a token is still answered (401), not dropped.
    let answer = ureq::get(&format!("http://{}/v1/sandboxes", s.addr)).call();
    assert!(matches!(answer, Err(ureq::Error::Status(401, _))), "{answer:?}");
    // Every slow connection is closed by the server (pushed out or past
    // the header timeout), never answered.
    let open: Vec<usize> = flood
        .iter_mut()
        .enumerate()
        .filter_map(|(i, c)| (!closed_by_server(c, Duration::from_secs(30))).then_some(i))
        .take(5)
        .collect();
    assert!(open.is_empty(), "slow connections still open: {open:?}");
    let text = s.unix_get("/metrics");
    for reason in ["evicted", "header_timeout"] {
        assert!(
            text.contains(&format!(
                "cairn_connections_closed_by_server_total{{listener=\"api\",reason=\"{reason}\"}}"
            )),
            "/metrics counts no {reason}:\n{text}"
        );
    }
    let (status, _) = s.tcp_get("/v1/sandboxes");
    assert_eq!(status, 200);
}

/// A connection that went quiet after a request is closed at the idle
/// timeout; one that starts its next request's headers and never ends them
/// is closed at the header timeout.
#[test]
fn idle_and_trickling_keep_alive_connections_are_closed() {
    let home = Home::new();
    let s = Server::start(&home, 4096, &["--header-timeout", "2s", "--idle-timeout", "4s"]);
    let request = format!(
        "GET /v1/sandboxes HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {}\r\n\r\n",
        s.token
    );
    let answered = |c: &mut TcpStream| {
        c.write_all(request.as_bytes()).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut buf = [0u8; 4096];
        let n = c.read(&mut buf).unwrap();
        assert!(
            buf[..n].starts_with(b"HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&buf[..n])
        );
    };
    let mut quiet = TcpStream::connect(s.addr).unwrap();
    answered(&mut quiet);
    let mut trickling = TcpStream::connect(s.addr).unwrap();
    answered(&mut trickling);
    trickling.write_all(b"GET /v1/sandboxes HTTP/1.1\r\n").unwrap();
    assert!(closed_by_server(&mut trickling, Duration::from_secs(30)));
    assert!(closed_by_server_quietly(&mut quiet, Duration::from_secs(30)));
    let text = s.unix_get("/metrics");
    for reason in ["idle_timeout", "header_timeout"] {
        assert!(
            text.contains(&format!("listener=\"api\",reason=\"{reason}\"")),
            "/metrics counts no {reason}:\n{text}"
        );
    }
}

/// [`closed_by_server`] without writing anything.
fn closed_by_server_quietly(stream: &mut TcpStream, within: Duration) -> bool {
    stream.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 512];
    match stream.read(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
    }
}

/// A client that asks for a large download and never reads it loses the
/// connection at the write timeout; the server stays up for others.
#[test]
fn a_download_nobody_reads_is_cut_at_the_write_timeout() {
    if skip("a_download_nobody_reads_is_cut_at_the_write_timeout") {
        return;
    }
    let home = Home::new();
    let s = Server::start(&home, 4096, &["--write-timeout", "2s"]);
    let created = ureq::post(&format!("http://{}/v1/sandboxes", s.addr))
        .set("authorization", &format!("Bearer {}", s.token))
        .send_json(serde_json::json!({}))
        .unwrap()
        .into_json::<serde_json::Value>()
        .unwrap();
    let id = created["id"].as_str().unwrap().to_string();
    let made = ureq::post(&format!("http://{}/v1/sandboxes/{id}/exec", s.addr))
        .set("authorization", &format!("Bearer {}", s.token))
        .send_json(serde_json::json!({ "argv": ["sh", "-c", "head -c 67108864 /dev/zero > /tmp/big"] }))
        .unwrap()
        .into_json::<serde_json::Value>()
        .unwrap();
    assert_eq!(made["exit_code"], 0, "{made}");
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.connect(&s.addr.into()).unwrap();
    let mut stalled: TcpStream = socket.into();
    write!(
        stalled,
        "GET /v1/sandboxes/{id}/files?path=/tmp/big HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {}\r\n\r\n",
        s.token
    )
    .unwrap();
    // Read nothing for well past the write timeout, then drain: the
    // answer ends short of the file.
    std::thread::sleep(Duration::from_secs(8));
    stalled.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut got = 0usize;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match stalled.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    assert!(
        got < 64 << 20,
        "the whole file arrived ({got} bytes): the write was never cut"
    );
    let (status, _) = s.tcp_get("/v1/sandboxes");
    assert_eq!(status, 200);
}

/// A sandbox whose init stops answering (stopped with SIGSTOP) holds at
/// most its share of the threads for sandbox requests: more file requests
/// at it than its share are answered 503 at once, saying to retry, while
/// requests to another sandbox and the sandbox list answer as usual. Once
/// init runs again, the requests that waited are answered.
#[test]
fn a_sandbox_whose_init_stalls_cannot_take_the_threads_of_other_requests() {
    if skip("a_sandbox_whose_init_stalls_cannot_take_the_threads_of_other_requests") {
        return;
    }
    let home = Home::new();
    // Eight threads: one sandbox may hold two.
    let s = Server::start(&home, 4096, &["--init-threads", "8"]);
    let create = || {
        ureq::post(&format!("http://{}/v1/sandboxes", s.addr))
            .set("authorization", &format!("Bearer {}", s.token))
            .send_json(serde_json::json!({}))
            .unwrap()
            .into_json::<serde_json::Value>()
            .unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (stalled, other) = (create(), create());
    let init = home.ps().into_iter().find(|x| x["id"] == stalled.as_str()).unwrap()["pid"]
        .as_i64()
        .unwrap();
    let init = nix::unistd::Pid::from_raw(init as i32);
    nix::sys::signal::kill(init, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let stat = |id: &str| format!("/v1/sandboxes/{id}/files/stat?path=/etc/passwd");

    let (answers, answered) = std::sync::mpsc::channel();
    let waiting: Vec<_> = (0..10)
        .map(|_| {
            let (url, token, answers) = (
                format!("http://{}{}", s.addr, stat(&stalled)),
                s.token.clone(),
                answers.clone(),
            );
            std::thread::spawn(move || {
                let started = Instant::now();
                let status = match ureq::get(&url)
                    .set("authorization", &format!("Bearer {token}"))
                    .timeout(Duration::from_secs(120))
                    .call()
                {
                    Ok(r) => (r.status(), String::new()),
                    Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
                    Err(e) => panic!("a request at the stalled sandbox failed: {e}"),
                };
                answers.send((status, started.elapsed())).unwrap();
            })
        })
        .collect();
    // All but its share are refused at once, and say what to do.
    for _ in 0..8 {
        let ((status, body), took) = answered.recv_timeout(Duration::from_secs(20)).expect("a request hangs");
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("retry"), "{body}");
        assert!(took < Duration::from_secs(10), "refused only after {took:?}");
    }
    assert!(
        answered.recv_timeout(Duration::from_secs(1)).is_err(),
        "more than its share was taken or refused wrongly"
    );
    // Meanwhile other work goes on.
    for _ in 0..3 {
        let (status, body) = s.tcp_get(&stat(&other));
        assert_eq!(status, 200, "{body}");
        let (status, body) = s.tcp_get("/v1/sandboxes");
        assert_eq!(status, 200, "{body}");
    }
    let (_, metrics) = s.tcp_get("/metrics");
    for line in [
        "cairn_init_request_threads_busy 2",
        "cairn_init_request_queue_depth 0",
        "cairn_init_requests_refused_total{reason=\"sandbox_limit\"} 8",
    ] {
        assert!(metrics.lines().any(|l| l == line), "no {line:?} in\n{metrics}");
    }
    // Init runs again: the two that waited are answered.
    nix::sys::signal::kill(init, nix::sys::signal::Signal::SIGCONT).unwrap();
    for _ in 0..2 {
        let ((status, body), _) = answered.recv_timeout(Duration::from_secs(90)).expect("a request hangs");
        assert_eq!(status, 200, "{body}");
    }
    for w in waiting {
        w.join().unwrap();
    }
    let (status, body) = s.tcp_get(&stat(&stalled));
    assert_eq!(status, 200, "{body}");
}

//! `cairn bench api`: the HTTP API over its Unix socket, against the
//! engine doing the same job in the same run.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use cairn_engine::{CreateOptions, Silent};
use cairn_protocol::ExecRequest;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyperlocal::{UnixClientExt, UnixConnector};

use super::{summarize, Bench, Measurement};

type Http = Client<UnixConnector, Full<Bytes>>;

/// A `cairn serve` on the benchmark's state directory, stopped on drop.
struct Served {
    child: Child,
    socket: PathBuf,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
    }
}

fn request(method: &str, socket: &Path, path: &str, body: &str) -> hyper::Request<Full<Bytes>> {
    hyper::Request::builder()
        .method(method)
        .uri(hyperlocal::Uri::new(socket, path))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("a valid request")
}

/// Sends a request and reads the whole answer, which must be a success.
async fn call(http: &Http, method: &str, socket: &Path, path: &str, body: &str) -> Result<serde_json::Value> {
    let resp = http.request(request(method, socket, path, body)).await?;
    let status = resp.status();
    let bytes = resp.into_body().collect().await?.to_bytes();
    if !status.is_success() {
        bail!("{method} {path}: {status}: {}", String::from_utf8_lossy(&bytes));
    }
    Ok(serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null))
}

/// Streams an exec; returns when its first `stdout` event arrives if
/// `first_only`, else at its end (erroring unless it exited 0).
async fn stream(http: &Http, socket: &Path, id: &str, argv: &[&str], first_only: bool) -> Result<()> {
    let body = serde_json::json!({ "argv": argv }).to_string();
    let resp = http
        .request(request(
            "POST",
            socket,
            &format!("/v1/sandboxes/{id}/exec/stream"),
            &body,
        ))
        .await?;
    if !resp.status().is_success() {
        bail!("exec stream: {}", resp.status());
    }
    let mut body = resp.into_body();
    let mut seen = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Some(d) = frame?.data_ref() {
            seen.extend_from_slice(d);
        }
        let text = String::from_utf8_lossy(&seen);
        if first_only && text.contains("event: stdout") {
            return Ok(());
        }
        if text.contains("event: error") {
            bail!("exec stream failed: {text}");
        }
    }
    let text = String::from_utf8_lossy(&seen);
    if !text.contains("\"exit_code\":0") {
        bail!("exec stream ended without a clean exit: {text}");
    }
    Ok(())
}

impl Bench {
    fn serve(&self) -> Result<Served> {
        let socket = self.home.path().join("bench-api.sock");
        let child = Command::new(&self.exe)
            .args(["serve", "--socket"])
            .arg(&socket)
            .env("CAIRN_HOME", self.home.path())
            .env("CAIRN_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let served = Served { child, socket };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(&served.socket).is_err() {
            if Instant::now() > deadline {
                bail!("cairn serve did not start listening on {}", served.socket.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(served)
    }

    pub(super) fn api(&self, runs: usize) -> Result<Vec<Measurement>> {
        let served = self.serve()?;
        let socket = served.socket.clone();
        let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
        let http: Http = Client::unix();
        let mut out = Vec::new();

        // Create to first output: the engine in this process, then the API,
        // alternated so that both see the same machine.
        let mut engine = self.engine()?;
        let (mut direct, mut api) = (Vec::new(), Vec::new());
        let echo = ExecRequest {
            argv: vec!["echo".into(), "hi".into()],
            ..ExecRequest::default()
        };
        for _ in 0..runs.min(100) {
            let t0 = Instant::now();
            let rec = engine.create_sandbox(&CreateOptions::default(), &Silent)?;
            let session = engine
                .exec(&rec, echo.clone())?
                .map_err(|f| anyhow::anyhow!(f.message))?;
            let mut first = FirstByte::default();
            session.session.wait(&mut first, &mut io::sink())?;
            direct.push(
                first
                    .at
                    .context("echo printed nothing")?
                    .duration_since(t0)
                    .as_secs_f64()
                    * 1e3,
            );
            let rec = engine.sandbox(&rec.id)?;
            engine.remove_sandbox(&rec, true)?;

            let (dt, id) = rt.block_on(async {
                let t0 = Instant::now();
                let v = call(&http, "POST", &socket, "/v1/sandboxes", "{}").await?;
                let id = v["id"].as_str().context("no id")?.to_string();
                stream(&http, &socket, &id, &["echo", "hi"], true).await?;
                anyhow::Ok((t0.elapsed().as_secs_f64() * 1e3, id))
            })?;
            api.push(dt);
            rt.block_on(call(
                &http,
                "DELETE",
                &socket,
                &format!("/v1/sandboxes/{id}?force=true"),
                "",
            ))?;
        }
        let direct = summarize(
            "api: create to first output (engine, same run)",
            "ms",
            direct,
            None,
            true,
        );
        let mut through = summarize(
            "api: create to first output (POST sandbox + streamed exec)",
            "ms",
            api,
            None,
            true,
        );
        // The target is the engine's figure plus 2 ms.
        through.target = Some(direct.median + 2.0);
        out.push(direct);
        out.push(through);
        // The admission queue's share of those creates, none of which
        // waited: its histogram's mean (sum over count) from /metrics.
        let text = rt.block_on(async {
            let resp = http.request(request("GET", &socket, "/metrics", "")).await?;
            anyhow::Ok(String::from_utf8_lossy(&resp.into_body().collect().await?.to_bytes()).into_owned())
        })?;
        let field = |name: &str| -> Result<f64> {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .with_context(|| format!("/metrics has no {name}"))
        };
        let admitted = field("cairn_admission_wait_seconds_count ")?;
        let mean_ms = field("cairn_admission_wait_seconds_sum ")? / admitted.max(1.0) * 1e3;
        out.push(Measurement {
            name: format!("api: admission of an uncontended create (mean of {admitted} from /metrics)"),
            unit: "ms",
            median: mean_ms,
            p95: mean_ms,
            runs: admitted as usize,
            target: Some(0.5),
            lower_is_better: true,
            cairn_ratio: None,
        });

        // Exec round trip over one kept-alive connection.
        let id = rt.block_on(async {
            let v = call(&http, "POST", &socket, "/v1/sandboxes", "{}").await?;
            anyhow::Ok(v["id"].as_str().context("no id")?.to_string())
        })?;
        let path = format!("/v1/sandboxes/{id}/exec");
        let mut samples = Vec::with_capacity(runs);
        for i in 0..runs + 10 {
            let t0 = Instant::now();
            let v = rt.block_on(call(&http, "POST", &socket, &path, r#"{"argv":["true"]}"#))?;
            if v["exit_code"] != 0 {
                bail!("`true` failed through the API: {v}");
            }
            if i >= 10 {
                samples.push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        out.push(summarize(
            "api: exec round trip of `true` (POST .../exec)",
            "ms",
            samples,
            Some(2.0),
            true,
        ));
        rt.block_on(call(
            &http,
            "DELETE",
            &socket,
            &format!("/v1/sandboxes/{id}?force=true"),
            "",
        ))?;

        // 1,000 streamed execs held open at once, over four sandboxes.
        let held = 1000;
        let ids = rt.block_on(async {
            let mut ids = Vec::new();
            for _ in 0..4 {
                let v = call(&http, "POST", &socket, "/v1/sandboxes", r#"{"limits":{"pids":8192}}"#).await?;
                ids.push(v["id"].as_str().context("no id")?.to_string());
            }
            anyhow::Ok(ids)
        })?;
        let t0 = Instant::now();
        let failures = rt.block_on(async {
            let mut tasks = tokio::task::JoinSet::new();
            for i in 0..held {
                let (http, socket, id) = (http.clone(), socket.clone(), ids[i % ids.len()].clone());
                tasks.spawn(async move { stream(&http, &socket, &id, &["sleep", "5"], false).await });
            }
            let mut failures = Vec::new();
            while let Some(r) = tasks.join_next().await {
                if let Err(e) = r.map_err(anyhow::Error::from).and_then(|r| r) {
                    failures.push(e.to_string());
                }
            }
            failures
        });
        let took = t0.elapsed().as_secs_f64();
        for id in &ids {
            rt.block_on(call(
                &http,
                "DELETE",
                &socket,
                &format!("/v1/sandboxes/{id}?force=true"),
                "",
            ))?;
        }
        if let Some(first) = failures.first() {
            eprintln!(
                "cairn bench: {} of {held} streamed execs failed; the first: {first}",
                failures.len()
            );
        }
        out.push(Measurement {
            name: format!("api: {held} concurrent streamed execs of `sleep 5` held (all done in {took:.1} s)"),
            unit: "ok",
            median: (held - failures.len()) as f64,
            p95: (held - failures.len()) as f64,
            runs: 1,
            target: Some(held as f64),
            lower_is_better: false,
            cairn_ratio: None,
        });
        drop(served);
        out.extend(self.api_flood(runs)?);
        out.extend(self.e2b_uploads()?);
        out.extend(self.code_interpreter(runs.min(10))?);
        Ok(out)
    }

    /// Authenticated requests on TCP and on the Unix socket while 20,000
    /// connections without a token trickle headers at the TCP listener
    /// (one line every 5 s, from 100 loopback addresses, reconnecting 5 s
    /// after the server closes them), against the same requests on a quiet
    /// server.
    fn api_flood(&self, runs: usize) -> Result<Vec<Measurement>> {
        const FLOOD: usize = 20_000;
        // Descriptors are counted per process: the flood comes from two
        // processes of its own, not from the client that measures.
        const ATTACKERS: usize = 2;
        const ADDRESSES: usize = 100;
        const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
        let token = self.engine()?.create_token("bench-flood", None)?.secret;
        let (served, addr) = self.serve_tcp()?;
        let socket = served.socket.clone();
        let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
        let unix: Http = Client::unix();
        let tcp = Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build_http::<Full<Bytes>>();
        let rounds = runs.max(20) * 5;
        let quiet = rt.block_on(authenticated(&tcp, &unix, addr, &socket, &token, rounds));
        let open = std::sync::Arc::new(std::sync::Mutex::new(vec![0usize; ATTACKERS]));
        let mut attackers = Vec::new();
        for i in 0..ATTACKERS {
            let mut child = Command::new(&self.exe)
                .args(["bench-flood", "--to", &addr.to_string()])
                .args(["--connections", &(FLOOD / ATTACKERS).to_string()])
                .args(["--addresses", &ADDRESSES.to_string()])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .context("starting the flood's attacker")?;
            let stdout = child.stdout.take().context("no stdout")?;
            let open = std::sync::Arc::clone(&open);
            let reader = std::thread::spawn(move || {
                use std::io::BufRead;
                let mut lives = Vec::new();
                for line in io::BufReader::new(stdout).lines().map_while(Result::ok) {
                    if let Some(n) = line.strip_prefix("open ") {
                        open.lock().unwrap_or_else(|e| e.into_inner())[i] = n.parse().unwrap_or(0);
                    } else if let Ok(v) = serde_json::from_str::<Vec<f64>>(&line) {
                        lives = v;
                    }
                }
                lives
            });
            attackers.push((child, reader));
        }
        let total = || open.lock().unwrap_or_else(|e| e.into_inner()).iter().sum::<usize>();
        // Let the flood build up before measuring.
        let t0 = Instant::now();
        while total() < FLOOD * 9 / 10 && t0.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(100));
        }
        let connected = total();
        let flooded = rt.block_on(authenticated(&tcp, &unix, addr, &socket, &token, rounds));
        let mut lives = Vec::new();
        for (mut child, reader) in attackers {
            drop(child.stdin.take());
            let _ = child.wait();
            lives.extend(reader.join().unwrap_or_default());
        }
        drop(served);
        eprintln!(
            "cairn bench: flood: {connected} of {FLOOD} connections open at once (from {ATTACKERS} processes); \
             the server closed {} while it lasted",
            lives.len()
        );
        let mut out = Vec::new();
        for (label, (q, f)) in [
            ("TCP", (quiet.tcp, flooded.tcp)),
            ("Unix socket", (quiet.unix, flooded.unix)),
        ] {
            out.push(summarize(
                &format!("api flood: GET /v1/sandboxes on {label}, quiet server"),
                "ms",
                q?,
                None,
                true,
            ));
            out.push(summarize(
                &format!(
                    "api flood: GET /v1/sandboxes on {label}, {FLOOD} connections trickling headers ({connected} open at once)"
                ),
                "ms",
                f?,
                Some(5.0),
                true,
            ));
        }
        out.push(Measurement {
            name: format!(
                "api flood: authenticated requests failed during the flood (of {})",
                rounds * 2
            ),
            unit: "failed",
            median: flooded.failed as f64,
            p95: flooded.failed as f64,
            runs: 1,
            target: Some(0.0),
            lower_is_better: true,
            cairn_ratio: None,
        });
        if !lives.is_empty() {
            let mut m = summarize(
                "api flood: life of a half-open connection until the server closed it",
                "s",
                lives,
                None,
                true,
            );
            // Closed within the header timeout, plus the server's tick.
            m.target = Some(HEADER_TIMEOUT.as_secs_f64() + 1.0);
            out.push(m);
        }
        Ok(out)
    }

    /// A `cairn serve` on its own socket and a TCP port; its address.
    /// What 16 parallel 63 MiB uploads through the E2B API add to the
    /// server's peak resident memory (uploads are spooled to disk, so
    /// about nothing per upload), after one upload that warms it.
    fn e2b_uploads(&self) -> Result<Vec<Measurement>> {
        const UPLOADS: usize = 16;
        const SIZE: usize = 63 << 20;
        let key = self.engine()?.create_token("bench-e2b", None)?.secret;
        // The tiny base: this measures uploads, not E2B's Debian base (built on first use).
        let (served, addr) = self.serve_with(
            &["--e2b", "127.0.0.1:0", "--e2b-base", "busybox"],
            "cairn: serving the E2B API on http://",
        )?;
        let pid = served.child.id();
        let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
        let http = Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Full<Bytes>>();
        let send = |req: hyper::Request<Full<Bytes>>| send_tcp(http.clone(), req);
        let created = rt.block_on(send(
            hyper::Request::post(format!("http://{addr}/v2/sandboxes"))
                .header("x-api-key", &key)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(r#"{"templateID":"base","timeout":600}"#)))?,
        ))?;
        let created: serde_json::Value = serde_json::from_slice(&created)?;
        let id = created["sandboxID"].as_str().context("no sandboxID")?.to_string();
        let access = created["envdAccessToken"].as_str().unwrap_or_default().to_string();
        let data = Bytes::from(vec![0x5au8; SIZE]);
        let upload = |i: usize| {
            let req = hyper::Request::post(format!("http://{addr}/files?path=/tmp/up{i}.bin&username=user"))
                .header("e2b-sandbox-id", &id)
                .header("e2b-sandbox-port", "49983")
                .header("x-access-token", &access)
                .header("content-type", "application/octet-stream")
                .body(Full::new(data.clone()))
                .expect("a valid request");
            send(req)
        };
        let status = |field: &str| -> Result<f64> {
            let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
            let kib: f64 = text
                .lines()
                .find_map(|l| {
                    l.strip_prefix(field)
                        .and_then(|v| v.trim_start_matches(':').split_whitespace().next())
                })
                .context("no such field in /proc/PID/status")?
                .parse()?;
            Ok(kib * 1024.0 / 1e6)
        };
        rt.block_on(upload(UPLOADS))?;
        // Resets VmHWM, the peak resident set, to the current one.
        std::fs::write(format!("/proc/{pid}/clear_refs"), "5")?;
        let before = status("VmRSS")?;
        rt.block_on(async {
            let mut all = tokio::task::JoinSet::new();
            for i in 0..UPLOADS {
                all.spawn(upload(i));
            }
            while let Some(done) = all.join_next().await {
                done??;
            }
            Ok::<_, anyhow::Error>(())
        })?;
        let added = status("VmHWM")? - before;
        let _ = rt.block_on(send(
            hyper::Request::delete(format!("http://{addr}/sandboxes/{id}"))
                .header("x-api-key", &key)
                .body(Full::new(Bytes::new()))?,
        ));
        Ok(vec![Measurement {
            name: format!("E2B API: server peak RSS added by {UPLOADS} parallel 63 MiB uploads"),
            unit: "MB",
            median: added,
            p95: added,
            runs: 1,
            target: Some(64.0),
            lower_is_better: true,
            cairn_ratio: None,
        }])
    }

    /// E2B's code interpreter through the gateway, on the user's
    /// `code-interpreter` image imported into the benchmark's state
    /// directory: `Sandbox.create()`, the first `run_code("1+1")` after it
    /// (the kernel's own start, as its server timed it, beside), and warm
    /// `run_code("1+1")` round trips.
    fn code_interpreter(&self, creates: usize) -> Result<Vec<Measurement>> {
        const WARM: usize = 20;
        let Some(layer) = &self.interpreter else {
            eprintln!(
                "cairn bench: SKIPPED the code interpreter figures: the user's state directory has no \
                 code-interpreter image (`cairn image build code-interpreter` makes one in a few minutes)"
            );
            return Ok(Vec::new());
        };
        eprintln!(
            "cairn bench: importing the code-interpreter image from {}",
            layer.display()
        );
        let imported = Command::new(&self.exe)
            .args(["image", "import"])
            .arg(layer)
            .args(["--name", "code-interpreter"])
            .env("CAIRN_HOME", self.home.path())
            .stdout(Stdio::null())
            .status()?;
        if !imported.success() {
            bail!("cannot import the code-interpreter image into the benchmark's state directory ({imported})");
        }
        let key = self.engine()?.create_token("bench-code-interpreter", None)?.secret;
        let (served, addr) = self.serve_with(&["--e2b", "127.0.0.1:0"], "cairn: serving the E2B API on http://")?;
        let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
        let http = Client::builder(hyper_util::rt::TokioExecutor::new()).build_http::<Full<Bytes>>();
        let send = |req: hyper::Request<Full<Bytes>>| send_tcp(http.clone(), req);
        let port_request = |method: &str, path: &str, id: &str, token: &str, body: &str| {
            hyper::Request::builder()
                .method(method)
                .uri(format!("http://{addr}{path}"))
                .header("e2b-sandbox-id", id)
                .header(
                    "e2b-sandbox-port",
                    cairn_engine::images::CODE_INTERPRETER_PORT.to_string(),
                )
                .header("e2b-traffic-access-token", token)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body.to_string())))
        };
        // One cell; its `text/plain` result must be "2".
        let run_code = |id: &str, token: &str| -> Result<f64> {
            let t = Instant::now();
            let body = rt.block_on(send(port_request("POST", "/execute", id, token, r#"{"code":"1+1"}"#)?))?;
            let took = t.elapsed().as_secs_f64() * 1e3;
            let two = body.split(|b| *b == b'\n').any(|line| {
                serde_json::from_slice::<serde_json::Value>(line)
                    .is_ok_and(|e| e["type"] == "result" && e["text"] == "2")
            });
            if !two {
                bail!("run_code(\"1+1\") did not answer 2: {}", String::from_utf8_lossy(&body));
            }
            Ok(took)
        };
        let (mut create, mut first, mut kernel, mut warm) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..creates {
            let t = Instant::now();
            let created = rt.block_on(send(
                hyper::Request::post(format!("http://{addr}/v2/sandboxes"))
                    .header("x-api-key", &key)
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(
                        r#"{"templateID":"code-interpreter","timeout":600}"#,
                    )))?,
            ))?;
            create.push(t.elapsed().as_secs_f64() * 1e3);
            let created: serde_json::Value = serde_json::from_slice(&created)?;
            let id = created["sandboxID"].as_str().context("no sandboxID")?.to_string();
            let token = created["trafficAccessToken"].as_str().unwrap_or_default().to_string();
            let measured = (|| -> Result<()> {
                first.push(run_code(&id, &token)?);
                let contexts = rt.block_on(send(port_request("GET", "/contexts", &id, &token, "")?))?;
                let contexts: serde_json::Value = serde_json::from_slice(&contexts)?;
                if let Some(ms) = contexts
                    .as_array()
                    .and_then(|all| all.iter().find(|c| c["language"] == "python"))
                    .and_then(|c| c["start_ms"].as_f64())
                {
                    kernel.push(ms);
                }
                for _ in 0..WARM {
                    warm.push(run_code(&id, &token)?);
                }
                Ok(())
            })();
            let _ = rt.block_on(send(
                hyper::Request::delete(format!("http://{addr}/sandboxes/{id}"))
                    .header("x-api-key", &key)
                    .body(Full::new(Bytes::new()))?,
            ));
            measured?;
        }
        drop(served);
        let mut out = vec![
            summarize("E2B code interpreter: Sandbox.create()", "ms", create, None, true),
            summarize(
                "E2B code interpreter: first run_code(\"1+1\") after create",
                "ms",
                first,
                Some(1000.0),
                true,
            ),
        ];
        if !kernel.is_empty() {
            out.push(summarize(
                "E2B code interpreter: the Python kernel's own start (begins within create)",
                "ms",
                kernel,
                None,
                true,
            ));
        }
        out.push(summarize(
            "E2B code interpreter: warm run_code(\"1+1\") through the gateway",
            "ms",
            warm,
            Some(20.0),
            true,
        ));
        Ok(out)
    }

    fn serve_tcp(&self) -> Result<(Served, std::net::SocketAddr)> {
        self.serve_with(&["--listen", "127.0.0.1:0"], "cairn: serving on http://")
    }

    /// `cairn serve` with `args` (and a Unix socket of its own), and the
    /// address it printed after `prefix`.
    fn serve_with(&self, args: &[&str], prefix: &str) -> Result<(Served, std::net::SocketAddr)> {
        use std::io::BufRead;
        let socket = self.home.path().join("bench-flood.sock");
        let mut child = Command::new(&self.exe)
            .arg("serve")
            .args(args)
            .arg("--socket")
            .arg(&socket)
            .env("CAIRN_HOME", self.home.path())
            .env("CAIRN_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let stderr = child.stderr.take().context("no stderr")?;
        let served = Served { child, socket };
        let mut lines = io::BufReader::new(stderr).lines();
        let addr = loop {
            let line = lines.next().context("cairn serve stopped before listening")??;
            if let Some(rest) = line.strip_prefix(prefix) {
                break rest.split_whitespace().next().context("no address")?.parse()?;
            }
        };
        std::thread::spawn(move || for _ in lines.by_ref() {});
        Ok((served, addr))
    }
}

/// Sends `req` on `http`; the body of a 2xx answer, else an error naming
/// the status and the body.
async fn send_tcp(
    http: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    req: hyper::Request<Full<Bytes>>,
) -> Result<Bytes> {
    let resp = http.request(req).await?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    if !status.is_success() {
        bail!("{status}: {}", String::from_utf8_lossy(&body));
    }
    Ok(body)
}

/// Latencies (ms) of authenticated requests, and how many failed.
struct Latencies {
    tcp: Result<Vec<f64>>,
    unix: Result<Vec<f64>>,
    failed: usize,
}

/// `rounds` GETs of /v1/sandboxes on a new TCP connection each (with the
/// bearer token), and as many on the Unix socket, alternated.
async fn authenticated(
    tcp: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    unix: &Http,
    addr: std::net::SocketAddr,
    socket: &Path,
    token: &str,
    rounds: usize,
) -> Latencies {
    let (mut t, mut u, mut failed) = (Vec::new(), Vec::new(), 0);
    let mut first_error = None;
    for _ in 0..rounds {
        let req = hyper::Request::get(format!("http://{addr}/v1/sandboxes"))
            .header("authorization", format!("Bearer {token}"))
            .body(Full::new(Bytes::new()))
            .expect("a valid request");
        let t0 = Instant::now();
        match ok(tcp.request(req).await).await {
            Ok(()) => t.push(t0.elapsed().as_secs_f64() * 1e3),
            Err(e) => {
                failed += 1;
                first_error.get_or_insert(format!("TCP: {e}"));
            }
        }
        let t0 = Instant::now();
        match ok(unix.request(request("GET", socket, "/v1/sandboxes", "")).await).await {
            Ok(()) => u.push(t0.elapsed().as_secs_f64() * 1e3),
            Err(e) => {
                failed += 1;
                first_error.get_or_insert(format!("Unix socket: {e}"));
            }
        }
    }
    if let Some(e) = first_error {
        eprintln!("cairn bench: {failed} authenticated requests failed; the first: {e}");
    }
    let some = |v: Vec<f64>, what: &str| {
        if v.is_empty() {
            Err(anyhow::anyhow!("every request on {what} failed"))
        } else {
            Ok(v)
        }
    };
    Latencies {
        tcp: some(t, "TCP"),
        unix: some(u, "the Unix socket"),
        failed,
    }
}

async fn ok(resp: Result<hyper::Response<hyper::body::Incoming>, hyper_util::client::legacy::Error>) -> Result<()> {
    let resp = resp?;
    let status = resp.status();
    resp.into_body().collect().await?;
    if !status.is_success() {
        bail!("{status}");
    }
    Ok(())
}

/// `cairn bench-flood`: `connections` attackers from 127.0.2.1 and the
/// next `addresses - 1` addresses until stdin closes; see [`trickle`].
pub fn flood_attacker(to: std::net::SocketAddr, connections: usize, addresses: usize) -> Result<()> {
    use std::io::Write;
    use std::sync::atomic::Ordering;
    let nofile = raise_open_files(connections as u64 + 256);
    if nofile < connections as u64 + 64 {
        eprintln!("cairn bench: the descriptor limit ({nofile}) holds fewer than {connections} connections");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let stop = tokio_util::sync::CancellationToken::new();
    let lives = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let open = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks: Vec<_> = (0..connections)
        .map(|i| {
            let from = std::net::Ipv4Addr::new(127, 0, 2, 1 + (i % addresses.clamp(1, 250)) as u8);
            rt.spawn(trickle(
                from,
                to,
                stop.clone(),
                std::sync::Arc::clone(&lives),
                std::sync::Arc::clone(&open),
            ))
        })
        .collect();
    // Stdin closing is the signal to stop.
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = io::copy(&mut io::stdin(), &mut io::sink());
        let _ = done_tx.send(());
    });
    let mut shown = usize::MAX;
    let mut stdout = io::stdout();
    while done_rx.recv_timeout(Duration::from_millis(200)).is_err() {
        let now = open.load(Ordering::Relaxed);
        if now != shown {
            shown = now;
            writeln!(stdout, "open {now}")?;
        }
    }
    stop.cancel();
    rt.block_on(async {
        for t in tasks {
            let _ = t.await;
        }
    });
    let lives = std::mem::take(&mut *lives.lock().unwrap_or_else(|e| e.into_inner()));
    writeln!(stdout, "{}", serde_json::to_string(&lives)?)?;
    Ok(())
}

/// One attacker: connects from `from`, sends the start of a request and a
/// header line every 5 s, and when the server closes the connection notes
/// how long it lived and connects again 5 s later; until `stop`.
async fn trickle(
    from: std::net::Ipv4Addr,
    to: std::net::SocketAddr,
    stop: tokio_util::sync::CancellationToken,
    lives: std::sync::Arc<std::sync::Mutex<Vec<f64>>>,
    open: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let pause = Duration::from_secs(5);
    while !stop.is_cancelled() {
        let connected = async {
            let s = tokio::net::TcpSocket::new_v4()?;
            s.bind(std::net::SocketAddr::new(from.into(), 0))?;
            let mut c = s.connect(to).await?;
            c.write_all(b"GET /v1/sandboxes HTTP/1.1\r\nHost: cairn\r\n").await?;
            io::Result::Ok(c)
        };
        let mut conn = match connected.await {
            Ok(c) => c,
            Err(_) => {
                tokio::select! { _ = tokio::time::sleep(pause) => continue, _ = stop.cancelled() => return }
            }
        };
        open.fetch_add(1, Ordering::Relaxed);
        let born = Instant::now();
        let mut buf = [0u8; 256];
        let closed = loop {
            tokio::select! {
                r = conn.read(&mut buf) => match r {
                    Ok(0) | Err(_) => break true,
                    Ok(_) => {}
                },
                _ = tokio::time::sleep(pause) => {
                    if conn.write_all(b"X-Slow: 1\r\n").await.is_err() {
                        break true;
                    }
                }
                _ = stop.cancelled() => break false,
            }
        };
        open.fetch_sub(1, Ordering::Relaxed);
        if closed {
            lives
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(born.elapsed().as_secs_f64());
            tokio::select! { _ = tokio::time::sleep(pause) => {}, _ = stop.cancelled() => return }
        }
    }
}

/// Raises this process's descriptor limit to `want` where it may (root
/// can raise the hard limit too); the limit it has after.
fn raise_open_files(want: u64) -> u64 {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return 1024;
    };
    if soft >= want {
        return soft;
    }
    if setrlimit(Resource::RLIMIT_NOFILE, want, want.max(hard)).is_ok() {
        return want;
    }
    let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    hard.max(soft)
}

/// Notes when the first byte came.
#[derive(Default)]
struct FirstByte {
    at: Option<Instant>,
}

impl io::Write for FirstByte {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.at.is_none() && !buf.is_empty() {
            self.at = Some(Instant::now());
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

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
        Ok(out)
    }
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

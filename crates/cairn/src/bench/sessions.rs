//! `cairn bench sessions`: the context log on the embedded store (single
//! appends and tail reads beside a raw SQLite insert and select, at the
//! start of a log and again once it holds `--entries` entries), a native
//! session's suspend and resume with `--size` of files unchanged since its
//! last snapshot (beside a plain snapshot and restore of the same files),
//! and a gVisor session's resume to its first output.

use std::io::{self, Write};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use cairn_engine::{CreateOptions, Engine, Silent};
use cairn_protocol::ExecRequest;
use cairn_session::prelude::*;
use cairn_session::SessionRecord;
use cairn_session::{Entry, EntryKind, LogRange, SessionOptions};

use super::{summarize, Bench, Measurement};

/// What `cairn bench sessions` is asked for beyond the run count.
pub struct SessionsOptions {
    /// The log length the flatness figures are taken at.
    pub entries: u64,
    /// Bytes of files in the suspended and resumed session.
    pub size: u64,
}

/// Single appends (and tail reads) timed at each end of the log.
const WINDOW: usize = 1_000;
/// Entries per transaction while filling the log between the two windows.
const BATCH: usize = 10_000;
/// The entries a tail read returns.
const TAIL: usize = 100;

impl SessionsOptions {
    pub fn check(&self) -> Result<()> {
        if self.entries < 2 * WINDOW as u64 {
            bail!(
                "--entries must be at least {}: {WINDOW} appends are timed at each end",
                2 * WINDOW
            );
        }
        if self.size == 0 {
            bail!("--size must be above 0 (the empty session is measured beside it)");
        }
        Ok(())
    }
}

fn ms(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1e3
}

/// The `i`-th entry of the benchmark's log: the four kinds an agent's turn
/// writes, in turn, each a few hundred bytes.
fn entry(i: u64) -> Entry {
    let text = format!(
        "entry {i}: {}",
        "the agent reads the build log and decides what to try next; ".repeat(4)
    );
    let mut e = match i % 4 {
        0 => Entry::new(EntryKind::User),
        1 => Entry::new(EntryKind::Assistant),
        2 => Entry::new(EntryKind::ToolCall),
        _ => Entry::new(EntryKind::ToolResult),
    };
    match e.kind {
        EntryKind::ToolCall => {
            e.tool = Some("exec".into());
            e.arguments = Some(serde_json::json!({ "argv": ["sh", "-c", format!("make test-{i}")] }).to_string());
        }
        EntryKind::ToolResult => {
            e.tool = Some("exec".into());
            e.exit_status = Some(0);
            e.result = Some(serde_json::json!({ "stdout": text, "stderr": "" }).to_string());
        }
        EntryKind::User => {
            e.role = Some("user".into());
            e.content = Some(text);
        }
        _ => {
            e.role = Some("assistant".into());
            e.content = Some(text);
            e.tokens_in = Some(1200);
            e.tokens_out = Some(80);
        }
    }
    e
}

/// The peer for appends and tails: a table of the log's shape in a SQLite
/// database of its own, opened as the state store opens its own (WAL,
/// synchronous=NORMAL), one row per transaction, no hash chain, no head.
struct RawSqlite {
    conn: rusqlite::Connection,
    next: u64,
}

impl RawSqlite {
    fn open(path: &std::path::Path) -> Result<RawSqlite> {
        let conn = rusqlite::Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.execute_batch(
            "CREATE TABLE entries (session_id TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL,
             role TEXT, content TEXT, tool TEXT, arguments TEXT, result TEXT, exit_status INTEGER,
             created_at INTEGER NOT NULL, hash TEXT NOT NULL, PRIMARY KEY (session_id, seq))",
        )?;
        Ok(RawSqlite { conn, next: 1 })
    }

    fn insert(&mut self, e: &Entry) -> Result<()> {
        let tx = self
            .conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        tx.prepare_cached(
            "INSERT INTO entries (session_id, seq, kind, role, content, tool, arguments, result, exit_status,
             created_at, hash) VALUES ('bench', ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
        )?
        .execute(rusqlite::params![
            self.next,
            e.kind.as_str(),
            e.role,
            e.content,
            e.tool,
            e.arguments,
            e.result,
            e.exit_status,
            cairn_engine::now_ms(),
            cairn_session::GENESIS,
        ])?;
        tx.commit()?;
        self.next += 1;
        Ok(())
    }

    fn tail(&self, n: usize) -> Result<usize> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT seq, kind, role, content, tool, arguments, result, exit_status, created_at, hash
             FROM entries WHERE session_id = 'bench' ORDER BY seq DESC LIMIT ?1",
        )?;
        let rows = stmt.query_map([n as i64], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, Option<String>>(3)?,
                r.get::<_, String>(9)?,
            ))
        })?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?.len())
    }
}

/// Records when the first byte was written.
struct FirstByteAt(Option<Instant>);

impl Write for FirstByteAt {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.0.is_none() && !buf.is_empty() {
            self.0 = Some(Instant::now());
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// `median` and `p95` of `later` over `earlier`: how much a cost grew.
fn ratio(name: String, later: &Measurement, earlier: &Measurement, runs: usize, target: f64) -> Measurement {
    Measurement {
        name,
        unit: "x",
        median: later.median / earlier.median,
        p95: later.p95 / earlier.p95,
        runs,
        target: Some(target),
        lower_is_better: true,
        cairn_ratio: None,
    }
}

/// Runs `script` in the session's sandbox (through the session, so it is
/// recorded as an agent's call would be); it must exit 0.
fn session_sh(engine: &mut Engine, id: &str, script: &str) -> Result<()> {
    let argv = vec!["sh".into(), "-c".into(), script.into()];
    let out = engine.session_exec(id, argv, &mut io::sink(), &mut io::sink())?;
    if out.status != 0 {
        bail!("`{script}` exited {} in session {id}", out.status);
    }
    Ok(())
}

/// Milliseconds from `t0` to the first byte of `echo`'s output in `rec`.
fn first_echo(engine: &Engine, rec: &cairn_engine::SandboxRecord, t0: Instant) -> Result<f64> {
    let req = ExecRequest {
        argv: vec!["echo".into(), "hi".into()],
        ..ExecRequest::default()
    };
    let start = engine.exec(rec, req)?.map_err(|f| anyhow::anyhow!(f.message))?;
    let mut first = FirstByteAt(None);
    start.session.wait(&mut first, &mut io::sink())?;
    let at = first.0.context("echo printed nothing")?;
    Ok((at - t0).as_secs_f64() * 1e3)
}

impl Bench {
    pub(super) fn sessions(&self, runs: usize, opts: &SessionsOptions) -> Result<Vec<Measurement>> {
        let mut out = self.session_log(runs.min(200), opts.entries)?;
        out.extend(self.suspend_resume(runs.min(50), opts.size)?);
        match cairn_sandbox::gvisor::Runsc::locate() {
            Some(_) => out.extend(self.gvisor_session(runs.min(20))?),
            None => eprintln!(
                "cairn bench: runsc (gVisor) is not installed (apt-get install runsc); no gVisor session resume figure"
            ),
        }
        Ok(out)
    }

    /// Appends and tail reads at the start of a fresh log, a fill to
    /// `entries` by batches, the same again at the end.
    fn session_log(&self, reads: usize, entries: u64) -> Result<Vec<Measurement>> {
        let mut engine = self.engine()?;
        let s = engine.create_session(
            &SessionOptions {
                name: Some("bench-log".into()),
                ..SessionOptions::default()
            },
            &Silent,
        )?;
        let mut raw = RawSqlite::open(&self.home.path().join("raw-peer.db"))?;
        let appends = |engine: &Engine, s: &SessionRecord, from: u64| -> Result<Vec<f64>> {
            (from..from + WINDOW as u64)
                .map(|i| {
                    let e = entry(i);
                    let t0 = Instant::now();
                    engine.session_append(s, e)?;
                    Ok(ms(t0))
                })
                .collect()
        };
        let tails = |engine: &Engine, s: &SessionRecord| -> Result<Vec<f64>> {
            (0..reads)
                .map(|_| {
                    // A read looks the session up (its head) as `cairn session log` does.
                    let t0 = Instant::now();
                    let got = engine.session_log(&engine.session(&s.id)?, LogRange::Tail(TAIL))?;
                    let dt = ms(t0);
                    if got.len() != TAIL {
                        bail!("a tail read returned {} entries, not {TAIL}", got.len());
                    }
                    Ok(dt)
                })
                .collect()
        };
        // The peer's appends interleave with Cairn's, so disk noise falls on both.
        let mut first = Vec::with_capacity(WINDOW);
        let mut peer = Vec::with_capacity(WINDOW);
        for i in 1..=WINDOW as u64 {
            let e = entry(i);
            let t0 = Instant::now();
            raw.insert(&e)?;
            peer.push(ms(t0));
            let t0 = Instant::now();
            engine.session_append(&s, e)?;
            first.push(ms(t0));
        }
        let first_tails = tails(&engine, &s)?;
        let peer_tails = (0..reads)
            .map(|_| {
                let t0 = Instant::now();
                let n = raw.tail(TAIL)?;
                let dt = ms(t0);
                if n != TAIL {
                    bail!("the raw tail returned {n} rows, not {TAIL}");
                }
                Ok(dt)
            })
            .collect::<Result<Vec<f64>>>()?;

        let fill_to = entries - WINDOW as u64;
        let started = Instant::now();
        let mut at = WINDOW as u64;
        let mut said = 0;
        eprintln!(
            "cairn bench: filling the log to {fill_to} entries by batched appends ({BATCH} entries per transaction; \
             the timed appends are single)"
        );
        while at < fill_to {
            let n = (fill_to - at).min(BATCH as u64);
            let batch: Vec<Entry> = (at + 1..=at + n).map(entry).collect();
            engine.session_append_batch(&s, &batch)?;
            at += n;
            if at * 10 / fill_to > said {
                said = at * 10 / fill_to;
                eprintln!(
                    "cairn bench: {at} of {fill_to} entries ({:.0} s, {:.0} entries/s)",
                    started.elapsed().as_secs_f64(),
                    (at - WINDOW as u64) as f64 / started.elapsed().as_secs_f64()
                );
            }
        }
        let last = appends(&engine, &s, at + 1)?;
        let last_tails = tails(&engine, &s)?;
        let s = engine.session(&s.id)?;
        if s.head_seq != entries {
            bail!("the log holds {} entries, not {entries}", s.head_seq);
        }
        engine.close_session(&s.id, false)?;

        let n = WINDOW;
        let first = summarize(
            &format!("sessions: append one entry (engine API), first {n}"),
            "ms",
            first,
            Some(1.0),
            true,
        );
        let peer = summarize(
            "sessions: raw SQLite insert of one row (peer, same pragmas)",
            "ms",
            peer,
            None,
            true,
        )
        .peer_of(&first);
        let last = summarize(
            &format!("sessions: append one entry, last {n} of {entries}"),
            "ms",
            last,
            Some(1.0),
            true,
        );
        let first_tails = summarize(
            &format!("sessions: read the last {TAIL} entries, log of {n}"),
            "ms",
            first_tails,
            None,
            true,
        );
        let peer_tails = summarize(
            &format!("sessions: raw SQLite select of the last {TAIL} rows (peer)"),
            "ms",
            peer_tails,
            None,
            true,
        )
        .peer_of(&first_tails);
        let last_tails = summarize(
            &format!("sessions: read the last {TAIL} entries, log of {entries}"),
            "ms",
            last_tails,
            None,
            true,
        );
        let grow = ratio(format!("sessions: append, last {n} / first {n}"), &last, &first, n, 1.2);
        let tail_grow = ratio(
            format!("sessions: tail read, log of {entries} / of {n}"),
            &last_tails,
            &first_tails,
            reads,
            1.2,
        );
        Ok(vec![
            first,
            peer,
            last,
            grow,
            first_tails,
            peer_tails,
            last_tails,
            tail_grow,
        ])
    }

    /// Native sessions with no files and with `size` bytes of files, both
    /// already suspended once (the suspend that captures the files is not
    /// timed), then suspended and resumed in turn; beside them a plain
    /// sandbox over the same files, snapshotted and removed, then restored.
    fn suspend_resume(&self, runs: usize, size: u64) -> Result<Vec<Measurement>> {
        let mut engine = self.engine()?;
        let label = |bytes: u64| match bytes {
            0 => "no files".to_string(),
            b if b % (1 << 30) == 0 => format!("{} GiB of files", b >> 30),
            b => format!("{} MiB of files", b >> 20),
        };
        let mut ids = Vec::new();
        for bytes in [0, size] {
            let s = engine.create_session(
                &SessionOptions {
                    name: Some(format!("bench-suspend-{bytes}")),
                    ..SessionOptions::default()
                },
                &Silent,
            )?;
            if bytes > 0 {
                eprintln!(
                    "cairn bench: writing {} into a session and suspending it once (that suspend captures \
                     the files and is not timed)",
                    label(bytes)
                );
                let mib = bytes.div_ceil(1 << 20);
                let script = (0..mib.div_ceil(64))
                    .map(|i| {
                        format!(
                            "dd if=/dev/urandom of=/data/f{i} bs=1M count={} 2>/dev/null",
                            (mib - i * 64).min(64)
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(" && ");
                session_sh(&mut engine, &s.id, &format!("mkdir -p /data && {script}"))?;
            }
            engine.suspend_session(&s.id)?;
            engine.resume_session(&s.id)?;
            ids.push(s.id);
        }
        // The plain peer: a sandbox restored from the big session's newest
        // snapshot holds the same files, unchanged since that snapshot.
        let snap = engine
            .session(&ids[1])?
            .snapshot_id
            .context("the session recorded no snapshot")?;
        let mut snap = engine.snapshot_record(&snap)?;
        let mut plain = engine.restore(&snap, &CreateOptions::default())?;

        const WARM_UP: usize = 3;
        let mut samples: [[Vec<f64>; 3]; 2] = Default::default();
        let (mut plain_down, mut plain_up) = (Vec::new(), Vec::new());
        let (mut plain_snap, mut plain_rm) = (Vec::new(), Vec::new());
        for round in 0..WARM_UP + runs {
            let keep = round >= WARM_UP;
            for (k, id) in ids.iter().enumerate() {
                let t0 = Instant::now();
                engine.suspend_session(id)?;
                let down = ms(t0);
                let t0 = Instant::now();
                let s = engine.resume_session(id)?;
                let up = ms(t0);
                let sandbox = engine.sandbox(s.sandbox_id.as_deref().context("a resumed session has no sandbox")?)?;
                let first = first_echo(&engine, &sandbox, t0)?;
                if keep {
                    samples[k][0].push(down);
                    samples[k][1].push(up);
                    samples[k][2].push(first);
                }
            }
            let t0 = Instant::now();
            snap = engine.snapshot(&engine.sandbox(&plain.id)?, None)?;
            let snapped = ms(t0);
            engine.remove_sandbox(&engine.sandbox(&plain.id)?, true)?;
            let down = ms(t0);
            let t0 = Instant::now();
            plain = engine.restore(&snap, &CreateOptions::default())?;
            let up = ms(t0);
            if keep {
                plain_down.push(down);
                plain_snap.push(snapped);
                plain_rm.push(down - snapped);
                plain_up.push(up);
            }
        }
        engine.remove_sandbox(&engine.sandbox(&plain.id)?, true)?;
        for id in &ids {
            engine.close_session(id, false)?;
        }

        let mut out = Vec::new();
        let mut by_size = Vec::new();
        for (k, bytes) in [0, size].into_iter().enumerate() {
            let [down, up, first] = std::mem::take(&mut samples[k]);
            let what = label(bytes);
            let down = summarize(
                &format!("sessions: native suspend ({what})"),
                "ms",
                down,
                Some(50.0),
                true,
            );
            let up = summarize(&format!("sessions: native resume ({what})"), "ms", up, Some(50.0), true);
            let first = summarize(
                &format!("sessions: native resume to first output ({what})"),
                "ms",
                first,
                None,
                true,
            );
            by_size.push((down, up, first));
        }
        let (small, big) = (by_size.remove(0), by_size.remove(0));
        let what = label(size);
        let peer_down = summarize(
            &format!("sessions: plain snapshot + rm of a sandbox (peer, {what})"),
            "ms",
            plain_down,
            None,
            true,
        )
        .peer_of(&big.0);
        let parts = [("snapshot", plain_snap), ("rm", plain_rm)].map(|(part, samples)| {
            summarize(
                &format!("sessions: of which the plain {part} ({what})"),
                "ms",
                samples,
                None,
                true,
            )
        });
        let peer_up = summarize(
            &format!("sessions: plain restore of that snapshot (peer, {what})"),
            "ms",
            plain_up,
            None,
            true,
        )
        .peer_of(&big.1);
        let down_flat = ratio(format!("sessions: suspend, {what} / none"), &big.0, &small.0, runs, 1.2);
        let up_flat = ratio(format!("sessions: resume, {what} / none"), &big.1, &small.1, runs, 1.2);
        let [snap_part, rm_part] = parts;
        out.extend([
            small.0, small.1, small.2, big.0, big.1, big.2, peer_down, snap_part, rm_part, peer_up, down_flat, up_flat,
        ]);
        Ok(out)
    }

    /// A gVisor session with a process counting in memory: suspended (a
    /// memory snapshot), then `session exec echo` on it, which resumes it,
    /// timed to the first byte of output; beside it a plain restore of the
    /// same snapshot to the first output of echo.
    fn gvisor_session(&self, runs: usize) -> Result<Vec<Measurement>> {
        let mut engine = self.engine()?;
        let s = engine.create_session(
            &SessionOptions {
                name: Some("bench-gvisor".into()),
                driver: Some("gvisor".into()),
                ..SessionOptions::default()
            },
            &Silent,
        )?;
        let sandbox = engine.sandbox(s.sandbox_id.as_deref().context("a new session has no sandbox")?)?;
        let req = ExecRequest {
            argv: vec![
                "sh".into(),
                "-c".into(),
                "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 1; done".into(),
            ],
            detach: true,
            ..ExecRequest::default()
        };
        engine.exec(&sandbox, req)?.map_err(|f| anyhow::anyhow!(f.message))?;
        let (mut down, mut first, mut plain) = (Vec::new(), Vec::new(), Vec::new());
        let mut parts: [Vec<f64>; 3] = Default::default();
        for round in 0..runs + 1 {
            let t0 = Instant::now();
            let suspended = engine.suspend_session(&s.id)?;
            let dt = ms(t0);
            let t0 = Instant::now();
            let mut out = FirstByteAt(None);
            let done = engine.session_exec(&s.id, vec!["echo".into(), "hi".into()], &mut out, &mut io::sink())?;
            let at = out.0.context("echo printed nothing in the resumed session")?;
            if done.status != 0 {
                bail!("echo exited {} in the resumed gVisor session", done.status);
            }
            let snap = engine.snapshot_record(suspended.snapshot_id.as_deref().context("no snapshot recorded")?)?;
            let t1 = Instant::now();
            let rec = engine.restore(&snap, &CreateOptions::default())?;
            let plain_restore = ms(t1);
            let peer = first_echo(&engine, &rec, t1)?;
            engine.remove_sandbox(&engine.sandbox(&rec.id)?, true)?;
            // The parts, in a second cycle: the resume alone, then echo.
            engine.suspend_session(&s.id)?;
            let t2 = Instant::now();
            let resumed = engine.resume_session(&s.id)?;
            let resume = ms(t2);
            let sandbox = engine.sandbox(
                resumed
                    .sandbox_id
                    .as_deref()
                    .context("a resumed session has no sandbox")?,
            )?;
            let echo = first_echo(&engine, &sandbox, Instant::now())?;
            // The first round warms the runsc binary and the image cache.
            if round > 0 {
                down.push(dt);
                first.push((at - t0).as_secs_f64() * 1e3);
                plain.push(peer);
                parts[0].push(resume);
                parts[1].push(echo);
                parts[2].push(plain_restore);
            }
        }
        engine.close_session(&s.id, false)?;
        let first = summarize(
            "sessions: gvisor resume to first output (session exec echo)",
            "ms",
            first,
            Some(300.0),
            true,
        );
        let plain = summarize(
            "sessions: gvisor plain restore to first output (peer)",
            "ms",
            plain,
            None,
            true,
        )
        .peer_of(&first);
        let down = summarize("sessions: gvisor suspend (memory snapshot)", "ms", down, None, true);
        let [resume, echo, plain_restore] = parts;
        let parts = [
            ("sessions: gvisor of which the resume (restore with memory)", resume),
            ("sessions: gvisor of which echo's first output after it", echo),
            ("sessions: gvisor of which the plain restore (peer)", plain_restore),
        ]
        .map(|(name, samples)| summarize(name, "ms", samples, None, true));
        let mut out = vec![down, first, plain];
        out.extend(parts);
        Ok(out)
    }
}

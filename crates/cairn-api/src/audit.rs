//! Who did what: one audit row per request (`cairn audit`), with the token
//! and tenant that made it, written behind the answer.
//!
//! A request only hands its row to a channel; one thread writes what
//! gathered in one transaction, so no request waits for the store. Rows
//! older than [`KEPT`] go once an hour. When the store cannot keep up
//! (more than [`QUEUE`] rows waiting) rows are dropped and counted, and the
//! count is logged: the API never slows down or fails for its audit.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_engine::tenants::AuditEntry;
use cairn_engine::{now_ms, Engine, Home};

/// Rows waiting for the writer beyond this are dropped.
const QUEUE: usize = 16 * 1024;
/// Rows written in one transaction at most.
const BATCH: usize = 1024;
/// How long the writer gathers rows before it writes them.
const GATHER: Duration = Duration::from_millis(100);

/// A batch written this long after its first row was made is logged.
const SLOW: Duration = Duration::from_secs(1);
/// Times a batch is written before its rows are dropped.
const WRITE_TRIES: usize = 4;
/// How long rows are kept.
pub const KEPT: Duration = Duration::from_secs(30 * 24 * 3600);

pub struct Audit {
    tx: SyncSender<AuditEntry>,
    dropped: Arc<AtomicU64>,
}

impl Audit {
    pub fn start(home: Home) -> Audit {
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE);
        let dropped = Arc::new(AtomicU64::new(0));
        let d = Arc::clone(&dropped);
        let started = std::thread::Builder::new()
            .name("cairn-audit".into())
            .spawn(move || write_rows(home, rx, d));
        if let Err(e) = started {
            tracing::error!("cannot start the audit writer: {e}; requests are not audited");
        }
        Audit { tx, dropped }
    }

    /// Records one request; never waits.
    pub fn record(
        &self,
        token: Option<&str>,
        tenant: Option<&str>,
        surface: &str,
        method: &str,
        path: &str,
        status: u16,
    ) {
        let row = AuditEntry::now(token, tenant, surface, method, path, i64::from(status));
        match self.tx.try_send(row) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

fn write_rows(home: Home, rx: Receiver<AuditEntry>, dropped: Arc<AtomicU64>) {
    let mut engine: Option<Engine> = None;
    // None: not yet pruned by this writer (an Instant an hour back would
    // not exist on a host up for less than an hour).
    let mut pruned: Option<Instant> = None;
    let mut told = 0;
    while let Ok(first) = rx.recv() {
        // What arrives within GATHER goes in the same transaction: at most
        // one commit per GATHER however busy the server is.
        let mut rows = vec![first];
        let until = Instant::now() + GATHER;
        while rows.len() < BATCH {
            let left = until.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(r) => rows.push(r),
                Err(_) => break,
            }
        }
        if engine.is_none() {
            match Engine::open(home.clone()) {
                Ok(e) => engine = Some(e),
                Err(e) => {
                    tracing::warn!("audit: cannot open the state store: {e}; {} rows dropped", rows.len());
                    dropped.fetch_add(rows.len() as u64, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_secs(1));
                    continue;
                }
            }
        }
        let Some(e) = &engine else { continue };
        // A store busy for a moment (another command's long transaction)
        // gets the batch again before it is dropped.
        let writing = Instant::now();
        let mut written = e.record_audit(&rows);
        for _ in 0..WRITE_TRIES - 1 {
            if written.is_ok() {
                break;
            }
            std::thread::sleep(GATHER * 2);
            written = e.record_audit(&rows);
        }
        match written {
            Err(err) => {
                tracing::warn!("audit: cannot write {} rows: {err}", rows.len());
                dropped.fetch_add(rows.len() as u64, Ordering::Relaxed);
            }
            // Rows wait in the queue meanwhile (none is lost), but `cairn
            // token log` shows them late: say so, with how late.
            Ok(()) => {
                let late = now_ms().saturating_sub(rows[0].at);
                if late >= SLOW.as_millis() as i64 {
                    tracing::warn!(
                        "audit: {} rows written {:.1} s after the first was made ({:.1} s of it writing: \
                         the state store was slow to take them)",
                        rows.len(),
                        late as f64 / 1e3,
                        writing.elapsed().as_secs_f64()
                    );
                }
            }
        }
        if pruned.is_none_or(|at| at.elapsed() >= Duration::from_secs(3600)) {
            pruned = Some(Instant::now());
            if let Err(err) = e.prune_audit(now_ms() - KEPT.as_millis() as i64) {
                tracing::warn!("audit: cannot remove old rows: {err}");
            }
        }
        let lost = dropped.load(Ordering::Relaxed);
        if lost > told {
            tracing::warn!("audit: {lost} rows dropped so far (the state store did not keep up)");
            told = lost;
        }
    }
}

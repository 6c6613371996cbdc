//! envd's directory watchers (`CreateWatcher`, `GetWatcherEvents`,
//! `RemoveWatcher`, and the streamed `WatchDir`) over init's watches
//! ([`cairn_sandbox::client::InitClient::watch`]): a thread per watcher
//! reads its events into a bounded buffer that the client drains.

use std::collections::{HashMap, VecDeque};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use cairn_protocol::{WatchEvent, WatchKind};
use cairn_sandbox::client::DirWatch;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::rpc::{frame, Rpc, RpcError};
use super::Gateway;

/// Events a watcher keeps between two polls; later ones are counted as lost.
const BUFFERED_MAX: usize = 10_000;
/// Watchers one E2B sandbox may have.
const PER_SANDBOX_MAX: usize = 32;

/// What a watcher's thread collected since the last poll.
#[derive(Default)]
struct Buffer {
    events: VecDeque<WatchEvent>,
    lost: u64,
    /// The watch ended: the directory went, or the sandbox stopped.
    ended: bool,
}

pub(crate) struct Watcher {
    /// The E2B sandbox it belongs to.
    sandbox: String,
    buffer: Arc<Mutex<Buffer>>,
    stop: UnixStream,
}

/// The watchers of every sandbox, by id.
#[derive(Default)]
pub(crate) struct Watchers(Mutex<HashMap<String, Watcher>>);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn event_json(e: &WatchEvent) -> Value {
    let kind = match e.kind {
        WatchKind::Create => "EVENT_TYPE_CREATE",
        WatchKind::Write => "EVENT_TYPE_WRITE",
        WatchKind::Remove => "EVENT_TYPE_REMOVE",
        WatchKind::Rename => "EVENT_TYPE_RENAME",
        WatchKind::Chmod => "EVENT_TYPE_CHMOD",
    };
    json!({ "name": e.name, "type": kind })
}

impl Watchers {
    /// Starts collecting `watch`'s events for E2B sandbox `sandbox`;
    /// returns the watcher's id.
    pub(super) fn add(&self, sandbox: &str, mut watch: DirWatch) -> Rpc<String> {
        let stop = watch
            .stopper()
            .map_err(|e| RpcError::new("internal", format!("cannot keep the watch: {e}")))?;
        let mut all = lock(&self.0);
        // Watchers whose watch ended and whose last events were taken go.
        all.retain(|_, w| {
            let b = lock(&w.buffer);
            !(b.ended && b.events.is_empty())
        });
        if all.values().filter(|w| w.sandbox == sandbox).count() >= PER_SANDBOX_MAX {
            return Err(RpcError::new(
                "resource_exhausted",
                format!("sandbox {sandbox} already has {PER_SANDBOX_MAX} watchers; remove one first"),
            ));
        }
        let id = {
            let mut bytes = [0u8; 12];
            getrandom::getrandom(&mut bytes)
                .map_err(|e| RpcError::new("internal", format!("cannot make a watcher id: {e}")))?;
            bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
        };
        let buffer = Arc::new(Mutex::new(Buffer::default()));
        let collected = Arc::clone(&buffer);
        std::thread::Builder::new()
            .name("e2b-watch".into())
            .spawn(move || {
                while let Ok(Some(events)) = watch.next_events() {
                    let mut b = lock(&collected);
                    for e in events {
                        if b.events.len() < BUFFERED_MAX {
                            b.events.push_back(e);
                        } else {
                            b.lost += 1;
                        }
                    }
                }
                lock(&collected).ended = true;
            })
            .map_err(|e| RpcError::new("internal", format!("cannot start the watch's thread: {e}")))?;
        all.insert(
            id.clone(),
            Watcher {
                sandbox: sandbox.to_string(),
                buffer,
                stop,
            },
        );
        Ok(id)
    }

    /// The events watcher `id` of `sandbox` collected since the last call.
    pub(super) fn take(&self, sandbox: &str, id: &str) -> Rpc<Value> {
        let all = lock(&self.0);
        let w = all
            .get(id)
            .filter(|w| w.sandbox == sandbox)
            .ok_or_else(|| RpcError::new("not_found", format!("watcher {id} not found")))?;
        let mut b = lock(&w.buffer);
        if b.lost > 0 {
            tracing::warn!(
                watcher = id,
                lost = b.lost,
                "a watcher was not polled in time and lost events"
            );
            b.lost = 0;
        }
        let events: Vec<Value> = b.events.drain(..).map(|e| event_json(&e)).collect();
        Ok(json!({ "events": events }))
    }

    /// Ends watcher `id` of `sandbox`.
    pub(super) fn remove(&self, sandbox: &str, id: &str) -> Rpc<Value> {
        let mut all = lock(&self.0);
        match all.get(id) {
            Some(w) if w.sandbox == sandbox => {
                let _ = w.stop.shutdown(Shutdown::Both);
                all.remove(id);
                Ok(json!({}))
            }
            _ => Err(RpcError::new("not_found", format!("watcher {id} not found"))),
        }
    }

    /// Ends every watcher of `sandbox` (it was killed or paused).
    pub(crate) fn forget_sandbox(&self, sandbox: &str) {
        lock(&self.0).retain(|_, w| {
            if w.sandbox == sandbox {
                let _ = w.stop.shutdown(Shutdown::Both);
            }
            w.sandbox != sandbox
        });
    }
}

/// Relays `watch`'s events as `WatchDir` stream frames (each a
/// `WatchDirResponse`, whose oneof is the message's own field, unlike a
/// process event's: `start` first,
/// then one `filesystem` event each) until the client goes or the watch
/// ends.
pub(super) fn relay(mut watch: DirWatch, tx: mpsc::Sender<Bytes>) {
    let stop = watch.stopper().ok();
    if tx.blocking_send(frame(0, &json!({ "start": {} }))).is_err() {
        return;
    }
    // The client going is noticed on the next send; a watch with no events
    // is ended by a thread that waits for the channel to close.
    let closed = tx.clone();
    if let Some(stop) = stop {
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().build();
            if let Ok(rt) = rt {
                rt.block_on(closed.closed());
            }
            let _ = stop.shutdown(Shutdown::Both);
        });
    }
    while let Ok(Some(events)) = watch.next_events() {
        for e in &events {
            if tx
                .blocking_send(frame(0, &json!({ "filesystem": event_json(e) })))
                .is_err()
            {
                return;
            }
        }
    }
    let _ = tx.blocking_send(super::rpc::end_of_stream(None));
}

impl Gateway {
    pub(crate) fn watchers(&self) -> &Watchers {
        &self.watchers
    }
}

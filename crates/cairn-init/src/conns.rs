//! The registry of open host connections, so that a quiesce can end them.
//!
//! Every accepted connection is registered here and holds a [`Live`] until
//! its last user lets go; quiescing itself (ending the others, stopping the
//! accept loop) is [`crate::listen`]'s.

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

/// Every open host connection, so a quiesce can end them.
#[derive(Default)]
pub struct Connections {
    pub(crate) streams: Mutex<HashMap<u64, UnixStream>>,
    next: AtomicU64,
    /// Set by a quiesce request; the accept loop answers on the sender.
    pub(crate) quiesce: Mutex<Option<Sender<()>>>,
    /// From the start of a quiesce until init listens again: new
    /// connections are closed at once.
    pub(crate) quiescing: AtomicBool,
}

/// One connection's registration: dropped with the last holder of the
/// connection's socket (the serving loop's exec, or the thread serving
/// another request), which removes it from [`Connections`].
pub struct Live {
    pub(crate) id: u64,
    conns: Arc<Connections>,
}

impl Drop for Live {
    fn drop(&mut self) {
        self.conns
            .streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
    }
}

impl Connections {
    pub fn register(self: &Arc<Self>, stream: &UnixStream) -> Arc<Live> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(copy) = stream.try_clone() {
            self.streams.lock().unwrap_or_else(|e| e.into_inner()).insert(id, copy);
        }
        Arc::new(Live {
            id,
            conns: Arc::clone(self),
        })
    }
}

//! Suspended gVisor sessions kept ready to resume (`cairn serve
//! --session-warm`).
//!
//! A session on the gvisor driver suspends into a memory snapshot. Half of
//! resuming it does not depend on that snapshot's image: runsc creating
//! the sandbox. A long-lived process (the server) pays that half right
//! after the suspend ([`SessionResumes::prepare_session_resume`]: a sandbox named
//! for the session, state `creating`, its runsc sandbox waiting and holding
//! none of the session's memory), and the resume, in whichever of its
//! engines it comes, only loads the image into it. The prepared sandboxes
//! live in [`WarmResumes`], shared by the process's engines; one whose
//! session moved on (resumed elsewhere, closed, suspended again) is
//! removed by [`SessionResumes::prune_warm_resumes`]. A process that dies leaves
//! them to the next Cairn command, which removes them as any interrupted
//! create, and the session resumes the ordinary way.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::prelude::*;
use crate::steps::*;
use crate::SessionState;
use cairn_engine::snapshots::PreparedRestore;
use cairn_engine::tenants::Owned;
use cairn_engine::{Engine, EngineError};

/// Resumes prepared ahead, by session id; shared by the engines of one
/// process (clones share it). The default keeps none.
#[derive(Clone, Default)]
pub struct WarmResumes {
    inner: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    /// How many may be kept at once; 0: none.
    max: usize,
    slots: Mutex<HashMap<String, PreparedRestore>>,
}

impl WarmResumes {
    /// Keeps at most `max` prepared resumes (0 turns it off).
    pub fn new(max: usize) -> WarmResumes {
        WarmResumes {
            inner: Arc::new(Shared {
                max,
                slots: Mutex::default(),
            }),
        }
    }

    fn slots(&self) -> MutexGuard<'_, HashMap<String, PreparedRestore>> {
        self.inner.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether one more may be prepared for `session` (a session holding
    /// one counts as room: its new one replaces it).
    fn has_room(&self, session: &str) -> bool {
        let slots = self.slots();
        slots.contains_key(session) || slots.len() < self.inner.max
    }

    fn holds(&self, session: &str, snapshot: &str) -> bool {
        self.slots().get(session).is_some_and(|p| p.snapshot() == snapshot)
    }

    /// Keeps `p` for `session` unless another took the room meanwhile;
    /// answers whether it was kept, and what is to be removed: what it
    /// replaced, or `p` itself.
    fn put(&self, session: &str, p: PreparedRestore) -> (bool, Option<PreparedRestore>) {
        let mut slots = self.slots();
        if !slots.contains_key(session) && slots.len() >= self.inner.max {
            return (false, Some(p));
        }
        (true, slots.insert(session.to_string(), p))
    }

    /// Takes what is kept for `session`, whatever snapshot it restores.
    fn take(&self, session: &str) -> Option<PreparedRestore> {
        self.slots().remove(session)
    }

    /// The sessions kept for, and the snapshot each restores.
    fn kept(&self) -> Vec<(String, String)> {
        self.slots()
            .iter()
            .map(|(s, p)| (s.clone(), p.snapshot().to_string()))
            .collect()
    }
}

/// Session resumes prepared ahead (at a suspend, by a long-lived process).
pub trait SessionResumes {
    /// Shares `warm` with this engine: its session resumes use what is
    /// prepared there, and [`Self::prepare_session_resume`] keeps there.
    fn share_warm_resumes(&mut self, warm: WarmResumes);

    /// Prepares the resume of suspended session `key` ahead (see the
    /// module's comment). Answers whether one is kept for it now; `false`
    /// where it is not to be: no room, a session that is not suspended
    /// (or busy), a snapshot without memory, a tenant with limits (a
    /// prepared sandbox would hold one of its slots, which a suspended
    /// session does not), or a runsc that cannot restore into a created
    /// sandbox.
    fn prepare_session_resume(&mut self, key: &str) -> Result<bool, EngineError>;

    /// Removes the prepared resumes whose session moved on: no longer
    /// suspended in the snapshot prepared (resumed by another process,
    /// suspended again, closed, deleted). A session busy with a suspend or
    /// resume is left for the next call. Answers how many were removed.
    fn prune_warm_resumes(&mut self) -> Result<usize, EngineError>;
}

impl SessionResumes for Engine {
    fn share_warm_resumes(&mut self, warm: WarmResumes) {
        self.set_extension(warm);
    }

    fn prepare_session_resume(&mut self, key: &str) -> Result<bool, EngineError> {
        let id = self.session(key)?.id;
        if !self.warm().has_room(&id) {
            return Ok(false);
        }
        self.as_owner_of(Owned::Session, &id, |e| e.prepare_owned_resume(&id))
    }

    fn prune_warm_resumes(&mut self) -> Result<usize, EngineError> {
        let mut removed = 0;
        for (id, snapshot) in self.warm().kept() {
            let Some(_held) = self.lock_session(&id, true, false)? else {
                continue;
            };
            let waits = self
                .session(&id)
                .is_ok_and(|s| s.state == SessionState::Suspended && s.snapshot_id.as_deref() == Some(&snapshot));
            if waits {
                continue;
            }
            if let Some(p) = self.warm().take(&id) {
                self.discard_stale(&id, p);
                removed += 1;
            }
        }
        Ok(removed)
    }
}

pub(crate) trait WarmSteps {
    /// The resumes this engine shares ([`SessionResumes::share_warm_resumes`]);
    /// none kept unless shared.
    fn warm(&self) -> WarmResumes;

    fn prepare_owned_resume(&mut self, id: &str) -> Result<bool, EngineError>;

    /// What was prepared for session `id`'s resume from `snapshot`, taken.
    /// One prepared from another snapshot is removed.
    fn take_warm_resume(&mut self, id: &str, snapshot: Option<&str>) -> Option<PreparedRestore>;

    /// Removes a prepared resume no longer wanted; its sandbox may be gone
    /// already (a resume in another process removed it as a leftover).
    fn discard_stale(&mut self, session: &str, p: PreparedRestore);
}

impl WarmSteps for Engine {
    fn warm(&self) -> WarmResumes {
        self.extension::<WarmResumes>().cloned().unwrap_or_default()
    }

    fn prepare_owned_resume(&mut self, id: &str) -> Result<bool, EngineError> {
        if let Some(tenant) = self.db().acting_for() {
            if self.tenant(&tenant)?.has_limits() {
                return Ok(false);
            }
        }
        let suspended_in = |s: &crate::SessionRecord| match (&s.state, &s.snapshot_id) {
            (SessionState::Suspended, Some(snapshot)) => Some(snapshot.clone()),
            _ => None,
        };
        let Some(snapshot) = suspended_in(&self.session(id)?) else {
            return Ok(false);
        };
        if self.warm().holds(id, &snapshot) {
            return Ok(true);
        }
        let snap = self.snapshot_record(&snapshot)?;
        if snap.driver != "gvisor" {
            return Ok(false);
        }
        // Held while preparing: a resume that comes meanwhile waits for it
        // and then finds it ready (a suspend or close of the suspended
        // session waits too; see `lock_unless_running`).
        let Some(_held) = self.lock_session(id, true, false)? else {
            return Ok(false);
        };
        let s = self.session(id)?;
        if suspended_in(&s).as_deref() != Some(snapshot.as_str()) {
            return Ok(false);
        }
        // One kept from an older snapshot goes first: it bears the name.
        if let Some(stale) = self.warm().take(id) {
            self.discard_stale(id, stale);
        }
        // Named for the session as its resume names the sandbox it makes:
        // a resume in another process removes it as a leftover.
        let prepared = match self.prepare_restore(&snap, &crate::ops::session_sandbox_options(&s, id)) {
            Ok(p) => p,
            Err(EngineError::CannotPrepare { .. }) => return Ok(false),
            Err(e) => return Err(e),
        };
        let (kept, unwanted) = self.warm().put(id, prepared);
        if let Some(p) = unwanted {
            self.discard_stale(id, p);
        }
        Ok(kept)
    }

    fn take_warm_resume(&mut self, id: &str, snapshot: Option<&str>) -> Option<PreparedRestore> {
        let p = self.warm().take(id)?;
        if snapshot == Some(p.snapshot()) {
            return Some(p);
        }
        self.discard_stale(id, p);
        None
    }

    fn discard_stale(&mut self, session: &str, p: PreparedRestore) {
        if let Err(e) = self.discard_prepared(p) {
            tracing::warn!(session, "removing a resume prepared ahead: {e}");
        }
    }
}

//! Paused gVisor sandboxes kept ready to resume (`cairn serve --e2b-warm`).
//!
//! After a pause that kept memory, the restore of its snapshot is prepared
//! ahead ([`Engine::prepare_restore`]: a sandbox whose runsc sandbox is
//! created and waits, running nothing and holding no memory of its own), so
//! the resume pays only for loading the image, not for creating the
//! sandbox. At most `--e2b-warm` sandboxes are kept so; a paused sandbox
//! beyond that, of a tenant with limits (a prepared sandbox would hold one
//! of its slots, which a paused one does not), after a server restart, or
//! on a runsc that cannot restore into a created sandbox resumes the
//! ordinary way. A prepared sandbox is in state `creating`, owned by the
//! server: if the server dies, the next Cairn command removes it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cairn_engine::{CreateOptions, Engine, EngineError, PreparedRestore};

use super::{Gateway, Life};
use crate::app::App;

/// Resumes prepared ahead, by E2B sandbox id.
pub(crate) struct Warm {
    /// How many may be kept (`--e2b-warm`); 0: none.
    max: usize,
    slots: Mutex<HashMap<String, Slot>>,
}

enum Slot {
    /// Being prepared from this snapshot.
    Preparing(String),
    Ready(Box<PreparedRestore>),
}

impl Warm {
    pub(crate) fn new(max: usize) -> Warm {
        Warm {
            max,
            slots: Mutex::default(),
        }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts preparing the resume of E2B sandbox `id`, just paused as
    /// `snapshot`, unless as many are kept already. Runs on; a failure
    /// only means the resume will not be fast.
    pub(crate) fn prepare(gw: &Arc<Gateway>, id: &str, snapshot: &str, tenant: Option<String>) {
        {
            let mut slots = gw.warm.slots();
            if slots.len() >= gw.warm.max {
                return;
            }
            slots.insert(id.to_string(), Slot::Preparing(snapshot.to_string()));
        }
        let gw = Arc::clone(gw);
        let (id, snapshot) = (id.to_string(), snapshot.to_string());
        tokio::spawn(async move {
            let snap = snapshot.clone();
            let whose = tenant.clone();
            let made = crate::tenancy::acting(
                tenant,
                gw.app.engine(move |en| Ok(prepare(en, &snap, whose.as_deref())?)),
            )
            .await;
            let prepared = match made {
                Ok(Some(p)) => p,
                Ok(None) => return gw.warm.clear_preparing(&id, &snapshot),
                Err(e) => {
                    tracing::warn!(
                        sandbox = id,
                        "e2b: cannot prepare a paused sandbox's resume: {}",
                        e.message
                    );
                    return gw.warm.clear_preparing(&id, &snapshot);
                }
            };
            // Kept only if the sandbox is still paused as this snapshot and
            // nobody took or dropped its slot meanwhile.
            let still_paused = gw
                .entry(&id)
                .is_some_and(|e| matches!(&e.life, Life::Paused { snapshot: s } if *s == snapshot));
            let unwanted = {
                let mut slots = gw.warm.slots();
                match slots.get(&id) {
                    Some(Slot::Preparing(s)) if *s == snapshot && still_paused => {
                        slots.insert(id.clone(), Slot::Ready(Box::new(prepared)));
                        None
                    }
                    _ => Some(prepared),
                }
            };
            if let Some(p) = unwanted {
                discard(&gw.app, p);
            }
        });
    }

    fn clear_preparing(&self, id: &str, snapshot: &str) {
        let mut slots = self.slots();
        if matches!(slots.get(id), Some(Slot::Preparing(s)) if s == snapshot) {
            slots.remove(id);
        }
    }

    /// What was prepared for the resume of `id` from `snapshot`, if it is
    /// ready; its slot is emptied either way (one still being prepared is
    /// discarded once ready).
    pub(crate) fn take(&self, app: &Arc<App>, id: &str, snapshot: &str) -> Option<PreparedRestore> {
        match self.slots().remove(id)? {
            Slot::Ready(p) if p.snapshot() == snapshot => Some(*p),
            Slot::Ready(p) => {
                discard(app, *p);
                None
            }
            Slot::Preparing(_) => None,
        }
    }

    /// Drops what is prepared (or being prepared) for `id`: it was killed.
    pub(crate) fn forget(&self, app: &Arc<App>, id: &str) {
        if let Some(Slot::Ready(p)) = self.slots().remove(id) {
            discard(app, *p);
        }
    }
}

/// Prepares the restore of `snapshot` for `tenant` (the engine acts for
/// it); `None` where it is not to be: a tenant with limits, or a snapshot
/// or runsc that cannot be.
fn prepare(en: &mut Engine, snapshot: &str, tenant: Option<&str>) -> Result<Option<PreparedRestore>, EngineError> {
    if let Some(tenant) = tenant {
        if en.tenant(tenant)?.has_limits() {
            return Ok(None);
        }
    }
    let snap = en.snapshot_record(snapshot)?;
    match en.prepare_restore(&snap, &CreateOptions::default()) {
        Ok(p) => Ok(Some(p)),
        Err(EngineError::CannotPrepare { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Removes a prepared sandbox nobody will use, in the background.
fn discard(app: &Arc<App>, p: PreparedRestore) {
    let app = Arc::clone(app);
    tokio::spawn(async move {
        let id = p.sandbox().id.clone();
        if let Err(e) = app.engine(move |en| Ok(en.discard_prepared(p)?)).await {
            tracing::warn!(sandbox = id, "e2b: cannot remove a prepared sandbox: {}", e.message);
        }
    });
}

//! Finishing a gVisor checkpoint window that a Cairn process left open when
//! it died (see `cairn_sandbox::gvisor::window`): a memory snapshot stops
//! the sandbox (`runsc checkpoint`) and restores it, and a crash between
//! the two would otherwise leave a stage nothing to re-attach to.
//!
//! Reconciliation (every Cairn command, at open) finds the window and lets
//! the driver finish it: the sandbox goes on, is adopted from a restore
//! left running, is restored from the complete image, or is lost (then
//! marked exited, as a sandbox whose process died). What happened is noted
//! in the sandbox directory (`recovered`) until the pipeline stage that
//! owns the sandbox records it as an event ([`Engine::settle_window`]).

use std::fs;
use std::io::Write;
use std::path::Path;

use cairn_sandbox::gvisor::window::Window;
use cairn_sandbox::gvisor::Recovery;

use crate::sandboxes::process_of;
use crate::state::{SandboxRecord, SandboxState};
use crate::{Engine, EngineError};

/// In a sandbox directory: what finishing its checkpoint windows did, one
/// sentence a line, until a stage's event takes them.
const NOTE: &str = "recovered";

impl Engine {
    /// Whether `rec` has a checkpoint window open.
    pub(crate) fn window_open(&self, rec: &SandboxRecord) -> bool {
        rec.driver == "gvisor" && Window::of(&self.home.sandbox(&rec.id)).is_open()
    }

    /// Finishes the checkpoint window of running sandbox `rec`, unless its
    /// owner still holds the sandbox's lifecycle lock (it is in the window).
    pub(crate) fn finish_window(&mut self, rec: &SandboxRecord) -> Result<(), EngineError> {
        let _lifecycle = match self.lock_sandbox(&rec.id, false) {
            Ok(None) => return Ok(()),
            Ok(Some(lock)) => Some(lock),
            Err(_) => None,
        };
        self.finish_window_locked(rec)
    }

    /// Before a pipeline stage decides whether its sandbox is alive: a
    /// window of that sandbox that another Cairn command is finishing now
    /// (restoring a large image takes seconds) is waited for, one left open
    /// is finished, and what was done becomes the stage's `recovered` event.
    pub fn settle_window(&mut self, run: &str, stage: &str, branch: &str, sandbox: &str) -> Result<(), EngineError> {
        if let Ok(rec) = self.sandbox(sandbox) {
            if rec.state == SandboxState::Running && self.window_open(&rec) {
                // The stage owns the sandbox: waiting for its lock is safe.
                let _lifecycle = self.lock_sandbox(&rec.id, true).ok();
                self.finish_window_locked(&rec)?;
            }
        }
        self.note_recovery(run, stage, branch, sandbox)
    }

    /// [`Self::finish_window`], the sandbox's lifecycle lock held.
    fn finish_window_locked(&mut self, rec: &SandboxRecord) -> Result<(), EngineError> {
        // Read again once it is ours: another process may have finished it.
        let Some(now) = self
            .db
            .find_sandboxes(&rec.id)?
            .into_iter()
            .find(|r| r.id == rec.id && r.state == SandboxState::Running)
        else {
            return Ok(());
        };
        let dir = self.home.sandbox(&rec.id);
        let window = Window::of(&dir);
        if !window.is_open() {
            return Ok(());
        }
        let recovery = self
            .spec(&now)
            .and_then(|spec| {
                let gvisor = self.gvisor()?;
                Ok(gvisor
                    .recover(&spec, process_of(&now))
                    .map_err(cairn_sandbox::SandboxError::from)?)
            })
            .unwrap_or_else(|e| Recovery::Lost(format!("finishing its checkpoint failed: {e}")));
        let note = match recovery {
            Recovery::NoWindow => return Ok(()),
            Recovery::NotTaken => {
                "a memory checkpoint was interrupted before it stopped the sandbox (or one that leaves it running \
                 was, while it was paused); the sandbox ran on"
                    .to_string()
            }
            Recovery::Finished => {
                "a memory checkpoint had completed and the sandbox had gone on from its image".to_string()
            }
            Recovery::Adopted(p) => {
                self.db.set_process(&rec.id, p.pid, p.start_time)?;
                "a memory checkpoint was interrupted while the sandbox was restored; the restored sandbox was \
                 adopted and goes on"
                    .to_string()
            }
            Recovery::Restored(p) => {
                self.db.set_process(&rec.id, p.pid, p.start_time)?;
                "a memory checkpoint was interrupted after its image was complete; the sandbox was restored \
                 from that image and goes on"
                    .to_string()
            }
            Recovery::Lost(reason) => {
                let ended = format!("an interrupted memory checkpoint lost it: {reason}");
                if !self.won(
                    self.db
                        .transition(&rec.id, SandboxState::Running, SandboxState::Exited, Some(&ended)),
                )? {
                    return Ok(());
                }
                self.driver(&rec.driver)?.stop(&rec.id, None)?;
                format!("a memory checkpoint was interrupted and the sandbox is gone ({reason})")
            }
        };
        tracing::info!(sandbox = rec.id, "{note}");
        add_note(&dir, &note);
        if let Err(e) = window.remove() {
            tracing::warn!(sandbox = rec.id, "cannot remove the finished checkpoint window: {e}");
        }
        Ok(())
    }

    /// Records as a `recovered` event of a stage what finishing the
    /// checkpoint windows of its sandbox did, if anything.
    fn note_recovery(&self, run: &str, stage: &str, branch: &str, sandbox: &str) -> Result<(), EngineError> {
        let path = self.home.sandbox(sandbox).join(NOTE);
        let Ok(text) = fs::read_to_string(&path) else {
            return Ok(());
        };
        for line in text.lines().filter(|l| !l.is_empty()) {
            self.db.event(
                run,
                Some(stage),
                Some(branch),
                "recovered",
                &format!("{line} (sandbox {sandbox})"),
                None,
            )?;
        }
        let _ = fs::remove_file(&path);
        Ok(())
    }
}

fn add_note(dir: &Path, note: &str) {
    let path = dir.join(NOTE);
    let written = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| writeln!(f, "{note}").and_then(|()| f.sync_all()));
    if let Err(e) = written {
        tracing::warn!("cannot write {}: {e}", path.display());
    }
}

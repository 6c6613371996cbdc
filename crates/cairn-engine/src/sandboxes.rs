//! The sandbox service: create, exec, copy, list, remove, garbage-collect.

use std::collections::HashSet;
use std::fs;
use std::path::PathBuf;

use cairn_protocol::ExecRequest;
use cairn_sandbox::client::{ExecSession, InitClient, SpawnFailure};
use cairn_sandbox::{pid_start_time, Driver, Limits, SandboxProcess, SandboxSpec};
use serde::Serialize;

use crate::state::{SandboxRecord, SandboxState};
use crate::{now_ms, Engine, EngineError, Progress};

/// What `cairn create` and `cairn run` ask for.
#[derive(Debug, Clone, Default)]
pub struct CreateOptions {
    pub image: Option<String>,
    pub name: Option<String>,
    pub limits: Limits,
    /// Remove the sandbox once the creating process is gone (`cairn run`).
    pub auto_remove: bool,
}

/// A process started in a sandbox, with what is needed to explain its end.
pub struct ExecStart {
    pub session: ExecSession,
    pub probe: OomProbe,
}

/// The sandbox's OOM-kill count when a process started.
#[derive(Debug, Clone)]
pub struct OomProbe {
    sandbox_id: String,
    oom_kills_before: u64,
}

/// What `cairn gc` released.
#[derive(Debug, Default, Serialize)]
pub struct GcReport {
    pub sandboxes_removed: Vec<String>,
    pub cgroups_released: Vec<String>,
    pub directories_removed: Vec<String>,
    pub layers_removed: Vec<String>,
}

fn new_sandbox_id() -> String {
    let mut b = [0u8; 6];
    getrandom::getrandom(&mut b).expect("the kernel RNG is available");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn valid_hostname(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && !name.starts_with('-')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

fn me() -> (i32, u64) {
    let pid = std::process::id() as i32;
    (pid, pid_start_time(pid).unwrap_or(0))
}

impl Engine {
    fn driver(&self, name: &str) -> &dyn Driver {
        // One driver today; the row names it so others can join.
        debug_assert_eq!(name, "native");
        &self.native
    }

    fn spec(&self, rec: &SandboxRecord) -> Result<SandboxSpec, EngineError> {
        let layers = rec
            .layers
            .iter()
            .map(|l| self.layers.path(&l.parse()?))
            .collect::<Result<Vec<PathBuf>, _>>()?;
        Ok(SandboxSpec {
            id: rec.id.clone(),
            hostname: rec.name.clone(),
            dir: self.home.sandbox(&rec.id),
            layers,
            limits: Limits {
                memory_bytes: rec.memory_bytes,
                cpu_millis: rec.cpu_millis,
                pids: rec.pids_max,
            },
            init_binary: self.init_binary.clone(),
        })
    }

    /// Creates and starts a sandbox. On any error nothing is left behind:
    /// no row, no directory, no cgroup, no process.
    pub fn create_sandbox(
        &mut self,
        opts: &CreateOptions,
        progress: &dyn Progress,
    ) -> Result<SandboxRecord, EngineError> {
        let image_name = opts
            .image
            .clone()
            .unwrap_or_else(|| crate::images::DEFAULT_IMAGE.to_string());
        let image = self.image_or_default(&image_name, progress)?;
        let id = new_sandbox_id();
        let name = opts.name.clone().unwrap_or_else(|| id.clone());
        if !valid_hostname(&name) {
            return Err(EngineError::BadName(name));
        }
        let (owner_pid, owner_start) = me();
        let mut rec = SandboxRecord {
            id: id.clone(),
            name,
            image: image.name.clone(),
            driver: "native".into(),
            state: SandboxState::Creating,
            pid: None,
            pid_start: None,
            owner_pid,
            owner_start,
            memory_bytes: opts.limits.memory_bytes,
            cpu_millis: opts.limits.cpu_millis,
            pids_max: opts.limits.pids,
            created_at: now_ms(),
            auto_remove: opts.auto_remove,
            ended_reason: None,
            layers: image.layers.clone(),
        };
        // The row comes first: from here on a crash leaves something the
        // garbage collector can find.
        self.db.insert_sandbox(&rec)?;
        let started = self
            .spec(&rec)
            .and_then(|spec| Ok(self.driver(&rec.driver).start(&spec)?));
        let process = match started {
            Ok(p) => p,
            Err(e) => {
                let _ = fs::remove_dir_all(self.home.sandbox(&id));
                let _ = self.db.delete_sandbox(&id);
                return Err(e);
            }
        };
        self.db.set_running(&id, process.pid, process.start_time)?;
        rec.state = SandboxState::Running;
        rec.pid = Some(process.pid);
        rec.pid_start = Some(process.start_time);
        Ok(rec)
    }

    /// Finds a sandbox by name, id or unique id prefix.
    pub fn sandbox(&self, key: &str) -> Result<SandboxRecord, EngineError> {
        let mut found = self.db.find_sandboxes(key)?;
        match found.len() {
            0 => Err(EngineError::NoSuchSandbox(key.to_string())),
            1 => Ok(found.remove(0)),
            _ => Err(EngineError::AmbiguousSandbox {
                key: key.to_string(),
                ids: found.into_iter().map(|r| r.id).collect(),
            }),
        }
    }

    /// A client for a running sandbox's init.
    pub fn client(&self, rec: &SandboxRecord) -> Result<InitClient, EngineError> {
        if rec.state != SandboxState::Running {
            return Err(EngineError::NotRunning {
                id: rec.id.clone(),
                state: rec.state,
            });
        }
        Ok(InitClient::new(
            self.home.sandbox(&rec.id).join("init.sock"),
        ))
    }

    /// Starts a process in a running sandbox.
    pub fn exec(
        &self,
        rec: &SandboxRecord,
        req: ExecRequest,
    ) -> Result<Result<ExecStart, SpawnFailure>, EngineError> {
        let client = self.client(rec)?;
        let oom_kills_before = self.driver(&rec.driver).oom_kills(&rec.id);
        let probe = OomProbe {
            sandbox_id: rec.id.clone(),
            oom_kills_before,
        };
        Ok(client
            .exec(req)?
            .map(|session| ExecStart { session, probe }))
    }

    /// Whether the sandbox's OOM killer fired since the probe was taken: a
    /// process that died of SIGKILL then was killed for exceeding `--memory`.
    pub fn oom_killed_since(&self, probe: &OomProbe) -> bool {
        self.native.oom_kills(&probe.sandbox_id) > probe.oom_kills_before
    }

    /// Path of the sandbox's console log (init and background processes).
    pub fn log_path(&self, rec: &SandboxRecord) -> PathBuf {
        self.home.sandbox(&rec.id).join("console.log")
    }

    /// Lists sandboxes, after reconciling their states with the host.
    pub fn list_sandboxes(&mut self) -> Result<Vec<SandboxRecord>, EngineError> {
        Ok(self.db.sandboxes()?)
    }

    /// Removes a sandbox: its processes, cgroups, files and row. A running
    /// sandbox needs `force`.
    pub fn remove_sandbox(&mut self, rec: &SandboxRecord, force: bool) -> Result<(), EngineError> {
        match rec.state {
            SandboxState::Running if !force => {
                return Err(EngineError::StillRunning(rec.id.clone()))
            }
            SandboxState::Removing => {}
            from => self
                .db
                .transition(&rec.id, from, SandboxState::Removing, Some("removed"))?,
        }
        let (pid, start) = me();
        self.db.set_owner(&rec.id, pid, start)?;
        self.release(rec)
    }

    /// Releases the host resources of a sandbox in state `removing` and
    /// deletes its row last. Idempotent, so an interrupted removal is
    /// finished by whoever comes next.
    fn release(&self, rec: &SandboxRecord) -> Result<(), EngineError> {
        let process = process_of(rec);
        self.driver(&rec.driver).stop(&rec.id, process)?;
        let dir = self.home.sandbox(&rec.id);
        match fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(EngineError::Home { path: dir, source }),
        }
        self.db.delete_sandbox(&rec.id)?;
        Ok(())
    }

    /// Brings the rows in line with the host after crashes: a running
    /// sandbox whose init died becomes exited (its cgroups released); a
    /// sandbox whose creator or remover died mid-way is finished off; a
    /// `cairn run` sandbox whose CLI is gone is removed.
    pub(crate) fn reconcile(&mut self) -> Result<Vec<String>, EngineError> {
        let mut removed = Vec::new();
        for rec in self.db.sandboxes()? {
            let owner_alive = cairn_sandbox::process_alive(rec.owner_pid, rec.owner_start);
            match rec.state {
                SandboxState::Running if rec.auto_remove && !owner_alive => {
                    self.db.transition(
                        &rec.id,
                        rec.state,
                        SandboxState::Removing,
                        Some("its `cairn run` ended"),
                    )?;
                    self.release(&rec)?;
                    removed.push(rec.id);
                }
                SandboxState::Running if !process_of(&rec).is_some_and(|p| p.alive()) => {
                    let reason = if self.native.oom_kills(&rec.id) > 0 {
                        "init was killed (out of memory)"
                    } else {
                        "init exited"
                    };
                    self.driver(&rec.driver).stop(&rec.id, None)?;
                    match self.db.transition(
                        &rec.id,
                        SandboxState::Running,
                        SandboxState::Exited,
                        Some(reason),
                    ) {
                        Ok(()) | Err(crate::StateError::Conflict(_)) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                SandboxState::Creating | SandboxState::Removing if !owner_alive => {
                    self.release(&rec)?;
                    removed.push(rec.id);
                }
                _ => {}
            }
        }
        Ok(removed)
    }

    /// Reconciles, then removes exited sandboxes, cgroups and directories no
    /// row accounts for, unreferenced layers and interrupted temporaries.
    pub fn gc(&mut self) -> Result<GcReport, EngineError> {
        let mut report = GcReport {
            sandboxes_removed: self.reconcile()?,
            ..GcReport::default()
        };
        let rows = self.db.sandboxes()?;
        for rec in rows.iter().filter(|r| r.state == SandboxState::Exited) {
            self.db.transition(
                &rec.id,
                SandboxState::Exited,
                SandboxState::Removing,
                Some("garbage collected"),
            )?;
            self.release(rec)?;
            report.sandboxes_removed.push(rec.id.clone());
        }
        let known: HashSet<String> = self.db.sandboxes()?.into_iter().map(|r| r.id).collect();
        for id in self.native.leftovers() {
            if !known.contains(&id) {
                self.native.stop(&id, None)?;
                report.cgroups_released.push(id);
            }
        }
        if let Ok(entries) = fs::read_dir(self.home.sandboxes()) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if !known.contains(&name) && fs::remove_dir_all(e.path()).is_ok() {
                    report.directories_removed.push(name);
                }
            }
        }
        let referenced = self.db.referenced_layers()?;
        for layer in self.layers.list()? {
            if !referenced.contains(layer.as_str()) {
                self.layers.remove(&layer)?;
                report.layers_removed.push(layer.to_string());
            }
        }
        self.layers.sweep_temporaries();
        let _ = fs::remove_dir_all(self.home.scratch());
        Ok(report)
    }
}

fn process_of(rec: &SandboxRecord) -> Option<SandboxProcess> {
    Some(SandboxProcess {
        pid: rec.pid?,
        start_time: rec.pid_start?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_are_checked() {
        assert!(valid_hostname("web-1"));
        assert!(!valid_hostname("-x"));
        assert!(!valid_hostname("a_b"));
        assert!(!valid_hostname(&"a".repeat(64)));
        assert!(!valid_hostname(""));
    }

    #[test]
    fn sandbox_ids_are_twelve_hex_digits() {
        let id = new_sandbox_id();
        assert_eq!(id.len(), 12);
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
    }
}

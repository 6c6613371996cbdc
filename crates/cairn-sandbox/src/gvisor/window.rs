//! The checkpoint window, recorded in the sandbox directory.
//!
//! `runsc checkpoint` ends the sandbox it saves, so from the moment init is
//! asked to quiesce until the restored sandbox's process is recorded, the
//! sandbox may have no process at all. A Cairn process that dies there
//! (`kill -9`) would leave nothing to re-attach to. So the window is a
//! recorded state, `<sandbox dir>/checkpoint/`:
//!
//! - `window`: the record (JSON, versioned): the sandbox, its process when
//!   the window opened, and every runsc command started in it (checkpoint,
//!   restore) with its pid, so the next Cairn process knows what to wait for.
//! - `image/`: the checkpoint image runsc writes.
//! - `complete`: written (and fsynced) once `runsc checkpoint` succeeded, by
//!   the shell that runs it, which outlives the Cairn process that started it.
//! - `checkpoint.log`: what `runsc checkpoint` printed.
//! - `paused`: written before a checkpoint that leaves the sandbox running
//!   pauses it (see [`super::live`]); a recovery resumes such a sandbox.
//!
//! [`super::GvisorDriver::recover`] finishes a window its owner left open.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{pid_start_time, SandboxProcess};

/// The window's directory, inside the sandbox directory.
pub const WINDOW_DIR: &str = "checkpoint";
const RECORD: &str = "window";
const IMAGE: &str = "image";
const COMPLETE: &str = "complete";
const CHECKPOINT_LOG: &str = "checkpoint.log";
const PAUSED: &str = "paused";

const FORMAT: &str = "cairn-checkpoint-window";
const VERSION: u32 = 1;
/// A record is a few hundred bytes; anything much larger is not one.
const MAX_RECORD: u64 = 64 << 10;

/// The record in `checkpoint/window`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowRecord {
    pub format: String,
    pub version: u32,
    /// The sandbox's id.
    pub sandbox: String,
    /// The sandbox's process when the window opened.
    pub process: Option<RecordedProcess>,
    /// The runsc commands started in the window, oldest first.
    pub ops: Vec<Op>,
}

/// A host process, told apart from a recycled pid by its start time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedProcess {
    pub pid: i32,
    pub start_time: u64,
}

impl From<SandboxProcess> for RecordedProcess {
    fn from(p: SandboxProcess) -> RecordedProcess {
        RecordedProcess {
            pid: p.pid,
            start_time: p.start_time,
        }
    }
}

impl From<RecordedProcess> for SandboxProcess {
    fn from(p: RecordedProcess) -> SandboxProcess {
        SandboxProcess {
            pid: p.pid,
            start_time: p.start_time,
        }
    }
}

/// A runsc command started in the window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Op {
    /// `checkpoint` or `restore`.
    pub what: String,
    pub process: RecordedProcess,
}

#[derive(Debug, thiserror::Error)]
pub enum WindowError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "{path} is not a checkpoint window record Cairn can read ({reason}); a newer Cairn wrote it, or it is \
         damaged: remove the sandbox with `cairn rm -f`, or run this Cairn's newer release"
    )]
    Unreadable { path: PathBuf, reason: String },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> WindowError + '_ {
    move |source| WindowError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl WindowRecord {
    pub fn new(sandbox: &str, process: Option<SandboxProcess>) -> WindowRecord {
        WindowRecord {
            format: FORMAT.into(),
            version: VERSION,
            sandbox: sandbox.into(),
            process: process.map(Into::into),
            ops: Vec::new(),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = serde_json::to_vec_pretty(self).expect("a window record is plain data");
        bytes.push(b'\n');
        bytes
    }

    /// Parses a record; another format, another version or a bad shape is refused.
    pub fn decode(bytes: &[u8]) -> Result<WindowRecord, String> {
        #[derive(Deserialize)]
        struct Header {
            format: String,
            version: u32,
        }
        let header: Header = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        if header.format != FORMAT {
            return Err(format!("format {:?}, not {FORMAT:?}", header.format));
        }
        if header.version != VERSION {
            return Err(format!(
                "version {}, this Cairn reads version {VERSION}",
                header.version
            ));
        }
        serde_json::from_slice(bytes).map_err(|e| e.to_string())
    }
}

/// An open checkpoint window of one sandbox.
#[derive(Debug, Clone)]
pub struct Window {
    dir: PathBuf,
}

impl Window {
    /// The window of the sandbox whose directory is `sandbox_dir` (open or not).
    pub fn of(sandbox_dir: &Path) -> Window {
        Window {
            dir: sandbox_dir.join(WINDOW_DIR),
        }
    }

    /// Opens the window: whatever an earlier window left goes, then the
    /// record is written and made durable before anything else happens.
    pub fn open(sandbox_dir: &Path, sandbox: &str, process: Option<SandboxProcess>) -> Result<Window, WindowError> {
        let w = Window::of(sandbox_dir);
        match fs::remove_dir_all(&w.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&w.dir)(e)),
        }
        fs::create_dir_all(w.image_dir()).map_err(io_err(&w.dir))?;
        w.write(&WindowRecord::new(sandbox, process))?;
        sync_dir(sandbox_dir)?;
        Ok(w)
    }

    /// Whether a window is open (its record exists).
    pub fn is_open(&self) -> bool {
        self.record_path().exists()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn image_dir(&self) -> PathBuf {
        self.dir.join(IMAGE)
    }

    /// Written by the shell running `runsc checkpoint` once it succeeded.
    pub fn complete_marker(&self) -> PathBuf {
        self.dir.join(COMPLETE)
    }

    pub fn is_complete(&self) -> bool {
        self.complete_marker().exists()
    }

    /// Records that the sandbox is about to be paused (before it is).
    pub fn mark_paused(&self) -> Result<(), WindowError> {
        let path = self.dir.join(PAUSED);
        File::create(&path)
            .and_then(|f| f.sync_all())
            .map_err(|source| WindowError::Io { path, source })
    }

    pub fn was_paused(&self) -> bool {
        self.dir.join(PAUSED).exists()
    }

    pub fn checkpoint_log(&self) -> PathBuf {
        self.dir.join(CHECKPOINT_LOG)
    }

    fn record_path(&self) -> PathBuf {
        self.dir.join(RECORD)
    }

    /// The record; `Ok(None)` when no window is open.
    pub fn read(&self) -> Result<Option<WindowRecord>, WindowError> {
        let path = self.record_path();
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(&path)(e)),
        };
        let mut bytes = Vec::new();
        io::Read::read_to_end(&mut io::Read::take(file, MAX_RECORD + 1), &mut bytes).map_err(io_err(&path))?;
        if bytes.len() as u64 > MAX_RECORD {
            return Err(WindowError::Unreadable {
                path,
                reason: format!("larger than {MAX_RECORD} bytes"),
            });
        }
        WindowRecord::decode(&bytes)
            .map(Some)
            .map_err(|reason| WindowError::Unreadable { path, reason })
    }

    /// Records a runsc command started in the window (the record is read,
    /// extended and replaced atomically; only the window's owner writes it).
    pub fn add_op(&self, what: &str, pid: u32) -> Result<(), WindowError> {
        let mut record = self.read()?.ok_or_else(|| WindowError::Io {
            path: self.record_path(),
            source: io::Error::new(io::ErrorKind::NotFound, "the window is not open"),
        })?;
        let pid = pid as i32;
        record.ops.push(Op {
            what: what.into(),
            process: RecordedProcess {
                pid,
                start_time: pid_start_time(pid).unwrap_or(0),
            },
        });
        self.write(&record)
    }

    /// The recorded runsc commands still running.
    pub fn live_ops(&self) -> Result<Vec<Op>, WindowError> {
        Ok(self
            .read()?
            .map(|r| r.ops)
            .unwrap_or_default()
            .into_iter()
            .filter(|op| SandboxProcess::from(op.process).alive())
            .collect())
    }

    /// Ends the window: the record goes (the image stays for its owner).
    pub fn close(&self) -> Result<(), WindowError> {
        match fs::remove_file(self.record_path()) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_err(&self.record_path())(e)),
        }
        sync_dir(&self.dir)
    }

    /// Removes the window and its image.
    pub fn remove(&self) -> Result<(), WindowError> {
        self.close()?;
        match fs::remove_dir_all(&self.dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(&self.dir)(e)),
        }
    }

    /// Written whole, fsynced, then renamed over the old record.
    fn write(&self, record: &WindowRecord) -> Result<(), WindowError> {
        let tmp = self.dir.join(".window.tmp");
        let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
        f.write_all(&record.encode()).map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
        fs::rename(&tmp, self.record_path()).map_err(io_err(&self.record_path()))?;
        sync_dir(&self.dir)
    }
}

fn sync_dir(dir: &Path) -> Result<(), WindowError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir))
}

/// The shell script that runs `runsc checkpoint` (its arguments) and marks
/// the image complete when it succeeded: `$CAIRN_COMPLETE` is created and
/// fsynced with its directory. The shell, not the Cairn process that started
/// it, writes the mark, so it is written even when that process is gone.
pub const CHECKPOINT_SCRIPT: &str =
    r#""$@" || exit; : > "$CAIRN_COMPLETE" && sync "$CAIRN_COMPLETE" "$(dirname "$CAIRN_COMPLETE")""#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_record_round_trips() {
        let mut r = WindowRecord::new("0123456789ab", Some(SandboxProcess { pid: 42, start_time: 7 }));
        r.ops.push(Op {
            what: "checkpoint".into(),
            process: RecordedProcess { pid: 43, start_time: 8 },
        });
        assert_eq!(WindowRecord::decode(&r.encode()).unwrap(), r);
    }

    #[test]
    fn a_future_or_foreign_or_damaged_record_is_refused() {
        let r = WindowRecord::new("s", None);
        let text = String::from_utf8(r.encode()).unwrap();
        let future = text.replace("\"version\": 1", "\"version\": 2");
        assert!(WindowRecord::decode(future.as_bytes())
            .unwrap_err()
            .contains("version 2"));
        let foreign = text.replace(FORMAT, "something-else");
        assert!(WindowRecord::decode(foreign.as_bytes())
            .unwrap_err()
            .contains("something-else"));
        assert!(WindowRecord::decode(&text.as_bytes()[..text.len() / 2]).is_err());
    }

    #[test]
    fn opening_a_window_replaces_the_last_one_and_closing_keeps_the_image() {
        let dir = tempfile::tempdir().unwrap();
        let w = Window::open(dir.path(), "s", None).unwrap();
        fs::write(w.image_dir().join("checkpoint.img"), b"x").unwrap();
        fs::write(w.complete_marker(), b"").unwrap();
        w.add_op("checkpoint", std::process::id()).unwrap();
        let record = w.read().unwrap().unwrap();
        assert_eq!(record.ops.len(), 1);
        assert_eq!(w.live_ops().unwrap().len(), 1, "this test's own process is alive");
        let w = Window::open(dir.path(), "s", None).unwrap();
        assert!(!w.is_complete());
        assert!(w.read().unwrap().unwrap().ops.is_empty());
        fs::write(w.image_dir().join("checkpoint.img"), b"x").unwrap();
        w.close().unwrap();
        assert!(!w.is_open());
        assert!(w.read().unwrap().is_none());
        assert!(w.image_dir().join("checkpoint.img").exists());
        w.remove().unwrap();
        assert!(!w.dir().exists());
    }

    #[test]
    fn the_checkpoint_script_marks_only_a_successful_command() {
        let dir = tempfile::tempdir().unwrap();
        let mark = dir.path().join("complete");
        let run = |cmd: &str| {
            std::process::Command::new("sh")
                .args(["-c", CHECKPOINT_SCRIPT, "sh", cmd])
                .env("CAIRN_COMPLETE", &mark)
                .status()
                .unwrap()
        };
        assert!(!run("false").success());
        assert!(!mark.exists());
        assert!(run("true").success());
        assert!(mark.exists());
    }
}

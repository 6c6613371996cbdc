//! Files of a session's sandbox: reads and writes that resume the session
//! like an exec; a write is logged with the hash of what was written.

use std::io::{Read, Write};

use crate::prelude::*;
use crate::steps::*;
use crate::{Entry, EntryKind};
use cairn_engine::{Engine, EngineError};

/// A reader that hashes what passes through it.
struct HashingReader<'a> {
    inner: &'a mut dyn Read,
    hasher: blake3::Hasher,
}

impl Read for HashingReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// A session's files: reads and writes through its sandbox, writes logged.
pub trait SessionFiles {
    /// Writes a file into the session's sandbox (resuming or recovering it
    /// like exec) and records a `write_file` call and its result. The log
    /// keeps the path, mode, size and BLAKE3 hash of what was written, not
    /// the bytes.
    fn session_write_file(
        &mut self,
        key: &str,
        path: &str,
        mode: u32,
        size: u64,
        src: &mut dyn Read,
    ) -> Result<cairn_protocol::FileMeta, EngineError>;

    /// [`Self::session_write_file`] with `notes` (who asked, the reason a
    /// model gave) recorded among the call's arguments.
    fn session_write_file_noted(
        &mut self,
        key: &str,
        path: &str,
        mode: u32,
        size: u64,
        src: &mut dyn Read,
        notes: serde_json::Map<String, serde_json::Value>,
    ) -> Result<cairn_protocol::FileMeta, EngineError>;

    /// A path's metadata in the session's sandbox (resuming or recovering
    /// it like exec); symlinks are not followed. Not logged.
    fn session_stat(&mut self, key: &str, path: &str) -> Result<Option<cairn_protocol::FileMeta>, EngineError>;

    /// Opens a regular file of the session's sandbox for a download
    /// (resuming or recovering it like exec): opened and checked in the
    /// sandbox before any byte is sent, never looked up first.
    fn session_open_file(&mut self, key: &str, path: &str) -> Result<cairn_sandbox::client::FileDownload, EngineError>;

    /// Reads a file of the session's sandbox into `dst` (resuming or
    /// recovering it like exec). Reads change nothing, so they are not
    /// logged.
    fn session_read_file(
        &mut self,
        key: &str,
        path: &str,
        dst: &mut dyn Write,
    ) -> Result<cairn_protocol::FileMeta, EngineError>;
}

impl SessionFiles for Engine {
    fn session_write_file(
        &mut self,
        key: &str,
        path: &str,
        mode: u32,
        size: u64,
        src: &mut dyn Read,
    ) -> Result<cairn_protocol::FileMeta, EngineError> {
        self.session_write_file_noted(key, path, mode, size, src, serde_json::Map::new())
    }

    fn session_write_file_noted(
        &mut self,
        key: &str,
        path: &str,
        mode: u32,
        size: u64,
        src: &mut dyn Read,
        notes: serde_json::Map<String, serde_json::Value>,
    ) -> Result<cairn_protocol::FileMeta, EngineError> {
        let live = self.live_session(key)?;
        let s = &live.session;
        let mut call = Entry::new(EntryKind::ToolCall);
        call.tool = Some("write_file".into());
        let mut arguments = notes;
        arguments.insert("path".into(), path.into());
        arguments.insert("mode".into(), format!("{mode:o}").into());
        arguments.insert("size".into(), size.into());
        call.arguments = Some(serde_json::Value::Object(arguments).to_string());
        let call = self.session_append(s, call)?;
        let mut hashing = HashingReader {
            inner: src,
            hasher: blake3::Hasher::new(),
        };
        let meta = cairn_protocol::FileMeta {
            path: path.to_string(),
            kind: cairn_protocol::FileKind::File,
            mode,
            uid: 0,
            gid: 0,
            size,
            mtime_ns: cairn_engine::now_ms() as i128 * 1_000_000,
        };
        let written = self.client(&live.sandbox).and_then(|client| {
            client.put_file(meta.clone(), &mut hashing)?;
            Ok(client.stat(path)?.unwrap_or(meta))
        });
        let mut result = Entry::new(EntryKind::ToolResult);
        result.tool = Some("write_file".into());
        let body = match &written {
            Ok(_) => {
                result.exit_status = Some(0);
                serde_json::json!({ "call": call.seq, "bytes": size, "blake3": hashing.hasher.finalize().to_hex().as_str() })
            }
            Err(e) => {
                result.exit_status = Some(1);
                serde_json::json!({ "call": call.seq, "error": e.to_string() })
            }
        };
        result.result = Some(body.to_string());
        self.session_append(s, result)?;
        written
    }

    fn session_stat(&mut self, key: &str, path: &str) -> Result<Option<cairn_protocol::FileMeta>, EngineError> {
        let live = self.live_session(key)?;
        Ok(self.client(&live.sandbox)?.stat(path)?)
    }

    fn session_open_file(&mut self, key: &str, path: &str) -> Result<cairn_sandbox::client::FileDownload, EngineError> {
        let live = self.live_session(key)?;
        Ok(self.client(&live.sandbox)?.open_file(path)?)
    }

    fn session_read_file(
        &mut self,
        key: &str,
        path: &str,
        dst: &mut dyn Write,
    ) -> Result<cairn_protocol::FileMeta, EngineError> {
        let live = self.live_session(key)?;
        Ok(self.client(&live.sandbox)?.get_file(path, dst)?)
    }
}

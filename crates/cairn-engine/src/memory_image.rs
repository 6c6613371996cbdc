//! A snapshot's memory as its manifest records it: a driver's checkpoint
//! image, file by file, in the chunk store (`docs/formats.md`, the
//! snapshot manifest).

use cairn_sandbox::gvisor::image_host::ImageHost;
use serde::{Deserialize, Serialize};

/// A driver's checkpoint image: its files, by name, in the chunk store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryImage {
    pub driver: String,
    /// The host it was taken on, which a restoring host must match
    /// (checked before a restore starts anything). `None` only in images
    /// recorded before version 4: those are refused, fail-closed.
    pub host: Option<ImageHost>,
    pub files: Vec<MemoryFile>,
}

/// One file of a checkpoint image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryFile {
    pub name: String,
    pub form: MemoryForm,
    pub content: cairn_store::FileContent,
}

/// How a checkpoint file's bytes are kept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemoryForm {
    /// As the driver wrote it.
    AsWritten,
    /// A gVisor state file unpacked: `content` is its inflated state
    /// stream, `header` the bytes before its first chunk (see
    /// `cairn_sandbox::gvisor::statefile`).
    GvisorStateStream { header: Vec<u8> },
}

//! Objects that layers above the engine keep in the chunk store, and that
//! the engine's garbage collection follows to the chunks they reference:
//! a session log's payloads too large for their rows, a pipeline's
//! artifacts. Their frames are formats (docs/formats.md).

use cairn_store::{FileContent, Framed};
use serde::{Deserialize, Serialize};

/// A log payload too large for its row, in the chunk store.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PayloadObject {
    pub content: FileContent,
}

impl Framed for PayloadObject {
    const MAGIC: [u8; 8] = *b"CAIRNPAY";
    const VERSION: u32 = 1;
    const MAX_PAYLOAD: u64 = 64 << 20;
    const NAME: &'static str = "session payload";
}

/// The chunk list of an artifact, stored as an object.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ArtifactObject {
    pub path: String,
    pub content: FileContent,
}

impl Framed for ArtifactObject {
    const MAGIC: [u8; 8] = *b"CAIRNART";
    const VERSION: u32 = 1;
    const MAX_PAYLOAD: u64 = 64 << 20;
    const NAME: &'static str = "artifact";
}

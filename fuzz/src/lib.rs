//! What the fuzz targets share.

use cairn_store::frame::HEADER_LEN;
use cairn_store::Framed;

/// `payload` in a frame of kind `T` and `version` with a right length and
/// CRC, so the fuzzer's mutations reach the payload decoder instead of
/// stopping at the checksum.
pub fn seal<T: Framed>(version: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&T::MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&out);
    crc.update(payload);
    out.extend_from_slice(&crc.finalize().to_le_bytes());
    out.extend_from_slice(payload);
    out
}

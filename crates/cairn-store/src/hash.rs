//! Content addresses: the BLAKE3 hash of an object's uncompressed bytes.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The BLAKE3 hash of a chunk's uncompressed content; the key it is stored
/// under. Displays and parses as 64 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ChunkHash([u8; 32]);

impl ChunkHash {
    /// Hashes `data`.
    pub fn of(data: &[u8]) -> Self {
        Self(*blake3::hash(data).as_bytes())
    }

    /// Wraps raw hash bytes, e.g. from an incremental `blake3::Hasher`.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Full 64-digit lowercase hex form.
    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }

    /// First 12 hex digits followed by an ellipsis, for human-facing
    /// messages.
    pub fn short(&self) -> String {
        let hex = self.to_hex();
        format!("{}…", &hex[..12])
    }
}

impl fmt::Display for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkHash({})", self.short())
    }
}

/// A string that is not a 64-digit hex BLAKE3 hash.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{input:?} is not a chunk hash: expected 64 hex digits (a BLAKE3 hash)")]
pub struct ParseChunkHashError {
    input: String,
}

impl FromStr for ChunkHash {
    type Err = ParseChunkHashError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseChunkHashError {
            input: s.chars().take(80).collect(),
        };
        if s.len() != 64 {
            return Err(err());
        }
        let mut out = [0u8; 32];
        for (i, pair) in s.as_bytes().chunks_exact(2).enumerate() {
            let hi = hex_digit(pair[0]).ok_or_else(err)?;
            let lo = hex_digit(pair[1]).ok_or_else(err)?;
            out[i] = hi << 4 | lo;
        }
        Ok(Self(out))
    }
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_matches_blake3() {
        let h = ChunkHash::of(b"genome");
        assert_eq!(h.to_string(), blake3::hash(b"genome").to_hex().as_str());
        assert_eq!(h.to_string().parse::<ChunkHash>().unwrap(), h);
        assert_eq!(h.to_string().to_uppercase().parse::<ChunkHash>().unwrap(), h);
    }

    #[test]
    fn malformed_hex_is_refused() {
        assert!("abc".parse::<ChunkHash>().is_err());
        let bad = "g".repeat(64);
        let err = bad.parse::<ChunkHash>().unwrap_err();
        assert!(err.to_string().contains("64 hex digits"));
        // 64 bytes but multi-byte chars must not panic on slicing.
        assert!("é".repeat(32).parse::<ChunkHash>().is_err());
    }
}

//! The framed, versioned envelope around every metadata object Cairn
//! writes (snapshot manifests, layer indexes, the store's layout marker).
//!
//! ```text
//! offset size  field
//! 0      8     magic        identifies the kind of object
//! 8      4     version      format version of the payload (u32 LE)
//! 12     8     payload_len  bytes of payload that follow (u64 LE)
//! 20     4     crc32        CRC32 of bytes 0..20 followed by the payload
//! 24     n     payload      bincode 1.3 (varint, little endian) of one typed tree
//! ```
//!
//! The magic and version fields keep their positions in every future
//! version, so an old reader can always tell "newer than me" apart from
//! "corrupt". See `docs/formats-store.md` for the versioning policy.

use bincode::Options;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Bytes before the payload.
pub const HEADER_LEN: usize = 24;

/// A metadata type that is written inside a frame.
pub trait Framed: Serialize + DeserializeOwned {
    /// Eight bytes naming the kind of object; never reused for another kind.
    const MAGIC: [u8; 8];
    /// The payload format version this build writes and the newest it reads.
    /// Independent of the crate version; bumped only when the encoding of
    /// the typed tree changes.
    const VERSION: u32;
    /// Largest payload a reader accepts, checked before anything is
    /// allocated or decoded.
    const MAX_PAYLOAD: u64;
    /// Human name used in error messages ("layer index").
    const NAME: &'static str;

    /// Reads a payload written by an older `version` (1 ≤ version <
    /// `VERSION`). Types that bump their version override this to convert;
    /// the default refuses.
    fn decode_older(version: u32, _payload: &[u8]) -> Result<Self, FrameError> {
        Err(FrameError::UnsupportedOldVersion {
            what: Self::NAME,
            found: version,
            supported: Self::VERSION,
        })
    }
}

/// Why a frame could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("the {what} is truncated: it has {got} bytes where at least {needed} are needed; it was cut short (interrupted copy or full disk), so restore it from another replica or recapture it")]
    Truncated { what: &'static str, needed: u64, got: u64 },
    #[error("this is not a {what}: it starts with {found:02x?} instead of the magic {expected:02x?}; check that the right file or object id was given")]
    BadMagic {
        what: &'static str,
        found: Vec<u8>,
        expected: [u8; 8],
    },
    #[error("the {what} has format version {found}, newer than version {supported}, the newest this build of Cairn reads; upgrade Cairn to read it")]
    FutureVersion {
        what: &'static str,
        found: u32,
        supported: u32,
    },
    #[error("the {what} has format version {found}, which this build of Cairn (format version {supported}) can no longer read; read it with an older Cairn and re-save it")]
    UnsupportedOldVersion {
        what: &'static str,
        found: u32,
        supported: u32,
    },
    #[error("the {what} declares a {len}-byte payload, over the {cap}-byte limit for this kind of object; it is corrupt or was not written by Cairn")]
    TooLarge { what: &'static str, len: u64, cap: u64 },
    #[error("the {what} declares {declared} payload bytes but {actual} follow the header; it is truncated or has trailing garbage, so restore it from another replica or recapture it")]
    LengthMismatch {
        what: &'static str,
        declared: u64,
        actual: u64,
    },
    #[error("the {what} fails its CRC32 check (stored {stored:08x}, computed {computed:08x}); it is corrupt, so restore it from another replica or recapture it")]
    Checksum {
        what: &'static str,
        stored: u32,
        computed: u32,
    },
    #[error("the {what} passed its checksum but its payload does not decode ({source}); it was written by an incompatible build of Cairn")]
    Decode { what: &'static str, source: bincode::Error },
    #[error(
        "cannot encode the {what} ({source}); it is probably larger than the {cap}-byte limit for this kind of object"
    )]
    Encode {
        what: &'static str,
        cap: u64,
        source: bincode::Error,
    },
}

fn options(cap: u64) -> impl Options {
    bincode::DefaultOptions::new()
        .with_limit(cap)
        .with_little_endian()
        .with_varint_encoding()
        .reject_trailing_bytes()
}

/// Serialises `value` into a complete frame.
pub fn encode<T: Framed>(value: &T) -> Result<Vec<u8>, FrameError> {
    let payload = options(T::MAX_PAYLOAD)
        .serialize(value)
        .map_err(|source| FrameError::Encode {
            what: T::NAME,
            cap: T::MAX_PAYLOAD,
            source,
        })?;
    Ok(seal::<T>(T::VERSION, &payload))
}

/// `payload` in a frame of kind `T` and `version`: the header (magic,
/// version, length, CRC over both) and the payload as it is. Tests and fuzz
/// targets seal hostile payloads with it, so that they reach the payload
/// decoder instead of stopping at the checksum.
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

/// Checks and decodes a frame of type `T`. Every length is checked against
/// the input and the type's cap before use.
pub fn decode<T: Framed>(bytes: &[u8]) -> Result<T, FrameError> {
    let what = T::NAME;
    let truncated = |needed: usize| FrameError::Truncated {
        what,
        needed: needed as u64,
        got: bytes.len() as u64,
    };
    if bytes.len() < 8 {
        return Err(truncated(HEADER_LEN));
    }
    if bytes[..8] != T::MAGIC {
        return Err(FrameError::BadMagic {
            what,
            found: bytes[..8].to_vec(),
            expected: T::MAGIC,
        });
    }
    if bytes.len() < 12 {
        return Err(truncated(HEADER_LEN));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    // Checked before the rest of the header: a newer version may lay it out
    // differently, and "upgrade Cairn" is the useful message.
    if version > T::VERSION {
        return Err(FrameError::FutureVersion {
            what,
            found: version,
            supported: T::VERSION,
        });
    }
    if bytes.len() < HEADER_LEN {
        return Err(truncated(HEADER_LEN));
    }
    let declared = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
    if declared > T::MAX_PAYLOAD {
        return Err(FrameError::TooLarge {
            what,
            len: declared,
            cap: T::MAX_PAYLOAD,
        });
    }
    let actual = (bytes.len() - HEADER_LEN) as u64;
    if declared > actual {
        return Err(FrameError::Truncated {
            what,
            needed: HEADER_LEN as u64 + declared,
            got: bytes.len() as u64,
        });
    }
    if declared != actual {
        return Err(FrameError::LengthMismatch { what, declared, actual });
    }
    let stored = u32::from_le_bytes(bytes[20..24].try_into().expect("4 bytes"));
    let payload = &bytes[HEADER_LEN..];
    let mut crc = crc32fast::Hasher::new();
    crc.update(&bytes[..20]);
    crc.update(payload);
    let computed = crc.finalize();
    if stored != computed {
        return Err(FrameError::Checksum { what, stored, computed });
    }
    if version < T::VERSION {
        if version == 0 {
            return Err(FrameError::UnsupportedOldVersion {
                what,
                found: 0,
                supported: T::VERSION,
            });
        }
        return T::decode_older(version, payload);
    }
    decode_payload(what, T::MAX_PAYLOAD, payload)
}

/// Decodes a bare payload with the frame's bincode options; for
/// [`Framed::decode_older`] implementations reading a previous layout.
pub fn decode_payload<U: DeserializeOwned>(what: &'static str, cap: u64, payload: &[u8]) -> Result<U, FrameError> {
    options(cap)
        .deserialize(payload)
        .map_err(|source| FrameError::Decode { what, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use std::collections::BTreeMap;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Sample {
        name: String,
        sizes: BTreeMap<String, u64>,
        children: Vec<Sample>,
        blob: Vec<u8>,
    }

    impl Framed for Sample {
        const MAGIC: [u8; 8] = *b"CAIRNTST";
        const VERSION: u32 = 2;
        const MAX_PAYLOAD: u64 = 1 << 20;
        const NAME: &'static str = "test object";
    }

    fn sample() -> Sample {
        Sample {
            name: "root".into(),
            sizes: [("a".to_string(), 1u64), ("b".to_string(), u64::MAX)]
                .into_iter()
                .collect(),
            children: vec![Sample {
                name: "child".into(),
                sizes: BTreeMap::new(),
                children: vec![],
                blob: vec![0, 255, 7],
            }],
            blob: vec![1; 300],
        }
    }

    #[test]
    fn frame_round_trips_a_typed_tree() {
        let bytes = encode(&sample()).unwrap();
        assert_eq!(&bytes[..8], b"CAIRNTST");
        assert_eq!(decode::<Sample>(&bytes).unwrap(), sample());
    }

    #[test]
    fn every_single_flipped_bit_is_refused() {
        let bytes = encode(&sample()).unwrap();
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut bad = bytes.clone();
                bad[i] ^= 1 << bit;
                assert!(
                    decode::<Sample>(&bad).is_err(),
                    "flip of bit {bit} in byte {i} was accepted"
                );
            }
        }
    }

    #[test]
    fn corrupt_payload_names_the_checksum() {
        let mut bytes = encode(&sample()).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        let err = decode::<Sample>(&bytes).unwrap_err();
        assert!(matches!(err, FrameError::Checksum { .. }), "{err}");
        assert!(err.to_string().contains("test object fails its CRC32 check"));
    }

    #[test]
    fn every_truncation_is_refused() {
        let bytes = encode(&sample()).unwrap();
        for len in 0..bytes.len() {
            let err = decode::<Sample>(&bytes[..len]).unwrap_err();
            assert!(matches!(err, FrameError::Truncated { .. }), "len {len}: {err}");
        }
    }

    #[test]
    fn trailing_garbage_is_refused() {
        let mut bytes = encode(&sample()).unwrap();
        bytes.push(0);
        assert!(matches!(
            decode::<Sample>(&bytes).unwrap_err(),
            FrameError::LengthMismatch { .. }
        ));
    }

    #[test]
    fn future_version_is_refused_with_upgrade_advice() {
        let mut bytes = encode(&sample()).unwrap();
        bytes[8..12].copy_from_slice(&3u32.to_le_bytes());
        let err = decode::<Sample>(&bytes).unwrap_err();
        assert!(
            matches!(
                err,
                FrameError::FutureVersion {
                    found: 3,
                    supported: 2,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("upgrade Cairn"));
        // Even when the rest of a future header would not parse for us.
        let err = decode::<Sample>(&bytes[..12]).unwrap_err();
        assert!(matches!(err, FrameError::FutureVersion { .. }), "{err}");
    }

    #[test]
    fn older_version_without_upgrade_path_is_refused() {
        let mut bytes = encode(&sample()).unwrap();
        bytes[8..12].copy_from_slice(&1u32.to_le_bytes());
        // Re-seal so only the version matters.
        let mut crc = crc32fast::Hasher::new();
        crc.update(&bytes[..20]);
        crc.update(&bytes[HEADER_LEN..]);
        let crc = crc.finalize();
        bytes[20..24].copy_from_slice(&crc.to_le_bytes());
        let err = decode::<Sample>(&bytes).unwrap_err();
        assert!(
            matches!(err, FrameError::UnsupportedOldVersion { found: 1, .. }),
            "{err}"
        );
    }

    #[test]
    fn oversized_declared_length_is_refused_before_reading() {
        let mut bytes = encode(&sample()).unwrap();
        bytes[12..20].copy_from_slice(&(u64::MAX).to_le_bytes());
        assert!(matches!(
            decode::<Sample>(&bytes).unwrap_err(),
            FrameError::TooLarge { .. }
        ));
    }

    #[test]
    fn wrong_kind_of_object_is_refused() {
        let mut bytes = encode(&sample()).unwrap();
        bytes[..8].copy_from_slice(b"CAIRNLIX");
        let err = decode::<Sample>(&bytes).unwrap_err();
        assert!(err.to_string().contains("this is not a test object"), "{err}");
    }

    #[test]
    fn encoding_over_the_cap_is_refused() {
        let mut big = sample();
        big.blob = vec![0; 2 << 20];
        assert!(matches!(encode(&big).unwrap_err(), FrameError::Encode { .. }));
    }
}

//! Reading a session bundle as hostile input: its tar members in the
//! order the format fixes, each capped before it is read, and the checks
//! on the manifest and the entries made before anything is stored.

use std::collections::HashSet;
use std::io::{self, Read};

use cairn_store::{ChunkHash, Framed};

use super::format::{
    check_chain, BundleError, BundleManifest, EntryBatch, BUNDLE_MAGIC, BUNDLE_VERSION, MAX_ENTRIES, MAX_LOG_BYTES,
    MAX_OBJECTS, MAX_REWINDS, MAX_SNAPSHOTS,
};
use crate::Entry;

/// The tar members of a bundle, read in the order the format fixes.
pub(crate) struct Members<'a, R: Read> {
    pub(super) inner: tar::Entries<'a, R>,
}

impl<R: Read> Members<'_, R> {
    /// The next member, which must be the regular file `name` of at most
    /// `cap` bytes; `what` names it in errors.
    pub(super) fn next(&mut self, what: &str, name: &str, cap: u64) -> Result<Vec<u8>, BundleError> {
        let member = match self.inner.next() {
            None => return Err(BundleError::Truncated(what.to_string())),
            Some(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
                return Err(BundleError::Truncated(what.to_string()))
            }
            Some(Err(e)) => return Err(BundleError::Malformed(format!("before {what}: {e}"))),
            Some(Ok(m)) => m,
        };
        let path = member.path_bytes().into_owned();
        if path != name.as_bytes() || member.header().entry_type() != tar::EntryType::Regular {
            return Err(BundleError::Malformed(format!(
                "expected {what} as {name:?}, found {:?}",
                String::from_utf8_lossy(&path)
            )));
        }
        let size = member
            .header()
            .size()
            .map_err(|e| BundleError::Malformed(e.to_string()))?;
        if size > cap {
            return Err(BundleError::OverCap(format!("{what} is {size} bytes, over {cap}")));
        }
        let mut data = Vec::new();
        member.take(size).read_to_end(&mut data).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => BundleError::Truncated(what.to_string()),
            _ => BundleError::Io {
                action: "read the bundle",
                source: e,
            },
        })?;
        if data.len() as u64 != size {
            return Err(BundleError::Truncated(format!("the end of {what}")));
        }
        Ok(data)
    }

    /// Nothing follows the last object.
    pub(super) fn end(&mut self) -> Result<(), BundleError> {
        match self.inner.next() {
            None => Ok(()),
            Some(Ok(extra)) => Err(BundleError::Malformed(format!(
                "an extra member {:?} after the last object",
                String::from_utf8_lossy(&extra.path_bytes())
            ))),
            Some(Err(e)) => Err(BundleError::Malformed(format!("after the last object: {e}"))),
        }
    }
}

/// The magic and a version this build reads.
pub(super) fn read_header(input: &mut dyn Read) -> Result<(), BundleError> {
    let mut header = [0u8; 12];
    input.read_exact(&mut header).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => BundleError::Truncated("its header".into()),
        _ => BundleError::Io {
            action: "read the bundle",
            source: e,
        },
    })?;
    if header[..8] != BUNDLE_MAGIC {
        return Err(BundleError::NotABundle);
    }
    let mut version = [0u8; 4];
    version.copy_from_slice(&header[8..12]);
    match u32::from_le_bytes(version) {
        BUNDLE_VERSION => Ok(()),
        found if found > BUNDLE_VERSION => Err(BundleError::FutureVersion {
            found,
            known: BUNDLE_VERSION,
        }),
        found => Err(BundleError::UnknownVersion(found)),
    }
}

/// The manifest, with its counts and fields checked.
pub(super) fn read_manifest(members: &mut Members<'_, &mut dyn Read>) -> Result<BundleManifest, BundleError> {
    let cap = cairn_store::frame::HEADER_LEN as u64 + BundleManifest::MAX_PAYLOAD;
    let bytes = members.next("its manifest", "manifest", cap)?;
    let m: BundleManifest =
        cairn_store::frame::decode(&bytes).map_err(|e| BundleError::Malformed(format!("its manifest: {e}")))?;
    let s = &m.session;
    if m.entries > MAX_ENTRIES || m.objects.len() > MAX_OBJECTS {
        return Err(BundleError::OverCap(format!(
            "{} entries and {} objects (at most {MAX_ENTRIES} and {MAX_OBJECTS})",
            m.entries,
            m.objects.len()
        )));
    }
    if m.snapshots.len() > MAX_SNAPSHOTS || m.rewinds.len() > MAX_REWINDS {
        return Err(BundleError::OverCap(format!(
            "{} snapshots and {} rewinds (at most {MAX_SNAPSHOTS} and {MAX_REWINDS})",
            m.snapshots.len(),
            m.rewinds.len()
        )));
    }
    if !matches!(s.driver.as_str(), "native" | "gvisor") {
        return Err(BundleError::Malformed(format!("unknown driver {:?}", s.driver)));
    }
    for image in std::iter::once(&s.image).chain(m.image.as_ref().map(|i| &i.name)) {
        if !cairn_engine::images::valid_image_name(image) {
            return Err(BundleError::Malformed(format!("invalid image name {image:?}")));
        }
    }
    if m.entries != s.head_seq {
        return Err(BundleError::Malformed(format!(
            "{} entries for a log whose head is {}",
            m.entries, s.head_seq
        )));
    }
    if let Some(r) = m
        .rewinds
        .iter()
        .find(|r| r.to_seq >= r.head_seq || r.head_seq > s.head_seq)
    {
        return Err(BundleError::Malformed(format!(
            "a rewind from entry {} to {} in a log of {}",
            r.head_seq, r.to_seq, s.head_seq
        )));
    }
    Ok(m)
}

/// Every entry of the chain, in seq order, verified against the head.
pub(super) fn read_entries(
    members: &mut Members<'_, &mut dyn Read>,
    m: &BundleManifest,
) -> Result<Vec<Entry>, BundleError> {
    let cap = cairn_store::frame::HEADER_LEN as u64 + EntryBatch::MAX_PAYLOAD;
    let mut entries: Vec<Entry> = Vec::with_capacity(m.entries.min(1 << 16) as usize);
    let (mut bytes, mut batch) = (0u64, 0);
    while (entries.len() as u64) < m.entries {
        batch += 1;
        let framed = members.next(&format!("entry batch {batch}"), &format!("entries/{batch:06}"), cap)?;
        bytes += framed.len() as u64;
        if bytes > MAX_LOG_BYTES {
            return Err(BundleError::OverCap(format!(
                "more than {MAX_LOG_BYTES} bytes of entries"
            )));
        }
        let b: EntryBatch = cairn_store::frame::decode(&framed)
            .map_err(|e| BundleError::Malformed(format!("entry batch {batch}: {e}")))?;
        if b.entries.is_empty() || entries.len() as u64 + b.entries.len() as u64 > m.entries {
            return Err(BundleError::Malformed(format!(
                "entry batch {batch} holds {} entries, the manifest says {} in all",
                b.entries.len(),
                m.entries
            )));
        }
        entries.extend(b.entries.into_iter().map(Entry::from));
    }
    check_chain(&entries, m.session.head_seq, &m.session.head_hash).map_err(BundleError::Chain)?;
    Ok(entries)
}

/// What the chain does not cover: arguments are JSON, every payload
/// reference is a hash, and every snapshot named is in the bundle (the
/// session's own at the entry that records it). Returns the payloads.
pub(super) fn check_entries(m: &BundleManifest, entries: &[Entry]) -> Result<HashSet<String>, BundleError> {
    let snapshot_ids: HashSet<String> = m.snapshots.iter().map(|r| r.id.to_string()).collect();
    let mut payloads = HashSet::new();
    for e in entries {
        let bad = |why: String| BundleError::Malformed(format!("entry {}: {why}", e.seq));
        if let Some(a) = &e.arguments {
            serde_json::from_str::<serde_json::Value>(a)
                .map_err(|err| bad(format!("arguments are not JSON: {err}")))?;
        }
        for r in [&e.content_ref, &e.result_ref].into_iter().flatten() {
            r.parse::<ChunkHash>().map_err(|err| bad(err.to_string()))?;
            payloads.insert(r.clone());
        }
        if let Some(id) = e.snapshot_id.as_ref().filter(|id| !snapshot_ids.contains(*id)) {
            return Err(bad(format!("it names snapshot {id}, which the bundle does not hold")));
        }
    }
    let s = &m.session;
    let recorded = |seq: u64| {
        seq.checked_sub(1)
            .and_then(|i| entries.get(i as usize))
            .and_then(|e| e.snapshot_id.as_ref())
    };
    match (&s.snapshot_id, s.snapshot_seq) {
        (None, None) => Ok(payloads),
        (Some(id), Some(seq)) if snapshot_ids.contains(id) && recorded(seq) == Some(id) => Ok(payloads),
        _ => Err(BundleError::Malformed(format!(
            "the session's snapshot {:?} is not the one its entry {:?} records",
            s.snapshot_id, s.snapshot_seq
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tar_of(members: &[(&str, &[u8])]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for (name, data) in members {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            builder.append_data(&mut header, name, *data).unwrap();
        }
        builder.into_inner().unwrap()
    }

    fn first(bytes: &[u8], name: &str, cap: u64) -> Result<Vec<u8>, BundleError> {
        let mut input: &[u8] = bytes;
        let mut archive = tar::Archive::new(&mut input);
        let mut members = Members {
            inner: archive.entries().unwrap().raw(true),
        };
        members.next("its manifest", name, cap)
    }

    #[test]
    fn members_come_by_name_within_their_cap_and_long_names_are_refused() {
        let bytes = tar_of(&[("manifest", b"framed")]);
        assert_eq!(first(&bytes, "manifest", 6).unwrap(), b"framed");
        assert!(matches!(first(&bytes, "manifest", 5), Err(BundleError::OverCap(_))));
        assert!(matches!(
            first(&bytes, "entries/000001", 6),
            Err(BundleError::Malformed(_))
        ));
        let cut = &bytes[..512 + 3];
        assert!(matches!(first(cut, "manifest", 6), Err(BundleError::Truncated(_))));
        // A GNU long name is a member of its own, not merged into the next.
        let long = "m".repeat(150);
        let err = first(&tar_of(&[(&long, b"x")]), "manifest", 6).unwrap_err();
        assert!(err.to_string().contains("LongLink"), "{err}");
    }

    #[test]
    fn a_header_from_elsewhere_or_the_future_is_refused() {
        let header = |magic: &[u8; 8], version: u32| {
            let mut h = magic.to_vec();
            h.extend_from_slice(&version.to_le_bytes());
            h
        };
        assert!(read_header(&mut &header(&BUNDLE_MAGIC, BUNDLE_VERSION)[..]).is_ok());
        assert!(matches!(
            read_header(&mut &header(&BUNDLE_MAGIC, BUNDLE_VERSION + 1)[..]),
            Err(BundleError::FutureVersion { .. })
        ));
        assert!(matches!(
            read_header(&mut &header(b"CAIRNSNP", 1)[..]),
            Err(BundleError::NotABundle)
        ));
        assert!(matches!(
            read_header(&mut &BUNDLE_MAGIC[..5]),
            Err(BundleError::Truncated(_))
        ));
    }
}

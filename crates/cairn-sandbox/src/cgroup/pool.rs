//! A pool of emptied memory cgroups, so that removing a sandbox does not
//! leave a dying one behind.
//!
//! A memory cgroup removed while pages are still charged to it (the page
//! cache of files the sandbox wrote or first read, the file system's own
//! metadata blocks) is only hidden: the kernel keeps it, "dying", until the
//! last of those pages is reclaimed, which on a host with free memory is
//! never. Thousands of them after a few thousand sandboxes slow every
//! following cgroup operation, and sandbox start with it (9 ms to 17-25 ms
//! measured here). A memory cgroup that is renamed instead of removed stays
//! alive and keeps its charges; the next sandbox of the same scope takes it
//! by renaming it to its own id (the kernel renames a cgroup only within
//! its parent, hence one pool per scope, and only on v1: v2 refuses any
//! rename, so v2 hosts have no pool).
//!
//! An entry is reset before it goes into the pool: its limits back to
//! unlimited, its peak and failure counters to zero. One whose sandbox saw
//! an OOM kill is removed instead (that counter cannot be reset and Cairn
//! reads it to explain a death), as is one still holding a process. Entries
//! are named `pooled-<unix seconds>-<pid>-<n>`: names no sandbox id takes
//! and that carry their age. A scope keeps at most [`MAX_ENTRIES`]; entries
//! older than [`MAX_AGE`] are removed by the next pool operation of their
//! scope or by any `gc` on the host, and `gc` drains its own scope's pool.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The prefix of a pooled entry's name.
pub const PREFIX: &str = "pooled-";

/// At most this many entries wait in one scope's pool: enough for the
/// sandboxes a host starts at once, few enough that an idle pool costs
/// little kernel memory.
pub const MAX_ENTRIES: usize = 64;

/// An entry unused this long is removed: a pool does not outlive its use
/// (or its state directory) by much.
pub const MAX_AGE: Duration = Duration::from_secs(600);

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A fresh entry name: unique across processes (pid) and within one (n).
fn fresh_name() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{PREFIX}{}-{}-{n}", now_secs(), std::process::id())
}

/// Whether `name` is a pooled entry's.
pub fn is_entry(name: &str) -> bool {
    name.starts_with(PREFIX)
}

/// The entry's age from its name; unknown names count as stale.
fn age(name: &str) -> Duration {
    let secs = name
        .strip_prefix(PREFIX)
        .and_then(|rest| rest.split('-').next())
        .and_then(|s| s.parse::<u64>().ok());
    match secs {
        Some(s) => Duration::from_secs(now_secs().saturating_sub(s)),
        None => Duration::MAX,
    }
}

/// The pooled entries in `parent`, newest first; stale ones are removed on
/// the way.
fn entries(parent: &Path) -> Vec<(String, PathBuf)> {
    let Ok(dir) = fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut found: Vec<(String, PathBuf)> = dir
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok().map(|n| (n, e.path())))
        .filter(|(n, _)| is_entry(n))
        .filter(|(n, p)| {
            if age(n) > MAX_AGE {
                let _ = fs::remove_dir(p);
                return false;
            }
            true
        })
        .collect();
    found.sort_by_key(|(n, _)| age(n));
    found
}

/// Renames a pooled entry of `target`'s parent to `target`; false when the
/// pool has none (or others took them all first).
pub fn take(target: &Path) -> bool {
    let Some(parent) = target.parent() else { return false };
    for (_, entry) in entries(parent) {
        match fs::rename(&entry, target) {
            Ok(()) => return true,
            // Another process took it, or a gc removed it: try the next.
            Err(_) => continue,
        }
    }
    false
}

/// Puts the emptied, reset cgroup `dir` into its parent's pool; false when
/// the pool is full or the rename failed (the caller removes `dir` then).
pub fn put(dir: &Path) -> bool {
    let Some(parent) = dir.parent() else { return false };
    if entries(parent).len() >= MAX_ENTRIES {
        return false;
    }
    fs::rename(dir, parent.join(fresh_name())).is_ok()
}

/// Removes every entry in `parent`; returns how many went.
pub fn drain(parent: &Path) -> usize {
    let Ok(dir) = fs::read_dir(parent) else { return 0 };
    dir.flatten()
        .filter(|e| e.file_name().to_str().is_some_and(is_entry))
        .filter(|e| remove(&e.path()))
        .count()
}

/// Removes entries older than [`MAX_AGE`] in every scope under `top` (the
/// `cairn` directory of a hierarchy), and scopes left empty: pools of state
/// directories that are gone. Returns how many entries went.
pub fn sweep_stale(top: &Path) -> usize {
    let Ok(scopes) = fs::read_dir(top) else { return 0 };
    let mut removed = 0;
    for scope in scopes.flatten().filter(|e| e.path().is_dir()) {
        let Ok(dir) = fs::read_dir(scope.path()) else { continue };
        let mut stale = 0;
        for e in dir.flatten() {
            let Some(name) = e.file_name().to_str().map(str::to_string) else {
                continue;
            };
            if is_entry(&name) && age(&name) > MAX_AGE && remove(&e.path()) {
                stale += 1;
            }
        }
        if stale > 0 {
            // Only an empty scope goes; one with sandboxes or fresh entries stays.
            let _ = fs::remove_dir(scope.path());
        }
        removed += stale;
    }
    removed
}

/// Removes one entry; false if another process took or removed it first.
fn remove(entry: &Path) -> bool {
    fs::remove_dir(entry).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_names_carry_their_age_and_never_look_like_a_sandbox_id() {
        let name = fresh_name();
        assert!(is_entry(&name));
        assert!(age(&name) < Duration::from_secs(5));
        assert!(!is_entry("0123456789ab"));
        assert_eq!(age("pooled-garbage"), Duration::MAX);
        assert!(age(&format!("{PREFIX}{}-1-0", now_secs() - 3600)) > MAX_AGE);
    }

    #[test]
    fn take_prefers_the_newest_entry_and_drops_stale_ones() {
        let dir = tempfile::tempdir().unwrap();
        let old = dir.path().join(format!("{PREFIX}{}-1-0", now_secs() - 3600));
        let older = dir.path().join(format!("{PREFIX}{}-1-1", now_secs() - 30));
        let newer = dir.path().join(format!("{PREFIX}{}-1-2", now_secs() - 10));
        for d in [&old, &older, &newer] {
            fs::create_dir(d).unwrap();
        }
        let target = dir.path().join("0123456789ab");
        assert!(take(&target));
        assert!(target.is_dir() && !newer.exists() && older.exists());
        assert!(!old.exists(), "a stale entry survived");
        assert_eq!(drain(dir.path()), 1);
        assert!(!take(&dir.path().join("ba9876543210")));
    }
}

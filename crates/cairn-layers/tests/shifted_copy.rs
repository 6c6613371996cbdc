//! A shifted copy of a layer directory keeps everything a layer holds and
//! shifts only its ids (runs as root: ownership, whiteouts, trusted.*).

use std::fs;
use std::os::unix::fs::{symlink, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

use cairn_layers::archive::{remove_abandoned_materialisations, shifted_copy, HostIds};
use nix::sys::stat::{makedev, mknod, Mode, SFlag};
use nix::unistd::{chown, fchownat, Gid, Uid};

const IDS: HostIds = HostIds {
    base: 0x7000_0000,
    count: 65536,
};

fn root_only() -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "shifted copies need root (CI=true: a missing part fails the test)"
    );
    eprintln!("SKIPPED: shifted copies need root; run the tests as root");
    false
}

fn own(p: &Path, uid: u32, gid: u32) {
    chown(p, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid))).unwrap();
}

/// A cap_net_raw+ep file capability in version 2, as layers record one.
fn cap_v2() -> Vec<u8> {
    let mut v = (0x0200_0000u32 | 1).to_le_bytes().to_vec();
    v.extend_from_slice(&(1u32 << 13).to_le_bytes());
    v.extend_from_slice(&[0; 12]);
    v
}

/// A layer with a bit of everything.
fn layer(src: &Path) {
    fs::create_dir(src).unwrap();
    fs::create_dir(src.join("a")).unwrap();
    fs::set_permissions(src.join("a"), fs::Permissions::from_mode(0o750)).unwrap();
    own(&src.join("a"), 1000, 1001);
    xattr::set(src.join("a"), "trusted.overlay.opaque", b"y").unwrap();
    fs::write(src.join("a/f"), b"data of f").unwrap();
    own(&src.join("a/f"), 1000, 1000);
    xattr::set(src.join("a/f"), "user.note", b"kept").unwrap();
    fs::hard_link(src.join("a/f"), src.join("h")).unwrap();
    fs::write(src.join("suid"), b"#!/bin/sh\n").unwrap();
    fs::set_permissions(src.join("suid"), fs::Permissions::from_mode(0o4755)).unwrap();
    fs::write(src.join("ping"), b"elf").unwrap();
    xattr::set(src.join("ping"), "security.capability", &cap_v2()).unwrap();
    fs::write(src.join("far"), b"id beyond the range").unwrap();
    own(&src.join("far"), 70_000, 70_000);
    symlink("a/f", src.join("l")).unwrap();
    fchownat(
        None,
        &src.join("l"),
        Some(Uid::from_raw(5)),
        Some(Gid::from_raw(6)),
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .unwrap();
    mknod(&src.join("w"), SFlag::S_IFCHR, Mode::empty(), makedev(0, 0)).unwrap();
    mknod(
        &src.join("null"),
        SFlag::S_IFCHR,
        Mode::from_bits_truncate(0o666),
        makedev(1, 3),
    )
    .unwrap();
    nix::unistd::mkfifo(&src.join("p"), Mode::from_bits_truncate(0o640)).unwrap();
    // An mtime from long ago on a directory: kept after its entries.
    let t = nix::sys::time::TimeSpec::new(1_000_000, 0);
    nix::sys::stat::utimensat(
        None,
        &src.join("a"),
        &t,
        &t,
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .unwrap();
}

#[test]
fn a_shifted_copy_keeps_the_layer_and_shifts_its_ids() {
    if !root_only() {
        return;
    }
    let tmp = tempfile::tempdir_in("/tmp").unwrap();
    let (src, dest) = (tmp.path().join("src"), tmp.path().join("shifted/layer"));
    layer(&src);
    let made = shifted_copy(&src, &dest, IDS).unwrap();
    assert!(!made.existed);
    assert_eq!(made.entries, 9, "{made:?}: every entry but the device node");
    let meta = |p: &str| fs::symlink_metadata(dest.join(p)).unwrap();
    let base = IDS.base;
    assert_eq!((meta("").uid(), meta("").gid()), (base, base));
    assert_eq!((meta("a").uid(), meta("a").gid()), (base + 1000, base + 1001));
    assert_eq!(meta("a").mode() & 0o7777, 0o750);
    assert_eq!(meta("a").mtime(), 1_000_000);
    assert_eq!(
        xattr::get(dest.join("a"), "trusted.overlay.opaque").unwrap().as_deref(),
        Some(&b"y"[..])
    );
    assert_eq!(fs::read(dest.join("a/f")).unwrap(), b"data of f");
    assert_eq!(
        xattr::get(dest.join("a/f"), "user.note").unwrap().as_deref(),
        Some(&b"kept"[..])
    );
    assert_eq!(
        meta("a/f").ino(),
        meta("h").ino(),
        "the hard link is one file in the copy"
    );
    assert_eq!(meta("a/f").uid(), base + 1000);
    assert_eq!(meta("suid").mode() & 0o7777, 0o4755, "set-id bits survive the chown");
    assert_eq!(
        meta("far").uid(),
        base + 65534,
        "an id beyond the range is the overflow id"
    );
    assert_eq!(fs::read_link(dest.join("l")).unwrap(), Path::new("a/f"));
    assert_eq!((meta("l").uid(), meta("l").gid()), (base + 5, base + 6));
    assert!(
        meta("w").file_type().is_char_device() && meta("w").rdev() == 0,
        "the whiteout is kept"
    );
    assert!(
        fs::symlink_metadata(dest.join("null")).is_err(),
        "a device node is left out"
    );
    assert!(meta("p").file_type().is_fifo());
    assert_eq!(meta("p").mode() & 0o777, 0o640);
    // The capability names the range's root, as one set inside would.
    let cap = xattr::get(dest.join("ping"), "security.capability").unwrap().unwrap();
    assert_eq!(cap.len(), 24);
    assert_eq!(&cap[..4], &(0x0300_0000u32 | 1).to_le_bytes());
    assert_eq!(&cap[20..], &base.to_le_bytes());
    // The layer itself is untouched.
    assert_eq!(fs::metadata(src.join("a")).unwrap().uid(), 1000);
    // A second copy to the same place finds it there and copies nothing.
    let again = shifted_copy(&src, &dest, IDS).unwrap();
    assert!(again.existed && again.entries == 0);
    assert_eq!(
        fs::read_dir(tmp.path().join("shifted")).unwrap().count(),
        1,
        "no temporaries left"
    );
}

#[test]
fn a_failed_copy_leaves_nothing_and_a_dead_writer_s_temporary_is_swept() {
    if !root_only() {
        return;
    }
    let tmp = tempfile::tempdir_in("/tmp").unwrap();
    let dest = tmp.path().join("shifted/layer");
    let err = shifted_copy(&tmp.path().join("missing"), &dest, IDS).unwrap_err();
    assert!(err.to_string().contains("opening the layer"), "{err}");
    assert_eq!(fs::read_dir(tmp.path().join("shifted")).unwrap().count(), 0);
    // A temporary named after a process that is gone, as a start killed
    // mid-copy leaves it (pid 2^22 + 1 is above pid_max's ceiling).
    let dead = tmp.path().join("shifted/.layer.materialising-4194305+1-1");
    fs::create_dir_all(dead.join("half")).unwrap();
    let mine = tmp.path().join(format!(
        "shifted/.other.materialising-{}-1",
        cairn_store::process::WriterId::current()
    ));
    fs::create_dir_all(&mine).unwrap();
    assert_eq!(
        remove_abandoned_materialisations(&tmp.path().join("shifted")).unwrap(),
        1
    );
    assert!(!dead.exists() && mine.exists(), "only the dead writer's temporary goes");
}

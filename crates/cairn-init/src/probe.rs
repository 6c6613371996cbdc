//! `cairn-init --probe-layers DIR BASE:COUNT`: which way this kernel takes
//! a native sandbox's layers (see [`cairn_protocol::LayerMount`]).
//!
//! The host runs it once per kernel release and state directory, and keeps
//! the answer. In a user namespace mapping `0..COUNT` to `BASE..` and a
//! mount namespace of its own, inside the empty directory `DIR` on the state
//! directory's filesystem, it builds a one-file layer stored as Cairn stores
//! layers (owned by id 0) and a shifted copy of it (owned by `BASE`), and
//! mounts an overlay root each way in turn with the code a sandbox's start
//! runs. A way works when, through its overlay, the layer's file shows as
//! the sandbox root's host id and a write lands in the upper directory.
//!
//! It prints one line per check, `NAME\tok|no\tDETAIL`, then
//! `mechanism\tfd|path|shifted|none`, and exits 0 whenever it could say so
//! (2 for bad arguments). Its mounts go with its mount namespace when it
//! exits; the host removes `DIR`.

use std::fs;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{chown, MetadataExt};
use std::path::Path;

use cairn_protocol::LayerMount;
use nix::mount::{mount, MsFlags};
use nix::sched::{unshare, CloneFlags};

use crate::native::{ctx, kernel_release, mount_overlay, user_namespace, Layers, Step};

/// What the layer's file holds, so a read through the overlay is checked.
const CONTENT: &[u8] = b"cairn layer probe\n";

/// Runs the probe with `args` (`DIR BASE:COUNT`), reporting to `out`.
pub fn run(args: &[String], out: &mut impl Write) -> i32 {
    let parsed = match args {
        [dir, ids] => ids
            .split_once(':')
            .and_then(|(b, c)| Some((b.parse::<u32>().ok()?, c.parse::<u32>().ok()?)))
            .map(|(base, count)| (Path::new(dir), base, count)),
        _ => None,
    };
    let Some((dir, base, count)) = parsed else {
        eprintln!("usage: cairn-init --probe-layers DIR BASE:COUNT");
        return 2;
    };
    let mut line = |name: &str, result: &Step<String>| {
        let (state, detail) = match result {
            Ok(detail) => ("ok", detail.as_str()),
            Err(e) => ("no", e.as_str()),
        };
        let detail = detail.replace(['\t', '\n'], " ");
        let _ = writeln!(out, "{name}\t{state}\t{detail}");
    };
    line(
        "kernel",
        &kernel_release().ok_or_else(|| "cannot read /proc/sys/kernel/osrelease".to_string()),
    );
    let mechanism = probe(dir, base, count, &mut line);
    let name = match mechanism {
        Some(LayerMount::Descriptors) => "fd",
        Some(LayerMount::IdmappedPaths) => "path",
        Some(LayerMount::ShiftedPaths) => "shifted",
        None => "none",
    };
    let _ = writeln!(out, "mechanism\t{name}");
    0
}

fn probe(dir: &Path, base: u32, count: u32, line: &mut impl FnMut(&str, &Step<String>)) -> Option<LayerMount> {
    let made = user_namespace(base, count);
    line(
        "user namespace",
        &made
            .as_ref()
            .map(|_| format!("ids 0-{} as host {base}+", count - 1))
            .map_err(Clone::clone),
    );
    let (userns, holder) = made.ok()?;
    let _ = nix::sys::wait::waitpid(holder, None);
    let private = ctx(unshare(CloneFlags::CLONE_NEWNS), || "create a mount namespace".into()).and_then(|()| {
        ctx(
            mount(
                None::<&str>,
                "/",
                None::<&str>,
                MsFlags::MS_REC | MsFlags::MS_PRIVATE,
                None::<&str>,
            ),
            || "make mounts private".into(),
        )
    });
    line("mount namespace", &private.map(|()| "private".into()));
    if let Err(e) = prepare(dir, base) {
        line("probe directory", &Err(e));
        return None;
    }
    let fs = filesystem(dir);
    let idmapped = crate::mount_api::layer_clone(&dir.join("path").join("layer").to_string_lossy(), Some(&userns))
        .map(|_| format!("the state directory's filesystem ({fs}) takes idmapped mounts"))
        .map_err(|e| format!("the state directory's filesystem ({fs}) refused an idmapped mount: {e}"));
    line("idmapped mounts", &idmapped);
    let mut chosen = None;
    for (name, how, what) in [
        (
            "overlay fd",
            LayerMount::Descriptors,
            "idmapped layers given to overlayfs as file descriptors",
        ),
        (
            "overlay path",
            LayerMount::IdmappedPaths,
            "idmapped layers given to overlayfs by path",
        ),
        (
            "overlay shifted",
            LayerMount::ShiftedPaths,
            "overlayfs over layers copied with shifted ids",
        ),
    ] {
        // The refusal without the remedy a start would print with it.
        let result = attempt(dir, base, &userns, how)
            .map(|()| what.to_string())
            .map_err(|e| e.split("; this kernel (Linux").next().unwrap_or_default().to_string());
        line(name, &result);
        if result.is_ok() && chosen.is_none() {
            chosen = Some(how);
        }
    }
    chosen
}

/// Per way, a directory of its own (a way may leave mounts over its
/// paths): its one-file layer (`layer/`, owned by 0 as stored layers are,
/// or by `base` for the shifted way, as its copies are), and an upper, a
/// work and a root directory.
fn prepare(dir: &Path, base: u32) -> Step<()> {
    let mk = |p: &Path| ctx(fs::create_dir(p), || format!("create {}", p.display()));
    for (way, owner) in [("fd", 0), ("path", 0), ("shifted", base)] {
        let d = dir.join(way);
        mk(&d)?;
        for sub in ["layer", "upper", "work", "root"] {
            mk(&d.join(sub))?;
        }
        let f = d.join("layer").join("probe");
        ctx(fs::write(&f, CONTENT), || format!("write {}", f.display()))?;
        for (p, id) in [(d.join("layer"), owner), (f, owner), (d.join("upper"), base)] {
            ctx(chown(&p, Some(id), Some(id)), || format!("chown {}", p.display()))?;
        }
    }
    Ok(())
}

/// Mounts an overlay `how` would, and checks it: the layer's file shows
/// as the sandbox root's host id, with its content, and a write lands in
/// the upper directory.
fn attempt(dir: &Path, base: u32, userns: &OwnedFd, how: LayerMount) -> Step<()> {
    let way = match how {
        LayerMount::Descriptors => "fd",
        LayerMount::IdmappedPaths => "path",
        LayerMount::ShiftedPaths => "shifted",
    };
    let lower = [dir.join(way).join("layer").to_string_lossy().into_owned()];
    let (upper, work) = (dir.join(way).join("upper"), dir.join(way).join("work"));
    let (upper, work) = (upper.to_string_lossy(), work.to_string_lossy());
    let root = dir.join(way).join("root");
    let layers = Layers {
        lower: &lower,
        upper: &upper,
        work: &work,
    };
    mount_overlay(&layers, &root, userns, how)?;
    let file = root.join("probe");
    let meta = ctx(fs::symlink_metadata(&file), || {
        "stat the layer's file through the overlay".into()
    })?;
    if (meta.uid(), meta.gid()) != (base, base) {
        return Err(format!(
            "the layer's file shows as {}:{} through the overlay, not the sandbox root's {base}:{base}",
            meta.uid(),
            meta.gid()
        ));
    }
    if ctx(fs::read(&file), || "read the layer's file through the overlay".into())? != CONTENT {
        return Err("the layer's file reads differently through the overlay".into());
    }
    ctx(fs::write(root.join("written"), b"1"), || {
        "write through the overlay".into()
    })?;
    if !Path::new(&*upper).join("written").exists() {
        return Err("a write through the overlay did not reach the upper directory".into());
    }
    Ok(())
}

/// The name of `dir`'s filesystem type, as far as the probe knows it.
fn filesystem(dir: &Path) -> String {
    let Ok(st) = nix::sys::statfs::statfs(dir) else {
        return "unknown".into();
    };
    let magic = st.filesystem_type().0 as u64;
    let name = match magic {
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0x0102_1994 => "tmpfs",
        0x794C_7630 => "overlayfs",
        0x2FC1_2FC1 => "zfs",
        0x6969 => "nfs",
        0x0102_1997 => "9p",
        0xF2F5_2010 => "f2fs",
        0x6573_5546 => "fuse",
        _ => return format!("type {magic:#x}"),
    };
    name.into()
}

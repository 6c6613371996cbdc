//! End-to-end: each way a native sandbox's layers reach overlayfs
//! (descriptors, idmapped mounts by path, copies with shifted ids), chosen
//! by the kernel's probe or asked for with `CAIRN_LAYER_MOUNT`, keeps the
//! same promises; a way the kernel refused is refused whole; shifted copies
//! survive a kill mid-copy and go with their layer in `gc`. Runs on this
//! host and in the virtual machines of older kernels (scripts/test.sh).

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{skip, Home};

const WAYS: [&str; 3] = ["fd", "path", "shifted"];
/// Host id of a native sandbox's root.
const SANDBOX_ROOT_ON_HOST: u32 = 0x7000_0000;

/// The kernel probe's answer, read from the state directory's cache after
/// one sandbox ran there.
fn probe(home: &Home) -> serde_json::Value {
    home.ok(&["run", "--", "true"]);
    let cache = std::fs::read(home.path().join("layer-mount.json")).expect("the probe's answer is cached");
    serde_json::from_slice(&cache).unwrap()
}

fn works(probe: &serde_json::Value, way: &str) -> bool {
    probe["checks"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["name"] == format!("overlay {way}") && c["ok"] == true)
}

fn with_way(way: &str) -> Home {
    Home::with_state_and_env(None, vec![("CAIRN_LAYER_MOUNT".into(), way.into())])
}

#[test]
fn every_way_the_kernel_takes_gives_the_sandbox_its_layers_as_its_own_and_no_host_path() {
    if skip("layer ways") {
        return;
    }
    let probed = probe(&Home::new());
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_eq!(probed["kernel"], release.trim(), "the answer is keyed by this kernel");
    let chosen = probed["mechanism"]
        .as_str()
        .expect("some way works on a host the suites run on");
    assert!(works(&probed, chosen) && works(&probed, "shifted"), "{probed}");
    for way in WAYS {
        let home = with_way(way);
        if !works(&probed, way) {
            // Refused whole: a message naming the way and the fix, no
            // sandbox, directory or cgroup left.
            let out = home.cairn(&["create"]);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(125), "{err}");
            assert!(
                err.contains(&format!("CAIRN_LAYER_MOUNT={way}")) && err.contains("refused"),
                "{err}"
            );
            assert!(home.ps().is_empty(), "a refused start left a sandbox");
            let dirs = std::fs::read_dir(home.path().join("sandboxes"))
                .map(|d| d.count())
                .unwrap_or(0);
            assert_eq!(dirs, 0, "a refused start left a sandbox directory");
            assert!(home.sandbox_cgroups_left().is_empty(), "a refused start left a cgroup");
            continue;
        }
        let id = home.ok(&["create"]);
        // The image's files are the sandbox root's, and its own writes are.
        let owners = home.sh(
            &id,
            "stat -c %u:%g /bin/busybox /; echo x >/tmp/w; stat -c %u:%g /tmp/w; id -u",
        );
        assert_eq!(owners.lines().collect::<Vec<_>>(), ["0:0", "0:0", "0:0", "0"], "{way}");
        let mountinfo = home.ok(&["exec", &id, "--", "cat", "/proc/self/mountinfo"]);
        let state_dir = home.path().to_str().unwrap();
        assert!(
            !mountinfo.contains(state_dir),
            "{way}: the mount table shows the state directory:\n{mountinfo}"
        );
        let root = mountinfo
            .lines()
            .find(|l| l.split(' ').nth(4) == Some("/"))
            .unwrap_or_else(|| panic!("no root mount in\n{mountinfo}"));
        let layers = if way == "fd" { "lowerdir+=/" } else { "lowerdir=0," };
        assert!(
            root.contains(layers) && root.contains("nosuid") && root.contains("nodev"),
            "{way}: {root}"
        );
        // On the host, what the sandbox wrote belongs to its root's host id.
        let upper = home.path().join("sandboxes").join(&id).join("upper/tmp/w");
        assert_eq!(owner(&upper), SANDBOX_ROOT_ON_HOST, "{way}");
        // A snapshot and a fork of it see the same files, owned the same.
        home.sh(&id, "mkdir -p /data && echo kept >/data/f && chown 1000:1000 /data/f");
        let snap = home.ok(&["snapshot", &id]);
        let fork = home.ok(&["fork", &snap]);
        let seen = home.sh(&fork, "cat /data/f; stat -c %u:%g /data/f /bin/busybox");
        assert_eq!(seen.lines().collect::<Vec<_>>(), ["kept", "1000:1000", "0:0"], "{way}");
        let shifted = home.path().join("shifted");
        if way == "shifted" {
            let copies: Vec<PathBuf> = std::fs::read_dir(&shifted)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with(".seal-"))
                .collect();
            // The image's layer and the snapshot's, each sealed.
            assert_eq!(copies.len(), 2, "{copies:?}");
            for copy in &copies {
                let seal = format!(".seal-{}", copy.file_name().unwrap().to_string_lossy());
                assert!(shifted.join(seal).is_file(), "{} is not sealed", copy.display());
            }
            for copy in &copies {
                assert_eq!(owner(copy), SANDBOX_ROOT_ON_HOST, "{}", copy.display());
            }
        } else {
            assert!(!shifted.exists(), "{way} made shifted copies");
        }
        home.ok(&["rm", "-f", &id, &fork]);
    }
}

fn owner(p: &Path) -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(p).unwrap().uid()
}

/// A tree of many small files and a few large ones, so a copy takes long
/// enough to be caught in the middle.
fn big_tree(dir: &Path) {
    let bin = common::busybox_layer();
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(bin)
        .arg(dir)
        .status()
        .unwrap();
    assert!(status.success());
    for d in 0..20 {
        let sub = dir.join(format!("data/{d}"));
        std::fs::create_dir_all(&sub).unwrap();
        for f in 0..100 {
            std::fs::write(sub.join(f.to_string()), format!("{d}/{f}\n").repeat(64)).unwrap();
        }
    }
    std::fs::write(dir.join("data/large"), vec![7u8; 16 << 20]).unwrap();
}

#[test]
fn a_shifted_copy_killed_midway_is_made_again_and_gc_keeps_the_copies_in_use() {
    if skip("shifted copies") {
        return;
    }
    let home = with_way("shifted");
    if !works(&probe(&home), "shifted") {
        panic!("overlayfs over plain layers failed on this host");
    }
    let tree = home.path().join("tree");
    big_tree(&tree);
    home.ok(&["image", "import", tree.to_str().unwrap(), "--name", "big"]);
    std::fs::remove_dir_all(&tree).unwrap();
    let images: serde_json::Value = serde_json::from_str(&home.ok(&["image", "ls", "--json"])).unwrap();
    let layer = images
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == "big")
        .and_then(|i| i["layers"][0].as_str())
        .unwrap()
        .to_string();
    let shifted = home.path().join("shifted");
    let copy = shifted.join(&layer);
    // Killed while its temporary fills; up to five tries, in case a copy
    // finishes between two looks.
    let mut caught = false;
    for _ in 0..5 {
        let _ = std::fs::remove_dir_all(&copy);
        let mut child = home.command(&["run", "--image", "big", "--", "true"]).spawn().unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline && !copy.exists() {
            if temporaries(&shifted).iter().any(|t| t.contains(&layer)) {
                child.kill().unwrap();
                caught = true;
                break;
            }
            if child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let _ = child.wait();
        if caught {
            break;
        }
    }
    assert!(caught, "no start was caught copying");
    assert!(!copy.exists(), "a killed copy was put in place");
    assert!(!temporaries(&shifted).is_empty());
    // The next start makes it again; the file a sandbox reads is whole.
    let id = home.ok(&["create", "--image", "big"]);
    assert!(copy.is_dir());
    let size = home.sh(
        &id,
        "wc -c </data/large; cat /data/19/99 | head -1; stat -c %u /data/large",
    );
    assert_eq!(
        size.lines().collect::<Vec<_>>(),
        [&(16u64 << 20).to_string(), "19/99", "0"]
    );
    // gc sweeps the killed start's temporary and keeps the copy in use...
    let report: serde_json::Value = serde_json::from_str(&home.ok(&["gc", "--json"])).unwrap();
    assert!(report["shifted_copies_removed"].as_u64().unwrap() >= 1, "{report}");
    assert!(temporaries(&shifted).is_empty(), "gc left {:?}", temporaries(&shifted));
    assert!(copy.is_dir(), "gc removed a copy in use");
    assert_eq!(home.sh(&id, "head -1 /data/0/0"), "0/0");
    // ... and, with the image and its sandbox gone, the copy goes too.
    home.ok(&["rm", "-f", &id]);
    home.ok(&["image", "rm", "big"]);
    home.ok(&["gc"]);
    assert!(!copy.exists(), "gc kept the copy of a removed layer");
}

/// The attack: a shifted copy edited on the host (a planted password
/// line, a setuid bit) reached every sandbox started on it. Copies are
/// sealed when made and checked before use: the changed one is set aside
/// and made again from the layer, and gc names what was set aside.
#[test]
fn a_shifted_copy_edited_on_the_host_is_made_again_before_use() {
    if skip("a_shifted_copy_edited_on_the_host_is_made_again_before_use") {
        return;
    }
    let home = with_way("shifted");
    if !works(&probe(&home), "shifted") {
        panic!("overlayfs over plain layers failed on this host");
    }
    let look = "head -1 /etc/passwd; stat -c %a /bin/busybox";
    let before = home.ok(&["run", "--", "sh", "-c", look]);
    let images: serde_json::Value = serde_json::from_str(&home.ok(&["image", "ls", "--json"])).unwrap();
    let layer = images[0]["layers"][0].as_str().unwrap().to_string();
    let shifted = home.path().join("shifted");
    let copy = shifted.join(&layer);
    assert!(
        copy.is_dir() && shifted.join(format!(".seal-{layer}")).is_file(),
        "the copy is not sealed"
    );
    std::fs::write(copy.join("etc/passwd"), "root::0:0:planted:/root:/bin/sh\n").unwrap();
    let busybox = copy.join("bin/busybox");
    let mode = std::fs::metadata(&busybox).unwrap().permissions();
    std::fs::set_permissions(&busybox, std::os::unix::fs::PermissionsExt::from_mode(0o4755)).unwrap();
    let after = home.ok(&["run", "--", "sh", "-c", look]);
    assert_eq!(
        after, before,
        "an edit to the shifted copy on the host reached a sandbox"
    );
    assert_eq!(std::fs::metadata(&busybox).unwrap().permissions(), mode);
    let aside: Vec<String> = std::fs::read_dir(&shifted)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!(".changed-{layer}-")))
        .collect();
    assert_eq!(aside.len(), 1, "the changed copy is kept aside for inspection");
    let gc = home.cairn(&["gc"]);
    let said = String::from_utf8_lossy(&gc.stderr);
    assert!(said.contains(&aside[0]), "gc does not name the changed copy: {said}");
}

/// Names of copies' temporaries in `dir`.
fn temporaries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with('.') && !n.starts_with(".seal-"))
                .collect()
        })
        .unwrap_or_default()
}

/// A tmpfs mounted for a test, unmounted (lazily) when dropped.
struct Tmpfs(tempfile::TempDir);

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(self.0.path(), nix::mount::MntFlags::MNT_DETACH);
    }
}

#[test]
fn a_state_directory_on_tmpfs_runs_sandboxes_by_the_best_way_its_probe_found() {
    if skip("a state directory on tmpfs") {
        return;
    }
    // tmpfs takes idmapped mounts only from Linux 6.3: before, its state
    // directory gets shifted copies.
    let dir = tempfile::Builder::new()
        .prefix("cairn-tmpfs")
        .tempdir_in("/tmp")
        .unwrap();
    nix::mount::mount(
        Some("tmpfs"),
        dir.path(),
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        Some("mode=0700,size=512m"),
    )
    .expect("mount a tmpfs");
    let mount = Tmpfs(dir);
    let home = Home::in_dir(mount.0.path());
    let probed = probe(&home);
    let best = WAYS
        .into_iter()
        .find(|w| works(&probed, w))
        .expect("a way works on tmpfs");
    assert_eq!(probed["mechanism"], best, "{probed}");
    let id = home.ok(&["create"]);
    assert_eq!(home.sh(&id, "stat -c %u:%g /bin/busybox; echo x >/f; cat /f"), "0:0\nx");
    let copies = std::fs::read_dir(home.path().join("shifted"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(copies > 0, best == "shifted", "{best}: {copies} shifted copies");
    home.ok(&["rm", "-f", &id]);
}

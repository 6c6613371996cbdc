//! End-to-end: `cairn gc` run over and over beside work in progress (an
//! image import, a pipeline collecting artifacts) takes nothing from it.

mod common;

use std::path::Path;
use std::process::{Child, Stdio};

use common::{skip, stderr, stdout, Home};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Files in the imported tree: enough that copying them takes a while.
const DIRS: usize = 20;
const FILES_PER_DIR: usize = 500;

/// A file's content: seven different ones, so the store keeps seven chunks
/// and the import's capture stays quick.
fn content(d: usize, f: usize) -> String {
    format!("file {} of a directory like {}\n", f % 7, d % 7).repeat(1 + f % 7)
}

/// The pid of `parent`'s child process whose command is `name`.
fn child_named(parent: u32, name: &str) -> Option<i32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid = e.file_name().to_str()?.parse::<i32>().ok()?;
        let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
        let (open, close) = (stat.find('(')?, stat.rfind(')')?);
        let ppid = stat[close + 2..].split_whitespace().nth(1)?.parse::<u32>().ok()?;
        (&stat[open + 1..close] == name && ppid == parent).then_some(pid)
    })
}

/// Whether `pid`, sent SIGSTOP, stops (false: it ended first).
fn stopped(pid: i32) -> bool {
    loop {
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| stat[stat.rfind(')')? + 2..].chars().next());
        match state {
            Some('T') => return true,
            None | Some('Z') | Some('X') => return false,
            // The signal is taken on the way back to user space.
            _ => std::thread::sleep(std::time::Duration::from_millis(1)),
        }
    }
}

/// The `.tmp-*` entries of the home's layer directory.
fn layer_temporaries(home: &Home) -> Vec<String> {
    std::fs::read_dir(home.path().join("layers"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(".tmp-"))
                .collect()
        })
        .unwrap_or_default()
}

/// Runs `cairn gc` over and over until `child` exits; returns its output.
fn gc_until_done(home: &Home, mut child: Child) -> std::process::Output {
    while child.try_wait().unwrap().is_none() {
        let gc = home.cairn(&["gc"]);
        assert!(gc.status.success(), "cairn gc failed: {}", stderr(&gc));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn an_image_imported_while_gc_runs_is_complete() {
    if skip("an_image_imported_while_gc_runs_is_complete") {
        return;
    }
    let home = Home::new();
    // A busybox root (so the image runs) plus thousands of small files.
    let busybox = home.busybox_layer();
    let src = tempfile::tempdir().unwrap();
    let cp = std::process::Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", busybox.display()))
        .arg(src.path())
        .status()
        .unwrap();
    assert!(cp.success());
    for d in 0..DIRS {
        let dir = src.path().join(format!("data/{d}"));
        std::fs::create_dir_all(&dir).unwrap();
        for f in 0..FILES_PER_DIR {
            std::fs::write(dir.join(f.to_string()), content(d, f)).unwrap();
        }
    }

    let mut child = home
        .command(&["image", "import", src.path().to_str().unwrap(), "--name", "big"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The copy into the import's layer is held still while one gc runs from
    // start to end: the race, every time.
    let cp = loop {
        if let Some(cp) = child_named(child.id(), "cp") {
            break cp;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "the import ended before its copy was seen"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    };
    kill(Pid::from_raw(cp), Signal::SIGSTOP).unwrap();
    let held = stopped(cp);
    let filling = layer_temporaries(&home);
    let gc = home.cairn(&["gc"]);
    kill(Pid::from_raw(cp), Signal::SIGCONT).unwrap();
    assert!(
        held,
        "the copy ended before it could be held; make the imported tree larger"
    );
    assert_eq!(filling.len(), 1, "{filling:?}");
    assert!(gc.status.success(), "cairn gc failed: {}", stderr(&gc));
    // And gc goes on running through the rest of the copy and the capture.
    let import = gc_until_done(&home, child);
    assert!(import.status.success(), "the import failed: {}", stderr(&import));

    // Every file made it into the image's layer, with its content.
    let images: serde_json::Value = serde_json::from_str(&home.ok(&["image", "ls", "--json"])).unwrap();
    let big = images.as_array().unwrap().iter().find(|i| i["name"] == "big").unwrap();
    let layer = home.path().join("layers").join(big["layers"][0].as_str().unwrap());
    let mut missing = Vec::new();
    for d in 0..DIRS {
        for f in 0..FILES_PER_DIR {
            let path = layer.join(format!("data/{d}/{f}"));
            if std::fs::read_to_string(&path).ok() != Some(content(d, f)) {
                missing.push(format!("data/{d}/{f}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the import reported success, but {} of {} files are missing or wrong in its image (first: {:?})",
        missing.len(),
        DIRS * FILES_PER_DIR,
        &missing[..missing.len().min(5)]
    );
    // And a sandbox on it, after one more gc, sees them all.
    home.ok(&["gc"]);
    let count = home.ok(&["run", "--image", "big", "--", "sh", "-c", "find /data -type f | wc -l"]);
    assert_eq!(count, (DIRS * FILES_PER_DIR).to_string());
}

/// The pipeline collecting four artifacts; `{key}` is the stage's key.
const ARTIFACTS: &str = r#"
[pipeline]
name = "artifacts"
image = "busybox"

[[stage]]
name = "make"
key = "{key}"
# /dev/shm is not in the stage's snapshot: only the artifacts hold these chunks.
run = ["for i in 1 2 3 4; do head -c 12000000 /dev/urandom > /dev/shm/a$i; done"]
artifacts = ["/dev/shm/a1", "/dev/shm/a2", "/dev/shm/a3", "/dev/shm/a4"]
"#;

/// The home's scratch directories: while an artifact is collected, its
/// download sits in one until its chunks are stored and recorded.
fn scratch_dirs(home: &Home) -> Vec<String> {
    std::fs::read_dir(home.path().join("tmp"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn gc_during_artifact_collection_loses_nothing() {
    if skip("gc_during_artifact_collection_loses_nothing") {
        return;
    }
    let home = Home::new();
    // Each attempt collects anew (a stage key of its own). One is enough
    // when the pipeline is caught while an artifact's download sits in its
    // scratch directory; a collection quicker than the poll can slip by.
    let held = (1..=5).any(|attempt| collect_beside_gc(&home, &format!("make-v{attempt}")));
    assert!(
        held,
        "no collection was caught in progress in five runs; make the artifacts larger"
    );
}

/// Runs the artifacts pipeline with stage key `key`. The pipeline is
/// stopped while an artifact is being collected and one gc runs (to its end
/// if it can; a gc waiting for the collection's store lock finishes once
/// the pipeline goes on), then gc runs over and over until the pipeline
/// ends, and every artifact must read back whole. Returns whether a
/// collection was caught and held.
fn collect_beside_gc(home: &Home, key: &str) -> bool {
    let file = home.path().join("p.toml");
    std::fs::write(&file, ARTIFACTS.replace("{key}", key)).unwrap();
    let mut child = home
        .command(&["pipeline", "run", file.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = Pid::from_raw(child.id() as i32);
    let held = loop {
        if child.try_wait().unwrap().is_some() {
            break false;
        }
        if scratch_dirs(home).is_empty() {
            std::thread::sleep(std::time::Duration::from_micros(200));
            continue;
        }
        kill(pid, Signal::SIGSTOP).unwrap();
        let filling = scratch_dirs(home);
        if !stopped(pid.as_raw()) || filling.is_empty() {
            // The collection ended before the stop took hold: the next one.
            kill(pid, Signal::SIGCONT).unwrap();
            continue;
        }
        let mut gc = home
            .command(&["gc"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
        while gc.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let finished_while_held = gc.try_wait().unwrap().is_some();
        let left = scratch_dirs(home);
        kill(pid, Signal::SIGCONT).unwrap();
        let gc = gc.wait_with_output().unwrap();
        assert!(gc.status.success(), "cairn gc failed: {}", stderr(&gc));
        if finished_while_held {
            // gc ran from start to end with the download in its scratch
            // directory, whose writer is alive: the directory must be there.
            for d in &filling {
                assert!(
                    left.contains(d),
                    "gc removed the scratch directory {d} of a live collection"
                );
            }
        }
        break true;
    };
    let run = gc_until_done(home, child);
    assert!(run.status.success(), "the pipeline failed: {}", stderr(&run));
    let run = stdout(&run).trim().to_string();

    // One more gc, then every artifact reads back whole.
    home.ok(&["gc"]);
    let v: serde_json::Value = serde_json::from_str(&home.ok(&["pipeline", "show", &run, "--json"])).unwrap();
    let artifacts = v["artifacts"].as_array().unwrap();
    assert_eq!(artifacts.len(), 4, "{v}");
    let out_dir = tempfile::tempdir().unwrap();
    for a in artifacts {
        let id = a["id"].as_str().unwrap();
        let out = out_dir.path().join(id);
        let got = home.cairn(&["artifact", "get", id, "-o", out.to_str().unwrap()]);
        assert!(
            got.status.success(),
            "artifact {} does not read back: {}",
            a["path"],
            stderr(&got)
        );
        check_whole(&out, a);
    }
    held
}

fn check_whole(out: &Path, artifact: &serde_json::Value) {
    let bytes = std::fs::read(out).unwrap();
    assert_eq!(bytes.len(), 12_000_000, "artifact {}", artifact["path"]);
    assert_eq!(
        blake3::hash(&bytes).to_hex().as_str(),
        artifact["content_hash"].as_str().unwrap(),
        "artifact {} reads back other bytes than were collected",
        artifact["path"]
    );
}

#[test]
fn gc_removes_a_temporary_only_when_its_writer_is_dead() {
    if skip("gc_removes_a_temporary_only_when_its_writer_is_dead") {
        return;
    }
    let home = Home::new();
    let pid = std::process::id() as i32;
    let live = format!("{pid}+{}", cairn_sandbox::pid_start_time(pid).unwrap());
    // This test's pid with another start time: a writer whose pid was reused.
    let reused = format!("{pid}+{}", cairn_sandbox::pid_start_time(pid).unwrap() + 1);
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = format!("{}+1", child.id());
    child.wait().unwrap();
    let layer = "ab".repeat(32);
    let at = |p: String| home.path().join(p);
    let kept = [
        at(format!("store/tmp/{live}-0-1.partial")),
        at(format!("layers/.tmp-0011223344556677-{live}")),
        at(format!("layers/.tmp-rm-{layer}-{live}")),
        at(format!("layers/.{layer}.materialising-{live}-1")),
        at(format!("tmp/{live}-1-0")),
    ];
    let removed: Vec<_> = [dead, reused]
        .iter()
        .flat_map(|w| {
            [
                at(format!("store/tmp/{w}-0-1.partial")),
                at(format!("layers/.tmp-0011223344556677-{w}")),
                at(format!("layers/.tmp-rm-{layer}-{w}")),
                at(format!("layers/.{layer}.materialising-{w}-1")),
                at(format!("tmp/{w}-1-0")),
            ]
        })
        .collect();
    for p in kept.iter().chain(&removed) {
        if p.extension().is_some_and(|e| e == "partial") {
            std::fs::write(p, b"half").unwrap();
        } else {
            std::fs::create_dir_all(p.join("half/built")).unwrap();
        }
    }
    home.ok(&["gc"]);
    for p in &kept {
        assert!(p.exists(), "gc removed {} while its writer runs", p.display());
    }
    for p in &removed {
        assert!(!p.exists(), "gc kept {} though its writer is dead", p.display());
    }
}

//! End-to-end: snapshots, forks, restores and resets of real sandboxes.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{init_pid, skip, stderr, stdout, tree, Home};

/// Changes through the sandbox that exercise every overlay case.
const FIRST_ROUND: &str = r#"
set -e
rm /bin/vi                                     # whiteout over an image file
rm -rf /var && mkdir -p /var/new && echo v > /var/new/f   # opaque directory
mv /etc/hosts /etc/hosts.moved                 # rename of an image file
mkdir -p /d1/sub && echo a > /d1/sub/f && mv /d1 /d2      # rename of a new directory
rm -rf /root && echo file > /root              # directory replaced by a file
rm /etc/group && mkdir /etc/group && echo x > /etc/group/inner   # file replaced by a directory
echo h > /h1 && ln /h1 /h2 && ln /h1 /tmp/h3   # hard links
ln -s /etc/passwd /link && ln -s /nowhere /dangling       # symlinks
mkfifo /fifo
mkdir -p /data && echo owned > /data/owned && chown 1234:5678 /data/owned && chmod 4750 /data/owned
echo old > /data/old && touch -d '2001-02-03 04:05:06' /data/old
dd if=/dev/zero of=/data/sparse bs=1 count=0 seek=100M 2>/dev/null
echo middle | dd of=/data/sparse bs=1M seek=50 conv=notrunc 2>/dev/null
: > /data/empty
mkdir '/data/ünïcødé dir' && echo u > '/data/ünïcødé dir/ファイル'
touch "/data/$(printf 'n%.0s' $(seq 255))"
dd if=/dev/urandom of=/data/random bs=64k count=40 2>/dev/null
"#;

/// Changes after the first snapshot: the second, incremental, snapshot must
/// carry deletions of things the first one holds.
const SECOND_ROUND: &str = r#"
set -e
rm /h2 /dangling /fifo                         # delete what snapshot 1 holds
rm -rf /d2                                     # and a whole directory of it
echo changed > /var/new/f                      # change a file of snapshot 1
rm /bin/sh.static 2>/dev/null || true
rm /bin/ls                                     # a new whiteout over the image
mkdir -p /var/new/deeper && echo deep > /var/new/deeper/f
chmod 600 /data/old                            # metadata-only change
dd if=/dev/urandom of=/data/random bs=64k count=1 seek=3 conv=notrunc 2>/dev/null
"#;

#[test]
fn every_overlay_case_round_trips_through_two_snapshots_and_a_fork() {
    if skip("every_overlay_case_round_trips_through_two_snapshots_and_a_fork") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    let out = home.cairn(&["exec", &id, "--", "sh", "-c", FIRST_ROUND]);
    assert!(out.status.success(), "{}", stderr(&out));
    // An xattr, set through the sandbox's root from the host (busybox has no setfattr).
    let pid = init_pid(&home, &id);
    xattr::set(format!("/proc/{pid}/root/data/owned"), "user.origin", b"test").unwrap();

    let first = home.ok(&["snapshot", &id, "--label", "first"]);
    let fork1 = home.ok(&["fork", &first]);
    let source = tree(pid);
    let forked = tree(init_pid(&home, &fork1));
    assert_trees_equal(&source, &forked);
    assert_eq!(source["h1"].nlink, 3);
    assert_eq!(
        source["data/owned"].xattrs,
        vec![("user.origin".to_string(), b"test".to_vec())]
    );
    assert!(!source.contains_key("bin/vi"));

    let out = home.cairn(&["exec", &id, "--", "sh", "-c", SECOND_ROUND]);
    assert!(out.status.success(), "{}", stderr(&out));
    // `cairn diff` of the running sandbox against the first snapshot names
    // exactly what the two trees, walked from the host, differ in.
    let expected = differences(&source, &tree(pid));
    assert!(expected.len() > 5, "{expected:?}");
    let live = diff_json(&home, &first, &id);
    assert_eq!(live, expected, "cairn diff FIRST SANDBOX");
    let second = home.ok(&["snapshot", &id]);
    assert_eq!(diff_json(&home, &first, &second), expected, "cairn diff FIRST SECOND");
    let snaps: serde_json::Value = serde_json::from_str(&home.ok(&["snapshots", "--json"])).unwrap();
    let second_rec = snaps
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == second.as_str())
        .unwrap();
    assert_eq!(second_rec["parent_id"], first.as_str());
    // Incremental: only the changes were stored, not the 2.5 MB of the first round again.
    assert!(second_rec["stored_bytes"].as_u64().unwrap() < 1_200_000, "{second_rec}");

    let fork2 = home.ok(&["fork", &second]);
    let source = tree(pid);
    let forked = tree(init_pid(&home, &fork2));
    assert_trees_equal(&source, &forked);
    for gone in ["h2", "dangling", "fifo", "d2", "bin/ls"] {
        assert!(!forked.contains_key(gone), "{gone} came back in the fork");
    }
    assert_eq!(forked["h1"].nlink, 2);
    assert!(forked.contains_key("var/new/deeper/f"));
}

/// Each path where tree `b` differs from tree `a`, and how: `added`,
/// `removed`, or `changed` (type, content or target, permission bits); a
/// modification time or a link count alone is no change.
fn differences(
    a: &std::collections::BTreeMap<String, common::Seen>,
    b: &std::collections::BTreeMap<String, common::Seen>,
) -> std::collections::BTreeMap<String, &'static str> {
    let mut out = std::collections::BTreeMap::new();
    for (path, x) in a {
        match b.get(path) {
            None => {
                out.insert(format!("/{path}"), "removed");
            }
            Some(y) => {
                let same = x.kind == y.kind
                    && x.content == y.content
                    && x.target == y.target
                    && x.mode & 0o7777 == y.mode & 0o7777
                    && (x.uid, x.gid) == (y.uid, y.gid);
                if !same {
                    out.insert(format!("/{path}"), "changed");
                }
            }
        }
    }
    for path in b.keys().filter(|p| !a.contains_key(*p)) {
        out.insert(format!("/{path}"), "added");
    }
    out
}

/// `cairn diff A B --json` as path -> change (exit 1: something differs).
fn diff_json(home: &Home, a: &str, b: &str) -> std::collections::BTreeMap<String, &'static str> {
    let out = home.cairn(&["diff", a, b, "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let changes = v["changes"].as_array().unwrap();
    assert_eq!(
        changes.len() as u64,
        v["added"].as_u64().unwrap() + v["removed"].as_u64().unwrap() + v["changed"].as_u64().unwrap()
    );
    changes
        .iter()
        .map(|c| {
            let change = match c["change"].as_str().unwrap() {
                "added" => "added",
                "removed" => "removed",
                _ => "changed",
            };
            (c["path"].as_str().unwrap().to_string(), change)
        })
        .collect()
}

fn assert_trees_equal(
    a: &std::collections::BTreeMap<String, common::Seen>,
    b: &std::collections::BTreeMap<String, common::Seen>,
) {
    let only_a: Vec<&String> = a.keys().filter(|k| !b.contains_key(*k)).collect();
    let only_b: Vec<&String> = b.keys().filter(|k| !a.contains_key(*k)).collect();
    assert!(
        only_a.is_empty() && only_b.is_empty(),
        "only in source: {only_a:?}; only in fork: {only_b:?}"
    );
    for (path, seen) in a {
        assert_eq!(seen, &b[path], "{path} differs");
    }
}

#[test]
fn forks_diverge_and_reset_rewinds() {
    if skip("forks_diverge_and_reset_rewinds") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create", "--name", "origin"]);
    home.sh(&id, "echo base > /shared; echo keep > /deleted-later");
    let snap = home.ok(&["snapshot", &id, "--label", "start"]);
    let forks: Vec<String> = home
        .ok(&["fork", "start", "-n", "3"])
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(forks.len(), 3);
    for (i, f) in forks.iter().enumerate() {
        home.ok(&[
            "exec",
            f,
            "--",
            "sh",
            "-c",
            &format!("echo fork{i} > /shared; echo {i} > /mine-{i}"),
        ]);
    }
    for (i, f) in forks.iter().enumerate() {
        assert_eq!(home.ok(&["exec", f, "--", "cat", "/shared"]), format!("fork{i}"));
        let listing = home.sh(f, "ls / | grep mine- || true");
        assert_eq!(listing, format!("mine-{i}"), "fork {i} sees another fork's files");
    }
    assert_eq!(home.ok(&["exec", &id, "--", "cat", "/shared"]), "base");

    // Reset: files created after the snapshot go, deleted ones come back.
    home.sh(&id, "echo later > /created-later; rm /deleted-later; echo x > /shared");
    home.ok(&["exec", "-d", &id, "--", "sleep", "1000"]);
    assert_eq!(home.ok(&["reset", "origin", &snap[..10]]), id);
    let after = home.sh(&id, "ls /created-later 2>&1; cat /deleted-later /shared");
    assert!(after.contains("No such file"), "{after}");
    assert!(after.ends_with("keep\nbase"), "{after}");
    let procs = home.sh(&id, "ps -o comm | grep -cx sleep || true");
    assert_eq!(procs, "0", "the old processes survived the reset");
    assert_eq!(
        home.ps().iter().find(|s| s["id"] == id.as_str()).unwrap()["name"],
        "origin"
    );
}

#[test]
fn a_snapshot_taken_while_a_process_writes_is_consistent_and_the_process_goes_on() {
    if skip("a_snapshot_taken_while_a_process_writes_is_consistent_and_the_process_goes_on") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    // Shell builtins only: a and b are written in turn with the same number.
    home.sh_detached(&id, "i=0; while true; do i=$((i+1)); echo $i > /a; echo $i > /b; done");
    std::thread::sleep(Duration::from_millis(200));
    let mut last = 0u64;
    for _ in 0..8 {
        let snap = home.ok(&["snapshot", &id]);
        let fork = home.ok(&["restore", &snap]);
        let out = home.cairn(&["exec", &fork, "--", "cat", "/a", "/b"]);
        let ab = common::stdout(&out);
        let (a, b) = ab.split_once('\n').unwrap_or((&ab, ""));
        let (a, b): (u64, u64) = (a.trim().parse().unwrap_or(0), b.trim().parse().unwrap_or(0));
        // Frozen between the two writes or after both: b is a or a - 1 (an
        // empty file is a write caught between truncate and write).
        assert!(
            b == a || b + 1 == a || a == 0 || b == 0,
            "inconsistent snapshot: a={a} b={b}"
        );
        home.ok(&["rm", "-f", &fork]);
        let now = home.read_number(&id, "/b");
        assert!(now >= last, "the writer went backwards");
        last = now;
    }
    std::thread::sleep(Duration::from_millis(100));
    let later = home.read_number(&id, "/b");
    assert!(
        later > last,
        "the writer stopped after the snapshots ({later} <= {last})"
    );
}

#[test]
fn a_killed_snapshot_leaves_only_restorable_snapshots_and_gc_reclaims_its_chunks() {
    if skip("a_killed_snapshot_leaves_only_restorable_snapshots_and_gc_reclaims_its_chunks") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    // One complete snapshot, whose storage gc must keep.
    home.sh(&id, "dd if=/dev/urandom of=/kept bs=1M count=2 2>/dev/null");
    let kept = home.ok(&["snapshot", &id]);
    for round in 0..8u64 {
        home.ok(&[
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            &format!("dd if=/dev/urandom of=/f{round} bs=1M count=4 2>/dev/null"),
        ]);
        let mut child = home
            .command(&["snapshot", &id])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(5 + round * 9));
        let _ = child.kill();
        let _ = child.wait();
    }
    // The sandbox is not left frozen: it answers.
    assert_eq!(home.ok(&["exec", &id, "--", "echo", "alive"]), "alive");
    let snaps: serde_json::Value = serde_json::from_str(&home.ok(&["snapshots", "--json"])).unwrap();
    for s in snaps.as_array().unwrap() {
        let fork = home.ok(&["restore", s["id"].as_str().unwrap()]);
        home.ok(&["exec", &fork, "--", "ls", "/"]);
        home.ok(&["rm", "-f", &fork]);
    }
    let report: serde_json::Value = serde_json::from_str(&home.ok(&["gc", "--json"])).unwrap();
    let tmp = home.path().join("store/tmp");
    let leftovers = std::fs::read_dir(&tmp).map(|d| d.count()).unwrap_or(0);
    assert_eq!(leftovers, 0, "partial writes survived gc: {report}");
    assert!(snaps.as_array().unwrap().iter().any(|s| s["id"] == kept.as_str()));
    // What gc kept is still enough: every snapshot restores from the store alone.
    home.ok(&["rm", "-f", &id]);
    home.ok(&["gc"]);
    std::fs::remove_dir_all(home.path().join("layers")).unwrap();
    for s in snaps.as_array().unwrap() {
        let fork = home.ok(&["restore", s["id"].as_str().unwrap()]);
        if s["id"] == kept.as_str() {
            assert_eq!(home.sh(&fork, "wc -c < /kept"), "2097152");
        }
        home.ok(&["rm", "-f", &fork]);
    }
}

#[test]
fn gc_removes_the_half_built_layers_of_killed_processes_and_keeps_those_being_built() {
    if skip("gc_removes_the_half_built_layers_of_killed_processes_and_keeps_those_being_built") {
        return;
    }
    let home = Home::new();
    let images: serde_json::Value = serde_json::from_str(&home.ok(&["image", "ls", "--json"])).unwrap();
    let layer = images[0]["layers"][0].as_str().unwrap().to_string();
    let layers = home.path().join("layers");
    // As a restore killed while it materialised a layer leaves it.
    // Temporaries name their writer as `<pid>+<start time>`.
    let writer_of = |p: &std::process::Child| {
        let pid = p.id() as i32;
        format!("{pid}+{}", cairn_sandbox::pid_start_time(pid).unwrap())
    };
    let mut killed = std::process::Command::new("sleep").arg("1000").spawn().unwrap();
    let killed_writer = writer_of(&killed);
    killed.kill().unwrap();
    killed.wait().unwrap();
    let abandoned = layers.join(format!(".{layer}.materialising-{killed_writer}-1796000000000000000"));
    std::fs::create_dir_all(abandoned.join("usr/bin")).unwrap();
    std::fs::write(abandoned.join("usr/bin/half"), "partial").unwrap();
    // And one whose process still writes it.
    let mut writer = std::process::Command::new("sleep").arg("1000").spawn().unwrap();
    let building = layers.join(format!(
        ".{layer}.materialising-{}-1796000000000000001",
        writer_of(&writer)
    ));
    std::fs::create_dir_all(building.join("usr")).unwrap();

    let report: serde_json::Value = serde_json::from_str(&home.ok(&["gc", "--json"])).unwrap();
    let building_survived = building.exists();
    writer.kill().unwrap();
    writer.wait().unwrap();
    assert!(!abandoned.exists(), "a killed materialisation survived gc: {report}");
    assert!(building_survived, "gc removed a materialisation still in progress");
    assert_eq!(report["partial_layers_removed"], 1, "{report}");
    // The image itself is untouched.
    let id = home.ok(&["create"]);
    assert_eq!(home.ok(&["exec", &id, "--", "echo", "alive"]), "alive");
}

#[test]
fn a_flipped_byte_in_a_chunk_makes_restore_fail_with_a_clear_error() {
    if skip("a_flipped_byte_in_a_chunk_makes_restore_fail_with_a_clear_error") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    home.sh(&id, "dd if=/dev/urandom of=/payload bs=1M count=2 2>/dev/null");
    let snap = home.ok(&["snapshot", &id]);
    // Another host: nothing materialised locally; everything comes from the store.
    std::fs::remove_dir_all(home.path().join("layers")).unwrap();
    let mut objects: Vec<(u64, std::path::PathBuf)> = Vec::new();
    let mut stack = vec![home.path().join("store/objects")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(d).unwrap().flatten() {
            if e.path().is_dir() {
                stack.push(e.path());
            } else {
                objects.push((e.metadata().unwrap().len(), e.path()));
            }
        }
    }
    objects.sort();
    let (_, biggest) = objects.last().unwrap();
    let mut bytes = std::fs::read(biggest).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    std::fs::write(biggest, bytes).unwrap();
    let before = home.ps().len();
    let out = home.cairn(&["restore", &snap]);
    assert_eq!(out.status.code(), Some(125));
    let err = stderr(&out);
    assert!(err.contains("corrupt") || err.contains("does not decompress"), "{err}");
    assert!(
        err.contains("payload") || err.contains("layer"),
        "the error names neither file nor layer: {err}"
    );
    assert!(
        err.contains(&format!("snapshot {snap} cannot be restored")) && err.contains(&format!("cairn verify {snap}")),
        "the error names the snapshot and what checks it: {err}"
    );
    assert_eq!(home.ps().len(), before, "a failed restore left a sandbox");
}

/// The attack on `main`: a corrupt stored chunk stayed hidden while its
/// layer was cached, and a later snapshot of the same bytes failed instead
/// of healing it. A snapshot checks a chunk it would reuse and writes a
/// corrupt one again from the bytes it has; restores from the store then
/// work again.
#[test]
fn a_snapshot_heals_a_corrupt_chunk_from_the_bytes_it_has() {
    if skip("a_snapshot_heals_a_corrupt_chunk_from_the_bytes_it_has") {
        return;
    }
    let home = Home::new();
    let a = home.ok(&["create"]);
    // Under the smallest chunk size: one chunk, named by its bytes' hash.
    home.sh(&a, "head -c 60000 /dev/urandom > /p");
    let out = home.cairn(&["exec", &a, "--", "cat", "/p"]);
    let payload = out.stdout;
    assert_eq!(payload.len(), 60000);
    let first = home.ok(&["snapshot", &a]);
    let hash = blake3::hash(&payload).to_hex().to_string();
    let object = home
        .path()
        .join("store/objects")
        .join(&hash[..2])
        .join(&hash[2..4])
        .join(&hash);
    let mut bytes = std::fs::read(&object).expect("the payload's chunk is stored under its hash");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    std::fs::write(&object, bytes).unwrap();
    // The same bytes in another sandbox: its snapshot succeeds and heals.
    let b = home.ok(&["create"]);
    let local = home.path().join("payload");
    std::fs::write(&local, &payload).unwrap();
    home.ok(&["cp", local.to_str().unwrap(), &format!("{b}:/q")]);
    home.ok(&["snapshot", &b]);
    // From the store alone, the first snapshot restores whole again.
    home.ok(&["rm", "-f", &a, &b]);
    std::fs::remove_dir_all(home.path().join("layers")).unwrap();
    let r = home.ok(&["restore", &first]);
    let out = home.cairn(&["exec", &r, "--", "cat", "/p"]);
    assert!(
        out.stdout == payload,
        "the restored file differs from the one snapshotted"
    );
}

/// The service of `services_come_back_after_every_fork_restore_and_reset`,
/// as `ps` shows its shell.
const TICKER: &str = "while true; do date +%s >> /tmp/ticks; sleep 0.1; done";

/// Waits (up to a minute) for the sandbox's ticker service to add lines to
/// /tmp/ticks, and checks exactly one copy of it runs.
fn assert_ticking(home: &Home, id: &str, when: &str) {
    let ticks = || home.ok(&["exec", id, "--", "sh", "-c", "cat /tmp/ticks 2>/dev/null | wc -l"]);
    let before = ticks();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while ticks() == before {
        assert!(
            std::time::Instant::now() < deadline,
            "{when}: the service in {id} adds no ticks"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // A copy whose parent is a copy is the loop forking `date` or `sleep`
    // before it execs: the same service, caught mid-fork.
    let ps = home.ok(&["exec", id, "--", "ps", "-o", "pid,ppid,args"]);
    let loops: Vec<(&str, &str)> = ps
        .lines()
        .filter(|l| l.contains("while true"))
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((f.next()?, f.next()?))
        })
        .collect();
    let copies = loops
        .iter()
        .filter(|(_, ppid)| !loops.iter().any(|(pid, _)| pid == ppid))
        .count();
    assert_eq!(copies, 1, "{when}: {copies} copies of the service in {id}:\n{ps}");
}

#[test]
fn services_come_back_after_every_fork_restore_and_reset() {
    if skip("services_come_back_after_every_fork_restore_and_reset") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create", "--service", TICKER]);
    assert_ticking(&home, &id, "after create");
    let forks: Vec<String> = home.ok(&["fork", &id, "-n", "2"]).lines().map(str::to_string).collect();
    for f in &forks {
        assert_ticking(&home, f, "after fork");
    }
    let snap = home.ok(&["snapshot", &forks[0]]);
    let restored = home.ok(&["restore", &snap]);
    assert_ticking(&home, &restored, "after restore");
    // A reset replaces the sandbox's processes: the service runs once again,
    // not beside its old copy.
    home.ok(&["reset", &forks[1], &snap]);
    assert_ticking(&home, &forks[1], "after reset");
}

#[test]
fn the_lineage_tree_nests_each_snapshot_under_its_parent() {
    if skip("the_lineage_tree_nests_each_snapshot_under_its_parent") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    let base = home.ok(&["snapshot", &id, "--label", "base"]);
    let forks: Vec<String> = home
        .ok(&["fork", "base", "-n", "2"])
        .lines()
        .map(str::to_string)
        .collect();
    home.sh(&forks[0], "echo a > /a");
    let a = home.ok(&["snapshot", &forks[0], "--label", "left"]);
    home.sh(&forks[0], "echo b > /b");
    let a2 = home.ok(&["snapshot", &forks[0], "--label", "left-again"]);
    home.sh(&forks[1], "echo c > /c");
    let b = home.ok(&["snapshot", &forks[1], "--label", "right"]);
    let text = home.ok(&["snapshots", "--tree"]);
    // Each snapshot once, on a line whose indent shows its depth, below its parent.
    let line = |snap: &str| -> (usize, usize) {
        let found: Vec<(usize, &str)> = text
            .lines()
            .enumerate()
            .filter(|(_, l)| l.contains(&snap[..12]))
            .collect();
        assert_eq!(found.len(), 1, "{snap} not once in:\n{text}");
        let (n, l) = found[0];
        (n, l.find(|c: char| c.is_ascii_hexdigit()).unwrap())
    };
    let (base_line, base_indent) = line(&base);
    for (child, parent, label) in [(&a, &base, "[left]"), (&a2, &a, "[left-again]"), (&b, &base, "[right]")] {
        let ((cl, ci), (pl, pi)) = (line(child), line(parent));
        assert!(cl > pl && ci > pi, "{child} is not nested under {parent}:\n{text}");
        assert!(
            text.lines().nth(cl).unwrap().contains(label),
            "{label} missing:\n{text}"
        );
    }
    assert_eq!(base_line, 0, "{text}");
    assert!(base_indent < line(&a2).1);
    let json: serde_json::Value = serde_json::from_str(&home.ok(&["snapshots", "--tree", "--json"])).unwrap();
    let parent_of = |snap: &str| {
        json.as_array()
            .unwrap()
            .iter()
            .find(|s| s["id"] == snap)
            .map(|s| s["parent_id"].clone())
            .unwrap()
    };
    assert_eq!(parent_of(&a2), serde_json::json!(a));
    assert_eq!(parent_of(&b), serde_json::json!(base));
}

#[test]
fn snapshot_commands_refuse_bad_input_and_change_nothing() {
    if skip("snapshot_commands_refuse_bad_input_and_change_nothing") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    for (args, needle) in [
        (vec!["snapshot", "nosuchbox"], "no sandbox matches"),
        (vec!["restore", "feedbeef"], "no snapshot matches"),
        (vec!["fork", "nosuch"], "no snapshot matches"),
        (vec!["fork", id.as_str(), "-n", "0"], "at least 1"),
        (vec!["snapshot", id.as_str(), "--label", ""], "invalid label"),
        (vec!["reset", id.as_str(), "feedbeef"], "no snapshot matches"),
    ] {
        let out = home.cairn(&args);
        assert_eq!(out.status.code(), Some(125), "{args:?}");
        assert!(stderr(&out).contains(needle), "{args:?}: {}", stderr(&out));
    }
    assert_eq!(home.ps().len(), 1);
    assert_eq!(home.ok(&["snapshots", "--json"]), "[]");
}

#[test]
fn a_chain_of_seventy_snapshots_still_restores() {
    if skip("a_chain_of_seventy_snapshots_still_restores") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    let mut last = String::new();
    for i in 1..=70 {
        home.ok(&["exec", &id, "--", "sh", "-c", &format!("echo {i} > /f{i}")]);
        last = home.ok(&["snapshot", &id]);
    }
    let snaps: serde_json::Value = serde_json::from_str(&home.ok(&["snapshots", "--json"])).unwrap();
    let deepest = snaps
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == last.as_str())
        .unwrap();
    // Past what overlay options in one page can name (about 38 layers here).
    assert_eq!(deepest["layers"].as_array().unwrap().len(), 71);
    let fork = home.ok(&["restore", &last]);
    assert_eq!(home.sh(&fork, "ls / | grep -c '^f'"), "70");
    assert_eq!(home.ok(&["exec", &fork, "--", "cat", "/f1", "/f70"]), "1\n70");
}

#[test]
fn snapshots_taken_back_to_back_each_restore() {
    if skip("snapshots_taken_back_to_back_each_restore") {
        return;
    }
    // Entries changed within a clock tick of a capture are captured again by
    // the next snapshot, so back-to-back snapshots of an unchanged sandbox
    // can make the same layer twice; each must still mount and restore.
    let home = Home::new();
    let id = home.ok(&["create"]);
    home.sh(&id, "echo one > /f && mkdir -p /d && echo two > /d/g");
    let snaps: Vec<String> = (0..3).map(|_| home.ok(&["snapshot", &id])).collect();
    home.sh(&id, "rm /f");
    let after_rm = home.ok(&["snapshot", &id]);
    for snap in &snaps {
        let r = home.ok(&["restore", snap]);
        assert_eq!(home.sh(&r, "cat /f /d/g"), "one\ntwo", "restored from {snap}");
    }
    let r = home.ok(&["restore", &after_rm]);
    assert_eq!(home.sh(&r, "ls /f 2>/dev/null; cat /d/g"), "two");
    let json: serde_json::Value = serde_json::from_str(&home.ok(&["snapshots", "--json"])).unwrap();
    for s in json.as_array().unwrap() {
        let layers: Vec<&str> = s["layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_str().unwrap())
            .collect();
        let distinct: std::collections::HashSet<&&str> = layers.iter().collect();
        assert_eq!(distinct.len(), layers.len(), "a layer twice in {}: {layers:?}", s["id"]);
    }
}

#[test]
fn verify_names_each_corrupt_or_missing_object_with_what_it_holds() {
    if skip("verify_names_each_corrupt_or_missing_object_with_what_it_holds") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    // Objects written after this are the snapshot's own (the image's were
    // stored when it was imported, at the create).
    std::thread::sleep(std::time::Duration::from_millis(20));
    let since = std::time::SystemTime::now();
    home.sh(
        &id,
        "mkdir -p /data && dd if=/dev/urandom of=/data/random bs=64k count=8 2>/dev/null && seq 1 50000 > /data/text",
    );
    let snap = home.ok(&["snapshot", &id, "--label", "checked"]);
    let whole = home.cairn(&["verify", "checked", "--json"]);
    assert_eq!(whole.status.code(), Some(0), "{}", stderr(&whole));
    let v: serde_json::Value = serde_json::from_slice(&whole.stdout).unwrap();
    assert_eq!(
        (v[0]["snapshot_id"].as_str(), v[0]["root_hash"].as_str()),
        (Some(snap.as_str()), Some(snap.as_str()))
    );
    assert!(v[0]["objects"].as_u64().unwrap() > 5 && v[0]["ok"] == true, "{v}");

    // Damage two chunks of the snapshot's own layer: one byte of one, the
    // other gone. The layer's index names its files' chunks.
    let layers = home.snapshot_layers(&snap);
    let index = std::fs::read(home.store_object(&layers[0])).unwrap();
    let mut chunks: Vec<String> = std::fs::read_dir(home.path().join("store/objects"))
        .unwrap()
        .flat_map(|a| std::fs::read_dir(a.unwrap().path()).unwrap())
        .flat_map(|b| std::fs::read_dir(b.unwrap().path()).unwrap())
        .map(|o| o.unwrap().file_name().into_string().unwrap())
        .filter(|h| {
            let md = std::fs::metadata(home.store_object(h)).unwrap();
            // The snapshot's own objects but layer indexes (the image's is
            // refreshed when used again) and its manifest: the chunks of
            // /data's files (content-defined, of any size).
            !layers.contains(h) && *h != snap && md.modified().unwrap() > since
        })
        .collect();
    chunks.sort();
    assert!(chunks.len() >= 2, "{chunks:?} ({} index bytes)", index.len());
    let (flipped, deleted) = (&chunks[0], &chunks[1]);
    let path = home.store_object(flipped);
    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
    std::fs::remove_file(home.store_object(deleted)).unwrap();

    let out = home.cairn(&["verify", "--all", "--json"]);
    assert_eq!(out.status.code(), Some(1), "damage is exit status 1: {}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let report = v
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["snapshot_id"] == snap.as_str())
        .unwrap();
    assert_eq!(report["ok"], false);
    let damaged: std::collections::BTreeMap<&str, &serde_json::Value> = report["damaged"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["hash"].as_str().unwrap(), d))
        .collect();
    assert_eq!(damaged.len(), 2, "{report}");
    assert!(
        damaged[flipped.as_str()]["local"]
            .as_str()
            .unwrap()
            .starts_with("corrupt"),
        "{report}"
    );
    assert_eq!(damaged[deleted.as_str()]["local"], "missing", "{report}");
    for d in damaged.values() {
        assert!(
            d["what"].as_str().unwrap().contains("/data/"),
            "named by the file it holds: {d}"
        );
        assert_eq!(d["recoverable"], false);
    }
    // A local store has no other copy: --repair says so and mends nothing.
    let out = home.cairn(&["verify", &snap, "--repair"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stdout(&out).contains("not repaired: no intact copy"),
        "{}",
        stdout(&out)
    );
    assert!(stdout(&out).contains("DAMAGED"), "{}", stdout(&out));
    // Nothing asked for that is not there.
    let out = home.cairn(&["verify", "no-such-snapshot"]);
    assert_eq!(out.status.code(), Some(125), "{}", stderr(&out));
    let out = home.cairn(&["verify"]);
    assert_eq!(out.status.code(), Some(2), "a snapshot or --all is needed");
}

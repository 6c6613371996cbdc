//! End-to-end: a gVisor pipeline stage whose orchestrator is killed inside
//! its memory checkpoints (`runsc checkpoint` stops the sandbox; the
//! restore brings it back) goes on where it was after `cairn pipeline
//! resume`, every time.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{skip_without_runsc, stderr, Home};

/// The stage holds 256 MiB in gVisor's memory (`/tmp` is the sentry's
/// tmpfs, so it is in every checkpoint image) and counts, one line per
/// tick, until the test tells it to stop: a restart would count from 1
/// again and write `start` twice.
const BIG_MEMORY: &str = r#"
[pipeline]
name = "big-memory"
image = "busybox"
driver = "gvisor"

[[stage]]
name = "count"
key = "count-big-memory-v1"
retries = 2
checkpoint_every = "1s"
checkpoint_share = "50%"
run = ["mkdir -p /work; echo start >> /work/starts; yes cairn-ballast | head -c 268435456 > /tmp/ballast; i=0; until [ -e /work/stop ]; do i=$((i+1)); echo $i >> /work/progress; sleep 0.1; done; echo counted to $i; wc -c < /tmp/ballast"]
artifacts = ["/work/starts", "/work/progress"]
"#;

fn show(home: &Home, run: &str) -> serde_json::Value {
    serde_json::from_str(&home.ok(&["pipeline", "show", run, "--json"])).unwrap()
}

/// The run's events, one line each (kind, stage, detail): what a failure
/// message needs to say what happened, short enough to survive a cut log.
fn timeline(v: &serde_json::Value) -> String {
    v["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| format!("{} {} {}: {}", e["seq"], e["kind"], e["stage"], e["detail"]))
        .collect::<Vec<_>>()
        .join("\n")
}

fn events<'a>(v: &'a serde_json::Value, kind: &str) -> Vec<&'a serde_json::Value> {
    v["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == kind)
        .collect()
}

/// Waits (up to two minutes) until `done` gives a value.
fn wait_for<T>(why: &str, mut done: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(v) = done() {
            return v;
        }
        assert!(Instant::now() < deadline, "{why}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The record of an open checkpoint window of the sandbox whose directory is `dir`.
fn window_record(dir: &Path) -> PathBuf {
    dir.join("checkpoint").join("window")
}

/// runsc processes working for this home (their command lines name it).
fn runsc_processes(home: &Home) -> Vec<String> {
    let home = home.path().to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains("runsc") && c.contains(&home))
        .collect()
}

#[test]
fn a_gvisor_stage_killed_inside_its_memory_checkpoints_goes_on_where_it_was() {
    let name = "a_gvisor_stage_killed_inside_its_memory_checkpoints_goes_on_where_it_was";
    if skip_without_runsc(name) {
        return;
    }
    let home = Home::new();
    let file = home.path().join("p.toml");
    std::fs::write(&file, BIG_MEMORY).unwrap();
    let file = file.to_string_lossy().into_owned();

    // Each orchestrator is killed (`kill -9`) at a spread instant after a
    // checkpoint window opened: at once (quiescing, `runsc checkpoint`), a
    // little later (the image being written or the files captured), later
    // still (the restore, the image being stored, or just after).
    // Where runsc can leave the sandbox running, the early kills land while
    // it is paused: runsc writing the pages file, Cairn reading and hashing
    // it behind the writer, the files being captured.
    let delays = [0, 300, 900, 1800, 50, 150].map(Duration::from_millis);
    let mut run = String::new();
    let mut sandbox_dir = PathBuf::new();
    let mut inside = 0;
    for (i, delay) in delays.iter().enumerate() {
        let args: Vec<&str> = if i == 0 {
            vec!["pipeline", "run", &file]
        } else {
            vec!["pipeline", "resume", &run]
        };
        let mut child = home
            .command(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        if i == 0 {
            // The run, its stage's sandbox, and the ballast in its memory.
            let (r, dir) = wait_for("the stage never started counting", || {
                let runs: serde_json::Value = serde_json::from_str(&home.ok(&["pipeline", "ls", "--json"])).ok()?;
                let r = runs.as_array()?.first()?["id"].as_str()?.to_string();
                let sandbox = show(&home, &r)["stages"][0]["sandbox_id"].as_str()?.to_string();
                let dir = home.path().join("sandboxes").join(sandbox);
                dir.join("upper/work/progress").exists().then_some((r, dir))
            });
            run = r;
            sandbox_dir = dir;
        }
        // The next window of this orchestrator, in the same sandbox: a
        // resume that discarded the attempt would have made another.
        let mut polls = 0;
        wait_for("no memory checkpoint of the running stage began", || {
            polls += 1;
            if polls % 100 == 0 {
                let now = show(&home, &run)["stages"][0]["sandbox_id"].clone();
                let was = sandbox_dir.file_name().unwrap().to_string_lossy().into_owned();
                assert!(
                    now.is_null() || now == was.as_str(),
                    "the stage left its sandbox {was} for {now}:\n{}",
                    timeline(&show(&home, &run))
                );
            }
            window_record(&sandbox_dir).exists().then_some(())
        });
        std::thread::sleep(*delay);
        let _ = child.kill();
        let _ = child.wait();
        if window_record(&sandbox_dir).exists() {
            inside += 1;
            let window = sandbox_dir.join("checkpoint");
            eprintln!(
                "kill {i} landed in a window: paused {}, pages file written so far {:?}, image complete {}",
                window.join("paused").exists(),
                std::fs::metadata(window.join("image/pages.img")).map(|m| m.len()).ok(),
                window.join("complete").exists()
            );
            // The next Cairn command, whatever it is, finishes the window;
            // every other time that one is killed too, a spread instant
            // into its recovery, and the one after finishes it.
            if i % 2 == 1 {
                let mut ps = home.command(&["ps"]).stdout(Stdio::null()).spawn().unwrap();
                std::thread::sleep(Duration::from_millis(150 * i as u64));
                let _ = ps.kill();
                let _ = ps.wait();
                let left = if window_record(&sandbox_dir).exists() {
                    "open"
                } else {
                    "finished"
                };
                eprintln!("kill {i}: the killed recovery left the window {left}");
            }
            home.ok(&["ps"]);
            assert!(
                !window_record(&sandbox_dir).exists(),
                "`cairn ps` left the checkpoint window open"
            );
        }
    }
    assert!(inside >= 1, "no kill landed inside a checkpoint window");

    // The stage still counts in its sandbox (whichever command came first
    // finished the window); it is told to stop, and a last resume ends it.
    let sandbox = sandbox_dir.file_name().unwrap().to_string_lossy().into_owned();
    wait_for("the stage's sandbox never took the stop file", || {
        home.cairn(&["exec", &sandbox, "--", "touch", "/work/stop"])
            .status
            .success()
            .then_some(())
    });
    let out = home.cairn(&["pipeline", "resume", &run]);
    assert!(out.status.success(), "{}", stderr(&out));

    let v = show(&home, &run);
    let log = home.ok(&["logs", &run, "count"]);
    assert_eq!(v["run"]["status"], "completed", "{}\n{log}", timeline(&v));
    // One attempt, re-attached after every kill: never discarded, never
    // started again from its input or an older checkpoint.
    assert_eq!(events(&v, "forked").len(), 1, "{}", timeline(&v));
    assert!(
        events(&v, "resumed").is_empty(),
        "an attempt was discarded: {}",
        timeline(&v)
    );
    assert!(events(&v, "retry").is_empty(), "{}", timeline(&v));
    assert_eq!(events(&v, "reattached").len(), delays.len(), "{}", timeline(&v));
    // Every window a kill left open was finished, and none lost the sandbox.
    let recovered = events(&v, "recovered");
    for e in &recovered {
        eprintln!("recovered: {}", e["detail"]);
    }
    // (A recovery killed after noting what it did is noted again.)
    assert!(recovered.len() >= inside, "{}", timeline(&v));
    assert!(
        recovered
            .iter()
            .all(|e| !e["detail"].as_str().unwrap().contains("gone")),
        "{}",
        timeline(&v)
    );
    // The command ran once, and its counter never went back.
    let artifact = |path: &str| {
        let a = v["artifacts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["path"] == path)
            .unwrap_or_else(|| panic!("no artifact {path}: {v:#}"));
        home.ok(&["artifact", "get", a["id"].as_str().unwrap()])
    };
    assert_eq!(artifact("/work/starts"), "start", "{log}");
    let progress: Vec<u64> = artifact("/work/progress").lines().map(|l| l.parse().unwrap()).collect();
    let expected: Vec<u64> = (1..=progress.len() as u64).collect();
    assert_eq!(progress, expected, "the counter went back or skipped");
    assert!(log.contains(&format!("counted to {}", progress.len())), "{log}");
    assert!(log.contains("268435456"), "the ballast was lost: {log}");

    // Nothing is left: no sandbox, mount, cgroup or runsc process.
    let _ = home.cairn(&["gc"]);
    assert!(home.ps().is_empty(), "{:?}", home.ps());
    assert!(home.host_mounts().is_empty(), "{:?}", home.host_mounts());
    assert!(home.cgroup_scopes_left().is_empty(), "{:?}", home.cgroup_scopes_left());
    wait_for("runsc processes were left running", || {
        runsc_processes(&home).is_empty().then_some(())
    });
}

//! End-to-end: many hosts on one stage queue. Each "host" is a network
//! namespace of its own (a veth pair on a bridge, its own address) with a
//! state directory of its own; all of them reach one PostgreSQL state
//! store and one Garage (a real S3 server) over the bridge. Workers are
//! real `cairn worker` processes inside the namespaces.
//!
//! A host killed mid-stage (its worker and its sandboxes, kill -9) loses
//! the stage to another host once its lease expires, and the other host,
//! whose cache never saw the run, resumes the stage from its newest
//! checkpoint restored from S3. A worker paused past its lease (SIGSTOP)
//! wakes to find its commit refused by the fence: the stage is committed
//! once, by the host that took it over.

mod common;

#[allow(dead_code)]
#[path = "../../cairn-store/tests/support/garage.rs"]
mod garage;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{skip, CAIRN};
use garage::Garage;

/// Clusters made by this process so far: tests run at once, each with
/// its own bridge, namespaces and subnet.
static CLUSTERS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The bridge and a host namespace per worker, removed on drop.
struct Hosts {
    /// Names this cluster's links apart from other clusters' (short: a
    /// link name has at most 15 characters).
    tag: String,
    bridge: String,
    gateway: String,
    names: Vec<String>,
}

impl Hosts {
    fn new(count: usize) -> Hosts {
        let n = CLUSTERS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let tag = format!("{}{n}", std::process::id() % 10_000);
        let bridge = format!("cbr{tag}");
        // 10.213.N.0/24, N from the process and the cluster's number.
        let net = format!("10.213.{}", 20 + (std::process::id() % 40 * 5 + n) % 230);
        let gateway = format!("{net}.1");
        let _ = Command::new("ip").args(["link", "del", &bridge]).output();
        ip(&["link", "add", &bridge, "type", "bridge"]);
        ip(&["addr", "add", &format!("{gateway}/24"), "dev", &bridge]);
        ip(&["link", "set", &bridge, "up"]);
        let mut hosts = Hosts {
            tag: tag.clone(),
            bridge,
            gateway: gateway.clone(),
            names: Vec::new(),
        };
        for k in 0..count {
            let ns = format!("cairn-h{tag}-{k}");
            let (outside, inside) = (format!("ch{tag}x{k}"), format!("ch{tag}y{k}"));
            let _ = Command::new("ip").args(["netns", "del", &ns]).output();
            ip(&["netns", "add", &ns]);
            hosts.names.push(ns.clone());
            ip(&["link", "add", &outside, "type", "veth", "peer", "name", &inside]);
            ip(&["link", "set", &outside, "master", &hosts.bridge]);
            ip(&["link", "set", &outside, "up"]);
            ip(&["link", "set", &inside, "netns", &ns]);
            let inns = |args: &[&str]| {
                let mut all = vec!["netns", "exec", &ns, "ip"];
                all.extend_from_slice(args);
                ip(&all);
            };
            inns(&["addr", "add", &format!("{net}.{}/24", 10 + k), "dev", &inside]);
            inns(&["link", "set", &inside, "up"]);
            inns(&["link", "set", "lo", "up"]);
            inns(&["route", "add", "default", "via", &gateway]);
        }
        hosts
    }

    /// Sets host `k`'s link (its veth end on the bridge) up or down.
    fn link(&self, k: usize, up: bool) {
        ip(&[
            "link",
            "set",
            &format!("ch{}x{k}", self.tag),
            if up { "up" } else { "down" },
        ]);
    }

    /// Every process in host `k`'s network namespace.
    fn pids(&self, k: usize) -> Vec<i32> {
        let out = Command::new("ip")
            .args(["netns", "pids", &self.names[k]])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for k in 0..self.names.len() {
            for pid in self.pids(k) {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
            }
        }
        for ns in &self.names {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
        let _ = Command::new("ip").args(["link", "del", &self.bridge]).output();
    }
}

/// Relays connections to `addr:port` on to 127.0.0.1:`port` (the test's
/// PostgreSQL and Garage listen on loopback; hosts reach them over the bridge).
fn relay(addr: &str, port: u16) {
    let listener = TcpListener::bind((addr, port)).unwrap_or_else(|e| panic!("bind {addr}:{port}: {e}"));
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Ok(server) = TcpStream::connect(("127.0.0.1", port)) else {
                continue;
            };
            for (mut from, mut to) in [
                (client.try_clone().unwrap(), server.try_clone().unwrap()),
                (server, client),
            ] {
                std::thread::spawn(move || {
                    let mut buf = [0u8; 64 * 1024];
                    loop {
                        match from.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                if to.write_all(&buf[..n]).is_err() {
                                    break;
                                }
                            }
                        }
                    }
                    let _ = to.shutdown(std::net::Shutdown::Both);
                });
            }
        }
    });
}

/// One cluster: the hosts, the state store and the bucket they share.
struct Cluster {
    hosts: Hosts,
    env: Vec<(String, String)>,
    homes: Vec<tempfile::TempDir>,
    db: cairn_engine::testing::TestDatabase,
    garage: Garage,
    /// The test's own PostgreSQL, where it restarts one (dropped after `db`).
    own_server: Option<cairn_engine::testing::PostgresServer>,
}

impl Cluster {
    fn start(test: &str, hosts: usize) -> Option<Cluster> {
        Cluster::start_with(test, hosts, false)
    }

    /// With `own_server`, on a PostgreSQL cluster of the test's own, which
    /// it may restart (`Cluster::restart_database`).
    fn start_with(test: &str, hosts: usize, own_server: bool) -> Option<Cluster> {
        if skip(test) {
            return None;
        }
        for (tool, package) in [("ip", "iproute2"), ("nsenter", "util-linux")] {
            if Command::new(tool).arg("-V").output().is_err() {
                common::skipped(&format!("{test}: {tool} is not installed; apt-get install {package}"));
                return None;
            }
        }
        let (db, own_server) = if own_server {
            let server = cairn_engine::testing::dedicated_postgres(test)?;
            (server.database(test), Some(server))
        } else {
            (cairn_engine::testing::postgres_database(test)?, None)
        };
        let garage = Garage::start(test)?;
        let hosts = Hosts::new(hosts);
        let pg_port: u16 = db
            .url
            .rsplit_once(':')
            .and_then(|(_, rest)| rest.split('/').next())
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no port in {}", db.url));
        let s3_port: u16 = garage.endpoint.rsplit_once(':').unwrap().1.parse().unwrap();
        relay(&hosts.gateway, pg_port);
        relay(&hosts.gateway, s3_port);
        let state = db.url.replace("127.0.0.1", &hosts.gateway);
        let store = format!(
            "s3://{}/cluster?endpoint=http://{}:{s3_port}&region=garage",
            garage.bucket, hosts.gateway
        );
        let env = vec![
            ("CAIRN_STATE".to_string(), state),
            ("CAIRN_STORE".to_string(), store),
            ("AWS_ACCESS_KEY_ID".to_string(), garage.key_id.clone()),
            ("AWS_SECRET_ACCESS_KEY".to_string(), garage.secret.clone()),
        ];
        let homes = (0..hosts.names.len())
            .map(|_| {
                tempfile::Builder::new()
                    .prefix("cairn-host")
                    .tempdir_in("/tmp")
                    .unwrap()
            })
            .collect();
        Some(Cluster {
            hosts,
            env,
            homes,
            db,
            garage,
            own_server,
        })
    }

    /// Restarts the test's own PostgreSQL: every connection ends.
    fn restart_database(&self) {
        self.own_server
            .as_ref()
            .expect("a cluster started with its own server")
            .restart();
    }

    fn home(&self, k: usize) -> &Path {
        self.homes[k].path()
    }

    /// `cairn ARGS` on host `k`.
    fn command(&self, k: usize, args: &[&str]) -> Command {
        // nsenter enters the network namespace only (`ip netns exec` also
        // remounts /sys, hiding the cgroup hierarchies).
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.hosts.names[k]))
            .args(["--", CAIRN])
            .args(args)
            .env("CAIRN_HOME", self.home(k))
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null());
        c
    }

    fn cairn(&self, k: usize, args: &[&str]) -> Output {
        self.command(k, args).output().expect("run cairn")
    }

    fn ok(&self, k: usize, args: &[&str]) -> String {
        let out = self.cairn(k, args);
        assert!(
            out.status.success(),
            "cairn {args:?} on host {k} failed with {}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Imports the busybox image on host `k`: every host then has it
    /// through the shared state and bucket.
    fn import_busybox(&self, k: usize) {
        self.ok(
            k,
            &[
                "image",
                "import",
                common::busybox_layer().to_str().unwrap(),
                "--name",
                "busybox",
            ],
        );
    }

    /// Queues a run of `file` from host `k`; its id.
    fn enqueue(&self, k: usize, file: &Path, params: &[&str]) -> String {
        let mut args = vec!["pipeline", "run", "--queue", "--detach", file.to_str().unwrap()];
        for p in params {
            args.extend(["--param", p]);
        }
        self.ok(k, &args)
    }

    /// Waits (up to 180 s) until the run completes, as host `k` sees it.
    fn wait_completed(&self, k: usize, run: &str) {
        let deadline = Instant::now() + Duration::from_secs(180);
        while self.run_status(k, run) != "completed" {
            assert!(
                Instant::now() < deadline,
                "the run did not complete: {:?}\nworkers said:\n{}",
                kinds(&self.events(k, run)),
                (0..self.homes.len())
                    .map(|h| self.worker_log(h))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// A worker on host `k`, its JSON lines to a file in its home.
    fn worker(&self, k: usize, lease_secs: u32) -> Child {
        self.worker_with(k, lease_secs, 2)
    }

    fn worker_with(&self, k: usize, lease_secs: u32, slots: u32) -> Child {
        self.worker_command(k, lease_secs, slots)
            .spawn()
            .expect("start a worker")
    }

    /// The command of a worker on host `k`, its JSON lines to a file in its home.
    fn worker_command(&self, k: usize, lease_secs: u32, slots: u32) -> Command {
        let log = std::fs::File::create(self.home(k).join("worker.log")).unwrap();
        let err = std::fs::File::create(self.home(k).join("worker.err")).unwrap();
        let mut c = self.command(
            k,
            &[
                "worker",
                "--json",
                "--slots",
                &slots.to_string(),
                "--lease",
                &lease_secs.to_string(),
                "--poll",
                "0.5",
            ],
        );
        c.stdout(log).stderr(err);
        c
    }

    fn worker_log(&self, k: usize) -> String {
        std::fs::read_to_string(self.home(k).join("worker.log")).unwrap_or_default()
            + &std::fs::read_to_string(self.home(k).join("worker.err")).unwrap_or_default()
    }

    /// Stops host `k`'s worker with SIGTERM; it must stop cleanly.
    fn stop_worker(&self, k: usize, child: &mut Child) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let status = child.wait().unwrap();
        assert!(
            status.success(),
            "worker {k} stopped with {status}: {}",
            self.worker_log(k)
        );
    }

    /// Waits (up to 90 s) until host `k`'s worker says one of `events` of a job.
    fn wait_for_job_event(&self, k: usize, events: &[&str]) {
        let deadline = Instant::now() + Duration::from_secs(90);
        while !events
            .iter()
            .any(|e| self.worker_log(k).contains(&format!("\"event\":\"{e}\"")))
        {
            assert!(
                Instant::now() < deadline,
                "host {k}'s worker said none of {events:?}: {}",
                self.worker_log(k)
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// Kills host `k`: every process in its namespace and every sandbox
    /// its state directory runs, with SIGKILL.
    fn kill_host(&self, k: usize) {
        for pid in self.hosts.pids(k).into_iter().chain(sandbox_pids(self.home(k))) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }

    fn events(&self, k: usize, run: &str) -> Vec<serde_json::Value> {
        let shown: serde_json::Value = serde_json::from_str(&self.ok(k, &["pipeline", "show", run, "--json"])).unwrap();
        shown["events"].as_array().cloned().unwrap_or_default()
    }

    fn run_status(&self, k: usize, run: &str) -> String {
        let shown: serde_json::Value = serde_json::from_str(&self.ok(k, &["pipeline", "show", run, "--json"])).unwrap();
        shown["run"]["status"].as_str().unwrap_or_default().to_string()
    }

    /// Waits until `done` holds of the run's events, or panics after `secs`.
    fn wait_for(&self, k: usize, run: &str, secs: u64, what: &str, done: impl Fn(&[serde_json::Value]) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let events = self.events(k, run);
            if done(&events) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "waited {secs}s for {what}; events: {}",
                serde_json::to_string_pretty(&events).unwrap()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for k in 0..self.homes.len() {
            self.kill_host(k);
        }
        std::thread::sleep(Duration::from_millis(200));
        for k in 0..self.homes.len() {
            // Removes what the kills left (mounts, cgroups) on each host.
            let _ = self.command(k, &["gc"]).output();
        }
    }
}

/// The processes in the cgroups of a state directory's sandboxes.
fn sandbox_pids(home: &Path) -> Vec<i32> {
    let scope = cairn_engine::Home::at(home).scope();
    let dirs = cairn_sandbox::cgroup::Hierarchy::detect(&scope).unwrap().dirs("x");
    let mut pids = Vec::new();
    for scope_dir in dirs.iter().filter_map(|d| d.parent()) {
        let mut stack: Vec<PathBuf> = vec![scope_dir.to_path_buf()];
        while let Some(dir) = stack.pop() {
            if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
                pids.extend(procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
            }
            if let Ok(entries) = std::fs::read_dir(&dir) {
                stack.extend(entries.flatten().map(|e| e.path()).filter(|p| p.is_dir()));
            }
        }
    }
    pids
}

/// A stage that counts to `to`, a step every 0.2 s, from the count its
/// state holds; each start is appended to /work/starts. The count is its
/// artifact.
fn counting_pipeline(dir: &Path, to: u32) -> PathBuf {
    let file = dir.join("count.toml");
    std::fs::write(
        &file,
        format!(
            r#"[pipeline]
name = "count"
image = "busybox"

[[stage]]
name = "count"
key = "count-to-{to}-{{params.nonce}}"
checkpoint_every = "1s"
artifacts = ["/work/progress"]
run = [
  "mkdir -p /work; start=$(cat /work/progress 2>/dev/null || echo 0); echo $start >> /work/starts; for i in $(seq $start {to}); do echo $i > /work/progress; sleep 0.2; done",
]

[params]
nonce = "0"
"#
        ),
    )
    .unwrap();
    file
}

fn kinds(events: &[serde_json::Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["kind"].as_str().unwrap_or_default().to_string())
        .collect()
}

fn count_kind(events: &[serde_json::Value], kind: &str) -> usize {
    events.iter().filter(|e| e["kind"] == kind).count()
}

/// The output snapshot's /work/FILE, read on host `k` from a sandbox
/// restored there.
fn read_output(c: &Cluster, k: usize, run: &str, file: &str) -> String {
    let shown: serde_json::Value = serde_json::from_str(&c.ok(k, &["pipeline", "show", run, "--json"])).unwrap();
    let snap = shown["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == "count")
        .and_then(|s| s["output_snapshot"].as_str())
        .expect("the stage's output snapshot")
        .to_string();
    let id = c.ok(k, &["restore", &snap]);
    let out = c.ok(k, &["exec", &id, "--", "cat", &format!("/work/{file}")]);
    c.ok(k, &["rm", "-f", &id]);
    out
}

#[test]
fn a_host_killed_mid_stage_loses_it_to_another_that_resumes_from_the_checkpoint_in_s3() {
    let test = "a_host_killed_mid_stage_loses_it_to_another_that_resumes_from_the_checkpoint_in_s3";
    let Some(c) = Cluster::start(test, 3) else {
        return;
    };
    // Host 2 enqueues (and imports the image every host uses, through S3).
    c.import_busybox(2);
    let file = counting_pipeline(c.home(2), 60);
    let run = c.enqueue(2, &file, &["nonce=kill"]);
    let mut first = c.worker(0, 3);
    c.wait_for(2, &run, 120, "a checkpoint on host 0", |e| {
        count_kind(e, "checkpoint") >= 2
    });
    c.kill_host(0);
    let _ = first.wait();
    let mut second = c.worker(1, 3);
    c.wait_completed(2, &run);
    let events = c.events(2, &run);
    let ks = kinds(&events);
    assert!(ks.contains(&"lease-expired".to_string()), "{ks:?}");
    let resumed = events
        .iter()
        .find(|e| e["kind"] == "resumed" || e["kind"] == "retry")
        .map(|e| e["detail"].as_str().unwrap_or_default().to_string());
    let restored = events
        .iter()
        .filter(|e| e["kind"] == "forked" || e["kind"] == "retry")
        .filter_map(|e| e["detail"].as_str())
        .any(|d| d.contains("restores checkpoint"));
    assert!(restored, "host 1 did not restore a checkpoint: {ks:?} ({resumed:?})");
    assert_eq!(
        count_kind(&events, "completed"),
        2,
        "one stage completion and the run's: {ks:?}"
    );
    // Host 1's cache never saw the run before; the stage went on from a
    // count host 0 reached, and reached the end.
    let starts = read_output(&c, 1, &run, "starts");
    let starts: Vec<u32> = starts.lines().filter_map(|l| l.trim().parse().ok()).collect();
    assert_eq!(starts.len(), 2, "{starts:?}");
    assert_eq!(starts[0], 0);
    assert!(
        starts[1] > 0,
        "the second host started from the input, not a checkpoint: {starts:?}"
    );
    assert_eq!(read_output(&c, 1, &run, "progress"), "60");
    // Host 1 also restores on a third host that never ran anything.
    assert_eq!(read_output(&c, 2, &run, "progress"), "60");
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(second.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = second.wait();
}

#[test]
fn a_worker_paused_past_its_lease_has_its_commit_refused_and_the_stage_commits_once() {
    let test = "a_worker_paused_past_its_lease_has_its_commit_refused_and_the_stage_commits_once";
    let Some(c) = Cluster::start(test, 3) else {
        return;
    };
    c.import_busybox(2);
    let file = counting_pipeline(c.home(2), 25);
    let run = c.enqueue(2, &file, &["nonce=pause"]);
    let mut paused = c.worker(0, 2);
    c.wait_for(2, &run, 120, "a checkpoint on host 0", |e| {
        count_kind(e, "checkpoint") >= 1
    });
    let pid = nix::unistd::Pid::from_raw(paused.id() as i32);
    // nsenter execs cairn, so the child is the worker itself.
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let mut other = c.worker(1, 2);
    c.wait_completed(2, &run);
    // The paused worker's own attempt ran on in its sandbox meanwhile; once
    // woken it tries to commit, and the fence refuses it.
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    c.wait_for_job_event(0, &["lost"]);
    let events = c.events(2, &run);
    let ks = kinds(&events);
    assert_eq!(
        count_kind(&events, "completed"),
        2,
        "the stage and the run, once each: {ks:?}"
    );
    assert!(ks.contains(&"lease-expired".to_string()), "{ks:?}");
    assert_eq!(read_output(&c, 2, &run, "progress"), "25");
    // One artifact, the committing attempt's: the refused one left none.
    assert_eq!(
        artifacts_of(&c, 2, &run),
        [("/work/progress".to_string(), "25".to_string())]
    );
    // Nothing of the refused attempt is left on host 0.
    c.stop_worker(0, &mut paused);
    c.stop_worker(1, &mut other);
    let left: Vec<serde_json::Value> = serde_json::from_str(&c.ok(0, &["ps", "--json"])).unwrap();
    assert!(left.is_empty(), "host 0 kept sandboxes: {left:?}");
}

#[test]
fn the_branches_of_a_group_spread_over_hosts_and_one_winner_is_kept() {
    let test = "the_branches_of_a_group_spread_over_hosts_and_one_winner_is_kept";
    let Some(c) = Cluster::start(test, 3) else {
        return;
    };
    c.import_busybox(2);
    let file = c.home(2).join("spread.toml");
    std::fs::write(
        &file,
        r#"[pipeline]
name = "spread"
image = "busybox"

[[stage]]
name = "base"
key = "base-v1"
run = ["mkdir -p /work && echo base > /work/base"]

[[stage]]
name = "fit"
after = "base"
key = "fit-{hypothesis}"
run = ["sleep 2; echo {hypothesis.score} > /work/score"]
[stage.branches]
select = "min"
metric = "file:/work/score"
hypotheses = [
  { name = "a", score = "7" }, { name = "b", score = "3" },
  { name = "c", score = "9" }, { name = "d", score = "5" },
]
"#,
    )
    .unwrap();
    let run = c.enqueue(2, &file, &[]);
    let mut workers = [c.worker_with(0, 5, 1), c.worker_with(1, 5, 1)];
    c.wait_completed(2, &run);
    let branches_of = |k: usize| {
        c.worker_log(k)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["event"] == "ended" && v["kind"] == "branch")
            .count()
    };
    let (zero, one) = (branches_of(0), branches_of(1));
    assert_eq!(
        zero + one,
        4,
        "each branch ran once:\n{}\n{}",
        c.worker_log(0),
        c.worker_log(1)
    );
    assert!(
        zero >= 1 && one >= 1,
        "the branches did not spread: {zero} on host 0, {one} on host 1:\n{}\n{}",
        c.worker_log(0),
        c.worker_log(1)
    );
    let events = c.events(2, &run);
    let won: Vec<&serde_json::Value> = events.iter().filter(|e| e["kind"] == "won").collect();
    assert_eq!(won.len(), 1, "{:?}", kinds(&events));
    assert!(
        won[0]["detail"].as_str().unwrap().starts_with("b won under min"),
        "{:?}",
        won[0]
    );
    for (k, w) in workers.iter_mut().enumerate() {
        c.stop_worker(k, w);
    }
}

#[test]
fn a_host_cut_off_mid_upload_marks_no_snapshot_durable_until_its_chunks_are_remote() {
    let test = "a_host_cut_off_mid_upload_marks_no_snapshot_durable_until_its_chunks_are_remote";
    let Some(c) = Cluster::start(test, 2) else {
        return;
    };
    c.import_busybox(0);
    let id = c.ok(0, &["create"]);
    c.ok(
        0,
        &[
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "mkdir -p /data && dd if=/dev/urandom of=/data/big bs=1M count=96 2>/dev/null",
        ],
    );
    let sums = c.ok(0, &["exec", &id, "--", "md5sum", "/data/big"]);
    // The snapshot's uploads start behind it once its row is recorded; the
    // link goes down under them (the state store goes with it, as on a
    // real host cut off, and comes back before the command gives up on it).
    let snapshot = c
        .command(0, &["snapshot", &id])
        .env("CAIRN_UPLOAD_WAIT", "3")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let snap: String = loop {
        let row =
            c.db.client()
                .query_opt("SELECT id FROM snapshots ORDER BY created_at DESC LIMIT 1", &[])
                .unwrap();
        if let Some(row) = row {
            break row.get(0);
        }
        assert!(Instant::now() < deadline, "the snapshot was never recorded");
        std::thread::sleep(Duration::from_millis(20));
    };
    c.hosts.link(0, false);
    std::thread::sleep(Duration::from_secs(5));
    let durable = |c: &Cluster| -> Option<i64> {
        c.db.client()
            .query_one("SELECT remote_durable_at FROM snapshots WHERE id = $1", &[&snap])
            .unwrap()
            .get(0)
    };
    let restored_sums = |k: usize| -> String {
        let sb = c.ok(k, &["restore", &snap]);
        let sums = c.ok(k, &["exec", &sb, "--", "md5sum", "/data/big"]);
        c.ok(k, &["rm", "-f", &sb]);
        sums
    };
    // Cut off, the host cannot have confirmed every chunk: either the mark
    // is absent, or (every upload finished before the cut) another host
    // restores the snapshot whole from the bucket right now.
    if durable(&c).is_some() {
        assert_eq!(restored_sums(1), sums);
    }
    let was_marked = durable(&c).is_some();
    // Back on the network, the next command on the host finishes the
    // uploads and marks the snapshot; another host restores it whole.
    c.hosts.link(0, true);
    let out = snapshot.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the snapshot failed once the host was back: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), snap);
    let out = c
        .command(0, &["snapshots"])
        .env("CAIRN_UPLOAD_WAIT", "120")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        durable(&c).is_some(),
        "the snapshot was not marked once its uploads could finish"
    );
    assert_eq!(restored_sums(1), sums);
    eprintln!(
        "{test}: the cut landed {}",
        if was_marked { "after every upload" } else { "mid-upload" }
    );
    c.ok(0, &["rm", "-f", &id]);
}

/// The run's artifacts, as host `k` lists them: (path, content).
fn artifacts_of(c: &Cluster, k: usize, run: &str) -> Vec<(String, String)> {
    let shown: serde_json::Value = serde_json::from_str(&c.ok(k, &["pipeline", "show", run, "--json"])).unwrap();
    shown["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            let path = a["path"].as_str().unwrap().to_string();
            (path, c.ok(k, &["artifact", "get", a["id"].as_str().unwrap()]))
        })
        .collect()
}

/// The ids of the sandboxes host `k`'s state directory runs.
fn sandboxes_on(c: &Cluster, k: usize) -> Vec<String> {
    let all: Vec<serde_json::Value> = serde_json::from_str(&c.ok(k, &["ps", "--json"])).unwrap();
    all.iter()
        .filter_map(|s| s["id"].as_str().map(str::to_string))
        .collect()
}

#[test]
fn a_killed_workers_attempt_is_reaped_on_its_host_and_a_held_one_is_never_touched() {
    let test = "a_killed_workers_attempt_is_reaped_on_its_host_and_a_held_one_is_never_touched";
    let Some(c) = Cluster::start(test, 3) else {
        return;
    };
    c.import_busybox(2);
    let file = counting_pipeline(c.home(2), 80);
    let run = c.enqueue(2, &file, &["nonce=orphan"]);
    let mut first = c.worker(0, 3);
    c.wait_for(2, &run, 120, "a checkpoint on host 0", |e| {
        count_kind(e, "checkpoint") >= 1
    });
    // Only the worker dies: the stage's sandbox counts on, on host 0.
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
    let _ = first.wait();
    let orphan = sandboxes_on(&c, 0);
    assert_eq!(orphan.len(), 1, "{orphan:?}");
    let second = c.worker(1, 3);
    // Host 1 takes the job over and runs its own attempt: `cairn gc` there
    // leaves that sandbox alone, its claim being held.
    let deadline = Instant::now() + Duration::from_secs(60);
    let held = loop {
        let held = sandboxes_on(&c, 1);
        if !held.is_empty() {
            break held;
        }
        assert!(
            Instant::now() < deadline,
            "host 1 never ran the stage: {}",
            c.worker_log(1)
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let gc: serde_json::Value = serde_json::from_str(&c.ok(1, &["gc", "--json"])).unwrap();
    assert_eq!(gc["orphans_reaped"], serde_json::json!([]), "{gc}");
    c.wait_completed(2, &run);
    let events = c.events(2, &run);
    assert_eq!(count_kind(&events, "completed"), 2, "{:?}", kinds(&events));
    assert_eq!(read_output(&c, 1, &run, "progress"), "80");
    assert_eq!(
        artifacts_of(&c, 0, &run),
        [("/work/progress".to_string(), "80".to_string())]
    );
    assert!(
        !kinds(&events).contains(&"orphan-reaped".to_string()),
        "host 1's held sandbox {held:?} was reaped: {events:?}"
    );
    // Nobody on host 0 has looked yet: the killed worker's attempt runs on.
    assert_eq!(sandboxes_on(&c, 0), orphan);
    // Host 0's worker, back, records and removes it when it starts.
    let back = c.worker(0, 3);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !sandboxes_on(&c, 0).is_empty() {
        assert!(
            Instant::now() < deadline,
            "host 0's worker left the orphan {orphan:?}: {}",
            c.worker_log(0)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let reaped: Vec<String> = c
        .events(2, &run)
        .iter()
        .filter(|e| e["kind"] == "orphan-reaped")
        .filter_map(|e| e["detail"].as_str().map(str::to_string))
        .collect();
    assert_eq!(reaped.len(), 1, "{reaped:?}");
    assert!(
        reaped[0].contains(&orphan[0]) && reaped[0].contains("claim 1") && reaped[0].contains("ended"),
        "{reaped:?}"
    );
    assert!(
        c.worker_log(0).contains("\"event\":\"orphan-reaped\""),
        "{}",
        c.worker_log(0)
    );
    c.stop_worker(1, &mut { second });
    c.stop_worker(0, &mut { back });
}

/// Whether process `pid` is stopped (SIGSTOP), as /proc says.
fn stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| stat.rsplit_once(") ").map(|(_, rest)| rest.starts_with('T')))
        .unwrap_or(false)
}

#[test]
fn a_worker_stopped_inside_its_commit_blocks_no_takeover_and_commits_nothing() {
    let test = "a_worker_stopped_inside_its_commit_blocks_no_takeover_and_commits_nothing";
    let Some(c) = Cluster::start(test, 3) else {
        return;
    };
    c.import_busybox(2);
    let file = counting_pipeline(c.home(2), 25);
    let run = c.enqueue(2, &file, &["nonce=commit"]);
    // Host 0's worker stops itself inside its first commit under the claim,
    // with the job's row locked in an open transaction.
    let mut stuck = c
        .worker_command(0, 3, 2)
        .env("CAIRN_FAILPOINTS", "fenced-commit")
        .spawn()
        .expect("start a worker");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !stopped(stuck.id()) {
        assert!(
            Instant::now() < deadline,
            "the worker never reached its commit: {}",
            c.worker_log(0)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // PostgreSQL ends the idle transaction (idle_in_transaction_session_timeout),
    // the row lock goes with it, and host 1 takes the run over and completes it
    // while host 0 is still stopped.
    let other = c.worker(1, 3);
    c.wait_completed(2, &run);
    assert!(stopped(stuck.id()), "host 0's worker was continued by someone");
    let events = c.events(2, &run);
    assert!(
        kinds(&events).contains(&"lease-expired".to_string()),
        "{:?}",
        kinds(&events)
    );
    assert_eq!(read_output(&c, 2, &run, "progress"), "25");
    // Continued, host 0's worker finds its transaction gone and commits nothing.
    let before = c.events(2, &run).len();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(stuck.id() as i32),
        nix::sys::signal::Signal::SIGCONT,
    )
    .unwrap();
    c.wait_for_job_event(0, &["lost", "failed"]);
    let after = c.events(2, &run);
    assert_eq!(count_kind(&after, "completed"), 2, "{:?}", kinds(&after));
    // What it may still record: its error, and the removal of the sandbox
    // its attempt left (an orphan once the attempt ended).
    assert!(
        after[before..]
            .iter()
            .all(|e| e["kind"] == "worker-error" || e["kind"] == "orphan-reaped"),
        "host 0 committed after its claim moved on: {:?}",
        &after[before..]
    );
    assert_eq!(
        artifacts_of(&c, 2, &run),
        [("/work/progress".to_string(), "25".to_string())]
    );
    c.stop_worker(0, &mut stuck);
    c.stop_worker(1, &mut { other });
}

#[test]
fn a_run_goes_on_across_a_postgresql_restart_and_its_stage_commits_once() {
    let test = "a_run_goes_on_across_a_postgresql_restart_and_its_stage_commits_once";
    let Some(c) = Cluster::start_with(test, 3, true) else {
        return;
    };
    c.import_busybox(2);
    let file = counting_pipeline(c.home(2), 40);
    let run = c.enqueue(2, &file, &["nonce=restart"]);
    let mut workers = [c.worker(0, 3), c.worker(1, 3)];
    c.wait_for(2, &run, 120, "a checkpoint", |e| count_kind(e, "checkpoint") >= 2);
    // Every connection of every worker ends mid-run.
    c.restart_database();
    c.wait_completed(2, &run);
    let events = c.events(2, &run);
    assert_eq!(
        count_kind(&events, "completed"),
        2,
        "the stage and the run, once each: {:?}",
        kinds(&events)
    );
    assert_eq!(read_output(&c, 2, &run, "progress"), "40");
    assert_eq!(
        artifacts_of(&c, 2, &run),
        [("/work/progress".to_string(), "40".to_string())]
    );
    // The restart reached the workers: they reconnected and went on.
    let logs = c.worker_log(0) + &c.worker_log(1);
    assert!(logs.contains("reconnected to the PostgreSQL state store"), "{logs}");
    // Nothing is left running on any host once the workers stop.
    for (k, child) in workers.iter_mut().enumerate() {
        c.stop_worker(k, child);
    }
    for k in 0..2 {
        c.ok(k, &["gc"]);
        assert!(
            sandboxes_on(&c, k).is_empty(),
            "host {k} kept {:?}",
            sandboxes_on(&c, k)
        );
    }
}

#[test]
fn a_worker_cut_off_from_the_database_stops_its_attempt_and_commits_nothing() {
    let test = "a_worker_cut_off_from_the_database_stops_its_attempt_and_commits_nothing";
    let Some(c) = Cluster::start(test, 2) else {
        return;
    };
    c.import_busybox(1);
    let file = counting_pipeline(c.home(1), 60);
    let run = c.enqueue(1, &file, &["nonce=cutoff"]);
    let mut first = c.worker(0, 3);
    c.wait_for(1, &run, 120, "a checkpoint on host 0", |e| {
        count_kind(e, "checkpoint") >= 1
    });
    assert!(!sandbox_pids(c.home(0)).is_empty(), "host 0 runs no stage");
    // Host 0 loses its link: the state store and the bucket with it.
    c.hosts.link(0, false);
    let mut second = c.worker(1, 3);
    // Its worker cannot renew its lease; once the lease has run down it
    // stops the attempt it can no longer commit.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !sandbox_pids(c.home(0)).is_empty() {
        assert!(
            Instant::now() < deadline,
            "host 0 went on computing cut off: {}",
            c.worker_log(0)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    c.wait_completed(1, &run);
    // Back on the network, host 0 commits nothing of its attempt.
    c.hosts.link(0, true);
    c.wait_for_job_event(0, &["lost", "failed"]);
    let events = c.events(1, &run);
    assert_eq!(count_kind(&events, "completed"), 2, "{:?}", kinds(&events));
    assert_eq!(read_output(&c, 1, &run, "progress"), "60");
    assert_eq!(
        artifacts_of(&c, 1, &run),
        [("/work/progress".to_string(), "60".to_string())]
    );
    c.stop_worker(0, &mut first);
    c.stop_worker(1, &mut second);
    c.ok(0, &["gc"]);
    assert!(sandboxes_on(&c, 0).is_empty(), "host 0 kept {:?}", sandboxes_on(&c, 0));
}

/// A stage that writes 32 MiB of random bytes once, then counts to `to` as
/// counting_pipeline's does, checkpointing every second.
fn heavy_counting_pipeline(dir: &Path, to: u32) -> PathBuf {
    let file = dir.join("heavy.toml");
    std::fs::write(
        &file,
        format!(
            r#"[pipeline]
name = "heavy"
image = "busybox"

[[stage]]
name = "count"
key = "heavy-{to}-{{params.nonce}}"
checkpoint_every = "1s"
artifacts = ["/work/progress"]
run = [
  "mkdir -p /work; [ -f /work/blob ] || head -c 33554432 /dev/urandom > /work/blob; start=$(cat /work/progress 2>/dev/null || echo 0); for i in $(seq $start {to}); do echo $i > /work/progress; head -c 262144 /dev/urandom > /work/noise; sleep 0.2; done",
]

[params]
nonce = "0"
"#
        ),
    )
    .unwrap();
    file
}

#[test]
fn checkpoints_taken_while_the_object_store_is_down_are_whole_once_it_is_back() {
    let test = "checkpoints_taken_while_the_object_store_is_down_are_whole_once_it_is_back";
    let Some(mut c) = Cluster::start(test, 2) else {
        return;
    };
    c.import_busybox(1);
    let file = heavy_counting_pipeline(c.home(1), 40);
    let run = c.enqueue(1, &file, &["nonce=s3down"]);
    let mut worker = c.worker(0, 3);
    c.wait_for(1, &run, 120, "a checkpoint", |e| count_kind(e, "checkpoint") >= 1);
    // The S3 server goes away under the next checkpoints' uploads, and comes back.
    c.garage.kill();
    std::thread::sleep(Duration::from_secs(4));
    c.garage.restart();
    c.wait_completed(1, &run);
    let events = c.events(1, &run);
    assert_eq!(count_kind(&events, "completed"), 2, "{:?}", kinds(&events));
    assert_eq!(read_output(&c, 1, &run, "progress"), "40");
    assert_eq!(
        artifacts_of(&c, 1, &run),
        [("/work/progress".to_string(), "40".to_string())]
    );
    // Every checkpoint recorded restores whole on the host that never ran
    // the stage, from the bucket alone: none names a missing chunk.
    let checkpoints: Vec<String> = events
        .iter()
        .filter(|e| e["kind"] == "checkpoint")
        .filter_map(|e| e["snapshot_id"].as_str().map(str::to_string))
        .collect();
    assert!(!checkpoints.is_empty(), "{:?}", kinds(&events));
    for snap in &checkpoints {
        let id = c.ok(1, &["restore", snap]);
        let sizes = c.ok(
            1,
            &["exec", &id, "--", "sh", "-c", "wc -c < /work/blob; cat /work/progress"],
        );
        assert!(sizes.starts_with("33554432\n"), "checkpoint {snap}: {sizes}");
        c.ok(1, &["rm", "-f", &id]);
    }
    c.stop_worker(0, &mut worker);
}

//! Times the gVisor driver: start to first output, checkpoint, restore to
//! first output, on a fresh sandbox and on one that ran a fork/exec loop.
//!
//! `cargo run -p cairn-sandbox --example gvisor_timing -- <busybox root> [runs] [churn seconds]`
//! (as root). Not a test: numbers go to stdout for `docs/gvisor.md`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use cairn_protocol::ExecRequest;
use cairn_sandbox::client::InitClient;
use cairn_sandbox::gvisor::GvisorDriver;
use cairn_sandbox::{init_binary, Driver, Limits, SandboxSpec};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let base = PathBuf::from(
        args.get(1)
            .expect("usage: gvisor_timing <busybox root> [runs] [churn seconds]"),
    );
    let runs: usize = args.get(2).map_or(5, |s| s.parse().unwrap());
    let churn: u64 = args.get(3).map_or(0, |s| s.parse().unwrap());
    let tmp = tempfile::Builder::new().prefix("gvb").tempdir_in("/tmp").unwrap();
    let driver = GvisorDriver::new(tmp.path().join("state"), "gvisor-test").unwrap();
    let init = init_binary::install(&tmp.path().join("bin")).unwrap();

    let mut rows = Vec::new();
    for run in 0..runs {
        let spec = |name: &str| {
            let dir = tmp.path().join(format!("{name}{run}"));
            std::fs::create_dir_all(&dir).unwrap();
            SandboxSpec {
                id: format!("gvb{}-{name}{run}", std::process::id()),
                hostname: name.into(),
                dir,
                layers: vec![base.clone()],
                limits: Limits::default(),
                init_binary: init.clone(),
                network: None,
            }
        };
        let s = spec("s");
        let t = Instant::now();
        driver.start(&s).unwrap();
        let client = driver.client(&s.dir);
        run_sh(&client, "true", false);
        let start = t.elapsed();
        run_sh(
            &client,
            "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done",
            true,
        );
        if churn > 0 {
            run_sh(&client, "while true; do /bin/true; done", true);
            std::thread::sleep(Duration::from_secs(churn));
        } else {
            std::thread::sleep(Duration::from_millis(500));
        }
        let image = tmp.path().join(format!("img{run}"));
        let t = Instant::now();
        let cp = driver.checkpoint(&s.id, &image).unwrap();
        let checkpoint = t.elapsed();
        let t = Instant::now();
        driver.restore(&s, &image).unwrap();
        run_sh(&client, "true", false);
        let restore = t.elapsed();
        driver.stop(&s.id, None).unwrap();
        println!(
            "run {run}: start+first exec {:.0} ms, checkpoint {:.0} ms (quiesce {:.0}, runsc checkpoint {:.0}, cleanup {:.0}; {} KiB), restore+first exec {:.0} ms",
            ms(start),
            ms(checkpoint),
            ms(cp.quiesce),
            ms(cp.save),
            ms(cp.cleanup),
            cp.image_bytes / 1024,
            ms(restore)
        );
        rows.push((start, checkpoint, restore));
    }
    let median = |f: fn(&(Duration, Duration, Duration)) -> Duration| {
        let mut v: Vec<Duration> = rows.iter().map(f).collect();
        v.sort();
        ms(v[v.len() / 2])
    };
    println!(
        "median over {runs} (churn {churn} s): start+first exec {:.0} ms, checkpoint {:.0} ms, restore+first exec {:.0} ms",
        median(|r| r.0),
        median(|r| r.1),
        median(|r| r.2)
    );
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn run_sh(client: &InitClient, script: &str, detach: bool) {
    let session = client
        .exec(ExecRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            env: vec![],
            cwd: None,
            stdin: false,
            timeout_ms: None,
            detach,
            user: None,
        })
        .unwrap()
        .unwrap();
    session.wait(&mut Vec::new(), &mut Vec::new()).unwrap();
}

//! Three Garage nodes on loopback, each object kept on all three
//! (replication factor 3): a throwaway S3 cluster for tests that lose a
//! node. Each node has its own directory and ports; the cluster is laid
//! out with `garage layout assign`/`apply`, its bucket and key made with
//! the `garage` command line. Every node is killed on drop.

use std::fs;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::garage::{config_text, free_port, random_hex, skipped, INSTALL};

struct Node {
    config: PathBuf,
    s3_port: u16,
    rpc_port: u16,
    child: Option<Child>,
}

pub struct GarageCluster {
    dir: tempfile::TempDir,
    nodes: Vec<Node>,
    pub bucket: String,
    pub key_id: String,
    pub secret: String,
}

fn garage(config: &Path, args: &[&str]) -> Output {
    Command::new("garage")
        .arg("-c")
        .arg(config)
        .args(args)
        .env("RUST_LOG", "garage=warn")
        .stdin(Stdio::null())
        .output()
        .expect("run garage")
}

impl GarageCluster {
    /// Starts three nodes and joins them into one cluster, or returns
    /// `None` (after saying so) when the `garage` binary is not installed.
    pub fn start(test: &str) -> Option<GarageCluster> {
        if Command::new("garage").arg("--version").output().is_err() {
            skipped(&format!(
                "{test}: garage (a real S3 server) is not installed; {INSTALL}"
            ));
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let secret = random_hex(32);
        let mut nodes = Vec::new();
        for i in 0..3 {
            let (s3, rpc) = (free_port(), free_port());
            let d = dir.path().join(format!("node{i}"));
            fs::create_dir_all(&d).unwrap();
            let config = d.join("garage.toml");
            fs::write(&config, config_text(&d, rpc, s3, &secret, 3)).unwrap();
            nodes.push(Node {
                config,
                s3_port: s3,
                rpc_port: rpc,
                child: None,
            });
        }
        let mut cluster = GarageCluster {
            dir,
            nodes,
            bucket: "cairn-cluster".to_string(),
            key_id: format!("GK{}", random_hex(12)),
            secret: random_hex(32),
        };
        for i in 0..3 {
            cluster.start_node(i);
        }
        cluster.form();
        Some(cluster)
    }

    fn start_node(&mut self, i: usize) {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(i))
            .unwrap();
        let node = &mut self.nodes[i];
        let child = Command::new("garage")
            .arg("-c")
            .arg(&node.config)
            .arg("server")
            .env("RUST_LOG", "garage=warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start garage");
        node.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", node.rpc_port)).is_err() {
            if let Some(status) = node.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("garage node {i} exited ({status}):\n{}", self.log(i));
            }
            assert!(
                Instant::now() < deadline,
                "garage node {i} not listening after 30 s:\n{}",
                self.log(i)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log_path(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("node{i}.log"))
    }

    pub fn log(&self, i: usize) -> String {
        fs::read_to_string(self.log_path(i)).unwrap_or_default()
    }

    /// Runs the garage command line against node 0, asserting success.
    fn admin(&self, args: &[&str]) -> String {
        let out = garage(&self.nodes[0].config, args);
        assert!(
            out.status.success(),
            "garage {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Connects the nodes, gives each a role (its own zone, 1 GB), applies
    /// the layout, then makes the bucket and the key.
    fn form(&self) {
        let ids: Vec<String> = self
            .nodes
            .iter()
            .map(|n| {
                let out = garage(&n.config, &["node", "id", "-q"]);
                assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
                String::from_utf8_lossy(&out.stdout).trim().to_string()
            })
            .collect();
        for id in &ids[1..] {
            self.admin(&["node", "connect", id]);
        }
        for (i, id) in ids.iter().enumerate() {
            let node_id = id.split('@').next().unwrap();
            self.admin(&["layout", "assign", "-z", &format!("dc{i}"), "-c", "1G", node_id]);
        }
        self.admin(&["layout", "apply", "--version", "1"]);
        self.admin(&["bucket", "create", &self.bucket]);
        self.admin(&["key", "import", "--yes", "-n", "cairn", &self.key_id, &self.secret]);
        self.admin(&[
            "bucket",
            "allow",
            "--read",
            "--write",
            "--owner",
            &self.bucket,
            "--key",
            &self.key_id,
        ]);
        // Ready once node 0 answers S3 requests with the new key.
        let deadline = Instant::now() + Duration::from_secs(30);
        let url = self.url("ready-probe");
        loop {
            let (id, secret) = (self.key_id.clone(), self.secret.clone());
            let config = cairn_store::S3Config::from_url_with_env(&url, |name| match name {
                "AWS_ACCESS_KEY_ID" => Some(id.clone()),
                "AWS_SECRET_ACCESS_KEY" => Some(secret.clone()),
                _ => None,
            })
            .unwrap();
            match cairn_store::S3Store::open(config) {
                Ok(_) => return,
                Err(e) if Instant::now() > deadline => panic!("the cluster does not serve S3 after 30 s: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// `s3://…` for `prefix` in the cluster's bucket, through node 0.
    pub fn url(&self, prefix: &str) -> String {
        format!(
            "s3://{}/{prefix}?endpoint=http://127.0.0.1:{}&region=garage",
            self.bucket, self.nodes[0].s3_port
        )
    }

    /// Kills node `i` now, as a lost machine would vanish.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for GarageCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }
}

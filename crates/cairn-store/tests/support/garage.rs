//! A throwaway Garage (a real S3 server) on loopback for tests: its own
//! temporary directory and free ports, a default bucket and key, killed
//! on drop.

use std::fs;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cairn_store::{S3Config, S3Store};

pub const INSTALL: &str =
    "cargo install garage --locked --version 2.5.0 --debug --no-default-features --features bundled-libs,sqlite";

/// Under CI a missing part fails the test; elsewhere the test is skipped,
/// loudly.
pub fn skipped(message: &str) {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{message} (CI=true: a missing part fails the test)");
    }
    eprintln!("SKIPPED {message}");
}

/// A node's configuration: its data under `dir`, its ports, the cluster's
/// shared RPC secret and replication factor.
pub fn config_text(dir: &std::path::Path, rpc: u16, s3: u16, secret: &str, replication: u8) -> String {
    format!(
        r#"metadata_dir = "{d}/meta"
data_dir = "{d}/data"
db_engine = "sqlite"
replication_factor = {replication}
metadata_fsync = false
data_fsync = false
rpc_bind_addr = "127.0.0.1:{rpc}"
rpc_public_addr = "127.0.0.1:{rpc}"
rpc_secret = "{secret}"

[s3_api]
s3_region = "garage"
api_bind_addr = "127.0.0.1:{s3}"
root_domain = ".s3.garage.localhost"
"#,
        d = dir.display(),
    )
}

pub struct Garage {
    child: Option<Child>,
    s3_port: u16,
    dir: tempfile::TempDir,
    pub endpoint: String,
    pub bucket: String,
    pub key_id: String,
    pub secret: String,
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    fs::File::open("/dev/urandom").unwrap().read_exact(&mut buf).unwrap();
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

impl Garage {
    /// Starts a single-node Garage, or returns `None` (after saying so)
    /// when the `garage` binary is not installed.
    pub fn start(test: &str) -> Option<Garage> {
        if Command::new("garage").arg("--version").output().is_err() {
            skipped(&format!(
                "{test}: garage (a real S3 server) is not installed; {INSTALL}"
            ));
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let (s3, rpc) = (free_port(), free_port());
        let config = dir.path().join("garage.toml");
        fs::write(&config, config_text(dir.path(), rpc, s3, &random_hex(32), 1)).unwrap();
        let key_id = format!("GK{}", random_hex(12));
        let secret = random_hex(32);
        let bucket = "cairn-test".to_string();
        let mut garage = Garage {
            child: None,
            s3_port: s3,
            dir,
            endpoint: format!("http://127.0.0.1:{s3}"),
            bucket,
            key_id,
            secret,
        };
        garage.restart();
        Some(garage)
    }

    /// Starts the server again on the same ports and data (killing it
    /// first if it runs), and waits until it answers.
    pub fn restart(&mut self) {
        self.kill();
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("garage.log"))
            .unwrap();
        let child = Command::new("garage")
            .arg("-c")
            .arg(self.dir.path().join("garage.toml"))
            .args(["server", "--single-node", "--default-bucket"])
            .env("GARAGE_DEFAULT_ACCESS_KEY", &self.key_id)
            .env("GARAGE_DEFAULT_SECRET_KEY", &self.secret)
            .env("GARAGE_DEFAULT_BUCKET", &self.bucket)
            .env("RUST_LOG", "garage=warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start garage");
        self.child = Some(child);
        self.wait_ready(self.s3_port);
    }

    fn wait_ready(&mut self, port: u16) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("garage exited ({status}) before it was ready:\n{}", self.log());
            }
            if TcpStream::connect(("127.0.0.1", port)).is_ok() && S3Store::open(self.config("ready-probe")).is_ok() {
                return;
            }
            if Instant::now() > deadline {
                panic!("garage was not ready after 30 s:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("garage runs").id()
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("garage.log")).unwrap_or_default()
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The store at `prefix` in the default bucket, with its credentials.
    pub fn config(&self, prefix: &str) -> S3Config {
        let url = format!("s3://{}/{prefix}?endpoint={}&region=garage", self.bucket, self.endpoint);
        let (id, secret) = (self.key_id.clone(), self.secret.clone());
        S3Config::from_url_with_env(&url, |name| match name {
            "AWS_ACCESS_KEY_ID" => Some(id.clone()),
            "AWS_SECRET_ACCESS_KEY" => Some(secret.clone()),
            _ => None,
        })
        .unwrap()
    }

    pub fn open(&self, prefix: &str) -> S3Store {
        S3Store::open(self.config(prefix)).unwrap()
    }

    /// Runs the garage command line against this server, asserting
    /// success; returns its output.
    pub fn admin(&self, args: &[&str]) -> String {
        let out = Command::new("garage")
            .arg("-c")
            .arg(self.dir.path().join("garage.toml"))
            .args(args)
            .env("RUST_LOG", "garage=warn")
            .stdin(Stdio::null())
            .output()
            .expect("run garage");
        assert!(
            out.status.success(),
            "garage {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Kills the server now (as a lost host would vanish).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Garage {
    fn drop(&mut self) {
        self.kill();
    }
}

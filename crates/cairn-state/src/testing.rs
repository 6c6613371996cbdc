//! Test support (feature `test-support`): a throwaway PostgreSQL cluster
//! for the state store's tests, shared by the engine's conformance suite
//! and the CLI's end-to-end tests.
//!
//! One cluster per test binary, started on first use from the Debian
//! packages' `initdb`/`pg_ctl` (as the `postgres` user when running as
//! root, since PostgreSQL refuses root), listening on 127.0.0.1 at a free
//! port and on a Unix socket in its own directory under /tmp. A reaper
//! process holds a pipe from the test binary and, when the binary exits
//! in any way (tests passed, failed, or the process was killed), stops the
//! cluster and removes its directory. Each test gets a database of its own.
//!
//! `CAIRN_TEST_POSTGRES=postgres://…` uses an existing server instead.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::{Mutex, OnceLock};

pub use postgres;

/// What a PostgreSQL test prints when it cannot run here.
pub const NOT_INSTALLED: &str = "PostgreSQL is not installed (apt-get install postgresql)";

/// A server the tests may create databases on.
pub struct PostgresServer {
    /// A URL with the database part replaceable (see [`with_database`]).
    admin_url: String,
    /// The cluster's data directory, when this binary started it.
    pub data_dir: Option<PathBuf>,
    /// PostgreSQL's programs, when this binary started it.
    bin: Option<PathBuf>,
    /// Closing this (at process exit) tells the reaper to stop the cluster.
    _reaper: Option<Mutex<ChildStdin>>,
}

/// A database of its own for one test, dropped with it.
pub struct TestDatabase {
    pub url: String,
    pub name: String,
    admin_url: String,
}

impl TestDatabase {
    pub fn client(&self) -> postgres::Client {
        postgres::Client::connect(&self.url, postgres::NoTls)
            .unwrap_or_else(|e| panic!("connect to the test database {}: {e}", self.name))
    }

    /// The single integer a query returns (`SELECT count(*) …`).
    pub fn count(&self, sql: &str) -> i64 {
        self.client()
            .query_one(sql, &[])
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .get(0)
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        if let Ok(mut c) = postgres::Client::connect(&self.admin_url, postgres::NoTls) {
            let _ = c.batch_execute(&format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name));
        }
    }
}

/// The shared server; `None` (after saying why on stderr) when
/// PostgreSQL is not installed and `CAIRN_TEST_POSTGRES` is unset. A
/// server that is installed but does not start fails the test.
pub fn postgres_server(test: &str) -> Option<&'static PostgresServer> {
    static SERVER: OnceLock<Result<Option<PostgresServer>, String>> = OnceLock::new();
    let server = SERVER.get_or_init(start_server);
    match server {
        Ok(Some(s)) => Some(s),
        Ok(None) => {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{test}: {NOT_INSTALLED} (CI=true: a missing part fails the test)");
            }
            eprintln!("SKIPPED {test}: {NOT_INSTALLED}");
            None
        }
        Err(e) => panic!("{test}: cannot start a PostgreSQL cluster for the tests: {e}"),
    }
}

/// A cluster of `test`'s own, which it may restart ([`PostgresServer::restart`]);
/// stopped and removed when dropped. `None` (skipped, or failed under
/// `CI=true`) where PostgreSQL is not installed; `CAIRN_TEST_POSTGRES`
/// does not apply (a server of someone else's is not restarted).
pub fn dedicated_postgres(test: &str) -> Option<PostgresServer> {
    let Some(bin) = postgres_bin() else {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("{test}: {NOT_INSTALLED} (CI=true: a missing part fails the test)");
        }
        eprintln!("SKIPPED {test}: {NOT_INSTALLED}");
        return None;
    };
    Some(start_cluster(&bin).unwrap_or_else(|e| panic!("{test}: cannot start a PostgreSQL cluster: {e}")))
}

/// A fresh database for `test` on the shared server, or `None` (skipped).
pub fn postgres_database(test: &str) -> Option<TestDatabase> {
    Some(postgres_server(test)?.database(test))
}

impl PostgresServer {
    pub fn database(&self, test: &str) -> TestDatabase {
        let mut rand = [0u8; 4];
        getrandom::getrandom(&mut rand).expect("random bytes");
        let hint: String = test
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '_'
                }
            })
            .take(40)
            .collect();
        let name = format!(
            "cairn_{hint}_{}",
            rand.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
        let mut admin = postgres::Client::connect(&self.admin_url, postgres::NoTls)
            .unwrap_or_else(|e| panic!("connect to the test server: {e}"));
        admin
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .unwrap_or_else(|e| panic!("create database {name}: {e}"));
        TestDatabase {
            url: with_database(&self.admin_url, &name),
            name,
            admin_url: self.admin_url.clone(),
        }
    }
}

impl PostgresServer {
    /// Restarts a cluster this binary started (`pg_ctl restart -m fast`):
    /// every connection is ended, and the server listens again on the same
    /// port once this returns.
    pub fn restart(&self) {
        let (Some(bin), Some(data)) = (&self.bin, &self.data_dir) else {
            panic!("only a cluster these tests started can be restarted");
        };
        let log = data.parent().expect("the cluster's directory").join("server.log");
        run(
            as_owner(&bin.join("pg_ctl"))
                .arg("-D")
                .arg(data)
                .arg("-l")
                .arg(&log)
                .args(["-w", "-t", "60", "-m", "fast", "restart"])
                .stdout(Stdio::null())
                .stderr(Stdio::piped()),
            "pg_ctl restart",
            Some(&log),
        )
        .unwrap_or_else(|e| panic!("restart the test cluster: {e}"));
    }
}

/// `url` with its database replaced by `db`.
pub fn with_database(url: &str, db: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("postgres", url));
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let query = tail.split_once('?').map(|(_, q)| format!("?{q}")).unwrap_or_default();
    format!("{scheme}://{authority}/{db}{query}")
}

fn start_server() -> Result<Option<PostgresServer>, String> {
    if let Ok(url) = std::env::var("CAIRN_TEST_POSTGRES") {
        if !url.is_empty() {
            return Ok(Some(PostgresServer {
                admin_url: url,
                data_dir: None,
                bin: None,
                _reaper: None,
            }));
        }
    }
    let Some(bin) = postgres_bin() else { return Ok(None) };
    start_cluster(&bin).map(Some)
}

/// The newest `/usr/lib/postgresql/N/bin` holding `initdb` and `pg_ctl`.
fn postgres_bin() -> Option<PathBuf> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            (bin.join("initdb").is_file() && bin.join("pg_ctl").is_file()).then_some((version, bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, bin)| bin)
}

/// A command run as the cluster's owner: `postgres` when we are root.
fn as_owner(program: &Path) -> Command {
    if nix::unistd::geteuid().is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        // Somewhere the postgres user may enter.
        c.current_dir("/tmp");
        c
    } else {
        Command::new(program)
    }
}

fn run(cmd: &mut Command, what: &str, log: Option<&Path>) -> Result<(), String> {
    let out = cmd.stdin(Stdio::null()).output().map_err(|e| format!("{what}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let mut server_log = String::new();
    if let Some(mut f) = log.and_then(|l| std::fs::File::open(l).ok()) {
        let _ = f.read_to_string(&mut server_log);
    }
    Err(format!(
        "{what} failed ({}): {}{}{server_log}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

fn start_cluster(bin: &Path) -> Result<PostgresServer, String> {
    let mut rand = [0u8; 6];
    getrandom::getrandom(&mut rand).map_err(|e| e.to_string())?;
    let dir = PathBuf::from(format!(
        "/tmp/cairn-pg-{}",
        rand.iter().map(|b| format!("{b:02x}")).collect::<String>()
    ));
    let data = dir.join("data");
    std::fs::create_dir(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    // From here on the reaper removes the directory whatever happens.
    let reaper = spawn_reaper(bin, &dir, &data)?;
    if nix::unistd::geteuid().is_root() {
        let owner = nix::unistd::User::from_name("postgres")
            .map_err(|e| e.to_string())?
            .ok_or("PostgreSQL is installed but there is no postgres user to run it as")?;
        nix::unistd::chown(&dir, Some(owner.uid), Some(owner.gid)).map_err(|e| e.to_string())?;
    }
    run(
        as_owner(&bin.join("initdb")).arg("-D").arg(&data).args([
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        ]),
        "initdb",
        None,
    )?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("find a free port: {e}"))?
        .port();
    let log = dir.join("server.log");
    run(
        as_owner(&bin.join("pg_ctl"))
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(&log)
            .args(["-w", "-t", "60", "start", "-o"])
            .arg(format!(
                "-c listen_addresses=127.0.0.1 -p {port} -k {} -c fsync=off -c full_page_writes=off \
                 -c synchronous_commit=off -c max_connections=300",
                dir.display()
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
        "pg_ctl start",
        Some(&log),
    )?;
    Ok(PostgresServer {
        admin_url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
        data_dir: Some(data),
        bin: Some(bin.to_path_buf()),
        _reaper: Some(Mutex::new(reaper)),
    })
}

/// A process that waits for this one to exit (its stdin, our pipe, reads
/// end-of-file), then stops the cluster at `data` and removes `dir`.
fn spawn_reaper(bin: &Path, dir: &Path, data: &Path) -> Result<ChildStdin, String> {
    let pg_ctl = bin.join("pg_ctl");
    let stop = if nix::unistd::geteuid().is_root() {
        "runuser -u postgres -- \"$1\" -D \"$2\" -m immediate stop"
    } else {
        "\"$1\" -D \"$2\" -m immediate stop"
    };
    let script = format!("cat >/dev/null; if [ -f \"$2/postmaster.pid\" ]; then {stop}; fi; rm -rf \"$3\"");
    let mut child = Command::new("sh")
        .args(["-c", &script, "cairn-pg-reaper"])
        .arg(&pg_ctl)
        .arg(data)
        .arg(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Its own process group: a Ctrl-C aimed at the tests leaves it to
        // clean up after them.
        .process_group(0)
        .spawn()
        .map_err(|e| format!("start the cluster's reaper: {e}"))?;
    child.stdin.take().ok_or_else(|| "the reaper has no stdin".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_urls_keep_everything_but_the_database() {
        assert_eq!(
            with_database("postgres://u:p@h:5/postgres?sslmode=disable", "x"),
            "postgres://u:p@h:5/x?sslmode=disable"
        );
        assert_eq!(with_database("postgresql://h", "x"), "postgresql://h/x");
    }
}

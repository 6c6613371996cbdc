//! The OCI bundle (`config.json`) runsc runs: cairn-init as the process, the
//! sandbox's overlay as the root, and two host directories bind-mounted in:
//! the one holding the init executable and the one where init creates its
//! socket for the host.

use std::path::Path;

use serde_json::{json, Value};

use super::GvisorError;
use crate::SandboxSpec;

/// Where the host's init directory appears inside the sandbox.
pub const INIT_DIR: &str = "/run/cairn-init";
/// Where the socket directory appears inside the sandbox.
pub const SOCKET_DIR: &str = "/run/cairn";
/// The socket init binds, inside the sandbox.
pub const SOCKET_PATH: &str = "/run/cairn/init.sock";

/// The capabilities of init: the usual container set, plus CAP_SYS_ADMIN so
/// init can remount `/proc` before a checkpoint (it drops it from the
/// bounding set of every command it runs). These are capabilities in
/// gVisor's kernel, never the host's.
const CAPABILITIES: [&str; 15] = [
    "CAP_SYS_ADMIN",
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

/// Builds `config.json` for `spec`, whose root is mounted at `rootfs` and
/// whose init socket directory on the host is `socket_dir`.
pub fn config(spec: &SandboxSpec, rootfs: &Path, socket_dir: &Path) -> Result<Value, GvisorError> {
    let init_dir = spec
        .init_binary
        .parent()
        .ok_or_else(|| GvisorError::Bundle(format!("{} has no parent directory", spec.init_binary.display())))?;
    let init_name = spec
        .init_binary
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| GvisorError::Bundle(format!("{} is not a UTF-8 file name", spec.init_binary.display())))?;
    let utf8 = |p: &Path| {
        p.to_str()
            .map(str::to_owned)
            .ok_or_else(|| GvisorError::Bundle(format!("{} is not UTF-8", p.display())))
    };
    let caps = CAPABILITIES.to_vec();
    Ok(json!({
        "ociVersion": "1.0.0",
        "process": {
            "terminal": false,
            "user": { "uid": 0, "gid": 0 },
            "args": [format!("{INIT_DIR}/{init_name}")],
            "env": [
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                format!("CAIRN_INIT_LISTEN_PATH={SOCKET_PATH}"),
            ],
            "cwd": "/",
            "capabilities": {
                "bounding": caps,
                "effective": caps,
                "permitted": caps,
            },
            "rlimits": [{ "type": "RLIMIT_NOFILE", "hard": 1_048_576, "soft": 1_048_576 }],
            "noNewPrivileges": true,
        },
        "root": { "path": utf8(rootfs)?, "readonly": false },
        "hostname": spec.hostname,
        "mounts": [
            { "destination": "/proc", "type": "proc", "source": "proc" },
            { "destination": "/dev", "type": "tmpfs", "source": "tmpfs",
              "options": ["nosuid", "strictatime", "mode=755", "size=65536k"] },
            { "destination": "/dev/pts", "type": "devpts", "source": "devpts",
              "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"] },
            { "destination": "/dev/shm", "type": "tmpfs", "source": "shm",
              "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"] },
            { "destination": "/sys", "type": "sysfs", "source": "sysfs",
              "options": ["nosuid", "noexec", "nodev", "ro"] },
            { "destination": INIT_DIR, "type": "bind", "source": utf8(init_dir)?,
              "options": ["rbind", "ro"] },
            { "destination": SOCKET_DIR, "type": "bind", "source": utf8(socket_dir)?,
              "options": ["rbind", "rw"] },
        ],
        "linux": {
            "namespaces": [
                { "type": "pid" }, { "type": "network" }, { "type": "ipc" },
                { "type": "uts" }, { "type": "mount" },
            ],
        },
    }))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    #[test]
    fn config_runs_init_from_its_mounted_directory_and_listens_in_the_socket_mount() {
        let spec = SandboxSpec {
            id: "s1".into(),
            hostname: "box".into(),
            dir: PathBuf::from("/var/cairn/s1"),
            layers: vec![PathBuf::from("/var/cairn/layers/a")],
            limits: crate::Limits::default(),
            init_binary: PathBuf::from("/var/cairn/bin/cairn-init-abc"),
            network: None,
        };
        let c = config(&spec, Path::new("/var/cairn/s1/rootfs"), Path::new("/var/cairn/s1/uds")).unwrap();
        assert_eq!(c["process"]["args"][0], "/run/cairn-init/cairn-init-abc");
        assert_eq!(c["root"]["path"], "/var/cairn/s1/rootfs");
        assert_eq!(c["hostname"], "box");
        let mounts = c["mounts"].as_array().unwrap();
        let init = mounts.iter().find(|m| m["destination"] == INIT_DIR).unwrap();
        assert_eq!(init["source"], "/var/cairn/bin");
        let sock = mounts.iter().find(|m| m["destination"] == SOCKET_DIR).unwrap();
        assert_eq!(sock["source"], "/var/cairn/s1/uds");
        let env = c["process"]["env"].as_array().unwrap();
        assert!(env.iter().any(|e| e == "CAIRN_INIT_LISTEN_PATH=/run/cairn/init.sock"));
    }
}

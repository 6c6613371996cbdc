//! Resource limits and their command-line syntax.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Limits applied to a sandbox's cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Memory in bytes (no swap on top).
    pub memory_bytes: u64,
    /// CPU bandwidth in thousandths of a CPU (1000 = one core).
    pub cpu_millis: u32,
    /// Maximum number of processes and threads.
    pub pids: u32,
    /// The size of the sandbox's disk, the file system its upper
    /// directory is on (`--disk`); `None`: the state directory's.
    #[serde(default)]
    pub disk_bytes: Option<u64>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory_bytes: 1 << 30,
            cpu_millis: host_cpu_millis(),
            pids: 1024,
            disk_bytes: None,
        }
    }
}

/// The CPUs this process may use, in thousandths: read once per process
/// (the standard library reads the cgroup's quota files every time).
fn host_cpu_millis() -> u32 {
    static MILLIS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *MILLIS.get_or_init(|| {
        std::thread::available_parallelism()
            .map(|n| n.get() as u32 * 1000)
            .unwrap_or(1000)
    })
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LimitsError {
    #[error("invalid memory size {0:?}: write a number with an optional unit K, M or G (e.g. 512M, 2G)")]
    Memory(String),
    #[error("memory limit {0} is below the 4M minimum a sandbox needs")]
    MemoryTooSmall(String),
    #[error("invalid disk size {0:?}: write a number with an optional unit M, G or T (e.g. 512M, 10G)")]
    Disk(String),
    #[error("disk size {0} is below the 16M minimum a sandbox's file system needs")]
    DiskTooSmall(String),
    #[error("invalid CPU count {0:?}: write a positive number of cores, fractions allowed (e.g. 1, 0.5, 2)")]
    Cpus(String),
    #[error("invalid process limit {0:?}: write a whole number from 8 to 4194304")]
    Pids(String),
}

/// A memory size such as `512M`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemorySize(pub u64);

impl FromStr for MemorySize {
    type Err = LimitsError;
    fn from_str(s: &str) -> Result<Self, LimitsError> {
        let bad = || LimitsError::Memory(s.to_string());
        let t = s.trim();
        let t = t.strip_suffix(['b', 'B']).unwrap_or(t);
        let t = t.strip_suffix(['i']).unwrap_or(t);
        let (num, mult) = match t.char_indices().last() {
            Some((i, c)) if c.is_ascii_alphabetic() => {
                let mult: u64 = match c.to_ascii_uppercase() {
                    'K' => 1 << 10,
                    'M' => 1 << 20,
                    'G' => 1 << 30,
                    'T' => 1 << 40,
                    _ => return Err(bad()),
                };
                (&t[..i], mult)
            }
            _ => (t, 1),
        };
        let value: f64 = num.parse().map_err(|_| bad())?;
        if !value.is_finite() || value <= 0.0 {
            return Err(bad());
        }
        let bytes = (value * mult as f64) as u64;
        if bytes < 4 << 20 {
            return Err(LimitsError::MemoryTooSmall(s.to_string()));
        }
        Ok(MemorySize(bytes))
    }
}

impl fmt::Display for MemorySize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        if b.is_multiple_of(1 << 30) {
            write!(f, "{}G", b >> 30)
        } else if b.is_multiple_of(1 << 20) {
            write!(f, "{}M", b >> 20)
        } else {
            write!(f, "{b}")
        }
    }
}

/// The smallest disk a sandbox may have: ext4's metadata and journal take
/// a few megabytes of it.
pub const DISK_MIN: u64 = 16 << 20;

/// A disk size such as `10G`: the same syntax as [`MemorySize`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskSize(pub u64);

impl FromStr for DiskSize {
    type Err = LimitsError;
    fn from_str(s: &str) -> Result<Self, LimitsError> {
        let bytes = match s.parse::<MemorySize>() {
            Ok(m) => m.0,
            Err(LimitsError::MemoryTooSmall(_)) => 0,
            Err(_) => return Err(LimitsError::Disk(s.to_string())),
        };
        if bytes < DISK_MIN {
            return Err(LimitsError::DiskTooSmall(s.to_string()));
        }
        // Whole blocks of 4 KiB: the image's size and the file system's.
        Ok(DiskSize(bytes & !4095))
    }
}

impl fmt::Display for DiskSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        MemorySize(self.0).fmt(f)
    }
}

/// A CPU count such as `1.5`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuCount(pub u32);

impl FromStr for CpuCount {
    type Err = LimitsError;
    fn from_str(s: &str) -> Result<Self, LimitsError> {
        let v: f64 = s.trim().parse().map_err(|_| LimitsError::Cpus(s.to_string()))?;
        if !v.is_finite() || !(0.01..=4096.0).contains(&v) {
            return Err(LimitsError::Cpus(s.to_string()));
        }
        Ok(CpuCount((v * 1000.0).round() as u32))
    }
}

/// The most processes a kernel allows at all (`PID_MAX_LIMIT` on 64-bit
/// Linux); a cgroup's `pids.max` refuses more.
pub const PIDS_MAX: u32 = 4 << 20;

/// A process limit such as `256`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PidCount(pub u32);

impl FromStr for PidCount {
    type Err = LimitsError;
    fn from_str(s: &str) -> Result<Self, LimitsError> {
        match s.trim().parse::<u32>() {
            Ok(n) if (8..=PIDS_MAX).contains(&n) => Ok(PidCount(n)),
            _ => Err(LimitsError::Pids(s.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pid_limits_stay_within_what_the_kernel_allows() {
        assert_eq!("8".parse::<PidCount>().unwrap().0, 8);
        assert_eq!("4194304".parse::<PidCount>().unwrap().0, PIDS_MAX);
        assert!("4194305".parse::<PidCount>().is_err());
        assert!("2147483648".parse::<PidCount>().is_err());
        assert!("7".parse::<PidCount>().is_err());
    }

    #[test]
    fn memory_sizes_parse_with_units() {
        assert_eq!("512M".parse::<MemorySize>().unwrap().0, 512 << 20);
        assert_eq!("2G".parse::<MemorySize>().unwrap().0, 2 << 30);
        assert_eq!("1.5g".parse::<MemorySize>().unwrap().0, 3 << 29);
        assert_eq!("64MiB".parse::<MemorySize>().unwrap().0, 64 << 20);
        assert_eq!("8388608".parse::<MemorySize>().unwrap().0, 8 << 20);
    }

    #[test]
    fn bad_limits_are_refused_with_a_hint() {
        for bad in ["", "lots", "-1M", "5X", "0", "nanG"] {
            let err = bad.parse::<MemorySize>().unwrap_err();
            assert!(
                err.to_string().contains("512M") || err.to_string().contains("minimum"),
                "{err}"
            );
        }
        assert!(matches!(
            "1K".parse::<MemorySize>(),
            Err(LimitsError::MemoryTooSmall(_))
        ));
        assert!("0".parse::<CpuCount>().is_err());
        assert!("two".parse::<CpuCount>().is_err());
        assert_eq!("0.5".parse::<CpuCount>().unwrap().0, 500);
        assert!("3".parse::<PidCount>().is_err());
        assert!("many".parse::<PidCount>().is_err());
    }

    #[test]
    fn disk_sizes_parse_like_memory_and_refuse_tiny_disks() {
        assert_eq!("64M".parse::<DiskSize>().unwrap().0, 64 << 20);
        assert_eq!("10G".parse::<DiskSize>().unwrap().0, 10 << 30);
        assert_eq!("1.5G".parse::<DiskSize>().unwrap().to_string(), "1536M");
        assert!(matches!("8M".parse::<DiskSize>(), Err(LimitsError::DiskTooSmall(_))));
        assert!(matches!("1K".parse::<DiskSize>(), Err(LimitsError::DiskTooSmall(_))));
        let err = "lots".parse::<DiskSize>().unwrap_err();
        assert!(err.to_string().contains("10G"), "{err}");
    }
}

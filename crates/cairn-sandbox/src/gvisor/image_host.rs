//! [`ImageHost`]: what a host must match to resume a gVisor memory image.
//!
//! A checkpoint holds the sentry's memory as runsc laid it out and the
//! CPU state of every task: another runsc release may not read it, another
//! platform runs tasks differently, and a program that chose its code path
//! by a CPU feature (AVX-512, say) crashes where that feature is missing.
//! So a memory snapshot records the host it was taken on, and a restore
//! compares that record with the host it runs on first, refusing (naming
//! each difference) before anything is started. The check is fail-closed:
//! a record that leaves a field empty is refused like one that differs.

use std::fs;

use serde::{Deserialize, Serialize};

use super::{GvisorError, Runsc};

/// The x86 CPU features (as `/proc/cpuinfo` names them) that gVisor
/// passes through to the sandbox and that programs pick code paths by;
/// a host restoring an image must have every one the taking host had.
pub const X86_FEATURES: &[&str] = &[
    "3dnowprefetch",
    "abm",
    "adx",
    "aes",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
    "avx",
    "avx2",
    "avx512_bf16",
    "avx512_bitalg",
    "avx512_fp16",
    "avx512_vbmi2",
    "avx512_vnni",
    "avx512_vpopcntdq",
    "avx512bw",
    "avx512cd",
    "avx512dq",
    "avx512f",
    "avx512ifma",
    "avx512vbmi",
    "avx512vl",
    "avx_vnni",
    "bmi1",
    "bmi2",
    "clflushopt",
    "clwb",
    "cx16",
    "erms",
    "f16c",
    "fma",
    "fma4",
    "fpu",
    "fsgsbase",
    "fsrm",
    "gfni",
    "lahf_lm",
    "movbe",
    "pclmulqdq",
    "pku",
    "pni",
    "popcnt",
    "rdpid",
    "rdrand",
    "rdseed",
    "rdtscp",
    "sha_ni",
    "sse",
    "sse2",
    "sse4_1",
    "sse4_2",
    "sse4a",
    "ssse3",
    "vaes",
    "vpclmulqdq",
    "xsave",
    "xsavec",
    "xsaveopt",
    "xsaves",
];

/// The host a memory image was taken on, as far as a restore depends on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageHost {
    /// The first line of `runsc --version`; must be equal.
    pub runsc_version: String,
    /// The runsc platform (`systrap`, `ptrace`); must be equal.
    pub platform: String,
    /// The machine architecture (`x86_64`, `aarch64`); must be equal.
    pub arch: String,
    /// `vendor_id` from /proc/cpuinfo (`GenuineIntel`, `AuthenticAMD`);
    /// must be equal.
    pub cpu_vendor: String,
    /// `cpu family`; must be equal.
    pub cpu_family: String,
    /// `model`; recorded, not compared (features decide).
    pub cpu_model: String,
    /// The features of [`X86_FEATURES`] the host had (on other
    /// architectures every listed feature), sorted; the restoring host
    /// must have all of them.
    pub cpu_features: Vec<String>,
    /// The kernel release; recorded, not compared (runsc hides the host
    /// kernel from the sandbox).
    pub kernel_release: String,
}

impl ImageHost {
    /// This host, with `runsc`.
    pub fn here(runsc: &Runsc) -> Result<ImageHost, GvisorError> {
        let out = std::process::Command::new(&runsc.binary)
            .arg("--version")
            .output()
            .map_err(|e| GvisorError::Exec(runsc.binary.clone(), e))?;
        let runsc_version = String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_string();
        if !out.status.success() || runsc_version.is_empty() {
            return Err(GvisorError::Runsc {
                what: "--version".into(),
                message: format!(
                    "it said nothing about its version ({}); check that {} is runsc",
                    out.status,
                    runsc.binary.display()
                ),
            });
        }
        let cpuinfo = fs::read_to_string("/proc/cpuinfo").map_err(|e| GvisorError::io("read /proc/cpuinfo", e))?;
        let kernel_release = fs::read_to_string("/proc/sys/kernel/osrelease")
            .map_err(|e| GvisorError::io("read /proc/sys/kernel/osrelease", e))?
            .trim()
            .to_string();
        Ok(Self::from_parts(
            runsc_version,
            runsc.platform,
            std::env::consts::ARCH,
            &cpuinfo,
            kernel_release,
        ))
    }

    fn from_parts(runsc_version: String, platform: &str, arch: &str, cpuinfo: &str, kernel_release: String) -> Self {
        // The first processor's block speaks for all (Linux shows the
        // features every CPU has on each).
        let block = cpuinfo.split("\n\n").next().unwrap_or_default();
        let field = |names: &[&str]| -> String {
            block
                .lines()
                .filter_map(|l| l.split_once(':'))
                .find(|(k, _)| names.contains(&k.trim()))
                .map(|(_, v)| v.trim().to_string())
                .unwrap_or_default()
        };
        let all = field(&["flags", "Features"]);
        let mut cpu_features: Vec<String> = all
            .split_whitespace()
            .filter(|f| arch != "x86_64" || X86_FEATURES.contains(f))
            .map(str::to_string)
            .collect();
        cpu_features.sort();
        cpu_features.dedup();
        ImageHost {
            runsc_version,
            platform: platform.to_string(),
            arch: arch.to_string(),
            cpu_vendor: field(&["vendor_id", "CPU implementer"]),
            cpu_family: field(&["cpu family", "CPU architecture"]),
            cpu_model: field(&["model", "CPU part"]),
            cpu_features,
            kernel_release,
        }
    }

    /// Why an image taken on `self` cannot be restored on `here`, one
    /// sentence each; empty when it can.
    pub fn differences(&self, here: &ImageHost) -> Vec<String> {
        let mut out = Vec::new();
        let mut compare = |what: &str, taken: &str, now: &str| {
            if taken.is_empty() {
                out.push(format!("the record does not say which {what} took the image"));
            } else if taken != now {
                out.push(format!("it was taken with {what} {taken:?}, this host has {now:?}"));
            }
        };
        compare("runsc version", &self.runsc_version, &here.runsc_version);
        compare("runsc platform", &self.platform, &here.platform);
        compare("architecture", &self.arch, &here.arch);
        compare("CPU vendor", &self.cpu_vendor, &here.cpu_vendor);
        compare("CPU family", &self.cpu_family, &here.cpu_family);
        if self.cpu_features.is_empty() {
            out.push("the record lists no CPU features".to_string());
        }
        let missing: Vec<&str> = self
            .cpu_features
            .iter()
            .filter(|f| !here.cpu_features.contains(f))
            .map(String::as_str)
            .collect();
        if !missing.is_empty() {
            out.push(format!(
                "this host's CPU lacks feature(s) the image's programs may use: {}",
                missing.join(", ")
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CPUINFO: &str = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 167\n\
        flags\t\t: fpu sse sse2 avx avx2 avx512f hypervisor\n\nprocessor\t: 1\nvendor_id\t: GenuineIntel\n";

    fn host() -> ImageHost {
        ImageHost::from_parts(
            "runsc version 0.0~20221219.0".into(),
            "ptrace",
            "x86_64",
            CPUINFO,
            "6.1.0".into(),
        )
    }

    #[test]
    fn the_record_keeps_the_cpu_features_gvisor_passes_through() {
        let h = host();
        assert_eq!(h.cpu_vendor, "GenuineIntel");
        assert_eq!(h.cpu_family, "6");
        assert_eq!(h.cpu_model, "167");
        // `hypervisor` says nothing a program picks a code path by.
        assert_eq!(h.cpu_features, ["avx", "avx2", "avx512f", "fpu", "sse", "sse2"]);
        assert!(h.differences(&host()).is_empty());
    }

    #[test]
    fn another_runsc_or_a_missing_feature_is_named() {
        let taken = host();
        let mut here = host();
        here.runsc_version = "runsc version 0.0~20250101.0".into();
        here.cpu_features.retain(|f| f != "avx512f");
        here.kernel_release = "6.12.0".into();
        here.cpu_model = "85".into();
        let why = taken.differences(&here);
        assert_eq!(why.len(), 2, "{why:?}");
        assert!(
            why[0].contains("runsc version") && why[0].contains("20221219"),
            "{why:?}"
        );
        assert!(why[1].ends_with("avx512f"), "{why:?}");
        // The other way round, more features are fine; the version is not.
        assert_eq!(here.differences(&taken).len(), 1);
    }

    #[test]
    fn a_record_with_an_empty_field_is_refused() {
        let mut taken = host();
        taken.platform.clear();
        taken.cpu_features.clear();
        let why = taken.differences(&host());
        assert!(why.iter().any(|w| w.contains("which runsc platform")), "{why:?}");
        assert!(why.iter().any(|w| w.contains("no CPU features")), "{why:?}");
    }
}

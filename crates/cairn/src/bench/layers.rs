//! `cairn bench layers`: how a native sandbox's layers reach overlayfs on
//! this kernel. Start to first output by each way the kernel's probe says
//! works (`CAIRN_LAYER_MOUNT`), beside bwrap in the same rounds; then a
//! shifted copy of a 1 GiB image: the first start (which makes the copy),
//! the disk the copy takes, and a later start of the same image (which
//! pays nothing for it).

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};
use cairn_engine::Home;
use cairn_sandbox::native::layers::{self, Mechanism};

use super::{interleaved, peer, repeat, summarize, Bench, Measurement};

/// Files of the large image, 1 MiB each.
const LARGE_FILES: usize = 1024;

impl Bench {
    pub(super) fn layers(&self, runs: usize) -> Result<Vec<Measurement>> {
        let init = cairn_sandbox::init_binary::install(&Home::at(self.home.path()).lib())?;
        let probe = layers::cached_probe(self.home.path(), &init).map_err(anyhow::Error::msg)?;
        let ways: Vec<Mechanism> = Mechanism::ALL.into_iter().filter(|w| probe.works(*w)).collect();
        if ways.is_empty() {
            bail!("no way of giving layers to overlayfs works on this kernel: run `cairn doctor`");
        }
        eprintln!(
            "cairn bench: Linux {}: layers by {}",
            probe.kernel,
            ways.iter().map(Mechanism::name).collect::<Vec<_>>().join(", ")
        );
        let run = |way: Mechanism, image: &str| {
            let mut cmd = Command::new(&self.exe);
            cmd.args(["run", "--image", image, "--", "echo", "hi"])
                .env("CAIRN_HOME", self.home.path())
                .env(layers::OVERRIDE_VAR, way.name());
            cmd
        };
        // A first start by each way outside the rounds: the shifted way's
        // copy of the busybox layer is made there.
        for way in &ways {
            Self::first_output(&mut run(*way, "busybox"))?;
        }
        let bwrap = peer("bwrap", "bubblewrap");
        let mut makes: Vec<Box<dyn Fn() -> Command + '_>> = Vec::new();
        for way in &ways {
            let way = *way;
            makes.push(Box::new(move || run(way, "busybox")));
        }
        if let Some(bwrap) = &bwrap {
            makes.push(Box::new(move || self.bwrap(bwrap, &["/bin/echo", "hi"])));
        }
        let mut timed = interleaved(runs, &makes)?.into_iter();
        let mut results = Vec::new();
        for way in &ways {
            let (firsts, _) = timed.next().context("no figures for a way")?;
            let name = format!("layers: start by {way} ({}; to first output)", way.describe());
            results.push(summarize(&name, "ms", firsts, None, true));
        }
        if bwrap.is_some() {
            let (firsts, _) = timed.next().context("no bwrap figures")?;
            let best = results[0].median;
            let peer = summarize("layers: bwrap echo (peer)", "ms", firsts, None, true);
            // DESIGN.md's target for a start: 1.5x bwrap in the same run.
            for r in &mut results {
                r.target = Some(1.5 * peer.median);
            }
            results.push(Measurement {
                cairn_ratio: Some(best / peer.median),
                ..peer
            });
        }
        if ways.contains(&Mechanism::Shifted) {
            results.extend(self.large_shifted_copy(runs.min(20), &run)?);
        }
        Ok(results)
    }

    /// The shifted copy of a 1 GiB image: first start, disk, later starts.
    fn large_shifted_copy(&self, runs: usize, run: &dyn Fn(Mechanism, &str) -> Command) -> Result<Vec<Measurement>> {
        let tree = self.home.path().join("tmp").join("bench-large-image");
        let _ = std::fs::remove_dir_all(&tree);
        // The busybox image, to run `echo`, with 1 GiB of data beside it.
        let copied = Command::new("cp").arg("-a").arg(&self.layer).arg(&tree).status()?;
        if !copied.success() {
            bail!("cannot copy the busybox layer into the large image");
        }
        make_large_tree(&tree.join("data"))?;
        eprintln!("cairn bench: importing a 1 GiB image");
        let imported = Command::new(&self.exe)
            .args(["image", "import"])
            .arg(&tree)
            .args(["--name", "large"])
            .env("CAIRN_HOME", self.home.path())
            .stdout(std::process::Stdio::null())
            .status()?;
        std::fs::remove_dir_all(&tree)?;
        if !imported.success() {
            bail!("cannot import the benchmark's 1 GiB image");
        }
        let engine = self.engine()?;
        let image = engine.image("large")?;
        let layer = engine.home().layers().join(&image.layers[0]);
        drop(engine);
        let (first, _) = Self::first_output(&mut run(Mechanism::Shifted, "large"))?;
        let copy = layers::shifted_path(self.home.path(), &layer).map_err(anyhow::Error::msg)?;
        let (bytes, apparent) = disk_usage(&copy)?;
        let (later, _) = repeat(runs, || run(Mechanism::Shifted, "large"))?;
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        Ok(vec![
            summarize(
                "layers: shifted copy of a 1 GiB image, first start (makes the copy)",
                "ms",
                vec![first],
                None,
                true,
            ),
            summarize(
                "layers: the copy's data (apparent size)",
                "MiB",
                vec![mib(apparent)],
                None,
                true,
            ),
            summarize(
                "layers: the copy's disk (blocks; less where reflinked)",
                "MiB",
                vec![mib(bytes)],
                None,
                true,
            ),
            summarize(
                "layers: a later start of the same image (no copy)",
                "ms",
                later,
                None,
                true,
            ),
        ])
    }
}

/// `LARGE_FILES` files of 1 MiB of bytes that neither compress nor repeat.
fn make_large_tree(dir: &Path) -> Result<()> {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut buf = vec![0u8; 1 << 20];
    for i in 0..LARGE_FILES {
        let sub = dir.join(format!("{:02}", i % 32));
        std::fs::create_dir_all(&sub)?;
        for chunk in buf.chunks_mut(8) {
            // xorshift64
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
        }
        std::fs::File::create(sub.join(format!("{i}.bin")))?.write_all(&buf)?;
    }
    Ok(())
}

/// Bytes of disk blocks and apparent bytes under `dir` (hard links once).
fn disk_usage(dir: &Path) -> Result<(u64, u64)> {
    let mut seen = std::collections::HashSet::new();
    let (mut blocks, mut apparent) = (0u64, 0u64);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d)? {
            let entry = entry?;
            let meta = entry.metadata()?;
            if !seen.insert((meta.dev(), meta.ino())) {
                continue;
            }
            blocks += meta.blocks() * 512;
            apparent += meta.len();
            if meta.is_dir() {
                stack.push(entry.path());
            }
        }
    }
    Ok((blocks, apparent))
}

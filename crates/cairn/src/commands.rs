//! What each command does, in terms of engine services.

use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use cairn_engine::tenants::Owned;
use cairn_engine::{CreateOptions, Engine, Home, SandboxRecord, SandboxState};
use cairn_pipeline::prelude::*;
use cairn_protocol::{FileKind, FileMeta};
use cairn_sandbox::client::InitClient;
use cairn_sandbox::limits::{DiskSize, MemorySize};
use cairn_sandbox::Limits;
use cairn_session::prelude::*;

use crate::cli::{Cli, Command, ImageCommand, ImageKind, LimitArgs, ProcessArgs, SandboxArgs, SnapshotCommand};
use crate::host_files::{print_log, temporary_beside};
use crate::process::{follow, request};
use crate::progress::Steps;

/// How long a command waits at its end for what it stored to be uploaded,
/// unless `CAIRN_UPLOAD_WAIT` (whole seconds) says otherwise.
const UPLOAD_WAIT: std::time::Duration = std::time::Duration::from_secs(600);

/// [`UPLOAD_WAIT`], or `CAIRN_UPLOAD_WAIT` seconds.
fn upload_wait() -> std::time::Duration {
    match std::env::var("CAIRN_UPLOAD_WAIT") {
        Err(_) => UPLOAD_WAIT,
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(secs) => std::time::Duration::from_secs(secs),
            Err(_) => {
                eprintln!(
                    "cairn: CAIRN_UPLOAD_WAIT takes whole seconds (e.g. 30), got {v:?}; waiting the default {} s",
                    UPLOAD_WAIT.as_secs()
                );
                UPLOAD_WAIT
            }
        },
    }
}

pub fn dispatch(cli: Cli) -> Result<i32> {
    let mut home = cli.home.map(Home::at).unwrap_or_else(Home::from_env);
    if let Some(url) = cli.state {
        home = home.with_state(url);
    }
    if let Some(url) = cli.store {
        home = home.with_store(url);
    }
    let Some(secret) = cli.token else {
        return command(home, cli.command, None);
    };
    let caller = crate::caller::Caller::check(&home, &secret, &cli.command)?;
    let out = command(home, cli.command, Some(&caller));
    caller.record(match &out {
        Ok(code) => *code,
        Err(_) => i32::from(crate::CAIRN_FAILED),
    });
    out
}

/// Runs `cmd` as `caller`, the holder of the token it was given (`None`:
/// the administrator); a tenant's command is one
/// [`crate::caller::Caller::check`] let it run.
fn command(home: Home, cmd: Command, caller: Option<&crate::caller::Caller>) -> Result<i32> {
    let acting_for = caller.and_then(crate::caller::Caller::tenant);
    if let Command::BenchFlood {
        to,
        connections,
        addresses,
    } = cmd
    {
        crate::bench::flood_attacker(to, connections, addresses)?;
        return Ok(0);
    }
    if let Command::Bench {
        which,
        runs,
        entries,
        size,
        memory,
        postgres,
        churn,
        against,
        json,
    } = cmd
    {
        let sessions = crate::bench::SessionsOptions { entries, size };
        let scale = crate::bench::ScaleOptions {
            postgres,
            store: home.store_url().map(str::to_string),
            size,
        };
        let sizes = crate::bench::Sizes {
            churn,
            gvisor_memory: memory,
            against,
        };
        return crate::bench::run(home, &which, runs, &sessions, &scale, &sizes, json);
    }
    if let Command::Serve {
        socket,
        listen,
        e2b,
        e2b_driver,
        e2b_base,
        e2b_network,
        e2b_domain,
        e2b_warm,
        session_warm,
        max_upload,
        init_threads,
        max_sandboxes,
        max_memory,
        max_cpus,
        token_max_sandboxes,
        header_timeout,
        idle_timeout,
        write_timeout,
        max_connections,
        max_connections_per_peer,
        fd_reserve,
        allowed_host,
        openapi,
    } = cmd
    {
        if openapi {
            print!("{}", cairn_api::openapi_json());
            return Ok(0);
        }
        let opts = cairn_api::ServeOptions {
            socket,
            listen,
            e2b,
            e2b_options: cairn_api::e2b::E2bOptions {
                drivers: cairn_api::e2b::Drivers::new(e2b_driver),
                egress: e2b_network == "egress",
                domain: e2b_domain,
                base: e2b_base.parse().map_err(anyhow::Error::msg)?,
                warm: usize::from(e2b_warm),
            },
            settings: cairn_api::Settings {
                max_upload,
                init_threads: init_threads.into(),
                capacity: {
                    let host = cairn_api::admission::Capacity::from_host();
                    cairn_api::admission::Capacity {
                        sandboxes: max_sandboxes,
                        memory_bytes: max_memory.or(host.memory_bytes),
                        cpu_millis: max_cpus.map(|c| u64::from(c) * 1000).or(host.cpu_millis),
                        per_token: token_max_sandboxes,
                    }
                },
                session_warm: usize::from(session_warm),
            },
            limits: cairn_api::Limits {
                header_timeout,
                idle_timeout,
                write_timeout,
                max_connections,
                max_per_peer: max_connections_per_peer,
                fd_reserve,
            },
            allowed_hosts: allowed_host,
        };
        // A streamed exec holds a blocking thread for as long as it runs.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .max_blocking_threads(4096)
            .enable_all()
            .build()
            .context("starting the server's runtime")?;
        let served = runtime.block_on(cairn_api::serve(home, opts));
        // Threads still relaying a process whose client left (the process
        // keeps running in its sandbox) are not waited for past this.
        runtime.shutdown_timeout(std::time::Duration::from_secs(5));
        served?;
        return Ok(0);
    }
    if let Command::Mcp { schema } = cmd {
        if schema {
            println!("{}", serde_json::to_string_pretty(&cairn_api::mcp::tool_document())?);
            return Ok(0);
        }
        // Opened once here so that a home that cannot be used fails at start,
        // not at the first tool call.
        drop(Engine::open(home.clone())?);
        let caller = match caller {
            Some(c) => Some(
                cairn_api::mcp::StdioCaller::new(home.clone(), c.token_id().to_string(), c.tenant())
                    .map_err(anyhow::Error::msg)?,
            ),
            None => None,
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("starting the MCP server's runtime")?;
        runtime
            .block_on(cairn_api::mcp::serve_stdio(home, caller))
            .map_err(anyhow::Error::msg)?;
        runtime.shutdown_timeout(std::time::Duration::from_secs(2));
        return Ok(0);
    }
    if let Command::Doctor { json } = cmd {
        return crate::doctor::doctor(&home, json);
    }
    if let Command::Agent(cmd) = cmd {
        return crate::agent::agent(&home, cmd);
    }
    if let Command::Worker { opts, list } = cmd {
        return crate::worker::worker(home, opts, list);
    }
    // A command about to start a native sandbox has its init start first,
    // so that init's own start overlaps with opening the state store.
    let starts_native = match &cmd {
        Command::Run {
            show: None, sandbox, ..
        } => sandbox.driver == "native",
        Command::Create { sandbox } => sandbox.driver == "native",
        _ => false,
    };
    let mut engine = match caller.and_then(crate::caller::Caller::take_engine) {
        Some(engine) => engine,
        None if starts_native => Engine::open_to_start(home)?,
        None => Engine::open(home)?,
    };
    // A tenant's command acts for it: lookups, names, limits and owners
    // follow the rules the API's do.
    engine.act_for(acting_for);
    let result = match cmd {
        Command::Run { show: Some(cmd), .. } => crate::pipelines::deprecated(&mut engine, cmd),
        Command::Run {
            sandbox,
            process,
            cmd,
            show: None,
        } => run(&mut engine, &sandbox, &process, cmd),
        Command::Pipeline(cmd) => crate::pipelines::pipeline(&mut engine, cmd),
        Command::Runs { json } => {
            crate::pipelines::note_deprecated("runs", "pipeline ls");
            crate::pipelines::runs(&engine, json).map(|()| 0)
        }
        Command::Audit {
            run,
            json,
            long_stage_secs,
            large_state,
        } => {
            if !(long_stage_secs.is_finite() && long_stage_secs > 0.0 && long_stage_secs < 1e9) {
                anyhow::bail!("--long-stage-secs must be a number of seconds above 0, e.g. 300");
            }
            let limits = cairn_pipeline::audit::AuditLimits {
                long: std::time::Duration::from_secs_f64(long_stage_secs),
                large_bytes: large_state,
            };
            crate::pipelines::audit(&engine, &run, json, &limits).map(|()| 0)
        }
        Command::Dlq(cmd) => crate::pipelines::dlq(&mut engine, cmd),
        Command::Session(cmd) => crate::sessions::session(&mut engine, cmd),
        Command::Artifact(cmd) => crate::pipelines::artifact(&engine, cmd).map(|()| 0),
        Command::Token(cmd) => token(&engine, cmd).map(|()| 0),
        Command::Tenant(cmd) => tenant(&mut engine, cmd).map(|()| 0),
        Command::Create { sandbox } => {
            let rec = engine.create_sandbox(&create_options(&sandbox, false)?, &Steps::new())?;
            println!("{}", rec.id);
            Ok(0)
        }
        Command::Exec {
            sandbox,
            detach,
            tty,
            process,
            cmd,
        } => {
            let rec = engine.sandbox(&sandbox)?;
            if tty {
                return crate::terminal::exec(&engine, &rec, &process, cmd);
            }
            exec(&engine, &rec, &process, cmd, detach)
        }
        Command::Cp { src, dst } => copy(&engine, &src, &dst).map(|()| 0),
        Command::Ps { quiet, json } => ps(&mut engine, quiet, json).map(|()| 0),
        Command::Logs {
            sandbox,
            stage: Some(stage),
            tail,
        } => crate::pipelines::stage_log(&engine, &sandbox, &stage, tail).map(|()| 0),
        Command::Logs {
            sandbox,
            stage: None,
            tail,
        } => logs(&engine, &sandbox, tail).map(|()| 0),
        Command::Rm { force, sandboxes } => remove(&mut engine, &sandboxes, force),
        Command::Gc { json } => {
            let report = engine.gc()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!(
                    "removed {} sandboxes, released {} stray cgroups and {} pooled ones, {} stray directories, {} unused layers, {} shifted layer copies",
                    report.engine.sandboxes_removed.len(),
                    report.engine.cgroups_released.len(),
                    report.engine.pooled_cgroups_removed,
                    report.engine.directories_removed.len(),
                    report.engine.layers_removed.len(),
                    report.engine.shifted_copies_removed
                );
                for o in &report.orphans_reaped {
                    eprintln!(
                        "cairn: removed sandbox {} of run {}, made under claim {} of job {}: {}",
                        o.sandbox_id, o.run_id, o.epoch, o.job, o.reason
                    );
                }
                for c in &report.losers_collected {
                    eprintln!(
                        "cairn: collected losing branch {}.{} of run {} under its retention: {} snapshot(s)",
                        c.stage,
                        c.branch,
                        c.run_id,
                        c.snapshots.len()
                    );
                }
                for changed in &report.engine.changed_copies_kept {
                    eprintln!(
                        "cairn: warning: {changed} changed on the host and was rebuilt from the store; \
                         it is kept for inspection until a day after it was set aside (or remove it once \
                         no sandbox started before the rebuild runs)"
                    );
                }
                for removed in &report.engine.changed_copies_removed {
                    eprintln!("cairn: removed {removed}, set aside more than a day ago because it changed on the host");
                }
            }
            Ok(0)
        }
        Command::Image(cmd) => image(&mut engine, cmd).map(|()| 0),
        Command::Snapshot {
            command: Some(SnapshotCommand::Flatten { snapshot }),
            ..
        } => {
            let snap = engine.snapshot_record(&snapshot)?;
            let flat = engine.flatten_snapshot(&snap)?;
            eprintln!(
                "cairn: {} layers of snapshot {} are one in snapshot {}",
                snap.layers.len(),
                &snap.id[..12],
                &flat.id[..12]
            );
            println!("{}", flat.id);
            Ok(0)
        }
        Command::Snapshot {
            command: Some(SnapshotCommand::Show { snapshot, json }),
            ..
        } => {
            let snap = engine.snapshot_record(&snapshot)?;
            crate::lineage::show(&snap, &engine.remote_durability()?, json).map(|()| 0)
        }
        Command::Snapshot {
            command: Some(SnapshotCommand::Rm { snapshots }),
            ..
        } => {
            for key in snapshots {
                let snap = engine.snapshot_record(&key)?;
                engine.remove_snapshot(&snap)?;
                println!("{}", snap.id);
            }
            Ok(0)
        }
        Command::Snapshot {
            sandbox,
            label,
            json,
            command: None,
        } => {
            let rec = engine.sandbox(sandbox.as_deref().unwrap_or_default())?;
            let snap = engine.snapshot(&rec, label.as_deref())?;
            if json {
                println!("{}", serde_json::to_string_pretty(&snap)?);
            } else {
                println!("{}", snap.id);
            }
            Ok(0)
        }
        Command::Diff {
            a,
            b,
            stat,
            text_max,
            max_changes,
            json,
        } => {
            let opts = cairn_engine::DiffOptions {
                text_max: if stat { 0 } else { text_max },
                max_changes,
                ..cairn_engine::DiffOptions::default()
            };
            let d = engine.diff(&a, &b, &opts)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&d)?);
            } else {
                print_diff(&d);
            }
            Ok(if d.added + d.removed + d.changed == 0 { 0 } else { 1 })
        }
        Command::Verify {
            snapshots,
            all: _,
            repair,
            json,
        } => {
            let quiet = json;
            let reports = engine.verify_snapshots(&snapshots, repair, &|i, n, v| {
                if !quiet {
                    eprintln!(
                        "cairn: verified {}/{n}: {} ({} objects, {:.1} MB read, {:.0} ms)",
                        i + 1,
                        &v.snapshot_id[..12],
                        v.objects,
                        v.bytes_read as f64 / 1e6,
                        v.took_ms
                    );
                }
            })?;
            let whole = reports.iter().all(|v| v.ok);
            if json {
                println!("{}", serde_json::to_string_pretty(&reports)?);
            } else {
                for v in &reports {
                    let state = if v.ok { "whole" } else { "DAMAGED" };
                    println!(
                        "{} {state}: {} objects, {} damaged",
                        v.snapshot_id,
                        v.objects,
                        v.damaged.len()
                    );
                    for d in &v.damaged {
                        let remote = d
                            .remote
                            .as_deref()
                            .map(|r| format!(", bucket: {r}"))
                            .unwrap_or_default();
                        let repair = d.repair.as_deref().map(|r| format!(" -> {r}")).unwrap_or_default();
                        println!("  {} {} (local: {}{remote}){repair}", &d.hash[..12], d.what, d.local);
                    }
                    for u in &v.unreadable {
                        println!("  unreadable: {u}");
                    }
                }
                if !whole && !repair {
                    println!("run `cairn verify --repair` to mend damaged copies from intact ones (a store in S3)");
                }
            }
            Ok(if whole { 0 } else { 1 })
        }
        Command::Snapshots { tree, json } => {
            let mut all = engine.snapshots()?;
            engine.keep_mine(Owned::Snapshot, &mut all, |s| &s.id)?;
            crate::lineage::print(&all, &engine.remote_durability()?, tree, json).map(|()| 0)
        }
        Command::Fork {
            source,
            count,
            limits,
            driver,
        } => {
            let (snap, forks) = engine.fork(&source, count, &limit_options(&limits, driver)?)?;
            eprintln!("cairn: forked {count} from snapshot {}", &snap.id[..12]);
            for f in forks {
                println!("{}", f.id);
            }
            Ok(0)
        }
        Command::Restore {
            snapshot,
            limits,
            driver,
        } => {
            let snap = engine.snapshot_record(&snapshot)?;
            let rec = engine.restore(&snap, &limit_options(&limits, driver)?)?;
            println!("{}", rec.id);
            Ok(0)
        }
        Command::Reset { sandbox, snapshot } => {
            let rec = engine.sandbox(&sandbox)?;
            let snap = engine.snapshot_record(&snapshot)?;
            let rec = engine.reset(&rec, &snap)?;
            println!("{}", rec.id);
            Ok(0)
        }
        Command::Bench { .. }
        | Command::BenchFlood { .. }
        | Command::Serve { .. }
        | Command::Mcp { .. }
        | Command::Agent(_)
        | Command::Doctor { .. }
        | Command::Worker { .. } => {
            unreachable!("handled above")
        }
    };
    finish_uploads(&engine);
    if let Some(c) = caller {
        c.give_back(engine);
    }
    result
}

fn limits(args: &LimitArgs) -> Limits {
    let LimitArgs {
        memory,
        cpus,
        pids,
        disk,
        ..
    } = *args;
    let mut limits = Limits {
        disk_bytes: disk.map(|d| d.0),
        ..Limits::default()
    };
    if let Some(m) = memory {
        limits.memory_bytes = m.0;
    }
    if let Some(c) = cpus {
        limits.cpu_millis = c.0;
    }
    if let Some(p) = pids {
        limits.pids = p.0;
    }
    limits
}

pub fn create_options(args: &SandboxArgs, auto_remove: bool) -> Result<CreateOptions> {
    Ok(CreateOptions {
        image: Some(args.image.clone()),
        auto_remove,
        services: args.services.clone(),
        ..limit_options(&args.limits, Some(args.driver.clone()))?
    })
}

/// With a remote store, a command ends once what it stored is uploaded and
/// the snapshots now complete there are marked durable; uploads still
/// pending after [`upload_wait`] stay queued for the next command.
fn finish_uploads(engine: &Engine) {
    if engine.home().store_url().is_some() {
        if let Err(e) = engine.mark_remote_durable(upload_wait()) {
            eprintln!("cairn: not everything this command stored is in the remote store yet: {e}");
        }
    }
}

fn limit_options(args: &LimitArgs, driver: Option<String>) -> Result<CreateOptions> {
    Ok(CreateOptions {
        name: args.name.clone(),
        limits: limits(args),
        driver,
        network: args.network.policy()?,
        ..CreateOptions::default()
    })
}

fn run(engine: &mut Engine, sandbox: &SandboxArgs, process: &ProcessArgs, cmd: Vec<String>) -> Result<i32> {
    let req = request(process, cmd, false)?;
    let (rec, start) = match &process.user {
        // The user is looked up in the sandbox once it exists.
        Some(user) => {
            let rec = engine.create_sandbox(&create_options(sandbox, true)?, &Steps::new())?;
            let start = engine
                .with_user(&rec, req, Some(user))
                .and_then(|req| engine.exec(&rec, req));
            match start {
                Ok(start) => (rec, start),
                Err(e) => {
                    let _ = engine.remove_sandbox(&rec, true);
                    return Err(e.into());
                }
            }
        }
        None => engine.create_and_exec(&create_options(sandbox, true)?, req, &Steps::new())?,
    };
    let result = follow(engine, &rec, process, start, false);
    // Removal happens whatever the command did; a removal failure is
    // reported, and `cairn gc` finishes it later.
    let rec = engine.sandbox(&rec.id)?;
    engine.remove_sandbox(&rec, true).context("removing the sandbox")?;
    result
}

/// Runs a process and returns the exit status to pass on.
fn exec(engine: &Engine, rec: &SandboxRecord, process: &ProcessArgs, argv: Vec<String>, detach: bool) -> Result<i32> {
    let req = engine.with_user(rec, request(process, argv, detach)?, process.user.as_deref())?;
    let start = engine.exec(rec, req)?;
    follow(engine, rec, process, start, detach)
}

/// `ID:/path` or a host path.
enum Location {
    Sandbox(String, String),
    Host(PathBuf),
}

fn location(spec: &str) -> Location {
    match spec.split_once(':') {
        Some((id, path)) if !id.is_empty() && !id.contains('/') && path.starts_with('/') => {
            Location::Sandbox(id.to_string(), path.to_string())
        }
        _ => Location::Host(PathBuf::from(spec)),
    }
}

fn copy(engine: &Engine, src: &str, dst: &str) -> Result<()> {
    match (location(src), location(dst)) {
        (Location::Host(from), Location::Sandbox(id, to)) => {
            let rec = engine.sandbox(&id)?;
            let client = engine.client(&rec)?;
            let md = fs::metadata(&from).with_context(|| format!("cannot read {}", from.display()))?;
            if !md.is_file() {
                bail!(
                    "{} is not a regular file; copy directories as a tarball (tar c DIR | cairn exec -i ID -- tar x)",
                    from.display()
                );
            }
            let mut to = to;
            if to.ends_with('/') || client.stat(&to)?.is_some_and(|m| m.kind == FileKind::Dir) {
                let name = from
                    .file_name()
                    .context("the source has no file name")?
                    .to_string_lossy();
                to = format!("{}/{name}", to.trim_end_matches('/'));
            }
            let meta = FileMeta {
                path: to,
                kind: FileKind::File,
                mode: md.permissions().mode() & 0o7777,
                uid: 0,
                gid: 0,
                size: md.len(),
                mtime_ns: md.mtime() as i128 * 1_000_000_000 + md.mtime_nsec() as i128,
            };
            let mut file = fs::File::open(&from)?;
            client.put_file(meta, &mut file)?;
            Ok(())
        }
        (Location::Sandbox(id, from), Location::Host(to)) => {
            let rec = engine.sandbox(&id)?;
            let client = engine.client(&rec)?;
            if to.as_os_str() == "-" {
                client.get_file(&from, &mut io::stdout().lock())?;
                return Ok(());
            }
            let to = if to.is_dir() {
                let name = Path::new(&from).file_name().context("the source has no file name")?;
                to.join(name)
            } else {
                to
            };
            copy_out(&client, &from, &to)
        }
        (Location::Sandbox(..), Location::Sandbox(..)) => {
            bail!("copy between two sandboxes through the host: cp ID1:/f ./f, then cp ./f ID2:/f")
        }
        (Location::Host(_), Location::Host(_)) => {
            bail!("one side of `cairn cp` must be a sandbox path, ID:/path")
        }
    }
}

/// Writes the sandbox's file `from` to `to` on the host: into a new
/// temporary beside `to` (created exclusively under a random name,
/// owner-only while written), renamed over `to` once complete, so a symlink
/// at `to` is replaced rather than written through. The sandbox chose the
/// mode: only its permission bits are kept, less the umask, so no copy is
/// ever setuid, setgid or sticky on the host.
fn copy_out(client: &InitClient, from: &str, to: &Path) -> Result<()> {
    let mut tmp = temporary_beside(to)?;
    let meta = client.get_file(from, tmp.as_file_mut())?;
    let file = tmp.as_file();
    file.sync_all()?;
    file.set_permissions(fs::Permissions::from_mode(meta.mode & 0o777 & !crate::user_umask()))?;
    let secs = meta.mtime_ns.div_euclid(1_000_000_000) as i64;
    let ts = nix::sys::time::TimeSpec::new(secs, meta.mtime_ns.rem_euclid(1_000_000_000) as i64);
    nix::sys::stat::futimens(file.as_raw_fd(), &ts, &ts)?;
    tmp.persist(to)
        .with_context(|| format!("cannot write {}", to.display()))?;
    Ok(())
}

fn ps(engine: &mut Engine, quiet: bool, json: bool) -> Result<()> {
    let mut rows = engine.list_sandboxes()?;
    engine.keep_mine(Owned::Sandbox, &mut rows, |r| &r.id)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else if quiet {
        for r in rows {
            println!("{}", r.id);
        }
    } else {
        println!(
            "{:<12}  {:<16}  {:<10}  {:<8}  {:>7}  {:>6}  {:>4}  {:>6}  {:<15}  CREATED",
            "ID", "NAME", "IMAGE", "STATE", "PID", "MEMORY", "OOM", "DISK", "NETWORK"
        );
        for r in rows {
            let age = (cairn_engine::now_ms() - r.created_at) / 1000;
            // The address while it runs; `egress` (or `allow-list`) when not.
            let network = match &r.network {
                None => "none".to_string(),
                Some(n) => match &n.held {
                    Some(h) => h.address.to_string(),
                    None if n.policy.restricted() => "allow-list".into(),
                    None => "egress".into(),
                },
            };
            println!(
                "{:<12}  {:<16}  {:<10}  {:<8}  {:>7}  {:>6}  {:>4}  {:>6}  {:<15}  {} ago",
                r.id,
                r.name,
                r.image,
                r.state,
                r.pid
                    .filter(|_| r.state == SandboxState::Running)
                    .map(|p| p.to_string())
                    .unwrap_or_else(|| "-".into()),
                MemorySize(r.memory_bytes).to_string(),
                r.oom_kills,
                r.disk_bytes
                    .map(|d| DiskSize(d).to_string())
                    .unwrap_or_else(|| "-".into()),
                network,
                human_age(age)
            );
        }
    }
    Ok(())
}

fn human_age(secs: i64) -> String {
    match secs {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m", s / 60),
        s if s < 86400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

fn logs(engine: &Engine, key: &str, tail: Option<usize>) -> Result<()> {
    let rec = engine.sandbox(key)?;
    match fs::File::open(engine.log_path(&rec)) {
        Ok(log) => print_log(log, tail),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e.into()),
    }
}

fn remove(engine: &mut Engine, keys: &[String], force: bool) -> Result<i32> {
    let mut failed = 0;
    for key in keys {
        match engine
            .sandbox(key)
            .and_then(|rec| engine.remove_sandbox(&rec, force).map(|()| rec.id))
        {
            Ok(id) => println!("{id}"),
            Err(e) => {
                eprintln!("cairn: error: {e}");
                failed += 1;
            }
        }
    }
    Ok(if failed > 0 { i32::from(crate::CAIRN_FAILED) } else { 0 })
}

fn image(engine: &mut Engine, cmd: ImageCommand) -> Result<()> {
    match cmd {
        ImageCommand::Build {
            kind,
            name,
            packages,
            suite,
            file,
            context,
            build_args,
            network,
        } => {
            let steps = Steps::new();
            let Some(kind) = kind else {
                let file = file.expect("clap requires a kind or --file");
                let Some(name) = name else {
                    bail!("--file needs --name: the name of the image it builds");
                };
                let name = engine.qualified(name);
                if !packages.is_empty() || suite.is_some() {
                    bail!("--packages and --suite apply to the Debian kinds; a Dockerfile says what it installs");
                }
                let context = match context {
                    Some(c) => c,
                    None => file
                        .parent()
                        .filter(|p| !p.as_os_str().is_empty())
                        .unwrap_or(Path::new("."))
                        .to_path_buf(),
                };
                let args = build_args
                    .iter()
                    .map(|kv| match kv.split_once('=') {
                        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
                        _ => bail!("--build-arg takes NAME=VALUE, got {kv:?}"),
                    })
                    .collect::<Result<std::collections::BTreeMap<_, _>>>()?;
                let network = match network.as_deref() {
                    Some("egress") => Some(cairn_sandbox::net::NetPolicy::parse(Some("egress"), &[], &[])?),
                    _ => None,
                };
                let rec = engine.build_dockerfile(&name, &file, &context, &args, network, &steps)?;
                drop(steps);
                println!("{}", rec.name);
                return Ok(());
            };
            // A tenant's image is named in its own namespace.
            let name = |default: &str| engine.qualified(name.clone().unwrap_or_else(|| default.to_string()));
            let rec = match kind {
                ImageKind::Busybox => {
                    if !packages.is_empty() || suite.is_some() {
                        bail!(
                            "--packages and --suite apply to Debian images (debian, code-interpreter, e2b-base) only"
                        );
                    }
                    engine.build_busybox(&name("busybox"), &steps)?
                }
                ImageKind::Debian => engine.build_debian(&name("debian"), suite.as_deref(), &packages, &steps)?,
                ImageKind::E2bBase => engine.build_e2b_base(
                    &name(cairn_engine::images::E2B_BASE),
                    suite.as_deref(),
                    &packages,
                    &steps,
                )?,
                ImageKind::CodeInterpreter => {
                    engine.build_code_interpreter(&name("code-interpreter"), suite.as_deref(), &packages, &steps)?
                }
            };
            drop(steps);
            println!("{}", rec.name);
        }
        ImageCommand::Import { path, name } => {
            let rec = engine.import_image(&path, &engine.qualified(name), &Steps::new())?;
            println!("{}", rec.name);
        }
        ImageCommand::Tag { image, name } => {
            let rec = engine.tag_image(&image, &engine.qualified(name))?;
            println!("{}", rec.name);
        }
        ImageCommand::Ls { json } => {
            let images = engine.images()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&images)?);
            } else {
                println!("{:<20}  {:>9}  {:>6}  SOURCE", "NAME", "SIZE", "LAYERS");
                for i in images {
                    println!(
                        "{:<20}  {:>8.1}M  {:>6}  {}",
                        i.name,
                        i.size_bytes as f64 / 1048576.0,
                        i.layers.len(),
                        i.source
                    );
                }
            }
        }
        ImageCommand::Rm { names } => {
            for n in names {
                engine.remove_image(&n)?;
                println!("{n}");
            }
        }
    }
    Ok(())
}

fn token(engine: &Engine, cmd: crate::cli::TokenCommand) -> Result<()> {
    use crate::cli::TokenCommand;
    match cmd {
        TokenCommand::Create { name, tenant, json } => {
            let t = engine.create_token(&name, tenant.as_deref())?;
            if json {
                println!("{}", serde_json::to_string_pretty(&t)?);
            } else {
                let of = match &t.record.tenant {
                    Some(tenant) => format!("of tenant {tenant}"),
                    None => "an administrator".to_string(),
                };
                eprintln!(
                    "cairn: token {} ({}, {of}) made; its secret follows and is not shown again",
                    t.record.name, t.record.id
                );
                println!("{}", t.secret);
            }
        }
        TokenCommand::Ls { json } => {
            let all = engine.tokens()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&all)?);
            } else {
                println!(
                    "{:<14} {:<24} {:<16} {:<12} LAST USED",
                    "ID", "NAME", "TENANT", "CREATED"
                );
                let now = cairn_engine::now_ms();
                for t in all {
                    let used = t
                        .last_used
                        .map(|u| format!("{} ago", human_age((now - u) / 1000)))
                        .unwrap_or_else(|| "never".into());
                    println!(
                        "{:<14} {:<24} {:<16} {:<12} {used}",
                        t.id,
                        t.name,
                        t.tenant.as_deref().unwrap_or("(admin)"),
                        format!("{} ago", human_age((now - t.created_at) / 1000))
                    );
                }
            }
        }
        TokenCommand::Log { tenant, limit, json } => request_log(engine, tenant.as_deref(), limit, json)?,
        TokenCommand::Rm { tokens } => each(tokens, |key| engine.remove_token(key))?,
    }
    Ok(())
}

/// Runs `remove` on every key, printing each one removed and saying why
/// of each refused; the last refusal is the command's error.
fn each(keys: Vec<String>, mut remove: impl FnMut(&str) -> Result<(), cairn_engine::EngineError>) -> Result<()> {
    let mut failed: Option<cairn_engine::EngineError> = None;
    for key in keys {
        match remove(&key) {
            Ok(()) => println!("{key}"),
            Err(e) => {
                // Each said once: the last is the command's own error.
                if let Some(earlier) = failed.replace(e) {
                    eprintln!("cairn: error: {earlier}");
                }
            }
        }
    }
    match failed {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

fn tenant(engine: &mut Engine, cmd: crate::cli::TenantCommand) -> Result<()> {
    use crate::cli::TenantCommand;
    let size = |b: Option<i64>| b.map_or_else(|| "-".to_string(), |b| crate::lineage::size(b.max(0) as u64));
    match cmd {
        TenantCommand::Create {
            name,
            max_sandboxes,
            max_memory,
            max_disk,
            json,
        } => {
            let t = engine.create_tenant(&name, max_sandboxes, max_memory, max_disk)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&t)?);
            } else {
                println!("{}", t.name);
                eprintln!(
                    "cairn: give it tokens with `cairn token create NAME --tenant {}`",
                    t.name
                );
            }
        }
        TenantCommand::Set {
            name,
            max_sandboxes,
            max_memory,
            max_disk,
            json,
        } => {
            if max_sandboxes.is_none() && max_memory.is_none() && max_disk.is_none() {
                bail!("give a limit to change: --max-sandboxes, --max-memory or --max-disk (a value, or `none`)");
            }
            let value = |l: Option<crate::cli::Limit>| l.map(|l| l.0);
            let t = engine.set_tenant_limits(&name, value(max_sandboxes), value(max_memory), value(max_disk))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&t)?);
            } else {
                println!("{}", t.name);
            }
        }
        TenantCommand::Ls { json } => {
            let all = engine.tenants()?;
            if json {
                let rows: Vec<_> = all
                    .iter()
                    .map(|(t, used)| serde_json::json!({"tenant": t, "holds": used}))
                    .collect();
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                println!("{:<24} {:>15} {:>21} {:>21}", "NAME", "SANDBOXES", "MEMORY", "DISK");
                for (t, used) in all {
                    let of = |used: String, max: String| format!("{used} / {max}");
                    println!(
                        "{:<24} {:>15} {:>21} {:>21}",
                        t.name,
                        of(
                            used.sandboxes.to_string(),
                            t.max_sandboxes.map_or_else(|| "-".into(), |m| m.to_string())
                        ),
                        of(size(Some(used.memory)), size(t.max_memory)),
                        of(size(Some(used.disk)), size(t.max_disk)),
                    );
                }
            }
        }
        TenantCommand::Rm { tenants, force } => each(tenants, |name| engine.remove_tenant(name, force))?,
    }
    Ok(())
}

fn request_log(engine: &Engine, tenant: Option<&str>, limit: u32, json: bool) -> Result<()> {
    if let Some(t) = tenant {
        // A removed tenant's rows stay: only refuse a name never seen.
        if engine.tenant(t).is_err() && engine.audit(Some(t), 1)?.is_empty() {
            engine.tenant(t)?;
        }
    }
    let rows = engine.audit(tenant, i64::from(limit.max(1)))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "{:<24} {:<14} {:<16} {:<5} {:<7} {:>6} PATH",
        "AT", "TOKEN", "TENANT", "VIA", "METHOD", "STATUS"
    );
    for r in rows {
        let at = humantime::format_rfc3339_millis(
            std::time::UNIX_EPOCH + std::time::Duration::from_millis(r.at.max(0) as u64),
        );
        println!(
            "{:<24} {:<14} {:<16} {:<5} {:<7} {:>6} {}",
            at.to_string(),
            r.token.as_deref().unwrap_or("(socket)"),
            r.tenant.as_deref().unwrap_or("(admin)"),
            r.surface,
            r.method,
            r.status,
            r.path
        );
    }
    Ok(())
}

/// `cairn diff` as text: one line per path (`A`dded, `D`eleted, `M`odified
/// with what changed), each text file's unified diff under it, then the
/// counts. Paths and contents come from sandboxes: control characters are
/// shown escaped.
fn print_diff(d: &cairn_engine::SnapshotDiff) {
    use std::io::Write;
    let clean = |s: &str| -> String {
        s.chars()
            .map(|c| match c {
                '\n' | '\t' => c.to_string(),
                c if c.is_control() => c.escape_default().to_string(),
                c => c.to_string(),
            })
            .collect()
    };
    let mut out = std::io::stdout().lock();
    for c in &d.changes {
        let (mark, side) = match c.change {
            "added" => ("A", c.after.as_ref()),
            "removed" => ("D", c.before.as_ref()),
            _ => ("M", c.after.as_ref()),
        };
        let mut line = format!("{mark} {}", clean(&c.path).replace('\n', "\\n"));
        if let Some(e) = side {
            line += &format!("  ({}", e.kind);
            if e.kind == "file" {
                line += &format!(", {} bytes", e.size);
            }
            line += ")";
        }
        if !c.what.is_empty() {
            line += &format!("  {}", c.what.join(", "));
            if let (Some(x), Some(y)) = (&c.before, &c.after) {
                if c.what.contains(&"mode") {
                    line += &format!(" {} -> {}", x.mode, y.mode);
                }
                if x.kind == "file" && y.kind == "file" && x.size != y.size {
                    line += &format!(" ({} -> {} bytes)", x.size, y.size);
                }
            }
        }
        if let Some(why) = &c.no_diff {
            line += &format!("  [no text diff: {why}]");
        }
        let _ = writeln!(out, "{line}");
        if let Some(text) = &c.diff {
            for l in text.lines() {
                let _ = writeln!(out, "    {}", clean(l));
            }
        }
    }
    let more = if d.truncated {
        " (list truncated: --max-changes)"
    } else {
        ""
    };
    let _ = writeln!(
        out,
        "{} added, {} removed, {} changed{more}; {} shared layers not compared; {:.1} ms",
        d.added, d.removed, d.changed, d.shared_layers, d.took_ms
    );
}

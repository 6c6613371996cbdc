//! `cairn-init`: PID 1 inside every Cairn sandbox, whatever the driver.
//!
//! With `--native-setup` it first builds a native sandbox around itself
//! (see [`native`]) and then serves on the socket the driver handed it.
//! With `--time-spawn N COMMAND...` it is not an init but a benchmark's
//! probe ([`spawn::time`]): `cairn bench exec` copies it into a sandbox to
//! time the command alone, started the way init starts every command.
//! With `--probe-layers DIR BASE:COUNT` it tells the host which way this
//! kernel takes a native sandbox's layers ([`probe`]).
//! Otherwise it receives a listening Unix socket on fd [`LISTEN_FD`] from
//! the driver (or binds one itself at `CAIRN_INIT_LISTEN_PATH`, under gVisor),
//! serves one operation per connection (exec, files, signals, ping), and
//! reaps every process of the sandbox, including orphans. One thread
//! accepts connections and serves every exec and ping ([`hub`]); the other
//! operations get a thread each; the reaper has its own.
//! It is linked statically so that it runs in any image, even one without a
//! libc.

mod conns;
mod creds;
mod exec;
mod files;
mod hold;
mod hub;
mod jobs;
mod listen;
mod mount_api;
mod native;
mod net;
mod ports;
mod probe;
mod reaper;
mod resolve;
mod spawn;
mod tree;
mod watch;

use std::io::{BufWriter, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;

use cairn_protocol::{write_frame, FromInit, ToInit, LISTEN_FD};

use crate::conns::Live;
use crate::hub::HostReader;
use crate::listen::{Server, Source};
use crate::reaper::Reaper;

fn main() {
    if std::env::args().nth(1).as_deref() == Some("--time-spawn") {
        let args: Vec<String> = std::env::args().skip(2).collect();
        std::process::exit(spawn::time(&args, &mut std::io::stdout().lock()));
    }
    if std::env::args().nth(1).as_deref() == Some("--hold") {
        let args: Vec<String> = std::env::args().skip(2).collect();
        std::process::exit(hold::run(&args));
    }
    if std::env::args().nth(1).as_deref() == Some("--probe-layers") {
        let args: Vec<String> = std::env::args().skip(2).collect();
        std::process::exit(probe::run(&args, &mut std::io::stdout().lock()));
    }
    let native = std::env::args().nth(1).as_deref() == Some("--native-setup");
    let source = if native {
        Source::Inherited(listener_on(native::build()))
    } else {
        match std::env::var_os("CAIRN_INIT_LISTEN_PATH") {
            Some(path) => {
                keep_sys_admin_from_children();
                Source::Path(path.into())
            }
            None => Source::Inherited(inherited_listener()),
        }
    };

    // SIGCHLD and SIGUSR2 must be blocked in every thread before any thread
    // starts, so that only the reaper's and the accept loop's sigwait see them.
    listen::block_relisten_signal();
    let (exits_rx, exits_tx) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)
        .unwrap_or_else(|e| {
            eprintln!("cairn-init: cannot create a pipe: {e}");
            std::process::exit(111);
        });
    let reaper = Arc::new(Reaper::start(exits_tx));
    ignore_terminal_signals();

    let server = Arc::new(Server::new(source));
    let (for_handoff, reaper_for_handoff) = (Arc::clone(&server), Arc::clone(&reaper));
    let handoff: hub::Handoff = Box::new(move |request, reader, stream, live| {
        let reaper = Arc::clone(&reaper_for_handoff);
        let server = Arc::clone(&for_handoff);
        spawn_or_run(move || serve(request, reader, stream, &reaper, &server, live));
    });
    let mut hub = hub::Hub::new(Arc::clone(&reaper), exits_rx, handoff);
    server.accept_loop(&mut hub);
}

/// Runs `job` on a new thread; when none can start (the sandbox is at its
/// process limit, which counts init's threads too), runs it on this one, so
/// the host is still answered.
fn spawn_or_run(job: impl FnOnce() + Send + 'static) {
    let slot = Arc::new(std::sync::Mutex::new(Some(job)));
    let theirs = Arc::clone(&slot);
    let started = std::thread::Builder::new().spawn(move || {
        let job = theirs.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(job) = job {
            job();
        }
    });
    if started.is_err() {
        let job = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(job) = job {
            job();
        }
    }
}

/// The listening socket the driver passed on fd [`LISTEN_FD`] (or
/// `CAIRN_INIT_LISTEN_FD`).
fn inherited_listener() -> UnixListener {
    let listen_fd: RawFd = std::env::var("CAIRN_INIT_LISTEN_FD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(LISTEN_FD);
    listener_on(listen_fd)
}

/// Under gVisor init keeps CAP_SYS_ADMIN to remount `/proc` when quiescing
/// (see `listen`); the commands it starts must not get it. Without it in the
/// bounding set, inheritable or ambient sets, no exec regains it, while init
/// keeps it in its own effective set.
fn keep_sys_admin_from_children() {
    /// `CAP_SYS_ADMIN` from `<linux/capability.h>`.
    const CAP_SYS_ADMIN: libc::c_ulong = 21;
    // SAFETY: prctl calls with integer arguments only.
    unsafe {
        libc::prctl(libc::PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0);
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        );
    }
}

fn listener_on(listen_fd: RawFd) -> UnixListener {
    // Children must not inherit the listening socket.
    if let Err(e) = nix::fcntl::fcntl(listen_fd, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC)) {
        eprintln!("cairn-init: no listening socket on fd {listen_fd}: {e}");
        std::process::exit(111);
    }
    // SAFETY: the driver hands us fd `listen_fd` as a bound, listening Unix
    // socket; nothing else in this process owns it.
    unsafe { UnixListener::from_raw_fd(listen_fd) }
}

/// PID 1 gets no default signal actions, but when run outside a pid
/// namespace (tests) we still do not want a stray SIGPIPE to end the server.
fn ignore_terminal_signals() {
    use nix::sys::signal::{signal, SigHandler, Signal};
    // SAFETY: setting SIG_IGN installs no handler code; it is always sound.
    unsafe {
        let _ = signal(Signal::SIGPIPE, SigHandler::SigIgn);
    }
}

/// Serves one request the serving loop handed over (see [`hub`]), the
/// welcome already sent.
fn serve(
    request: ToInit,
    mut reader: HostReader,
    stream: UnixStream,
    reaper: &Reaper,
    server: &Server,
    live: Arc<Live>,
) {
    let mut writer = BufWriter::new(stream);
    // File operations run with what the sandbox's root could do, not more.
    let _as_root = matches!(
        request,
        ToInit::Stat { .. }
            | ToInit::PutFile(_)
            | ToInit::GetFile { .. }
            | ToInit::ListDir { .. }
            | ToInit::MakeDir { .. }
            | ToInit::MakeDirAs { .. }
            | ToInit::SetXattrs { .. }
            | ToInit::GetXattrs { .. }
            | ToInit::Rename { .. }
            | ToInit::Remove { .. }
            | ToInit::Watch { .. }
    )
    .then(creds::AsSandboxRoot::enter);
    let result = (|| -> Result<(), cairn_protocol::FrameError> {
        match request {
            ToInit::Kill { pid, signal } => {
                let reply = match nix::sys::signal::Signal::try_from(signal) {
                    Ok(sig) => match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig) {
                        Ok(()) => FromInit::Done,
                        Err(e) => FromInit::Error(format!("cannot signal process {pid}: {e}")),
                    },
                    Err(_) => FromInit::Error(format!("{signal} is not a signal number")),
                };
                write_frame(&mut writer, &reply)?;
                writer.flush()?;
            }
            ToInit::Stat { path } => files::stat(&path, &mut writer)?,
            ToInit::PutFile(meta) => files::put(meta, &mut reader, &mut writer)?,
            ToInit::GetFile { path } => files::get(&path, &mut writer)?,
            ToInit::Quiesce => {
                let reply = if !server.can_quiesce() {
                    FromInit::Error(
                        "this init was handed its socket by the driver and cannot reopen it; \
                         only the gVisor driver quiesces"
                            .into(),
                    )
                } else {
                    match server.conns.quiesce(&live, writer.get_ref(), &server.wake_tx) {
                        Ok(()) => FromInit::Done,
                        Err(e) => FromInit::Error(e),
                    }
                };
                write_frame(&mut writer, &reply)?;
                writer.flush()?;
            }
            ToInit::StartJob { name, request } => {
                let mut stream = writer.into_inner().map_err(|e| e.into_error())?;
                jobs::JOBS.start(name, request, reaper, &mut stream)?;
            }
            ToInit::AttachJob {
                name,
                stdout_from,
                stderr_from,
            } => {
                // A quiesce shuts this connection down; the follower notices
                // within a tenth of a second and lets go of it.
                let mut stream = writer.into_inner().map_err(|e| e.into_error())?;
                jobs::JOBS.attach(&name, [stdout_from, stderr_from], &mut stream)?;
            }
            ToInit::ListDir {
                path,
                depth,
                max_entries,
            } => tree::list(&path, depth, max_entries, &mut writer)?,
            ToInit::MakeDir { path, parents } => resolve::answer(&mut writer, tree::make_dir(&path, parents, None))?,
            ToInit::SetXattrs { path, attrs } => files::set_xattrs(&path, &attrs, &mut writer)?,
            ToInit::GetXattrs { paths } => files::get_xattrs(&paths, &mut writer)?,
            ToInit::MakeDirAs { path, parents, owner } => {
                resolve::answer(&mut writer, tree::make_dir(&path, parents, Some(owner)))?
            }
            ToInit::Rename { from, to } => resolve::answer(&mut writer, tree::rename(&from, &to))?,
            ToInit::Remove { path, recursive } => resolve::answer(&mut writer, tree::remove(&path, recursive))?,
            ToInit::Watch { path, recursive } => {
                let stream = writer.into_inner().map_err(|e| e.into_error())?;
                watch::watch(&path, recursive, stream)?
            }
            ToInit::ConnectPort { port } => {
                let stream = writer.into_inner().map_err(|e| e.into_error())?;
                ports::connect(port, reader, stream)?
            }
            ToInit::Restored { unix_time_ns, entropy } => {
                let reply = match files::restored(unix_time_ns, &entropy) {
                    Ok(()) => FromInit::Done,
                    Err(e) => FromInit::Error(e),
                };
                write_frame(&mut writer, &reply)?;
                writer.flush()?;
            }
            other => {
                write_frame(
                    &mut writer,
                    &FromInit::Error(format!("{} is not a request", name(&other))),
                )?;
                writer.flush()?;
            }
        }
        Ok(())
    })();
    match result {
        Ok(()) | Err(cairn_protocol::FrameError::Closed) => {}
        Err(e) => eprintln!("cairn-init: connection ended: {e}"),
    }
}

pub(crate) fn name(msg: &ToInit) -> &'static str {
    match msg {
        ToInit::Hello { .. } => "Hello",
        ToInit::Ping => "Ping",
        ToInit::Exec(_) => "Exec",
        ToInit::AsUser { .. } => "AsUser",
        ToInit::MakeDirAs { .. } => "MakeDirAs",
        ToInit::SetXattrs { .. } => "SetXattrs",
        ToInit::GetXattrs { .. } => "GetXattrs",
        ToInit::Stdin(_) => "Stdin",
        ToInit::StdinEof => "StdinEof",
        ToInit::Signal(_) => "Signal",
        ToInit::Kill { .. } => "Kill",
        ToInit::Stat { .. } => "Stat",
        ToInit::PutFile(_) => "PutFile",
        ToInit::GetFile { .. } => "GetFile",
        ToInit::Data(_) => "Data",
        ToInit::End => "End",
        ToInit::Restored { .. } => "Restored",
        ToInit::Quiesce => "Quiesce",
        ToInit::StartJob { .. } => "StartJob",
        ToInit::AttachJob { .. } => "AttachJob",
        ToInit::ListDir { .. } => "ListDir",
        ToInit::MakeDir { .. } => "MakeDir",
        ToInit::Rename { .. } => "Rename",
        ToInit::Remove { .. } => "Remove",
        ToInit::Watch { .. } => "Watch",
        ToInit::ExecPty { .. } => "ExecPty",
        ToInit::Resize(_) => "Resize",
        ToInit::ConnectPort { .. } => "ConnectPort",
    }
}

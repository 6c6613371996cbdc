//! E2B commands on gVisor sandboxes run as init's named jobs, not attached
//! to the connection that started them: gVisor cannot take a memory
//! snapshot while a host connection to init is open, and a job runs on
//! without one. The gateway follows a job over an attachment that a
//! snapshot's quiesce ends, then attaches again from the byte offsets it
//! has relayed: to the same sandbox after a snapshot or a fork, to the
//! restored one after a resume. Before a snapshot the gateway lets go of
//! those attachments itself and keeps its followers off until the snapshot
//! is done (init ends them on quiesce only once the job writes). A pause
//! ends the streams of the job's
//! clients (the process goes on in the paused sandbox; after the resume
//! `commands.connect(pid)` follows it again). Commands started with stdin
//! stay attached, and a memory snapshot waits for them to end.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use cairn_engine::{Engine, OomProbe, SandboxRecord};
use cairn_protocol::{ExecRequest, ExitStatus, PtySize};
use cairn_sandbox::client::{ExecControl, ExecSession};
use tokio::sync::{broadcast, mpsc};

use super::rpc::{end_of_stream, ended, forget_proc, Out, RpcError};
use super::Gateway;
use crate::error::ApiError;

/// Between two tries to follow a job while its sandbox is busy with a
/// snapshot.
const RETRY: Duration = Duration::from_millis(50);
/// How long a job's sandbox may not answer before its followers give up
/// (a memory snapshot of a large sandbox takes seconds).
const PATIENCE: Duration = Duration::from_secs(120);

/// One of init's jobs started for an E2B command.
pub(crate) struct Job {
    name: String,
    /// Bytes of stdout and stderr relayed so far: where the next
    /// attachment starts.
    relayed: [AtomicU64; 2],
    /// Whether a thread follows it now.
    following: AtomicBool,
    /// The attachment following it, to let go of before a snapshot.
    attachment: Mutex<Option<ExecControl>>,
}

impl Job {
    /// Counts bytes relayed from stream 0 (stdout) or 1 (stderr).
    pub(super) fn relayed(&self, stream: usize, n: usize) {
        self.relayed[stream].fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Ends the attachment following it, if any: init takes anything the
    /// host sends on an attachment as its end.
    pub(super) fn let_go(&self) {
        let held = self.attachment.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(c) = held {
            let _ = c.close_stdin();
        }
    }

    /// Records `session` as the attachment following it, unless followers
    /// are `held` off (checked under the same lock as [`Self::let_go`]
    /// takes, so no attachment slips past a hold); else lets go of it.
    fn follow_by(&self, session: &ExecSession, held: impl Fn() -> bool) -> bool {
        let mut current = self.attachment.lock().unwrap_or_else(|e| e.into_inner());
        if held() {
            let _ = session.control().close_stdin();
            return false;
        }
        *current = Some(session.control());
        true
    }

    /// Takes over following it; false when a thread already does.
    pub(super) fn claim_following(&self) -> bool {
        self.following
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

/// A name no other job of the sandbox has, from this server or an
/// earlier one (jobs live as long as the sandbox's init).
fn job_name() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "e2b-{}-{nanos}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// A command started in a sandbox.
pub(super) enum Started {
    /// With what tells, when it ends, whether the OOM killer ended it.
    Attached(ExecSession, OomProbe),
    Job(Arc<Job>),
}

/// Starts an E2B command: as a job on gVisor unless it wants stdin (jobs
/// have none), else attached. The pid, or why it could not start.
pub(super) fn start(
    engine: &Engine,
    rec: &SandboxRecord,
    exec: ExecRequest,
    pty: Option<PtySize>,
) -> Result<Result<(i32, Started), String>, ApiError> {
    if rec.driver == "gvisor" && !exec.stdin && pty.is_none() {
        let name = job_name();
        let started = engine.client(rec)?.start_job(&name, exec)?;
        return Ok(started
            .map(|pid| {
                let job = Job {
                    name,
                    relayed: Default::default(),
                    following: AtomicBool::new(true),
                    attachment: Mutex::new(None),
                };
                (pid, Started::Job(Arc::new(job)))
            })
            .map_err(|f| f.message));
    }
    Ok(engine
        .exec_on(rec, exec, pty)?
        .map(|s| (s.session.pid, Started::Attached(s.session, s.probe)))
        .map_err(|f| f.message))
}

/// How following a job stopped.
enum Followed {
    /// The process ended.
    Ended(Option<ExitStatus>),
    /// The E2B sandbox paused: the process goes on when it resumes.
    Paused,
    /// The E2B sandbox was killed.
    Gone,
    /// Init has no such job: the sandbox under the E2B one is not the one
    /// the job ran in (or what it was restored from).
    Missing,
    /// The sandbox did not answer for [`PATIENCE`].
    Unreachable(String),
}

/// Follows a job while its E2B sandbox runs, through the quiesces of
/// memory snapshots.
fn follow(gw: &Gateway, id: &str, job: &Job, out: &mut Out, err: &mut Out) -> Followed {
    let mut answered = Instant::now();
    loop {
        let Some(entry) = gw.entry(id) else {
            return Followed::Gone;
        };
        let Some(sandbox) = entry.running() else {
            return Followed::Paused;
        };
        if gw.followers_held(id) {
            // A snapshot is being taken: it may take long, and is no
            // sign of a sandbox that does not answer.
            answered = Instant::now();
            std::thread::sleep(RETRY);
            continue;
        }
        let why = match attach(gw, sandbox, job) {
            Ok(Some(session)) if job.follow_by(&session, || gw.followers_held(id)) => {
                answered = Instant::now();
                let waited = session.wait(out, err);
                job.attachment.lock().unwrap_or_else(|e| e.into_inner()).take();
                match waited {
                    Ok(status) => return Followed::Ended(status),
                    // Let go of for a snapshot, ended by a quiesce, or the
                    // sandbox stopped: look again.
                    Err(e) => e.to_string(),
                }
            }
            Ok(Some(_)) => "a snapshot is being taken".into(),
            Ok(None) => return Followed::Missing,
            Err(e) => e.message,
        };
        if answered.elapsed() > PATIENCE {
            return Followed::Unreachable(why);
        }
        std::thread::sleep(RETRY);
    }
}

fn attach(gw: &Gateway, sandbox: &str, job: &Job) -> Result<Option<ExecSession>, ApiError> {
    let engine = gw.app.take_engine()?;
    let client = engine
        .sandbox(sandbox)
        .and_then(|rec| engine.client(&rec))
        .map_err(ApiError::from);
    gw.app.give_back(engine);
    let [out, err] = [0, 1].map(|i| job.relayed[i].load(Ordering::Relaxed));
    Ok(client?.attach_job(&job.name, out, err)?)
}

/// Relays a job's output to `out` and `err` until it ends, or until its
/// E2B sandbox pauses or goes; then tells the clients.
pub(super) fn relay(gw: &Arc<Gateway>, id: &str, pid: i32, job: &Arc<Job>, out: &mut Out, err: &mut Out) {
    loop {
        let unavailable = |m: String| end_of_stream(Some(&RpcError::new("unavailable", m)));
        match follow(gw, id, job, out, err) {
            Followed::Ended(status) => {
                forget_proc(gw, id, pid, Some(job));
                return ended(out, status, false);
            }
            Followed::Gone => {
                forget_proc(gw, id, pid, Some(job));
                return out.send(unavailable(format!("sandbox {id} was killed")));
            }
            Followed::Missing => {
                forget_proc(gw, id, pid, Some(job));
                return out.send(unavailable(format!("process {pid} is no longer in sandbox {id}")));
            }
            Followed::Paused => out.send(unavailable(format!(
                "sandbox {id} was paused while process {pid} ran; the process goes on when the \
                 sandbox resumes: connect to the sandbox, then commands.connect({pid})"
            ))),
            Followed::Unreachable(why) => out.send(unavailable(format!(
                "sandbox {id} did not answer for {} s ({why}); process {pid} may still run: \
                 commands.connect({pid}) follows it again",
                PATIENCE.as_secs()
            ))),
        }
        job.following.store(false, Ordering::Release);
        // A resume that came before the release found the job followed:
        // follow it on, with no client of its own.
        let resumed = gw.entry(id).is_some_and(|e| e.running().is_some());
        if !(resumed && job.claim_following()) {
            return;
        }
        let (tx, _) = mpsc::channel(1);
        let events = out.events();
        (*out, *err) = Out::pair(tx, events, Some(Arc::clone(job)));
    }
}

/// Follows a job no thread follows (after a resume), for its reattached
/// clients.
pub(super) fn follow_again(gw: Arc<Gateway>, id: String, pid: i32, job: Arc<Job>, events: broadcast::Sender<Bytes>) {
    let (tx, _) = mpsc::channel(1);
    let (mut out, mut err) = Out::pair(tx, events, Some(Arc::clone(&job)));
    relay(&gw, &id, pid, &job, &mut out, &mut err);
}

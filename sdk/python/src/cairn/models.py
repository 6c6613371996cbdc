"""Typed records of the API, parsed leniently: fields a newer server adds
are ignored, so an older SDK keeps working."""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Type, TypeVar

T = TypeVar("T", bound="Model")


class Model:
    """Base of every record: `from_dict` keeps the fields it knows."""

    # Nested records: field name -> (record class, is a list).
    _nested: Dict[str, tuple] = {}

    @classmethod
    def from_dict(cls: Type[T], data: Dict[str, Any], **extra: Any) -> T:
        kwargs = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if not f.init or f.name not in data:
                continue
            value = data[f.name]
            nested = cls._nested.get(f.name)
            if nested is not None and value is not None:
                sub, many = nested
                value = [sub.from_dict(v, **extra) for v in value] if many else sub.from_dict(value, **extra)
            kwargs[f.name] = value
        obj = cls(**kwargs)  # type: ignore[call-arg]
        for k, v in extra.items():
            if hasattr(obj, k):
                object.__setattr__(obj, k, v)
        return obj

    def to_dict(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}  # type: ignore[arg-type]


@dataclass
class Health(Model):
    status: str
    version: str


@dataclass
class ExecResult(Model):
    """How a command ended. `exit_code` follows the shell: 128 + signal,
    124 on timeout, 127 when the program does not exist."""

    pid: int
    exit_code: int
    timed_out: bool = False
    oom_killed: bool = False
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    signal: Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass
class Output(Model):
    """A piece of a streamed exec's output: `stream` is `stdout` or `stderr`."""

    stream: str
    data: bytes

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace")

    @classmethod
    def from_event(cls, stream: str, payload: Dict[str, Any]) -> "Output":
        return cls(stream=stream, data=base64.b64decode(payload.get("data") or ""))


@dataclass
class FileStat(Model):
    path: str
    kind: str
    mode: int
    uid: int = 0
    gid: int = 0
    size: int = 0
    mtime_ns: int = 0


@dataclass
class Snapshot(Model):
    id: str
    sandbox_id: str
    image: str
    driver: str
    created_at: int
    new_bytes: int = 0
    stored_bytes: int = 0
    label: Optional[str] = None
    parent_id: Optional[str] = None
    # When every object is in the remote chunk store (ms since the epoch);
    # None while uploads are pending, or on a server without one.
    remote_durable_at: Optional[int] = None


@dataclass
class SnapshotDetail(Snapshot):
    lineage: List[Snapshot] = field(default_factory=list)
    children: List[str] = field(default_factory=list)

    _nested = {"lineage": (Snapshot, True)}


@dataclass
class DiffSide(Model):
    key: str
    kind: str
    snapshot_id: Optional[str] = None
    sandbox_id: Optional[str] = None


@dataclass
class DiffEntry(Model):
    kind: str
    size: int = 0
    mode: str = ""
    uid: int = 0
    gid: int = 0
    target: Optional[str] = None


@dataclass
class FileChange(Model):
    """One path that differs: `change` is added, removed or changed; `what`
    says what changed (type, content, mode, owner); `diff` is a unified
    diff of a text file."""

    path: str
    change: str
    what: List[str] = field(default_factory=list)
    before: Optional[DiffEntry] = None
    after: Optional[DiffEntry] = None
    diff: Optional[str] = None
    no_diff: Optional[str] = None

    _nested = {"before": (DiffEntry, False), "after": (DiffEntry, False)}


@dataclass
class SnapshotDiff(Model):
    """How side `b` differs from side `a` (`cairn diff`)."""

    a: DiffSide
    b: DiffSide
    added: int = 0
    removed: int = 0
    changed: int = 0
    shared_layers: int = 0
    changes: List[FileChange] = field(default_factory=list)
    truncated: bool = False
    took_ms: float = 0.0

    _nested = {"a": (DiffSide, False), "b": (DiffSide, False), "changes": (FileChange, True)}


@dataclass
class Sandbox(Model):
    """A sandbox's record, and a handle to work in it (when it came from a
    client): `exec`, files, snapshots, forks. `with` removes it on exit."""

    id: str
    name: str
    image: str
    driver: str
    state: str
    memory_bytes: int = 0
    cpu_millis: int = 0
    pids_max: int = 0
    created_at: int = 0
    services: List[str] = field(default_factory=list)
    pid: Optional[int] = None
    ended_reason: Optional[str] = None
    last_snapshot: Optional[str] = None
    _ops: Any = field(default=None, init=False, repr=False, compare=False)

    def _api(self) -> Any:
        if self._ops is None:
            raise RuntimeError("this Sandbox record is not bound to a client; use client.sandboxes.get(id)")
        return self._ops

    def exec(self, argv: Any, *, env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
             timeout: Optional[float] = None, stdin: Optional[str] = None) -> ExecResult:
        """Runs a command (a list, or a string run by `sh -c`) to its end."""
        return self._api().exec(self.id, argv, env=env, cwd=cwd, timeout=timeout, stdin=stdin)

    def exec_stream(self, argv: Any, *, env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
                    timeout: Optional[float] = None, stdin: Optional[str] = None) -> Any:
        """Runs a command, yielding `Output` pieces as they happen; the
        stream's `.result` is the ExecResult once iteration ends."""
        return self._api().exec_stream(self.id, argv, env=env, cwd=cwd, timeout=timeout, stdin=stdin)

    def write_file(self, path: str, data: Any, mode: int = 0o644) -> FileStat:
        """Uploads `data` (bytes, str, or a binary file object, streamed) to `path`."""
        return self._api().write_file(self.id, path, data, mode=mode)

    def read_file(self, path: str) -> bytes:
        return self._api().read_file(self.id, path)

    def download(self, path: str, dest: Any) -> int:
        """Streams the file at `path` into `dest` (a local path or a binary
        file object); a local file gets the sandbox file's mode. Answers the size."""
        return self._api().download(self.id, path, dest)

    def stat(self, path: str) -> FileStat:
        return self._api().stat(self.id, path)

    def snapshot(self, label: Optional[str] = None) -> Snapshot:
        return self._api().snapshot(self.id, label)

    def fork(self, count: int = 1, *, idempotency_key: Optional[str] = None) -> "ForkResult":
        return self._api().fork(self.id, count, idempotency_key=idempotency_key)

    def reset(self, snapshot: Any) -> "Sandbox":
        """Rewinds the sandbox to `snapshot` (an id or a Snapshot)."""
        return self._api().reset(self.id, snapshot)

    def signal(self, pid: int, sig: Any) -> None:
        """Sends a signal (a number, or a name like `TERM`) to a process."""
        return self._api().signal(self.id, pid, sig)

    def write_stdin(self, pid: int, data: Any, close: bool = False) -> None:
        return self._api().write_stdin(self.id, pid, data, close=close)

    def refresh(self) -> "Sandbox":
        return self._api().get(self.id)

    def remove(self, force: bool = True) -> None:
        return self._api().remove(self.id, force=force)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        from .errors import NotFound

        try:
            self.remove(force=True)
        except NotFound:
            pass


@dataclass
class ForkResult(Model):
    snapshot: Snapshot
    sandboxes: List[Sandbox] = field(default_factory=list)

    _nested = {"snapshot": (Snapshot, False), "sandboxes": (Sandbox, True)}


@dataclass
class Image(Model):
    name: str
    source: str = ""
    size_bytes: int = 0
    created_at: int = 0


@dataclass
class Run(Model):
    id: str
    pipeline: str
    status: str
    file: str = ""
    params: Dict[str, str] = field(default_factory=dict)
    created_at: int = 0
    orchestrated: bool = False
    ended_at: Optional[int] = None
    error: Optional[str] = None
    # Stage rows by status (in listings and a run's detail).
    stage_counts: Dict[str, int] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.status != "running"


@dataclass
class Stage(Model):
    stage: str
    branch: str
    stage_key: str
    status: str
    attempts: int = 0
    started_at: Optional[int] = None
    ended_at: Optional[int] = None
    error: Optional[str] = None
    input_snapshot: Optional[str] = None
    output_snapshot: Optional[str] = None
    sandbox_id: Optional[str] = None
    metric: Optional[float] = None


@dataclass
class RunEvent(Model):
    seq: int
    kind: str
    detail: str
    created_at: int = 0
    stage: Optional[str] = None
    branch: Optional[str] = None
    snapshot_id: Optional[str] = None
    # The event's typed fields, {"type": ..., ...} (docs/formats.md "Run events").
    data: Optional[Dict[str, Any]] = None


@dataclass
class Artifact(Model):
    id: str
    run_id: str
    stage: str
    branch: str
    path: str
    size_bytes: int = 0
    content_hash: str = ""
    snapshot_id: str = ""


@dataclass
class StageEdges(Model):
    """A stage of a run's pipeline and the stages whose output it forks
    (one at most today; none when it starts from the pipeline's snapshot
    or image)."""

    stage: str
    after: List[str] = field(default_factory=list)


@dataclass
class RunDetail(Model):
    run: Run
    stages: List[Stage] = field(default_factory=list)
    events: List[RunEvent] = field(default_factory=list)
    artifacts: List[Artifact] = field(default_factory=list)
    # Every stage of the pipeline with what it comes after, parents first;
    # None when the file the run stored no longer parses.
    graph: Optional[List[StageEdges]] = None

    _nested = {"run": (Run, False), "stages": (Stage, True), "events": (RunEvent, True),
               "artifacts": (Artifact, True), "graph": (StageEdges, True)}


@dataclass
class StageAudit(Model):
    """One stage's costs (one branch's, in a group): milliseconds summed
    over its attempts, None where its events do not say."""

    stage: str
    branch: str
    status: str
    attempts: int = 0
    # Its output came from a completed stage key.
    reused: bool = False
    wall_ms: Optional[int] = None
    # Making sandboxes and writing edits.
    setup_ms: Optional[int] = None
    # The stage's commands.
    compute_ms: Optional[int] = None
    restore_ms: Optional[int] = None
    snapshot_ms: Optional[int] = None
    checkpoints: int = 0
    checkpoint_ms: int = 0
    # Bytes the output snapshot stored anew.
    state_bytes: Optional[int] = None
    checkpoint_bytes: int = 0
    artifact_bytes: int = 0
    retries: int = 0
    # Work failed attempts did that no checkpoint kept.
    lost_ms: Optional[int] = None
    # Work retries did not redo because they restored a checkpoint.
    saved_ms: int = 0


@dataclass
class Recommendation(Model):
    """Advice about one stage; `kind` is `checkpoint`, `snapshot-state` or `share-prefix`."""

    stage: str
    kind: str
    advice: str


@dataclass
class RunAudit(Model):
    """Where a run's time and bytes went, stage by stage, and the advice
    that applies (`cairn audit --json`)."""

    run: str
    pipeline: str
    status: str
    stages: List[StageAudit] = field(default_factory=list)
    recommendations: List[Recommendation] = field(default_factory=list)
    # What the audit could not read.
    notes: List[str] = field(default_factory=list)

    _nested = {"stages": (StageAudit, True), "recommendations": (Recommendation, True)}


@dataclass
class DeadLetter(Model):
    id: str
    run_id: str
    stage: str
    branch: str
    error: str
    created_at: int = 0
    input_snapshot: Optional[str] = None
    failure_snapshot: Optional[str] = None
    retried_at: Optional[int] = None


@dataclass
class Event(Model):
    """Something that happened (`GET /v1/events`); `kind` is e.g.
    `sandbox.created`, `run.ended`, or `lagged` when events were missed."""

    kind: str
    id: str = ""
    detail: str = ""
    at: int = 0


@dataclass
class Session(Model):
    """An agent session: a sandbox whose machine state lives in snapshots,
    beside an append-only, hash-chained context log. `state` is `active`,
    `suspending`, `suspended`, `resuming`, `failed` or `closed`."""

    id: str
    name: str
    state: str
    image: str = ""
    driver: str = ""
    head_seq: int = 0
    head_hash: str = ""
    rewinds: int = 0
    created_at: int = 0
    updated_at: int = 0
    sandbox_id: Optional[str] = None
    snapshot_id: Optional[str] = None
    snapshot_seq: Optional[int] = None
    idle_timeout_ms: Optional[int] = None
    parent_id: Optional[str] = None
    fork_seq: Optional[int] = None
    fork_reason: Optional[str] = None
    error: Optional[str] = None


@dataclass
class LogEntry(Model):
    """One entry of a session's log. `kind` is `system`, `user`,
    `assistant`, `tool_call`, `tool_result`, `note` or `recovered`;
    `arguments` is the decoded JSON of a tool call."""

    seq: int
    kind: str
    hash: str = ""
    version: int = 1
    created_at: int = 0
    role: Optional[str] = None
    content: Optional[str] = None
    tool: Optional[str] = None
    arguments: Any = None
    result: Optional[str] = None
    exit_status: Optional[int] = None
    tokens_in: Optional[int] = None
    tokens_out: Optional[int] = None
    snapshot_id: Optional[str] = None


@dataclass
class SessionExecResult(Model):
    """How a command run in a session ended, and the `tool_call` and
    `tool_result` entries recording it. `error` says why it did not run
    or was cut short; `recovered` is the entry written when the session's
    dead sandbox was restored first."""

    exit_code: int
    call_seq: int
    result_seq: int
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    error: Optional[str] = None
    recovered: Optional[LogEntry] = None

    _nested = {"recovered": (LogEntry, False)}

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass
class ReplayedCall(Model):
    """One exec call run again by a replay: the original entry, the status
    the log recorded (None if it never finished), the status now, and the
    replay's own call entry."""

    call: int
    status: int
    call_seq: int
    expected: Optional[int] = None


@dataclass
class RecoverResult(Model):
    """What a recovery did: the `recovered` entry when the sandbox had died,
    the calls replayed, why a replay stopped early, and their output."""

    recovered: Optional[LogEntry] = None
    replayed: List[ReplayedCall] = field(default_factory=list)
    stopped: Optional[str] = None
    stdout: str = ""
    stderr: str = ""

    _nested = {"recovered": (LogEntry, False), "replayed": (ReplayedCall, True)}


@dataclass
class Rewind(Model):
    """Entries `to_seq + 1 ..= head_seq` left the live log."""

    to_seq: int
    head_seq: int
    n: int = 0
    created_at: int = 0


@dataclass
class BadEntry(Model):
    seq: int
    reason: str


@dataclass
class Verification(Model):
    """The outcome of walking a session's hash chain."""

    ok: bool
    entries: int
    head_hash: str = ""
    first_bad: Optional[BadEntry] = None

    _nested = {"first_bad": (BadEntry, False)}

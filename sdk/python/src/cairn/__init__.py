"""Cairn's Python SDK: durable, forkable sandboxes for AI agents.

    import cairn
    with cairn.Client() as client, client.sandboxes.create() as sb:
        print(sb.exec("echo hello").stdout)
"""

from .aio import AsyncClient, AsyncExecStream, AsyncSandbox, AsyncSessionExecStream
from .client import Client, ExecStream, SessionExecStream
from .errors import (BadRequest, CairnError, Conflict, ConnectError, NoCapacity, NotFound, TooLarge, Unauthorized,
                     Unavailable)
from .models import (Artifact, BadEntry, DeadLetter, Event, ExecResult, FileStat, ForkResult, Health, Image,
                     LogEntry, Output, Recommendation, RecoverResult, ReplayedCall, Rewind, Run, RunAudit, RunDetail,
                     RunEvent, Sandbox, Session, SessionExecResult, Snapshot, SnapshotDetail, Stage, StageAudit,
                     StageEdges, Verification, SnapshotDiff, FileChange, DiffSide, DiffEntry)

__version__ = "0.1.0"

__all__ = [
    "Client", "AsyncClient", "ExecStream", "AsyncExecStream", "SessionExecStream", "AsyncSessionExecStream",
    "Sandbox", "AsyncSandbox",
    "CairnError", "BadRequest", "Unauthorized", "NotFound", "Conflict", "TooLarge", "NoCapacity", "Unavailable",
    "ConnectError",
    "Artifact", "DeadLetter", "Event", "ExecResult", "FileStat", "ForkResult", "Health", "Image", "Output", "Run",
    "RunDetail", "RunEvent", "Snapshot", "SnapshotDetail", "Stage", "StageEdges", "RunAudit", "StageAudit",
    "Recommendation",
    "Session", "LogEntry", "SessionExecResult", "Rewind", "Verification", "BadEntry", "RecoverResult",
    "ReplayedCall", "SnapshotDiff", "FileChange", "DiffSide", "DiffEntry",
]

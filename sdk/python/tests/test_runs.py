import pytest
import uuid

import cairn
from cairn import CairnError

PIPELINE = """
[pipeline]
name = "sdk-test"
image = "busybox"

[params]
word = "hello"

[[stage]]
name = "make"
key = "make-{params.word}-%s"
run = ["mkdir -p /work", "echo {params.word} > /work/out.txt", "echo made it"]
artifacts = ["/work/out.txt"]

[[stage]]
name = "check"
after = "make"
key = "check-{params.word}-%s"
run = ["grep -q {params.word} /work/out.txt"]
"""


def test_pipeline_run_completes_and_its_artifact_downloads(client):
    salt = uuid.uuid4().hex[:8]
    text = PIPELINE % (salt, salt)
    run = client.runs.start(text, params={"word": "cairn"}, idempotency_key=f"run-{salt}")
    again = client.runs.start(text, params={"word": "cairn"}, idempotency_key=f"run-{salt}")
    assert again.id == run.id
    detail = client.runs.wait(run.id, timeout=60, poll=0.2)
    assert detail.run.status == "completed", detail.run.error
    assert {s.stage: s.status for s in detail.stages} == {"make": "completed", "check": "completed"}
    [artifact] = detail.artifacts
    assert artifact.path == "/work/out.txt" and artifact.stage == "make"
    assert client.artifacts.download(artifact.id) == b"cairn\n"
    assert "made it" in client.runs.log(run.id, "make")
    assert client.runs.log(run.id, "make", tail_bytes=1 << 20) == client.runs.log(run.id, "make")
    assert run.id in [r.id for r in client.runs.list()]
    # Events carry typed fields; the audit reads them back per stage.
    done = [e.data for e in detail.events if e.data and e.data["type"] == "stage-completed"]
    assert len(done) == 2 and all(d["compute_ms"] >= 0 for d in done)
    audit = client.runs.audit(run.id)
    assert isinstance(audit, cairn.RunAudit)
    assert (audit.run, audit.pipeline, audit.status) == (run.id, "sdk-test", "completed")
    assert all(isinstance(s, cairn.StageAudit) for s in audit.stages)
    by_stage = {s.stage: s for s in audit.stages}
    assert set(by_stage) == {"make", "check"}
    assert by_stage["make"].artifact_bytes == len("cairn\n") and by_stage["check"].artifact_bytes == 0
    assert by_stage["make"].attempts == 1 and by_stage["make"].compute_ms is not None
    assert all(isinstance(r, cairn.Recommendation) for r in audit.recommendations)
    # The run's stages as a graph: check comes after make.
    assert [(e.stage, e.after) for e in detail.graph] == [("make", []), ("check", ["make"])]


GATED = """
[pipeline]
name = "sdk-gated"
image = "busybox"

[[stage]]
name = "build"
key = "build-%s"
run = ["echo built > /out"]

[[stage]]
name = "ship"
after = "build"
key = "ship-%s"
approve = true
run = ["cat /out"]
"""


def test_a_stage_waiting_for_approval_is_approved_through_the_sdk(client):
    salt = uuid.uuid4().hex[:8]
    run = client.runs.start(GATED % (salt, salt))
    detail = client.runs.wait(run.id, timeout=60, poll=0.2)
    assert detail.run.status == "awaiting_approval", detail.run.error
    with pytest.raises(CairnError) as refused:
        client.runs.reject(run.id, "build", reason="wrong stage")
    assert refused.value.status == 409
    client.runs.approve(run.id, "ship", reason="looks right", by="sdk-test")
    detail = client.runs.wait(run.id, timeout=60, poll=0.2)
    assert detail.run.status == "completed", detail.run.error
    assert [e.detail for e in detail.events if e.kind == "approved"] == ["approved by sdk-test: looks right"]
    assert client.runs.log(run.id, "ship") == "built\n"


async def test_the_async_client_reads_a_runs_audit_as_typed_records(aclient):
    salt = uuid.uuid4().hex[:8]
    run = await aclient.runs.start(PIPELINE % (salt, salt), params={"word": "async"})
    detail = await aclient.runs.wait(run.id, timeout=60, poll=0.2)
    assert detail.run.status == "completed", detail.run.error
    audit = await aclient.runs.audit(run.id)
    assert isinstance(audit, cairn.RunAudit) and audit.run == run.id
    by_stage = {s.stage: s for s in audit.stages}
    assert set(by_stage) == {"make", "check"}
    assert by_stage["make"].artifact_bytes == len("async\n")
    assert not by_stage["check"].reused and by_stage["check"].retries == 0
    with pytest.raises(cairn.NotFound):
        await aclient.runs.audit("nosuchrun")

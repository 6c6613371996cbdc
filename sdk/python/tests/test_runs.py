import uuid

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
    assert run.id in [r.id for r in client.runs.list()]

#!/usr/bin/env bash
# Fuzzes the HTTP API against its OpenAPI document with schemathesis: a
# fresh `cairn serve` on a temporary state directory, every route but the
# ones named below, a bounded number of cases per route; fails on a 5xx or a
# response that does not match the document.
#
#   pip install schemathesis==4.32.5
#   CAIRN_BIN=target/x86_64-unknown-linux-gnu/debug/cairn scripts/api-fuzz.sh [extra schemathesis args]
#
# Environment: CAIRN_BIN (default target/<host tuple>/debug/cairn), SCHEMATHESIS (default
# `schemathesis`), FUZZ_EXAMPLES (cases per route, default 20), FUZZ_SEED.
#
# Not fuzzed: POST /v1/images (an image build runs debootstrap or fetches
# busybox: minutes per case) and GET /v1/events (a stream that never ends).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
bin=${CAIRN_BIN:-$repo/target/$(rustc --print host-tuple)/debug/cairn}
st=${SCHEMATHESIS:-schemathesis}
examples=${FUZZ_EXAMPLES:-20}
[ -x "$bin" ] || { echo "no cairn binary at $bin: cargo build -p cairn, or set CAIRN_BIN" >&2; exit 2; }
command -v "$st" >/dev/null || { echo "schemathesis not found: pip install schemathesis==4.32.5" >&2; exit 2; }

home=$(mktemp -d /tmp/cairn-fuzz.XXXXXX)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
token=$("$bin" token create fuzz --home "$home" 2>/dev/null)
# Capacity without bounds: the fuzzer makes sandboxes and never removes
# them, and past the default budgets its creates would wait in the queue
# (the queue has its own tests, crates/cairn/tests/api.rs).
"$bin" serve --home "$home" --listen "127.0.0.1:$port" --max-memory 1000000T --max-cpus 1000000 \
    >"$home/serve.log" 2>&1 &
server=$!
cleanup() {
    local status=$?
    for id in $(curl -s --unix-socket "$home/cairn.sock" 'http://cairn/v1/sandboxes?limit=1000' |
        python3 -c 'import json,sys; print(" ".join(s["id"] for s in json.load(sys.stdin)["items"]))' 2>/dev/null); do
        curl -s -o /dev/null -X DELETE --unix-socket "$home/cairn.sock" "http://cairn/v1/sandboxes/$id?force=true" || true
    done
    kill -TERM "$server" 2>/dev/null && wait "$server" 2>/dev/null || true
    if [ "$status" = 0 ]; then
        rm -rf "$home"
    else
        echo "kept the state directory and the server log: $home/serve.log" >&2
    fi
}
trap cleanup EXIT
for _ in $(seq 100); do
    curl -sf -o /dev/null -H "Authorization: Bearer $token" "http://127.0.0.1:$port/healthz" && break
    sleep 0.1
done

spec=$repo/docs/openapi.json

# Run from the state directory: schemathesis keeps a cache in its working directory.
cd "$home"
# application/x-tar bodies (image import) are sent as raw bytes.
PYTHONPATH="$repo/scripts${PYTHONPATH:+:$PYTHONPATH}" SCHEMATHESIS_HOOKS=api_fuzz_hooks \
"$st" run "$spec" \
    --url "http://127.0.0.1:$port" \
    -H "Authorization: Bearer $token" \
    --checks not_a_server_error,response_schema_conformance \
    --max-examples "$examples" \
    ${FUZZ_SEED:+--seed "$FUZZ_SEED"} \
    --workers 1 \
    --request-timeout 30 \
    --generation-database none \
    --exclude-path /v1/events \
    --exclude-operation-id build_image \
    "$@"

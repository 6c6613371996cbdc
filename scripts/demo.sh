#!/usr/bin/env bash
# Cairn end to end on the embedded default: build, create a sandbox, work in
# it, copy files both ways, watch the limits hold, clean up.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release -q -p cairn
cairn=target/$(rustc --print host-tuple)/release/cairn
export CAIRN_HOME="${CAIRN_HOME:-$(mktemp -d /tmp/cairn-demo.XXXXXX)}"
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "a one-off command in a fresh sandbox (the busybox image is built on first use)"
$cairn run -- sh -c 'echo "hello from $(hostname), PID $$, $(ls /sys/class/net) only"'

say "a sandbox that outlives this script's commands"
id=$($cairn create --name demo --memory 128M --pids 64)
$cairn ps

say "work inside it: files written land in its private upper layer"
$cairn exec demo -- sh -c 'mkdir -p /work && seq 1 100000 > /work/numbers && wc -l /work/numbers'
$cairn exec -d demo -- sh -c 'while true; do date +%T >> /work/clock; sleep 1; done'

say "copy a file in and out"
printf 'alpha\nbeta\n' > "$CAIRN_HOME/in.txt"
$cairn cp "$CAIRN_HOME/in.txt" demo:/work/
$cairn exec demo -- sh -c 'sort -r /work/in.txt > /work/out.txt'
$cairn cp demo:/work/out.txt "$CAIRN_HOME/out.txt"
cat "$CAIRN_HOME/out.txt"

say "limits: a memory hog is OOM-killed and reported (exit 137)"
set +e
$cairn exec demo -- sh -c 'x=aaaaaaaa; while true; do x=$x$x; done'
echo "exit status $?"
set -e

say "isolation: no mounting, only its own processes"
$cairn exec demo -- sh -c 'mount -t tmpfs none /mnt 2>&1 || true; ls /proc | grep -c "^[0-9]"'

say "snapshot: prepare once (an 'index'), fork three hypotheses from it"
$cairn exec demo -- sh -c 'seq 1 200000 | sort -rn > /work/index'
snap=$($cairn snapshot demo --label indexed)
forks=$($cairn fork indexed -n 3)
i=0
for f in $forks; do
  i=$((i + 1))
  $cairn exec "$f" -- sh -c "head -n $i /work/index | tail -n 1 > /work/answer; echo fork $i: \$(cat /work/answer)"
done

say "what two forks changed, read from their layers (exit status 1: they differ)"
$cairn diff $(echo $forks | cut -d' ' -f1,2) || [ $? -eq 1 ]

say "a step corrupts the sandbox; reset rewinds it"
$cairn exec demo -- sh -c 'rm -rf /work; ls /work 2>&1 || true'
$cairn reset demo indexed >/dev/null
$cairn exec demo -- sh -c 'wc -l /work/index'

say "lineage"
$cairn snapshot demo --label after-reset >/dev/null
$cairn snapshots --tree

say "a pipeline: prepare once, three hypotheses in parallel, a crash resumed from its checkpoint"
run=$($cairn pipeline run examples/quickstart.toml)
$cairn pipeline show "$run"

say "where the run's time and bytes went, stage by stage"
$cairn audit "$run"

say "clean up"
$cairn rm -f "$id" $forks
$cairn snapshot rm "$snap" after-reset >/dev/null
$cairn gc
echo "state directory: $CAIRN_HOME"

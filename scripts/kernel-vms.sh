#!/usr/bin/env bash
# The native sandbox suites on the kernels Cairn's users run, each in a
# throwaway virtual machine of scripts/cgroup-v2-vm.sh (pure cgroup v2, no
# network), the three machines at once (one virtual CPU each):
#
#   newest   Debian's newest kernel (trixie-backports): the six native
#            suites, on a pure cgroup v2 host (this machine binds its
#            controllers to v1);
#   6.1      Debian 12's kernel: overlayfs takes no layer descriptors, so
#            layers go as idmapped mounts by path, and a state directory on
#            tmpfs gets shifted copies: the suites that start, attack,
#            snapshot and fork sandboxes, the layer ways' own suite and
#            doctor;
#   6.12     Debian 13's kernel: the init, attack and layer ways' suites
#            by path, then the attack and snapshot suites again with
#            CAIRN_LAYER_MOUNT=shifted (the start suite's 4 minutes in the
#            emulated machine are spent on 6.1 alone).
#
#   bash scripts/kernel-vms.sh [newest|6.1|6.12]...   (all three by default)
#
# Builds the suites (cargo test --no-run), prints each machine's output in
# turn, and exits 1 if any suite failed there. Cargo's `test result:`
# lines pass through, so scripts/test.sh counts them. Left out in every
# machine: the default image's first build (it downloads); in the newest,
# the cgroup pool's v1-only tests.
set -euo pipefail
cd "$(dirname "$0")/.."

machines=("$@")
[ ${#machines[@]} -gt 0 ] || machines=(newest 6.1 6.12)
root=$PWD
out="$root/target/kernel-vms"
mkdir -p "$out"

# Every suite any machine runs, built once; `suites NAME... > FILE` writes
# the lines that run them (with the environment in $env, if set).
targets=(native exec seccomp sandbox isolation cgroup_pool snapshots layer_mounts doctor)
args=()
for t in "${targets[@]}"; do args+=(--test "$t"); done
cargo test -p cairn-sandbox -p cairn "${args[@]}" --no-run --message-format=json 2>/dev/null >"$out/build.json"
suites() {
    python3 - "$out/build.json" "${env:-}" "$@" <<'PY'
import json, os, shlex, sys
build, env, wanted = sys.argv[1], sys.argv[2], sys.argv[3:]
skip = {"cgroup_pool": ["a_reused_cgroup_has_the_new_limit_and_no_counters_of_the_sandbox_before",
                        "a_cgroup_that_saw_an_oom_kill_is_removed_not_pooled",
                        "gc_drains_the_pool_and_stale_pools_of_state_directories_that_are_gone",
                        "a_kill_during_a_start_from_the_pool_leaves_nothing_after_gc"],
        "sandbox": ["the_default_image_is_built_on_first_use"]}
found = {}
for line in open(build):
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or m["target"]["kind"] != ["test"]:
        continue
    found[m["target"]["name"]] = m
for name in wanted:
    if name not in found:
        sys.exit("kernel-vms.sh: the suite %s was not built" % name)
    m = found[name]
    args = " ".join(["--color never"] + ["--skip " + t for t in skip.get(name, [])])
    print("echo '== %s%s'; (cd %s && %s %s %s) || status=1" % (
        env + " " if env else "", name, shlex.quote(os.path.dirname(m["manifest_path"])), env,
        shlex.quote(m["executable"]), args))
PY
}

pids=()
for m in "${machines[@]}"; do
    script="$out/$m.sh"
    case "$m" in
        newest)
            suite=trixie-backports mem=6144
            lines=$(suites native exec seccomp sandbox isolation cgroup_pool) ;;
        6.1)
            suite=bookworm mem=4096
            lines=$(suites native sandbox isolation snapshots layer_mounts doctor) ;;
        6.12)
            suite=trixie mem=4096
            lines=$(suites native isolation layer_mounts; env=CAIRN_LAYER_MOUNT=shifted suites isolation snapshots) ;;
        *) echo "kernel-vms.sh: no machine $m (newest, 6.1 or 6.12)" >&2; exit 2 ;;
    esac
    { echo "status=0"; echo "$lines"; echo 'exit $status'; } >"$script"
    (CAIRN_VM_SUITE=$suite bash scripts/cgroup-v2-vm.sh --mem "$mem" --seed "/tmp/cairn-test-busybox-$(id -u)" \
        -- sh "$script" >"$out/$m.log" 2>&1; echo $? >"$out/$m.rc") &
    pids+=($!)
done
wait "${pids[@]}"
status=0
for m in "${machines[@]}"; do
    echo "=== kernel-vms.sh: machine $m ($(sed -n 's/^cgroup-v2-vm: \([^,]*\),.*/Linux \1/p' "$out/$m.log" | head -1))"
    cat "$out/$m.log"
    rc=$(cat "$out/$m.rc" 2>/dev/null || echo 1)
    if [ "$rc" != 0 ]; then
        echo "=== kernel-vms.sh: machine $m failed (status $rc)"
        status=1
    fi
done
exit "$status"

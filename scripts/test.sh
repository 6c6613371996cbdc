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
# runsc: the gvisor driver; postgresql: initdb/pg_ctl for the state store
# tests, which start throwaway clusters of their own (the system service is
# not used); gcc and libc6-dev: the static attack programs of the isolation
# and seccomp tests. busybox-static is fetched by `apt-get download`, which
# needs the package lists.
packages=(bubblewrap crun debootstrap runsc postgresql gcc libc6-dev ca-certificates)
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

log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
cargo test --workspace 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
# One closing line for the whole run (cargo's last line is a doc-test
# summary).
awk '/^test result:/ { p += $4; f += $6 } END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"

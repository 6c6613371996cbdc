#!/usr/bin/env bash
# Cairn's two packages for machines with no Rust toolchain, from one built
# static `cairn` (cairn-init is inside it):
#
#   a Python wheel, cairn_sdk-VERSION-py3-none-manylinux_2_17_ARCH.musllinux_1_1_ARCH.whl:
#       the SDK (`import cairn`) and the binary as the wheel's script, so
#       `pip install` puts `cairn` on the environment's PATH;
#   a Debian package, cairn_VERSION-1_ARCH.deb (cargo deb): /usr/bin/cairn,
#       its man page, the README, and the Debian packages Cairn calls
#       (crates/cairn/Cargo.toml, [package.metadata.deb]).
#
#   bash scripts/package.sh [--debug] [--no-build] [--out DIR]
#
# Builds the release binary first (cargo build --release -p cairn; ~8 min
# here from scratch) unless --no-build; --debug packages the dev profile's
# binary instead (what the test command does). The binary is packaged
# stripped of debug information. Writes both files to DIR (default
# target/packages) and prints their paths, one per line. Installs
# cargo-deb (cargo install, once) when it is missing; the wheel's build
# backend (hatchling) comes from PyPI through pip.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release build=1 out=
while [ $# -gt 0 ]; do
    case "$1" in
        --debug) profile=dev; shift ;;
        --no-build) build=; shift ;;
        --out) out=$2; shift 2 ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "package.sh: unknown argument $1; usage: bash scripts/package.sh [--debug] [--no-build] [--out DIR]" >&2; exit 2 ;;
    esac
done

export PATH="$HOME/.cargo/bin:$PATH"
for tool in cargo python3 strip; do
    if ! command -v "$tool" >/dev/null; then
        echo "package.sh: $tool is missing (strip: apt-get install binutils; python3: apt-get install python3-venv)" >&2
        exit 2
    fi
done
host=$(rustc --print host-tuple)
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
dir_name=release
[ "$profile" = dev ] && dir_name=debug
products="$target_dir/$host/$dir_name"
out=${out:-$target_dir/packages}
mkdir -p "$out"
out=$(cd "$out" && pwd)

if [ -n "$build" ]; then
    cargo build --locked --profile "$profile" -p cairn
fi
bin="$products/cairn"
if [ ! -x "$bin" ]; then
    echo "package.sh: no binary at $bin; build it (cargo build --profile $profile -p cairn) or drop --no-build" >&2
    exit 2
fi
version=$("$bin" --version | awk '{ print $2 }')

# One stripped copy of the binary for the wheel (cargo deb strips its own
# copy the same way).
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
strip --strip-unneeded --remove-section=.comment --remove-section=.note -o "$stage/cairn" "$bin"

# The man page: every command's --help, as clap prints it, under one
# heading each. Built beside the binary, where [package.metadata.deb]'s
# assets find it.
roff() { sed -e 's/\\/\\e/g' -e "s/^\\([.']\\)/\\\\\\&\\1/"; }
{
    printf '.TH CAIRN 1 "" "cairn %s" "User Commands"\n' "$version"
    printf '.SH NAME\ncairn \\- durable, forkable sandboxes for AI agents and long-running pipelines\n'
    printf '.SH SYNOPSIS\n.B cairn\n.I COMMAND\n[OPTIONS]\n'
    printf '.SH DESCRIPTION\n.nf\n'
    "$bin" --help | roff
    printf '.fi\n'
    "$bin" --help | awk '/^Commands:/ { on = 1; next } on && /^$/ { exit } on && /^  [a-z][a-z0-9-]* / && $1 != "help" { print $1 }' |
        while read -r command; do
            printf '.SH "CAIRN %s"\n.nf\n' "$(printf '%s' "$command" | tr '[:lower:]' '[:upper:]')"
            "$bin" "$command" --help | roff
            printf '.fi\n'
        done
} | gzip -9n >"$products/cairn.1.gz"

# The wheel: the SDK's own build (hatchling), with hatch_build.py adding
# the binary. pip runs it in a build environment of its own.
venv="$target_dir/package-venv"
if [ ! -x "$venv/bin/pip" ]; then
    python3 -m venv "$venv"
fi
rm -f "$out"/cairn_sdk-*.whl
CAIRN_BINARY="$stage/cairn" "$venv/bin/pip" wheel -q --disable-pip-version-check --no-deps \
    --wheel-dir "$out" ./sdk/python
wheel=$(ls "$out"/cairn_sdk-"$version"-py3-none-*.whl)

# The Debian package, from the binary as built.
if ! command -v cargo-deb >/dev/null; then
    echo "package.sh: installing cargo-deb (a few minutes, once)" >&2
    cargo install cargo-deb --locked --version 3.8.0
fi
rm -f "$out"/cairn_*.deb
# A debug build's package is for tests: the faster xz preset (~9 s, not
# ~80 s, for 16 MB, not 13).
fast=()
[ "$profile" = dev ] && fast=(--fast)
cargo deb -q -p cairn --no-build --target "$host" --profile "$profile" --strip "${fast[@]}" --output "$out" >&2
deb=$(ls "$out"/cairn_*.deb)
printf '%s\n%s\n' "$wheel" "$deb"

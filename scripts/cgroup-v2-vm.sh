#!/usr/bin/env bash
# Runs a command on a pure cgroup v2 host: a throwaway virtual machine
# (qemu, software emulation, so no /dev/kvm is needed) that boots Debian's
# kernel with every v1 controller disabled (cgroup_no_v1=all), sees this
# host's root file system read-only under a tmpfs overlay, and runs the
# command as root in the current directory. The command's output is shown;
# its exit status is this script's.
#
#   bash scripts/cgroup-v2-vm.sh [--mem MiB] [--timeout SECONDS] [--seed PATH]... -- COMMAND...
#
# The machine has no network. /tmp is a disk of its own, empty at boot;
# --seed copies a host path under /tmp (a test's fixture, say) to the same
# path inside before the command runs.
#
# What Cairn's sandboxes need on such a host is there: /proc, /sys, /dev,
# cgroup2 at /sys/fs/cgroup with the memory, pids and cpu controllers, an
# ext4 disk of its own at /tmp, tmpfs at /run, loopback up. The kernel, its
# modules and a static busybox for the first stage come from Debian's
# packages (fetched with `apt-get download` once, kept in
# target/cgroup-v2-vm). The machine has one virtual CPU: with two, the
# emulated kernel was seen to crash while patching its own code at boot
# (an int3 oops), about one boot in ten.
set -euo pipefail

mem=4096
limit=1800
seeds=()
while [ $# -gt 0 ]; do
    case "$1" in
        --seed) seeds+=("$2"); shift 2 ;;
        --mem) mem=$2; shift 2 ;;
        --timeout) limit=$2; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) break ;;
    esac
done
if [ $# -eq 0 ]; then
    echo "cgroup-v2-vm.sh: no command given; usage: bash scripts/cgroup-v2-vm.sh [--mem MiB] [--timeout SECONDS] [--seed PATH]... -- COMMAND..." >&2
    exit 2
fi
if [ "$(id -u)" != 0 ]; then
    echo "cgroup-v2-vm.sh: run it as root (the machine shares this host's root file system as root)" >&2
    exit 2
fi
for seed in "${seeds[@]}"; do
    case "$seed" in
        /tmp/*) [ -e "$seed" ] || { echo "cgroup-v2-vm.sh: --seed $seed: no such path" >&2; exit 2; } ;;
        *) echo "cgroup-v2-vm.sh: --seed $seed: only paths under /tmp need seeding (the rest of the host's files are there)" >&2; exit 2 ;;
    esac
done
if ! command -v qemu-system-x86_64 >/dev/null; then
    echo "cgroup-v2-vm.sh: qemu is missing; install it with: apt-get install -y --no-install-recommends qemu-system-x86" >&2
    exit 2
fi

root=$(cd "$(dirname "$0")/.." && pwd)
vm="$root/target/cgroup-v2-vm"
mkdir -p "$vm"

# Debian's kernel and static busybox, once: by default the newest
# (trixie-backports), read through an apt configuration of its own (the
# host's sources stay as they are). CAIRN_VM_SUITE names another suite
# (bookworm: Linux 6.1; trixie: 6.12).
suite=${CAIRN_VM_SUITE:-trixie-backports}
vm="$vm/$suite"
apt_opts=(-o "Dir::State::Lists=$vm/apt/lists" -o "Dir::Etc::SourceList=$vm/apt/sources.list"
    -o "Dir::Etc::SourceParts=/dev/null" -o "Dir::Cache=$vm/apt/cache")
if [ ! -s "$vm/release" ]; then
    echo "cgroup-v2-vm.sh: fetching Debian's newest kernel from $suite" >&2
    rm -rf "$vm" && mkdir -p "$vm/apt/lists/partial" "$vm/apt/cache" "$vm/dl"
    echo "deb http://deb.debian.org/debian $suite main" >"$vm/apt/sources.list"
    apt-get "${apt_opts[@]}" update -q >&2
    image=$(apt-cache "${apt_opts[@]}" depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
    if [ -z "$image" ]; then
        echo "cgroup-v2-vm.sh: $suite has no linux-image-amd64" >&2
        exit 2
    fi
    # The image package, or (newer kernels) the binary and modules it depends on.
    parts=$(apt-cache "${apt_opts[@]}" depends "$image" | awk '/Depends: linux-(binary|modules)-[0-9]/ { print $2 }')
    (cd "$vm/dl" && apt-get "${apt_opts[@]}" download -q "$image" $parts 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2 || true)
    (cd "$vm/dl" && apt-get download -q busybox-static 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2 || true)
    rm -rf "$vm/kernel" && mkdir -p "$vm/kernel"
    for deb in "$vm"/dl/linux-*.deb; do dpkg-deb -x "$deb" "$vm/kernel"; done
    dpkg-deb -x "$vm"/dl/busybox-static_*.deb "$vm/kernel/busybox"
    release=${image#linux-image-}
    if [ ! -d "$vm/kernel/usr/lib/modules/$release" ]; then
        mkdir -p "$vm/kernel/usr/lib" && ln -s ../../lib/modules "$vm/kernel/usr/lib/modules"
    fi
    # busybox's modprobe reads plain modules only.
    find "$vm/kernel/usr/lib/modules/" -name '*.ko.xz' -print0 | xargs -0 -r -n 200 -P "$(nproc)" xz -d
    "$vm/kernel/busybox/bin/busybox" depmod -b "$vm/kernel/usr" "$release"
    rm -rf "$vm/dl"
    echo "$release" >"$vm/release"
fi
release=$(cat "$vm/release")
k="$vm/kernel"
busybox="$k/busybox/bin/busybox"
modules="$k/usr/lib/modules/$release"
vmlinuz=
for f in "$modules/vmlinuz" "$k/boot/vmlinuz-$release"; do
    [ -f "$f" ] && vmlinuz=$f && break
done
if [ -z "$vmlinuz" ]; then
    echo "cgroup-v2-vm.sh: no kernel image in $k; remove $vm and run again" >&2
    exit 2
fi

# The first stage: busybox, the modules that reach the shared root, and an
# init that mounts it under an overlay and switches to it.
initrd="$k/initrd.gz"
if [ ! -f "$initrd" ] || [ "$0" -nt "$initrd" ]; then
    stage=$(mktemp -d)
    trap 'rm -rf "$stage"' EXIT
    mkdir -p "$stage/bin" "$stage/lib/modules/$release"
    cp "$busybox" "$stage/bin/busybox"
    for m in virtio virtio_ring virtio_pci virtio_pci_modern_dev virtio_pci_legacy_dev 9pnet 9pnet_virtio 9p netfs fscache overlay; do
        f=$(cd "$modules" && find kernel -name "$m.ko*" | head -1)
        # Built into this kernel when it is not a module.
        [ -n "$f" ] || continue
        mkdir -p "$stage/lib/modules/$release/$(dirname "$f")"
        cp "$modules/$f" "$stage/lib/modules/$release/$f"
    done
    chroot "$stage" /bin/busybox depmod "$release"
    cat >"$stage/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mkdir -p /proc /sys /dev /host /rw /newroot
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
# Built into some kernels, modules of others.
for m in virtio_pci 9pnet_virtio 9p overlay; do modprobe -q "$m"; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288,cache=loose hostroot /host || echo "vm init: the shared root did not mount"
mount -t tmpfs -o mode=755 rw /rw && mkdir -p /rw/upper /rw/work
mount -t overlay -o lowerdir=/host,upperdir=/rw/upper,workdir=/rw/work root /newroot
mkdir -p /newroot/vmio /newroot/mnt/host
mount --move /host /newroot/mnt/host
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 vmio /newroot/vmio || echo "vm init: the io share did not mount"
umount /proc /sys /dev 2>/dev/null
exec switch_root /newroot /bin/sh /vmio/stage2
EOF
    chmod +x "$stage/init"
    (cd "$stage" && find . | "$busybox" cpio -o -H newc 2>/dev/null | gzip -1 >"$initrd.tmp")
    mv "$initrd.tmp" "$initrd"
    rm -rf "$stage"
    trap - EXIT
fi

# The second stage, on the shared root: what a v2 host has, then the command.
io=$(mktemp -d)
trap 'rm -rf "$io"' EXIT
# /tmp is an ext4 disk of its own, as on most hosts: tmpfs takes idmapped
# mounts only from Linux 6.3.
truncate -s 16G "$io/tmp.img"
mkfs.ext4 -q -F "$io/tmp.img"
printf '%q ' "$@" >"$io/command"
seed_copies=
for seed in "${seeds[@]}"; do
    seed_copies+="mkdir -p $(printf '%q' "$(dirname "$seed")") && cp -a $(printf '%q' "/mnt/host$seed") $(printf '%q' "$seed")"$'\n'
done
cat >"$io/stage2" <<EOF
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts
mount -t tmpfs shm /dev/shm
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t tmpfs run /run
mkdir -p /lib/modules/$release && mount --bind "$modules" /lib/modules/$release
ln -sf "$busybox" /sbin/modprobe
modprobe -a virtio_blk ext4
# Loop devices, for sandboxes' disks (--disk); built into some kernels.
modprobe loop 2>/dev/null
# A checkout under /tmp stays in sight (and writable) on top of /tmp's disk.
mkdir -p /run/checkout && mount --bind "$root" /run/checkout
mount -t ext4 /dev/vda /tmp || { echo "cgroup-v2-vm: /tmp's disk did not mount"; echo 1 >/vmio/rc; "$busybox" poweroff -f; }
chmod 1777 /tmp
case "$root" in /tmp/*) mkdir -p "$root" && mount --bind /run/checkout "$root" ;; esac
${seed_copies}ip link set lo up
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root CI=${CI:-}
cd "$PWD"
echo "cgroup-v2-vm: \$(uname -r), cgroup v2 controllers: \$(cat /sys/fs/cgroup/cgroup.controllers)"
sh /vmio/command </dev/null
echo \$? >/vmio/rc
sync
"$busybox" poweroff -f
EOF
echo "cgroup-v2-vm.sh: booting Linux $release (software emulation; a boot takes a few seconds)" >&2
set +e
timeout "$limit" qemu-system-x86_64 -machine q35 -accel tcg -cpu max -smp 1 -m "$mem" \
    -nodefaults -display none -serial stdio -no-reboot \
    -kernel "$vmlinuz" -initrd "$initrd" \
    -append "console=ttyS0 rdinit=/init cgroup_no_v1=all quiet panic=-1" \
    -fsdev local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap \
    -device virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot \
    -fsdev local,id=vmio,path="$io",security_model=none,multidevs=remap \
    -device virtio-9p-pci,fsdev=vmio,mount_tag=vmio \
    -drive file="$io/tmp.img",if=virtio,format=raw,cache=unsafe </dev/null | sed -u 's/\r$//'
qemu_status=${PIPESTATUS[0]}
set -e
if [ ! -s "$io/rc" ]; then
    echo "cgroup-v2-vm.sh: the machine stopped before the command finished (qemu's status $qemu_status; 124 is the $limit s timeout)" >&2
    exit 1
fi
exit "$(cat "$io/rc")"

"""The wheel with the `cairn` binary in it.

With CAIRN_BINARY naming a built, static `cairn`, the wheel carries it as
a script (`cairn_sdk-….data/scripts/cairn`): `pip install` puts it on the
environment's PATH beside the `cairn` package, and the wheel is tagged for
the binary's architecture instead of `py3-none-any`. Without CAIRN_BINARY
the wheel is the SDK alone, pure Python. `scripts/package.sh` builds both
packages for users.
"""

import os
import struct
import subprocess

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

# ELF e_machine -> the architecture in a wheel's platform tag.
ARCHITECTURES = {62: "x86_64", 183: "aarch64"}
PT_INTERP = 3


def static_elf_architecture(path):
    """The wheel architecture of a static ELF executable; an error that says
    why for anything else (a dynamic executable would need the build host's
    C library, which the tag below does not promise)."""
    with open(path, "rb") as f:
        header = f.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            raise ValueError(f"CAIRN_BINARY={path} is not a 64-bit little-endian ELF executable")
        machine, = struct.unpack_from("<H", header, 18)
        phoff, = struct.unpack_from("<Q", header, 32)
        phentsize, phnum = struct.unpack_from("<HH", header, 54)
        if machine not in ARCHITECTURES:
            raise ValueError(f"CAIRN_BINARY={path} is for ELF machine {machine}, not x86_64 or aarch64")
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    for i in range(phnum):
        kind, = struct.unpack_from("<I", table, i * phentsize)
        if kind == PT_INTERP:
            raise ValueError(f"CAIRN_BINARY={path} is dynamically linked; the wheel needs the static build "
                             "(.cargo/config.toml links static-pie)")
    return ARCHITECTURES[machine]


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version, build_data):
        binary = os.environ.get("CAIRN_BINARY")
        if self.target_name != "wheel" or version == "editable" or not binary:
            return
        binary = os.path.abspath(binary)
        if not os.access(binary, os.X_OK):
            raise ValueError(f"CAIRN_BINARY={binary} is not an executable file")
        arch = static_elf_architecture(binary)
        # The SDK and the binary it talks to are one release.
        said = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout.split()
        if said[-1:] != [self.metadata.version]:
            raise ValueError(f"CAIRN_BINARY={binary} says {' '.join(said)!r}, the SDK is {self.metadata.version}")
        build_data["shared_scripts"][binary] = "cairn"
        build_data["pure_python"] = False
        # A static executable needs no C library of the host's: any glibc
        # (manylinux) or musl (musllinux) Linux of this architecture.
        build_data["tag"] = f"py3-none-manylinux_2_17_{arch}.musllinux_1_1_{arch}"

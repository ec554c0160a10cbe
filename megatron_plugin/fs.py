"""File-system helpers shared by checkpoints, the converter and the questionnaire (no torch here)."""

from __future__ import annotations

import os
import tempfile
import zlib

from .errors import MegatronPluginConfigError


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_writable(path: str, setting: str) -> None:
    """Raise a clear error now if `path` cannot become a folder we write into (no collectives)."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise MegatronPluginConfigError(setting, path, "is a file, not a folder: choose a folder path")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise MegatronPluginConfigError(setting, path, f"{existing} is a file, so no folder can be made there")
    try:  # a trial file tells what os.access can't (read-only mounts; root ignores permission bits)
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise MegatronPluginConfigError(
            setting, path, f"{existing} is not writable ({err.strerror}): choose another folder"
        ) from None


def file_checksum(path: str) -> dict:
    """CRC-32 and size of a file, read in 16 MiB pieces: enough to catch a flipped or missing byte."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 24)
            if not block:
                break
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"crc32": f"{crc:08x}", "bytes": size}

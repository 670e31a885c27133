"""Full disks and read-only folders for the tests of every writer.

- :func:`fake_free` makes ``shutil.disk_usage`` report little free space (the checks made before work
  starts); it works anywhere.
- :func:`small_disk` mounts a tmpfs of a few MB, a real file system that fills up (``ENOSPC`` from the
  kernel, in every process: a notebook's kernel too). It needs root and mount rights; without them the
  test is skipped (the monkeypatched cases beside it still run).
- :func:`read_only` gives a folder that cannot be written: a read-only tmpfs as root (root ignores
  permission bits), a folder without write permission otherwise.
- :func:`fake_df` puts a ``df`` on ``PATH`` that reports little room, for the shell scripts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest


def fake_free(monkeypatch, mb: float) -> None:
    """``shutil.disk_usage`` reports ``mb`` MB free on every file system."""
    real = shutil.disk_usage

    def usage(path):
        return real(path)._replace(free=int(mb * 2**20))

    monkeypatch.setattr(shutil, "disk_usage", usage)


def _mount(folder: Path, options: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True
    )
    return r.returncode == 0


def _umount(folder: Path) -> None:
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@contextlib.contextmanager
def small_disk(folder: Path, mb: int = 4):
    """``folder`` as a tmpfs of ``mb`` MB for the block (skips the test where mounting is not allowed)."""
    folder.mkdir(parents=True, exist_ok=True)
    if not _mount(folder, f"size={mb}m"):
        pytest.skip("a small file system needs root and mount rights (tmpfs)")
    try:
        yield folder
    finally:
        _umount(folder)


@contextlib.contextmanager
def read_only(folder: Path):
    """``folder`` (made empty) that this process cannot write, for the block."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        if not _mount(folder, "ro,size=1m"):
            pytest.skip(
                "root writes anywhere unless a read-only file system is mounted (no mount rights)"
            )
        try:
            yield folder
        finally:
            _umount(folder)
        return
    folder.chmod(0o500)
    try:
        yield folder
    finally:
        folder.chmod(0o700)


def fake_df(tmp_path: Path, free_mb: int) -> dict:
    """Environment for a script: a ``df -Pk`` on ``PATH`` that reports ``free_mb`` MB available."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir(exist_ok=True)
    df = bin_dir / "df"
    df.write_text(
        "#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
        f"echo 'fake 99999999 0 {free_mb * 1024} 1% /'\n"
    )
    df.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}

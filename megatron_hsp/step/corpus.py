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
import sys
import sysconfig
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_hsp.planner.errors import InputError

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
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".tmp-{os.getpid()}-{prefix.name}"

    def docs() -> Iterator[np.ndarray]:
        for p in files:
            for chunk in split_top_level(p.read_bytes()):
                data = np.frombuffer(chunk, dtype=np.uint8).astype(np.int64)
                yield np.append(data, EOD_TOKEN)

    n = write_indexed_dataset(tmp, docs())
    # Atomic publish: concurrent builders (several ranks, two demos) never see half a file.
    os.replace(str(tmp) + ".bin", str(prefix) + ".bin")
    os.replace(str(tmp) + ".idx", str(prefix) + ".idx")
    return Corpus(prefix, n, source, built=True)

"""Megatron's data arguments under ``--hsp``: which datasets feed which split, checked up front.

Megatron's own dataset provider builds ``GPTDataset``s of fixed ``--seq-length`` samples; under
``--hsp`` the provider is HSP's (``hooks.hsp_datasets_provider``) and every split is sampled in
whole documents by ``step.sampler``. This module reads the same flags Megatron reads, the same
way (megatron's ``get_blend_and_blend_per_split`` for the blends, its
``parse_and_normalize_split`` / ``convert_split_vector_to_split_matrix`` and its rounding for
``--split``), so a split holds the documents Megatron's ``GPTDataset`` of that split would hold:

* ``--data-path P`` / ``--data-path w1 P1 w2 P2 ...`` / ``--data-path P1 P2`` (weights from the
  datasets' sizes, as Megatron infers them) / ``--data-args-path FILE``: each dataset is cut by
  ``--split`` into train, validation and test documents, and each split blends its datasets'
  parts with the weights;
* ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` (or
  ``--per-split-data-args-path``): one blend per split, whole datasets;
* weights are shares of tokens (``sampler.BlendedBatchSampler`` says why).

Flags HSP cannot honour are refused here, at argument time (``installer.install``, right after
Megatron's ``validate_args``), one line naming the flag and what would work, instead of failing
inside the dataset provider after the model is built. Flags with nothing to do under HSP
(``--data-cache-path``: there is no sample index to cache) are accepted with a note.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megatron_hsp.megatron.refusals import HSPArgsError

SPLITS = ("train", "valid", "test")

# (attribute, flag, why, what would work): data options whose samples HSP does not produce.
_REFUSED_DATA_ARGS: tuple[tuple[str, str, str, str], ...] = (
    ("mock_data", "--mock-data", "HSP plans the lengths of real documents; mock data has none",
     "give --data-path PREFIX (an indexed dataset; `megatron-hsp demo` builds a small one)"),
    ("fim_data", "--fim-data", "fill-in-the-middle rewrites samples inside Megatron's "
     "GPTDataset, which HSP's sampler replaces", "drop --fim-data"),
    ("eod_mask_loss", "--eod-mask-loss", "HSP's loss mask covers every token with a next "
     "token of its own document; end-of-document tokens are not masked", "drop --eod-mask-loss"),
    ("phase_transition_iterations", "--phase-transition-iterations", "phases restart "
     "Megatron's sample counts, which HSP's sampler does not follow",
     "train each phase as its own run with --load"),
    ("full_validation", "--full-validation", "it sizes evaluation by len(dataloader), which "
     "HSP's planned batches of whole documents do not have", "use --eval-iters N"),
    ("multiple_validation_sets", "--multiple-validation-sets", "Megatron requires "
     "--full-validation with it", "blend the validation datasets in --valid-data-path"),
    ("object_storage_cache_path", "--object-storage-cache-path", "HSP reads local indexed "
     "datasets", "copy the dataset to a file system and drop the flag"),
)  # fmt: skip

# (attribute, flag, note): accepted; what they would change does not exist under HSP.
_NOTED_DATA_ARGS: tuple[tuple[str, str, str], ...] = (
    ("data_cache_path", "--data-cache-path", "nothing is cached: HSP reads document lengths "
     "from the .idx files and builds no sample index"),
    ("per_dataset_sequences_path", "--per-dataset-sequences-path", "ignored: HSP reads the "
     "documents of each dataset from its .idx"),
    ("dataloader_fast_cache_load", "--dataloader-fast-cache-load", "ignored: no sample index "
     "cache under HSP"),
    ("dataloader_defer_npy_index_mmap", "--dataloader-defer-npy-index-mmap", "ignored: no "
     "sample index under HSP"),
    ("reset_position_ids", "--reset-position-ids", "already so: every document is its own "
     "sequence with positions from 0"),
    ("reset_attention_mask", "--reset-attention-mask", "already so: attention never crosses "
     "documents"),
)  # fmt: skip


@dataclass(frozen=True)
class SplitSource:
    """One dataset feeding one split.

    ``weight`` None: by its token count (Megatron infers weights of an unweighted list from the
    datasets' sizes). ``bounds``: the row of Megatron's split matrix, the share of the dataset's
    documents ``[round(a n), round(b n))`` this split gets; None: the whole dataset
    (per-split paths)."""

    prefix: str
    weight: float | None
    bounds: tuple[float, float] | None


@dataclass(frozen=True)
class HSPData:
    """Which datasets (and which of their documents) feed train, validation and test."""

    splits: dict[str, tuple[SplitSource, ...]]  # a split without data is absent
    prefixes: tuple[str, ...]  # every dataset once, in blend order: the document numbering
    notes: tuple[str, ...] = field(default=(), compare=False)

    def describe(self) -> str:
        """One line: each split's datasets, weights and document shares."""
        parts = []
        for name in SPLITS:
            sources = self.splits.get(name)
            if not sources:
                parts.append(f"{name}: none")
                continue
            shown = []
            for s in sources:
                w = "by size" if s.weight is None else f"{s.weight:g}"
                b = "" if s.bounds is None else f" [{s.bounds[0]:g}, {s.bounds[1]:g})"
                shown.append(f"{Path(s.prefix).name}{b} x {w}")
            parts.append(f"{name}: " + " + ".join(shown))
        return "; ".join(parts)


def refuse_data_flags(args: argparse.Namespace) -> None:
    """The data options of ``_REFUSED_DATA_ARGS``: the training run refuses them when it reads
    its data flags (``hsp_data_from_args``), and ``plan``/``bench`` with or without data."""
    for attr, flag, why, instead in _REFUSED_DATA_ARGS:
        if getattr(args, attr, None) not in (None, False, 0, ""):
            raise HSPArgsError(f"--hsp does not support {flag}: {why}; {instead}")


def _refuse_and_note(args: argparse.Namespace, notes: list[str]) -> None:
    refuse_data_flags(args)
    for attr, flag, note in _NOTED_DATA_ARGS:
        if getattr(args, attr, None) not in (None, False, 0, ""):
            notes.append(f"{flag}: {note}")


def _check_prefix(flag: str, prefix: str) -> None:
    for suffix in (".idx", ".bin"):
        if not Path(prefix + suffix).is_file():
            raise HSPArgsError(
                f"{flag}: indexed dataset {prefix!r} has no {prefix + suffix}; pass the path "
                "prefix without .bin/.idx (e.g. my-corpus_text_document)"
            )


def _checked_weights(flag: str, weights: list[float] | None) -> list[float | None]:
    if weights is None:
        return []
    for w in weights:
        if not np.isfinite(w) or w < 0:
            raise HSPArgsError(f"{flag}: blend weight {w:g} must be a finite number >= 0")
    if sum(weights) <= 0:
        raise HSPArgsError(f"{flag}: blend weights sum to 0; give at least one positive weight")
    return list(weights)


def _blends(args: argparse.Namespace) -> tuple[Any, Any]:
    """(blend, blend per split) as Megatron-LM's ``get_blend_and_blend_per_split`` reads them
    (megatron/training/utils), with megatron-core's ``get_blend_from_list`` for each list; here
    so that it needs only megatron-core and names the flag when a file cannot be read."""
    import json

    from megatron.core.datasets.utils import get_blend_from_list

    def read(flag: str, path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError as exc:
            raise HSPArgsError(f"{flag} {path}: cannot read it ({exc.strerror})") from None

    data_path = getattr(args, "data_path", None)
    args_path = getattr(args, "data_args_path", None)
    per_split_path = getattr(args, "per_split_data_args_path", None)
    paths = [getattr(args, f"{s}_data_path", None) for s in SPLITS]
    try:
        if data_path is not None or args_path is not None:
            if data_path is not None and args_path is not None:
                raise HSPArgsError("give --data-path or --data-args-path, not both")
            if args_path is not None:
                return get_blend_from_list(read("--data-args-path", args_path).split()), None
            return get_blend_from_list(list(data_path)), None
        if per_split_path is not None:
            text = read("--per-split-data-args-path", per_split_path)
            try:
                loaded = json.loads(text)
                lists = [loaded[s] for s in SPLITS]
            except (ValueError, KeyError, TypeError):
                raise HSPArgsError(
                    f"--per-split-data-args-path {per_split_path}: a JSON object with train, "
                    "valid and test keys is expected"
                ) from None
            lists = [v.split() if isinstance(v, str) else v for v in lists]
            return None, [get_blend_from_list(v) for v in lists]
        if any(p is not None for p in paths):
            return None, [get_blend_from_list(p) for p in paths]
    except AssertionError:
        raise HSPArgsError(
            "--data-path: give a prefix, prefixes, or weight-prefix pairs "
            "(e.g. --data-path 0.5 A 0.5 B); weights and prefixes cannot be mixed otherwise"
        ) from None
    return None, None


def hsp_data_from_args(args: argparse.Namespace) -> HSPData:
    """Megatron's data flags as ``HSPData``; refuses what HSP cannot sample (argument time).

    Reads the flags with megatron's own helpers, so blends, ``--data-args-path`` files and
    ``--split`` mean what they mean to Megatron; checks that every dataset's ``.idx``/``.bin``
    exist (the model is not built yet)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    notes: list[str] = []
    _refuse_and_note(args, notes)
    blend, per_split = _blends(args)
    splits: dict[str, tuple[SplitSource, ...]] = {}
    if blend is not None:
        prefixes, raw = blend
        weights = _checked_weights("--data-path", raw)
        split_text = getattr(args, "split", None) or "969, 30, 1"
        shares = [float(x) for x in re.findall(r"[.0-9]+", split_text) if x.strip(".")]
        try:
            if not 1 <= len(shares) <= 3 or sum(shares) <= 0:
                raise ValueError(split_text)
            matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split_text))
        except (AssertionError, ValueError, ZeroDivisionError):
            raise HSPArgsError(
                f"--split {split_text!r}: give three non-negative shares with a positive sum "
                "(e.g. 969,30,1)"
            ) from None
        for name, bounds in zip(SPLITS, matrix, strict=True):
            if bounds is None:
                continue
            splits[name] = tuple(
                SplitSource(p, weights[i] if weights else None, (bounds[0], bounds[1]))
                for i, p in enumerate(prefixes)
            )
        flag_of = dict.fromkeys(SPLITS, "--data-path")
    elif per_split is not None:
        flag_of = {s: f"--{s}-data-path" for s in SPLITS}
        for name, split_blend in zip(SPLITS, per_split, strict=True):
            if split_blend is None:
                continue
            prefixes, raw = split_blend
            weights = _checked_weights(flag_of[name], raw)
            splits[name] = tuple(
                SplitSource(p, weights[i] if weights else None, None)
                for i, p in enumerate(prefixes)
            )
        if "train" not in splits:
            raise HSPArgsError(
                "--valid-data-path/--test-data-path without --train-data-path: give "
                "--train-data-path (weights and prefixes, as --data-path)"
            )
    else:
        raise HSPArgsError(
            "--hsp trains on indexed datasets: give --data-path PREFIX (or weights and "
            "prefixes, or --train-data-path/--valid-data-path/--test-data-path)"
        )
    order: list[str] = []
    for name, sources in splits.items():
        for s in sources:
            _check_prefix(flag_of[name], s.prefix)
            if s.prefix not in order:
                order.append(s.prefix)
    return HSPData(splits=splits, prefixes=tuple(order), notes=tuple(notes))


def document_range(bounds: tuple[float, float] | None, num_documents: int) -> tuple[int, int]:
    """The documents ``[lo, hi)`` of a dataset in one split: Megatron's own rounding
    (``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits``)."""
    if bounds is None:
        return 0, num_documents
    lo = round(bounds[0] * float(num_documents))
    hi = round(bounds[1] * float(num_documents))
    return lo, hi


def build_split_sampler(data: HSPData, split: str, indices: dict[str, Any], config: Any) -> Any:
    """The sampler of one split (None when its documents are empty): a
    ``sampler.BlendedBatchSampler`` over ``indices`` (prefix -> ``documents.DocumentIndex``),
    documents numbered as ``documents.BlendedDocumentReader`` over ``data.prefixes`` reads them."""
    from megatron_hsp.step.sampler import BlendComponent, BlendedBatchSampler

    bases, running = {}, 0
    for prefix in data.prefixes:
        bases[prefix] = running
        running += len(indices[prefix])
    components = []
    for s in data.splits.get(split, ()):
        lengths = indices[s.prefix].lengths
        lo, hi = document_range(s.bounds, len(lengths))
        if hi <= lo:
            continue
        part = np.asarray(lengths[lo:hi], dtype=np.int64)
        weight = float(part.sum()) if s.weight is None else float(s.weight)
        components.append(BlendComponent(s.prefix, weight, bases[s.prefix] + lo, part))
    if not components or all(c.weight <= 0 for c in components):
        return None
    return BlendedBatchSampler(components, config)


def train_sampler(
    data: HSPData, indices: dict[str, Any], cfg: Any, max_length: int, why: str
) -> tuple[Any, str]:
    """(the training split's sampler of a run with ``HSPConfig`` ``cfg``, the start-up line
    saying how many documents are over ``max_length`` and what happens to them).

    Whole documents up to ``max_length`` (``config.document_length_limit``, which gives
    ``why``), the run's seed, batch and overlong policy. The one place the training run
    (``hooks.build_pipeline``) and ``plan``/``bench`` (``commands/megatron_args.py``) build it,
    so both draw the same batches."""
    from megatron_hsp.megatron.config import LIMIT_REMEDIES, overlong_line
    from megatron_hsp.planner.errors import InputError
    from megatron_hsp.step.sampler import SamplerConfig

    base = SamplerConfig(
        seed=cfg.seed,
        max_length=max_length,
        global_batch_docs=cfg.global_batch_docs,
        token_budget=cfg.token_budget,
        overlong=cfg.overlong,
    )
    try:
        sampler = build_split_sampler(data, "train", indices, base)
    except InputError as exc:  # --hsp-overlong error: say which limit the documents pass
        remedy = LIMIT_REMEDIES.get(why)
        raise InputError(
            f"{exc} (the limit, {max_length} tokens, is {why}" + (f"; {remedy})" if remedy else ")")
        ) from None
    if sampler is None:
        raise InputError(
            "the training split has no documents: --split gives it a share of 0 or the "
            "datasets are too small for it; give training a share (e.g. --split 969,30,1)"
        )
    over = sum(s.overlong_docs for s in sampler.samplers)
    total = sum(len(s.lengths) for s in sampler.samplers)
    return sampler, overlong_line("training", over, total, max_length, why, cfg.overlong)


def data_fingerprint(data: HSPData, indices: dict[str, Any]) -> str:
    """What the splits hold: every dataset's document lengths, each split's sources."""
    h = hashlib.sha256()
    for prefix in data.prefixes:
        h.update(np.asarray(indices[prefix].lengths, dtype=np.int64).tobytes())
    for name in SPLITS:
        for s in data.splits.get(name, ()):
            h.update(repr((name, data.prefixes.index(s.prefix), s.weight, s.bounds)).encode())
    return h.hexdigest()[:16]

"""How the loop judges a run: Megatron's own expected schedule (``megatron_schedule``), each
parameter's gradient and weights against the stock side's (``per_param_diff``), the data
checks of evaluation, blend, resume and the sampler oracle (``_data_checks``, ``check_data``),
the tolerances and per-step checks (``check``) and each check's worst over its tolerance
(``margins``)."""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_hsp.testing.megatron_loop.corpus import MegatronDocuments
from megatron_hsp.testing.megatron_loop.options import (
    BLEND_WEIGHTS,
    EVAL_ITERS,
    EVAL_SPLIT,
    GLOBAL_BATCH,
    MODEL_FLAGS,
    RESUME_AFTER,
    LoopOptions,
)
from megatron_hsp.testing.sampler_oracle import (
    blend_deviation,
    coverage_failures,
    deficit_failures,
    order_failures,
)
from megatron_hsp.testing.tolerances import CPU


def megatron_schedule(args: Any, steps: int) -> list[dict[str, Any]]:
    """Per step, the learning rate and consumed samples Megatron's own machinery gives a run of
    ``--global-batch-size`` samples per step, computed apart from both runs.

    * lr: a fresh ``OptimizerParamScheduler`` from Megatron's ``get_optimizer_param_scheduler``
      (same flags), on a throwaway optimizer, stepped by ``--global-batch-size`` per step as
      ``train_step`` does with Megatron's own micro-batch count; read after the step (the value
      ``train_step`` leaves in the optimizer).
    * consumed samples: Megatron's ``MegatronPretrainingSampler`` on every data-parallel rank,
      each asked for ``ConstantNumMicroBatchesCalculator``'s micro-batches per step; the samples
      consumed are the indices it handed out (``0 .. n-1``), ``samples`` those of the step.
    """
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler
    from megatron.training.training import get_optimizer_param_scheduler

    dp = parallel_state.get_data_parallel_world_size()
    count = ConstantNumMicroBatchesCalculator(
        args.global_batch_size, args.micro_batch_size, dp, False, 0
    ).get()
    throwaway = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = get_optimizer_param_scheduler(throwaway)
    samplers = [
        iter(MegatronPretrainingSampler(10**9, 0, args.micro_batch_size, r, dp)) for r in range(dp)
    ]
    consumed, out = 0, []
    for _ in range(steps):
        indices = sorted(i for s in samplers for _ in range(count) for i in next(s))
        if indices != list(range(consumed, consumed + len(indices))):
            raise RuntimeError(f"Megatron's sampler skipped samples: {indices}")
        consumed += len(indices)
        scheduler.step(increment=args.global_batch_size)
        out.append(
            {
                "lr": float(throwaway.param_groups[0]["lr"]),
                "consumed_samples": consumed,
                "samples": len(indices),
            }
        )
    return out


def per_param_diff(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], scale: dict[str, torch.Tensor]
) -> tuple[dict[str, float], dict[str, float]]:
    """Per parameter, over all ranks: (max |got - want| / max |scale|, max |scale|).

    Collective (MAX all-reduce over the world): a parameter's shards (TP) and slices
    (distributed optimizer) on every rank count. A parameter whose scale is 0 everywhere is
    compared absolutely (any difference is infinite relative error). ``got`` may hold a subset
    of ``want`` on a rank (a pipeline stage's parameters against the unpipelined reference),
    but every parameter must be on some rank.
    """
    import torch.distributed as dist

    names = sorted(want)
    if set(got) - set(names) or sorted(scale) != names:
        raise RuntimeError(f"parameter names differ: {set(got) ^ set(want)}")
    table = torch.zeros(len(names), 3, dtype=torch.float64)
    for i, n in enumerate(names):
        if n in got:
            table[i, 2] = 1.0
            if want[n].numel():
                table[i, 0] = float((got[n] - want[n]).abs().max())
        if scale[n].numel():
            table[i, 1] = float(scale[n].abs().max())
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    absent = [n for i, n in enumerate(names) if table[i, 2] == 0]
    if absent:
        raise RuntimeError(f"parameters on no rank of the compared side: {absent[:5]}")
    rel, peak = {}, {}
    for i, n in enumerate(names):
        err, top = float(table[i, 0]), float(table[i, 1])
        rel[n] = err / top if top > 0 else (0.0 if err == 0 else math.inf)
        peak[n] = top
    return rel, peak


def _worst(rel: dict[str, float]) -> tuple[str, float]:
    name = max(rel, key=lambda n: rel[n])
    return name, rel[name]


def _data_checks(options: LoopOptions, hsp: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Checks of one option set (``check_data`` judges them):

    * ``evaluations``: per ``evaluate()`` call, the HSP and stock losses and consumed validation
      samples, and Megatron's count (``evaluate()`` adds ``--eval-global-batch-size`` per batch);
    * ``pieces_as_uninterrupted``: per split, whether the batches trained / evaluated are those
      an uninterrupted run draws (evaluation leaves the training sampler alone; a resume lands
      on the next batch of every split);
    * ``outside_split``: pieces whose document is not in Megatron's own split of its dataset
      (``MegatronDocuments.split_ranges``: megatron-core's split functions, not HSP's);
    * ``coverage``: per split and dataset, where the pieces drawn (``drawn``: trained
      or evaluated, then more from copies of the live samplers) break "every document of
      Megatron's split with >= 2 tokens once per epoch" (``sampler_oracle.coverage_failures``
      against megatron-core's own split builder and ``IndexedDataset`` lengths, documents
      over the HSP side's longest trainable length cut into pieces of it: the default
      ``--hsp-overlong split``);
    * ``order``: per split and dataset, where the same pieces leave the order the sampler's
      documented rule gives (``sampler_oracle.order_failures``: ``default_rng([seed, epoch])``,
      ``[seed, k, epoch]`` for a blend's dataset ``k >= 1``, the seed Megatron's ``--seed``
      the loop passes), or repeat the previous epoch's order (a dataset that stopped
      reshuffling); across the restart too;
    * ``blend_rule``: draws of a blend that did not come from the dataset the
      deficit rule picks, re-run on the drawn pieces' lengths (``sampler_oracle``);
    * ``blend``: each dataset's share of the trained tokens, how far it is from its weight in
      documents of the longest length, and that worst deviation over every prefix of the
      trained pieces as a fraction of the bound the deficit rule guarantees (``<= 1``);
    * ``resume``: what Megatron's ``load_checkpoint`` restored against the stock run at the
      step saved (``_resume_checks``).
    """
    reader: MegatronDocuments = ref["reader"]
    split_text = EVAL_SPLIT if options.evaluation else "100,0,0"
    evals = []
    for n, (h, r) in enumerate(zip(hsp["evaluations"], ref["evaluations"], strict=True)):
        evals.append(
            {
                "after_step": h["after_step"],
                "split": h["split"],
                "loss_hsp": h["loss"],
                "loss_ref": r["loss"],
                "consumed_valid_samples_hsp": h["consumed_valid_samples"],
                "consumed_valid_samples_ref": r["consumed_valid_samples"],
                "consumed_valid_samples_megatron": (n + 1) * EVAL_ITERS * GLOBAL_BATCH,
                "documents": [len(b) for b in h["pieces"]],
            }
        )
    got = {"train": hsp["pieces"], "train_next": hsp["train_next"]}
    for e in hsp["evaluations"]:
        got.setdefault(e["split"], []).extend(e["pieces"])
    same = {
        split: [list(map(tuple, b)) for b in got.get(split, [])]
        == [list(map(tuple, b)) for b in want]
        for split, want in hsp["expected"].items()
    }
    outside = []
    for split, batches in got.items():
        ranges = reader.split_ranges(split_text, split.removesuffix("_next"))
        for b in batches:
            for doc, _, _ in b:
                k, local = reader.locate(doc)
                if not ranges[k][0] <= local < ranges[k][1]:
                    outside.append(f"{split}: document {doc} (dataset {k}, {local})")
    coverage, rule, order = [], [], []
    seed = int(MODEL_FLAGS[MODEL_FLAGS.index("--seed") + 1])  # no --hsp-seed: Megatron's
    for split, stream in hsp["drawn"].items():
        units = reader.split_units(split_text, split, hsp["max_length"])
        datasets = [reader.locate(doc)[0] for doc, _, _ in stream]
        for k, expected in enumerate(units):
            if k == 0 or options.blend:
                mine = [p for p, d in zip(stream, datasets, strict=True) if d == k]
                coverage += coverage_failures(mine, expected, f"{split} dataset {k}")
                own = None if k == 0 else k  # the blend's dataset k >= 1: its own stream
                order += order_failures(mine, expected, seed, own, f"{split} dataset {k}")
        if options.blend:
            lengths = [n for _, _, n in stream]
            rule += [f"{split} {f}" for f in deficit_failures(datasets, lengths, BLEND_WEIGHTS)]
    blend = None
    if options.blend:
        trained = [p for b in hsp["pieces"] for p in b]
        datasets = [reader.locate(doc)[0] for doc, _, _ in trained]
        blend = blend_deviation(datasets, [n for _, _, n in trained], BLEND_WEIGHTS)
    return {
        "evaluations": evals,
        "pieces_as_uninterrupted": same,
        "outside_split": outside[:5],
        "coverage": coverage,
        "order": order,
        "blend_rule": rule,
        "blend": blend,
        "resume": _resume_checks(hsp, ref),
    }


def _resume_checks(hsp: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any] | None:
    """Per quantity, (restored, expected) after the restart through Megatron's checkpointing;
    expected: the uninterrupted stock run after step ``RESUME_AFTER - 1`` (its records and its
    last validation ``evaluate()`` by then; both are checked against Megatron's own counts
    elsewhere). None without a restart."""
    got = hsp.get("resume")
    if got is None:
        return None
    last = ref["records"][RESUME_AFTER - 1]
    valid = [
        r["consumed_valid_samples"]
        for h, r in zip(hsp["evaluations"], ref["evaluations"], strict=True)
        if h["split"] == "valid" and h["after_step"] < RESUME_AFTER
    ]
    expected = {
        "iteration": RESUME_AFTER,
        "consumed_train_samples": last["consumed_samples"],
        "consumed_valid_samples": valid[-1] if valid else 0,
        "scheduler_num_steps": last["scheduler_num_steps"],
        "weights_restored": True,
        "guard_record": True,
        "changed_split_exit_2_everywhere": True,
        # one line, naming the flag the resume changed
        "changed_split_refused_in_one_line": True,
    }
    lines = got["refusal_lines"]
    got = {**got, "changed_split_refused_in_one_line": len(lines) == 1 and "--split" in lines[0]}
    return {
        "format": got["format"],
        "refusal": lines,
        **{k: [got[k], v] for k, v in expected.items()},
    }


def check_data(entry: dict[str, Any]) -> list[str]:
    """Failures of the data fields of one entry (``_data_checks``); empty: ok."""
    bad = []
    for e in entry.get("evaluations", []):
        rel = abs(e["loss_hsp"] - e["loss_ref"]) / max(abs(e["loss_ref"]), 1e-30)
        where = f"{e['split']} evaluation after step {e['after_step']}"
        if not rel <= CPU.loss:
            bad.append(f"{where}: loss rel diff {rel:.2e} > {CPU.loss:g}")
        for side in ("hsp", "ref"):
            if e[f"consumed_valid_samples_{side}"] != e["consumed_valid_samples_megatron"]:
                bad.append(
                    f"{where}: consumed valid samples {side} "
                    f"{e[f'consumed_valid_samples_{side}']} vs Megatron's "
                    f"{e['consumed_valid_samples_megatron']}"
                )
        if any(n != GLOBAL_BATCH for n in e["documents"]):
            bad.append(f"{where}: batches of {e['documents']} documents, not {GLOBAL_BATCH}")
    for split, same in entry.get("pieces_as_uninterrupted", {}).items():
        if not same:
            bad.append(
                f"{split} batches differ from an uninterrupted run's (evaluation moved the "
                "training sampler, or a resume did not land on the next batch)"
            )
    for where in entry.get("outside_split", []):
        bad.append(f"document outside Megatron's split: {where}")
    resume = entry.get("resume") or {}
    for key, pair in resume.items():
        if key not in ("format", "refusal") and pair[0] != pair[1]:
            bad.append(
                f"after Megatron's load_checkpoint: {key} {pair[0]}, the uninterrupted run "
                f"had {pair[1]} when it was saved"
            )
    bad += [f"not once per epoch: {f}" for f in entry.get("coverage", [])]
    bad += [f"not in the seeded order: {f}" for f in entry.get("order", [])]
    bad += [f"blend: {f}" for f in entry.get("blend_rule", [])]
    blend = entry.get("blend")
    if blend is not None and not blend["worst_over_bound"] <= 1.0:
        bad.append(
            f"blend token shares {blend['token_shares']} vs weights {blend['weights']}: off by "
            f"{blend['worst_deviation_in_documents']:.2f} documents, "
            f"{blend['worst_over_bound']:.2f}x the deficit rule's bound"
        )
    return bad


def documents_per_step_hold(s: dict[str, Any]) -> bool:
    """By documents: HSP trained Megatron's sample count. By tokens (the default): whole
    documents up to the budget, the next one crossing it, while Megatron counts its
    ``--global-batch-size`` samples a step."""
    budget = s.get("token_budget")
    if budget is None:
        return s["documents_hsp"] == s["samples_megatron"]
    following = s.get("next_document_tokens")
    return (
        s["samples_megatron"] == GLOBAL_BATCH
        and s["documents_hsp"] >= 1
        and s["tokens_hsp"] <= budget
        and (following is None or s["tokens_hsp"] + following > budget)
    )


def check(steps: list[dict[str, Any]], weight_rel: float | None = None) -> list[str]:
    """Failures of one option set against the tolerances (empty list: ok).

    ``weight_rel``: the entry's ``max_rel_weight_diff_after`` (None: not checked).
    """
    bad = []
    for s in steps:
        i = s["step"]
        for side in ("hsp", "ref"):
            if s[f"lr_{side}"] != s["lr_megatron"]:
                bad.append(
                    f"step {i}: lr {side} {s[f'lr_{side}']} vs Megatron's scheduler "
                    f"{s['lr_megatron']}"
                )
            if s[f"consumed_samples_{side}"] != s["consumed_samples_megatron"]:
                bad.append(
                    f"step {i}: consumed samples {side} {s[f'consumed_samples_{side}']} vs "
                    f"Megatron's sampler {s['consumed_samples_megatron']}"
                )
        if not documents_per_step_hold(s):
            bad.append(
                f"step {i}: HSP trained {s['documents_hsp']} documents"
                + (
                    f", Megatron counts {s['samples_megatron']} samples"
                    if s.get("token_budget") is None
                    else f" of {s['tokens_hsp']} tokens (next {s['next_document_tokens']}), "
                    f"not the budget's {s['token_budget']}"
                )
            )
        rel = abs(s["loss_hsp"] - s["loss_ref"]) / max(abs(s["loss_ref"]), 1e-30)
        if not rel <= CPU.loss:
            bad.append(f"step {i}: loss rel diff {rel:.2e} > {CPU.loss:g}")
        if not s["max_rel_grad_diff"] <= CPU.grad:
            bad.append(
                f"step {i}: grad rel diff {s['max_rel_grad_diff']:.2e} > {CPU.grad:g} "
                f"({s.get('worst_grad_param')})"
            )
        gn_h, gn_r = s["grad_norm_hsp"], s["grad_norm_ref"]
        if gn_h is None or gn_r is None or not abs(gn_h - gn_r) <= CPU.grad * abs(gn_r):
            bad.append(f"step {i}: grad norm {gn_h} vs {gn_r}")
    if weight_rel is not None and not weight_rel <= CPU.weight:
        bad.append(f"weights after the steps: rel diff {weight_rel:.2e} > {CPU.weight:g}")
    return bad


def _rel(a: float | None, b: float | None) -> float:
    if a is None or b is None:
        return math.inf
    return abs(a - b) / max(abs(b), 1e-30)


def margins(entry: dict[str, Any]) -> dict[str, float]:
    """Per check of the entry, its worst value over its tolerance (< 1: passes by 1/ratio; > 1:
    fails by ratio). Checks that must hold exactly (learning rate, consumed samples, documents
    per step, batch identity, documents in their split and once per epoch, the blend's deficit
    rule, what a resume restored) count 0 when they hold and ``inf`` when they do not."""
    out: dict[str, float] = {"weights after the steps": 0.0}
    if entry.get("max_rel_weight_diff_after") is not None:
        out["weights after the steps"] = entry["max_rel_weight_diff_after"] / CPU.weight

    def worst(name: str, value: float) -> None:
        out[name] = max(out.get(name, 0.0), value)

    def exact(name: str, holds: bool) -> None:
        worst(name, 0.0 if holds else math.inf)

    for s in entry["steps"]:
        worst("loss", _rel(s["loss_hsp"], s["loss_ref"]) / CPU.loss)
        worst("per-parameter gradients", s["max_rel_grad_diff"] / CPU.grad)
        worst("grad norm", _rel(s.get("grad_norm_hsp"), s.get("grad_norm_ref")) / CPU.grad)
        exact("lr", s["lr_hsp"] == s["lr_ref"] == s["lr_megatron"])
        exact(
            "consumed samples",
            s["consumed_samples_hsp"]
            == s["consumed_samples_ref"]
            == s["consumed_samples_megatron"],
        )
        exact("documents per step", documents_per_step_hold(s))
    for e in entry.get("evaluations", []):
        worst("evaluation loss", _rel(e["loss_hsp"], e["loss_ref"]) / CPU.loss)
        megatron = e["consumed_valid_samples_megatron"]
        exact(
            "consumed validation samples",
            e["consumed_valid_samples_hsp"] == e["consumed_valid_samples_ref"] == megatron,
        )
        exact("evaluation batch size", all(n == GLOBAL_BATCH for n in e["documents"]))
    if "pieces_as_uninterrupted" in entry:
        exact("batch identity", all(entry["pieces_as_uninterrupted"].values()))
    if "outside_split" in entry:
        exact("documents in their split", not entry["outside_split"])
    if "coverage" in entry:
        exact("once per epoch", not entry["coverage"])
    if "order" in entry:
        exact("epoch order", not entry["order"])
    if entry.get("blend") is not None:
        exact("blend deficit rule", not entry.get("blend_rule"))
        worst("blend share bound", entry["blend"]["worst_over_bound"])
    resume = entry.get("resume") or {}
    pairs = [v for k, v in resume.items() if k not in ("format", "refusal")]
    if pairs:
        exact("resume record", all(v[0] == v[1] for v in pairs))
    return out


def margin(entry: dict[str, Any]) -> float:
    """The entry's worst check over its tolerance (``margins``): < 1 passes, > 1 fails."""
    return max(margins(entry).values())


def worst_check(entry: dict[str, Any]) -> str:
    """Which check gives ``margin`` (the first of equals)."""
    ratios = margins(entry)
    return max(ratios, key=lambda k: ratios[k])


def format_margin(value: float) -> str:
    """A margin as printed; ``inf`` says that an exact check failed."""
    return "inf (an exact check failed)" if math.isinf(value) else f"{value:.3g}"

"""The loop's option sets (``LoopOptions``, ``DEFAULT_OPTIONS``) and the run's sizes: steps,
batch, evaluation, split, blend, resume point, model shape; each option set's Megatron,
pipeline, MoE, HSP and data flags and its cost model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

STEPS = 3
GLOBAL_BATCH = 8
EVAL_ITERS = 1  # validation batches per evaluation (Megatron's --eval-iters)
EVAL_INTERVAL = 1  # evaluate after every training step (Megatron's --eval-interval)
# 64 + 32 documents: 50 + 25 train, 7 + 3 validation, 7 + 4 test. Boundaries at 49.8, 56.9 and
# 24.9, 28.4 documents: not integers, so megatron-core's rounding decides them.
EVAL_SPLIT = "7,1,1"
# Beyond what the run trains, the oracle's once-per-epoch check draws this many times each
# split's sequences from copies of its live sampler (lengths only), so that every dataset of a
# blend completes at least two epochs (testing/sampler_oracle.py).
CONTINUE_EPOCHS = 4
BLEND_WEIGHTS = (0.4, 0.6)
RESUME_AFTER = 2  # the resumed HSP side trains steps 2.. after a restart
HEAD_DIM = 4  # --hidden-size is HEAD_DIM x --num-attention-heads
MOE_TOPK = 2  # --moe-router-topk of the MoE option sets
KV_GROUPS = 2
SP_SPEC = ("megatron_hsp.testing.sp_spec", "local_sp_block_spec")
PIPELINE_LAYERS = 4  # layers of the pipeline option sets: 2 per stage, 1 per virtual stage
QK_NORM_FLAGS = {"l2-norm": "--qk-l2-norm", "layernorm": "--qk-layernorm"}

# The HSP side runs the user-facing defaults (the online refit on, the default overlong policy,
# the default planner process) except for these switches, the only ones the loop adds beyond
# ``--hsp``, the data flags and an option set's own choice (group sizes, plan method, plan log).
# Each with why it is there; ``selftest --megatron`` prints them (``driver.loop_table``).
TEST_ONLY_SWITCHES: tuple[tuple[str, str], ...] = (
    (
        "--hsp-solver greedy",
        "the default solver (highs) searches up to --hsp-time-budget-s (5 s) a plan on a "
        "shared CPU; the comparison holds for any plan (the planner's tests cover the solvers)",
    ),
    (
        "--hsp-sync-planner",
        "plans in the training process: no planner process started per option set; the "
        "background planner runs in megatron_loop/refit.py (tests/megatron/test_megatron_refit.py)",
    ),
    (
        "--hsp-cost-model FILE",
        "the default cost model prices a GPU from first principles; the loop's file (per option "
        "set) decides which group kinds (ring, hybrid, groups on padding) this tiny model runs",
    ),
    (
        "--hsp-batch-unit documents",
        "all but the token-budget option sets: Megatron's evaluate() and the checks of the "
        "evaluation, resume and blend sets count --global-batch-size documents per batch, and "
        "the default budget (8 x 256 tokens, ~40 of the loop's documents) trains ~5x the "
        "tokens of 8 documents a step; the token-budget set runs the default",
    ),
)


def switches(options: LoopOptions) -> list[str]:
    """The ``TEST_ONLY_SWITCHES`` an option set's HSP side runs with."""
    flags = [flag for flag, _ in TEST_ONLY_SWITCHES]
    return [f for f in flags if options.batch_unit != "tokens" or "batch-unit" not in f]


def test_only_switches_text() -> str:
    """``TEST_ONLY_SWITCHES`` as lines (``selftest --megatron`` prints them)."""
    return "\n".join(f"  {flag}: {why}" for flag, why in TEST_ONLY_SWITCHES)


# What a user would pass Megatron for this tiny fp32 model (local modules, no fusions on CPU);
# heads, hidden size and parallelism come from ``LoopOptions.flags``.
MODEL_FLAGS = [
    *("--num-layers", "2", "--ffn-hidden-size", "64"),
    *("--group-query-attention", "--num-query-groups", str(KV_GROUPS)),
    *("--seq-length", "256", "--max-position-embeddings", "512"),
    "--untie-embeddings-and-output-weights",
    *("--micro-batch-size", "1", "--global-batch-size", str(GLOBAL_BATCH)),
    *("--train-iters", "8", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine"),
    *("--lr-warmup-iters", "2", "--lr-decay-iters", "8", "--clip-grad", "1.0"),
    *("--eval-iters", "0", "--eval-interval", "1000"),  # pretrain() divides by the interval
    *("--transformer-impl", "local", "--use-cpu-initialization"),
    *("--no-gradient-accumulation-fusion", "--attention-dropout", "0", "--hidden-dropout", "0"),
    *("--no-bias-dropout-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion"),
    *("--no-persist-layer-norm", "--calculate-per-token-loss", "--seed", "1234"),
    *("--tokenizer-type", "NullTokenizer", "--vocab-size", "128"),
    *("--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"),
    "--disable-gloo-process-groups",  # the default group is gloo already (testing.dist)
]


@dataclass(frozen=True)
class LoopOptions:
    """One Megatron configuration the comparison runs under.

    ``group_sizes`` is passed as ``--hsp-group-sizes`` (None: every legal size the cost model
    prices); ``attention_heads`` with 2 KV groups decides each size's Ulysses x ring split
    (``groupspace.HeadSpace.split``): 8 heads make a group of 3 pure ring (1 x 3), 6 heads make a
    group of 4 hybrid (2 x 2). ``tokens_per_rank`` is the loop's cost model's capacity: documents
    over it need a group of 2 and so on (the corpus's longest is 200 tokens).
    """

    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    tp: int = 1
    sequence_parallel: bool = False
    group_sizes: tuple[int, ...] | None = None
    attention_heads: int = 8
    tokens_per_rank: int = 64
    # "rope", or Megatron's default "learned_absolute": an embedding table indexed by the
    # position ids HSP dispatches (RoPE recomputes positions inside attention and never reads them)
    position_embedding_type: str = "rope"
    # Megatron's evaluate() on the validation split every step and on the test split
    # after the last (both sides, --split EVAL_SPLIT); a two-dataset blend (--data-path 0.4 A
    # 0.6 B); a resume after RESUME_AFTER steps (the HSP side saves with Megatron's
    # save_checkpoint, is torn down and rebuilt with Megatron's load_checkpoint; the stock side
    # runs through).
    evaluation: bool = False
    blend: bool = False
    resume: bool = False
    # Pipeline stages of the HSP side (1F1B), and virtual stages per pipeline rank
    # (None: none; > 1: the interleaved schedule). The stock side is the unpipelined model
    # (``_run_stock``), so both sides get PIPELINE_LAYERS layers.
    pp: int = 1
    vpp: int | None = None
    # MoE layers (megatron-core's local block spec, SequentialMLP experts, top-2,
    # dropless) with ``ep`` expert-parallel ranks and the given token dispatcher; the
    # per-sequence aux loss and z-loss coefficients (0: off).
    num_experts: int | None = None
    ep: int = 1
    moe_dispatcher: str = "alltoall"
    seq_aux_loss: float = 0.0
    z_loss: float = 0.0
    # Normalization of queries and keys (a model-definition flag: ``QK_NORM_FLAGS``), which
    # changes the model but no parameter name (L2Norm has no weights): None, "l2-norm" or
    # "layernorm".
    qk_norm: str | None = None
    # Whose plan the HSP side trains (--hsp-plan-method: hsp or a baseline on the same
    # batches); an A/B of two option sets differing only here trains identical batches, and
    # their plan logs (``plan_log``: --hsp-plan-log, returned in the entry) feed
    # ``megatron-hsp compare``.
    plan_method: str = "hsp"
    plan_log: bool = False
    # What a global batch counts (--hsp-batch-unit): "documents" (--global-batch-size of
    # them, a test-only switch: ``TEST_ONLY_SWITCHES``) or "tokens", the users' default (the
    # stock step's --global-batch-size x --seq-length tokens of whole documents).
    batch_unit: str = "documents"

    def moe_flags(self) -> list[str]:
        """Megatron's MoE flags of this option set (none for a dense model)."""
        if not self.num_experts:
            return []
        out = [
            *("--num-experts", str(self.num_experts), "--moe-router-topk", str(MOE_TOPK)),
            *("--expert-model-parallel-size", str(self.ep)),
            *("--moe-token-dispatcher-type", self.moe_dispatcher),
        ]
        if self.seq_aux_loss:
            out += ["--moe-router-load-balancing-type", "seq_aux_loss"]
            out += ["--moe-aux-loss-coeff", str(self.seq_aux_loss)]
        if self.z_loss:
            out += ["--moe-z-loss-coeff", str(self.z_loss)]
        return out

    def qk_flags(self) -> list[str]:
        """Megatron's flag normalizing queries and keys (none when ``qk_norm`` is None)."""
        return [QK_NORM_FLAGS[self.qk_norm]] if self.qk_norm else []

    def flags(self) -> list[str]:
        """Megatron flags of this option set (both sides)."""
        out = [
            *("--num-attention-heads", str(self.attention_heads)),
            *("--hidden-size", str(HEAD_DIM * self.attention_heads)),
            *("--position-embedding-type", self.position_embedding_type),
        ]
        if self.tp > 1:
            out += ["--tensor-model-parallel-size", str(self.tp)]
        if self.sequence_parallel:
            # Megatron's CPU norms refuse sequence parallelism (testing/sp_spec.py says why).
            out += ["--sequence-parallel", "--spec", *SP_SPEC]
        if self.distributed_optimizer:
            out.append("--use-distributed-optimizer")
        if self.overlap_grad_reduce:
            out.append("--overlap-grad-reduce")
        if self.evaluation:
            out += ["--eval-iters", str(EVAL_ITERS), "--eval-interval", str(EVAL_INTERVAL)]
        if self.pp > 1:
            out += ["--num-layers", str(PIPELINE_LAYERS)]
        return out + self.moe_flags() + self.qk_flags()

    def pipeline_flags(self) -> list[str]:
        """Megatron's pipeline flags (HSP side only: the stock reference is unpipelined).
        Interleaving on 2 stages needs Megatron's default overlapped p2p communication (its
        ``validate_args`` refuses it under ``--no-overlap-p2p-communication``)."""
        if self.pp == 1:
            return []
        out = ["--pipeline-model-parallel-size", str(self.pp)]
        if self.vpp:
            per_chunk = PIPELINE_LAYERS // (self.pp * self.vpp)
            out += ["--num-layers-per-virtual-pipeline-stage", str(per_chunk)]
        return out

    def hsp_flags(self) -> list[str]:
        """``--hsp*`` flags beyond the data and cost model (HSP side only).

        ``--hsp-batch-unit documents`` unless ``batch_unit`` is "tokens" (the default: no
        flag): ``TEST_ONLY_SWITCHES`` says why most option sets count documents."""
        out = [] if self.batch_unit == "tokens" else ["--hsp-batch-unit", self.batch_unit]
        if self.plan_method != "hsp":
            out += ["--hsp-plan-method", self.plan_method]
        if self.group_sizes is None:
            return out
        return [*out, "--hsp-group-sizes", ",".join(map(str, self.group_sizes))]

    def data_flags(self, prefixes: Sequence[str]) -> list[str]:
        """Megatron's data flags (HSP side: its provider reads them): one dataset, or the blend
        of the first two at ``BLEND_WEIGHTS``; without evaluation every document trains."""
        if self.blend:
            (wa, wb), (a, b) = BLEND_WEIGHTS, prefixes[:2]
            data = ["--data-path", str(wa), a, str(wb), b]
        else:
            data = ["--data-path", prefixes[0]]
        return [*data, "--split", EVAL_SPLIT if self.evaluation else "100,0,0"]

    def heads(self) -> Any:
        """Query and KV heads per tensor-parallel rank (``groupspace.HeadSpace``)."""
        from megatron_hsp.planner.groupspace import HeadSpace

        return HeadSpace.from_model(self.attention_heads, KV_GROUPS, self.tp)

    def cost_model(self) -> dict[str, Any]:
        """The loop's cost model (a file, passed with ``--hsp-cost-model`` as a user's fit
        would be): every size > 1 of ``group_sizes`` (default 2 and 4) priced, ring steps
        priced for pure ring at every size (as the first-principles model prices them: a
        megatron-dcp run's groups are pure ring), and the heads per TP rank, so the plans
        record each group's Ulysses x ring split."""
        heads = self.heads()
        sizes = [d for d in (self.group_sizes or (2, 4)) if d > 1]
        return {
            "name": "megatron-loop-cpu",
            "coefficients": {
                "attn_ms_per_token2": 5.0e-5,
                "linear_ms_per_token": 0.12,
                "group_fixed_ms": 30.0,
                "a2a_ms_per_token": {d: 0.02 + 0.005 * d for d in sizes},
                "ring_step_ms_per_token": {d: 0.02 for d in sizes},
                "tokens_per_rank": self.tokens_per_rank,
                "heads": [heads.q_heads, heads.kv_heads],
            },
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "distributed_optimizer": self.distributed_optimizer,
            "overlap_grad_reduce": self.overlap_grad_reduce,
            "tp": self.tp,
            "sequence_parallel": self.sequence_parallel,
            "group_sizes": None if self.group_sizes is None else list(self.group_sizes),
            "attention_heads": self.attention_heads,
            "position_embedding_type": self.position_embedding_type,
            "evaluation": self.evaluation,
            "blend": self.blend,
            "resume": self.resume,
            "pp": self.pp,
            "vpp": self.vpp,
            "num_experts": self.num_experts,
            "ep": self.ep,
            "moe_dispatcher": self.moe_dispatcher if self.num_experts else None,
            "seq_aux_loss": self.seq_aux_loss,
            "z_loss": self.z_loss,
            "qk_norm": self.qk_norm,
            "plan_method": self.plan_method,
            "plan_log": self.plan_log,
            "batch_unit": self.batch_unit,
        }

    @property
    def label(self) -> str:
        parts = []
        if self.distributed_optimizer:
            parts.append("distopt")
        if self.overlap_grad_reduce:
            parts.append("overlap")
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sequence_parallel else ""))
        if self.group_sizes is not None:
            parts.append("sizes " + ",".join(map(str, self.group_sizes)))
        if self.attention_heads != 8:
            parts.append(f"{self.attention_heads} heads")
        if self.position_embedding_type != "rope":
            parts.append(self.position_embedding_type)
        parts += [n for n in ("evaluation", "blend", "resume") if getattr(self, n)]
        if self.pp > 1:
            parts.append(f"pp{self.pp}" + (f" vpp{self.vpp}" if self.vpp else ""))
        if self.num_experts:
            parts.append(f"moe{self.num_experts} ep{self.ep} {self.moe_dispatcher}")
            if self.seq_aux_loss:
                parts.append(f"seqaux {self.seq_aux_loss:g}")
            if self.z_loss:
                parts.append(f"z {self.z_loss:g}")
        if self.qk_norm:
            parts.append(f"qk-{self.qk_norm}")
        if self.plan_method != "hsp":
            parts.append(f"plan {self.plan_method}")
        if self.batch_unit != "documents":
            parts.append(f"by {self.batch_unit}")
        return " ".join(parts) or "ddp"


DEFAULT_OPTIONS = (
    LoopOptions(),
    LoopOptions(distributed_optimizer=True),
    LoopOptions(overlap_grad_reduce=True),
    # 2 sequence-parallel slots of 2 TP ranks: groups of 1 and 2 (4 query heads, 1 KV head per
    # TP rank); 100 tokens per rank fit the 200-token documents in a group of 2.
    LoopOptions(tp=2, sequence_parallel=True, tokens_per_rank=100),
    # The same with 6 heads (3 query heads per TP rank): a group of 2 is pure ring (1 x 2); the
    # distributed optimizer shards over the 2 data-parallel ranks.
    LoopOptions(
        tp=2,
        sequence_parallel=True,
        attention_heads=6,
        distributed_optimizer=True,
        tokens_per_rank=100,
    ),
    # Sizes 1, 2 and 3 with 8 heads: a group of 3 is pure ring (1 x 3); 70 tokens per rank put
    # the 200-token documents in groups of 3.
    LoopOptions(group_sizes=(1, 2, 3), tokens_per_rank=70),
    # 6 heads: a group of 4 runs Ulysses 2 x ring 2; the distributed optimizer shards it; with
    # Megatron's default learned absolute positions, so the dispatched position ids are used.
    LoopOptions(
        attention_heads=6, distributed_optimizer=True, position_embedding_type="learned_absolute"
    ),
    # Evaluation on the validation and test splits, a two-dataset blend, and a resume
    # after step 2 (the validation sampler resumed too), with the distributed optimizer.
    LoopOptions(distributed_optimizer=True, evaluation=True, blend=True, resume=True),
    # 2 pipeline stages of 2 data-parallel slots (groups of 1 and 2; 100 tokens per
    # rank fit the 200-token documents in a group of 2), 1F1B; then interleaved with 2 virtual
    # stages per rank (one layer per chunk), with evaluation (forward-only interleaved schedule,
    # per-chunk evaluation iterators).
    LoopOptions(pp=2, tokens_per_rank=100),
    LoopOptions(pp=2, vpp=2, evaluation=True, tokens_per_rank=100),
    # Dropless MoE, 4 experts top-2, alltoall. EP 1 without router losses; EP 2
    # (2 experts per rank, expert-data-parallel 2) with the per-sequence aux loss and the
    # z-loss, which HSP computes per document over the ranks holding it (runtime/moe.py).
    LoopOptions(num_experts=4),
    LoopOptions(num_experts=4, ep=2, seq_aux_loss=0.1, z_loss=0.01),
    # EP 2 with the distributed optimizer (expert buffers sharded over expert-data-parallel
    # ranks) and sizes 1 and 2: some micro-batches leave a group without documents, whose
    # ranks run on padding to join the all-to-alls.
    LoopOptions(
        num_experts=4,
        ep=2,
        distributed_optimizer=True,
        group_sizes=(1, 2),
        tokens_per_rank=100,
        seq_aux_loss=0.1,
    ),
    # The allgather dispatcher (EP 1: HSP refuses it under EP > 1, megatron/refusals.py says why).
    LoopOptions(num_experts=4, moe_dispatcher="allgather", seq_aux_loss=0.1, z_loss=0.01),
    # MoE with --qk-l2-norm (issue 44): Megatron's builder gives the MoE block spec L2Norm on
    # queries and keys (its local dense spec takes no qk-l2-norm); a spec built under --hsp
    # that dropped it trains another model with the same parameters, which only the loss and
    # gradients show (the ``moe-spec-drops-qk-l2-norm`` plant).
    LoopOptions(num_experts=4, qk_norm="l2-norm"),
    # The users' batch default, --hsp-batch-unit tokens (no flag): the stock step's 8 x 256
    # tokens of whole documents a step, as many as fit, while Megatron counts 8 samples. Sizes
    # 1 and 2 at 64 tokens per rank hold 128 tokens at most, so the default overlong policy
    # (split) cuts the longer documents into pieces of 128 that the stock side reads too.
    LoopOptions(batch_unit="tokens", group_sizes=(1, 2), tokens_per_rank=64),
)

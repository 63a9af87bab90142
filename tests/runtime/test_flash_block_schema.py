"""The fused ring's flash calls against the installed torch's own operator schemas.

``aten._flash_attention_forward`` / ``_backward`` are private operators whose arguments have
changed across releases; the fused ring (``runtime/ring.py``) builds each call by the schema's
argument names (``flash_forward_call`` / ``flash_backward_call``). This test reads
``torch.ops.aten.<op>.default._schema`` of whichever torch runs it (CI: the pinned venv, torch
2.14.1, and ``make test-oldest-torch``, torch 2.11.0) and checks every name, position and type,
then runs the ring's own flash block kernel (``ring.FLASH_KERNEL``) on meta tensors, which goes
through the dispatcher's argument parsing and torch's meta kernels of the two operators (shapes of
out, log-sum-exp and gradients). No GPU runs here: this checks the call, not the kernel's numbers
(docs/gpu-validation.md)."""

from __future__ import annotations

import pytest
import torch

from megatron_hsp.runtime import ring

H, HK, D = 4, 2, 64
LENGTHS_Q, LENGTHS_K = [3, 5, 2], [4, 5, 6]


def _type_name(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "Tensor"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return type(value).__name__


def _accepts(schema_type: str, value: object) -> bool:
    """Whether a schema type (``Tensor``, ``Optional[Tensor]`` / ``Tensor?``, ``SymInt``, ...)
    takes it."""
    optional = schema_type.endswith("?") or schema_type.startswith("Optional[")
    base = schema_type.removeprefix("Optional[").removesuffix("]").rstrip("?")
    if value is None:
        return optional
    want = {"SymInt": "int", "int": "int", "float": "float", "bool": "bool", "Tensor": "Tensor"}
    return want.get(base) == _type_name(value)


def mismatches(schema: torch._C.FunctionSchema, positional: dict, keywords: dict) -> list[str]:
    """What is wrong with a call by ``positional`` (in order) and ``keywords`` for ``schema``."""
    problems = []
    args = list(schema.arguments)
    pos_args = [a for a in args if not a.kwarg_only]
    kw_args = {a.name: a for a in args if a.kwarg_only}
    names = list(positional)
    if len(names) > len(pos_args):
        problems.append(f"{len(names)} positional arguments, the schema has {len(pos_args)}")
    for i, a in enumerate(pos_args):
        if i >= len(names):
            if not a.has_default_value():
                problems.append(f"required positional {a.name!r} not passed")
            continue
        if names[i] != a.name:
            problems.append(f"position {i}: passed as {names[i]!r}, the schema names {a.name!r}")
        elif not _accepts(str(a.type), positional[names[i]]):
            problems.append(f"{a.name}: {_type_name(positional[names[i]])} for {a.type}")
    for name, value in keywords.items():
        if name not in kw_args:
            problems.append(f"keyword {name!r} is not in the schema ({sorted(kw_args)})")
        elif not _accepts(str(kw_args[name].type), value):
            problems.append(f"{name}: {_type_name(value)} for {kw_args[name].type}")
    problems += [
        f"required keyword {a.name!r} not passed"
        for a in kw_args.values()
        if a.name not in keywords and not a.has_default_value()
    ]
    return problems


def _cu(lengths: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).to(
        device
    )


def _block(device: str, dtype: torch.dtype = torch.bfloat16):
    tq, tk = sum(LENGTHS_Q), sum(LENGTHS_K)
    q = torch.empty(tq, H, D, device=device, dtype=dtype)
    k = torch.empty(tk, HK, D, device=device, dtype=dtype)
    v = torch.empty(tk, HK, D, device=device, dtype=dtype)
    return q, k, v, _cu(LENGTHS_Q, device), _cu(LENGTHS_K, device)


def _calls():
    q, k, v, cu_q, cu_k = _block("cpu")
    fwd = ring.flash_forward_call(q, k, v, cu_q, cu_k, 5, 6, True, 0.125)
    lse = torch.empty(H, q.size(0))
    aux = (torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64))
    bwd = ring.flash_backward_call(q, q, k, v, q, lse, cu_q, cu_k, 5, 6, True, 0.125, aux)
    return {"_flash_attention_forward": fwd, "_flash_attention_backward": bwd}


@pytest.mark.parametrize("op", ["_flash_attention_forward", "_flash_attention_backward"])
def test_the_ring_calls_flash_by_the_installed_torch_schema(op: str) -> None:
    schema = getattr(torch.ops.aten, op).default._schema
    positional, keywords = _calls()[op]
    assert mismatches(schema, positional, keywords) == [], (torch.__version__, str(schema))
    # The check can fail: a renamed argument, a keyword the schema lacks, a wrong type.
    renamed = {("cu_seqlens_q" if n == "cum_seq_q" else n): x for n, x in positional.items()}
    assert mismatches(schema, renamed, keywords)
    assert mismatches(schema, positional, {"softmax_scale": 0.125})
    assert mismatches(schema, {**positional, "max_q": 5.0}, keywords)
    assert mismatches(schema, dict(list(positional.items())[:-1]), keywords)


def test_the_flash_block_kernel_runs_through_the_operators_on_meta_tensors() -> None:
    """The ring's FLASH_KERNEL end to end through the dispatcher (meta kernels): a wrong name,
    count or type raises here, and the outputs have the shapes the ring merges and scatters."""
    q, k, v, cu_q, cu_k = _block("meta")
    out, lse, aux = ring.FLASH_KERNEL.forward(q, k, v, cu_q, cu_k, 5, 6, True, 0.125)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (H, q.size(0)) and lse.dtype == torch.float32  # [h, total_q], varlen
    dq, dk, dv = ring.FLASH_KERNEL.backward(
        torch.empty_like(q), q, k, v, out, lse, cu_q, cu_k, 5, 6, True, 0.125, aux
    )
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == q.dtype


def test_the_fused_route_needs_cuda_a_half_dtype_and_a_flash_head_dim() -> None:
    fused = ring.flash_block_available()
    assert fused  # both ends of the supported torch range have the operators
    assert ring.ring_route("cuda", torch.bfloat16, 128) == "ring-fused"
    assert ring.ring_route("cuda", torch.float16, 64) == "ring-fused"
    assert ring.ring_route("cuda", torch.float32, 128) == "ring-tiled"
    assert ring.ring_route("cuda", torch.bfloat16, 12) == "ring-tiled"
    assert ring.ring_route("cuda", torch.bfloat16, 512) == "ring-tiled"
    assert ring.ring_route("cpu", torch.bfloat16, 128) == "ring-tiled"

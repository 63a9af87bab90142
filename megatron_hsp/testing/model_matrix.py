"""The model HSP builds against the model Megatron builds: spec trees and module trees compared.

``spec_differences(stock, hsp)`` walks two megatron-core specs (``ModuleSpec``, the dataclass
submodules, ``functools.partial`` layer builders, block and hybrid stack specs, their params)
side by side and lists every place they differ; ``module_differences(stock, hsp)`` does the same
for two instantiated models (module types, parameter and buffer names, shapes and values, the
modules' plain attributes and their ``TransformerConfig`` flags). ``unexpected`` removes what
``--hsp`` replaces on purpose (``HSP_REPLACES``): the self-attention module and its core
attention in every attention layer, and the MoE router. Anything else is a model ``--hsp``
changed that Megatron's flags did not ask for (issue 44: an MoE spec that dropped
``--qk-l2-norm`` trained a different model with the same parameters).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, NamedTuple

import torch


class Difference(NamedTuple):
    path: str
    stock: Any
    hsp: Any

    def __str__(self) -> str:
        return f"{self.path}: stock {_name(self.stock)} != hsp {_name(self.hsp)}"


def _name(value: Any) -> str:
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, functools.partial):
        return f"partial({_name(value.func)}, ...)"
    return repr(value)


def _resolved(spec: Any) -> Any:
    """A ``layer_spec.DeferredSpec`` built (as on its first read), and a
    ``ModuleSpec(TransformerBlock, submodules=<block submodules>)`` as those submodules:
    megatron-core's ``TransformerBlock`` takes both forms alike
    (``transformer_block._get_block_submodules``)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
    )

    resolve = getattr(spec, "resolve", None)  # layer_spec.DeferredSpec: built on first read
    if callable(resolve):
        spec = resolve()
    if (
        isinstance(spec, ModuleSpec)
        and isinstance(spec.module, type)
        and issubclass(spec.module, TransformerBlock)
        and isinstance(spec.submodules, TransformerBlockSubmodules)
        and not spec.params
    ):
        return spec.submodules
    return spec


def spec_differences(stock: Any, hsp: Any, path: str = "spec") -> list[Difference]:
    """Every place the two spec trees differ (classes and functions by identity, values by
    ``==``)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if stock is hsp:
        return []
    stock, hsp = _resolved(stock), _resolved(hsp)
    if isinstance(stock, ModuleSpec) and isinstance(hsp, ModuleSpec):
        return [
            *_leaf(stock.module, hsp.module, f"{path}.module"),
            *spec_differences(stock.params, hsp.params, f"{path}.params"),
            *spec_differences(stock.submodules, hsp.submodules, f"{path}.submodules"),
            *spec_differences(
                getattr(stock, "metainfo", None), getattr(hsp, "metainfo", None), f"{path}.metainfo"
            ),
        ]
    if isinstance(stock, functools.partial) and isinstance(hsp, functools.partial):
        return [
            *_leaf(stock.func, hsp.func, f"{path}.func"),
            *spec_differences(list(stock.args), list(hsp.args), f"{path}.args"),
            *spec_differences(stock.keywords, hsp.keywords, f"{path}.keywords"),
        ]
    if dataclasses.is_dataclass(stock) and not isinstance(stock, type) and type(stock) is type(hsp):
        out: list[Difference] = []
        for field in dataclasses.fields(stock):
            out += spec_differences(
                getattr(stock, field.name), getattr(hsp, field.name), f"{path}.{field.name}"
            )
        return out
    if isinstance(stock, dict) and isinstance(hsp, dict):
        out = [Difference(f"{path}[{k!r}]", stock.get(k), hsp.get(k)) for k in stock.keys() ^ hsp]
        for key in stock.keys() & hsp.keys():
            out += spec_differences(stock[key], hsp[key], f"{path}[{key!r}]")
        return out
    if isinstance(stock, (list, tuple)) and isinstance(hsp, (list, tuple)):
        if len(stock) != len(hsp):
            return [Difference(f"{path} (length)", len(stock), len(hsp))]
        out = []
        for i, (s, h) in enumerate(zip(stock, hsp, strict=True)):
            out += spec_differences(s, h, f"{path}[{i}]")
        return out
    return _leaf(stock, hsp, path)


def _leaf(stock: Any, hsp: Any, path: str) -> list[Difference]:
    if stock is hsp:
        return []
    if isinstance(stock, functools.partial) or isinstance(hsp, functools.partial):
        return (
            spec_differences(stock, hsp, path)
            if type(stock) is type(hsp)
            else [Difference(path, stock, hsp)]
        )
    try:
        same = bool(stock == hsp)
    except Exception:  # tensors and the like: identity only
        same = False
    return [] if same and type(stock) is type(hsp) else [Difference(path, stock, hsp)]


def hsp_replaces() -> dict[str, tuple[tuple[type, ...] | None, type]]:
    """Path ending -> (the stock classes it may replace, None: any; HSP's class): what
    ``--hsp`` swaps on purpose, in spec paths and module names alike."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_hsp.runtime.attention import HSPCoreAttention, HSPSelfAttention
    from megatron_hsp.runtime.moe import HSPTopKRouter

    return {
        "self_attention.module": ((SelfAttention,), HSPSelfAttention),  # spec
        "self_attention.submodules.core_attention": (None, HSPCoreAttention),  # spec
        "router": ((TopKRouter,), HSPTopKRouter),  # the MoE layer's, in specs and modules
        "self_attention": ((SelfAttention,), HSPSelfAttention),  # module tree
        "self_attention.core_attention": (None, HSPCoreAttention),  # module tree
    }


def _core(value: Any) -> Any:
    return value.func if isinstance(value, functools.partial) else value


def is_hsp_replacement(diff: Difference) -> bool:
    """Whether ``diff`` is one of the swaps ``--hsp`` makes on purpose."""
    for ending, (stock_classes, hsp_class) in hsp_replaces().items():
        if (
            diff.path == ending
            or diff.path.endswith("." + ending)
            or (diff.path.endswith(" (type)") and diff.path[: -len(" (type)")].endswith(ending))
        ):
            stock, hsp = _core(diff.stock), _core(diff.hsp)
            if hsp is hsp_class and (stock_classes is None or stock in stock_classes):
                return True
    return False


def unexpected(diffs: list[Difference]) -> list[Difference]:
    """The differences ``--hsp`` should not have made."""
    return [d for d in diffs if not is_hsp_replacement(d)]


_PLAIN = (bool, int, float, str, type(None), enum.Enum)


def _plain_attributes(module: torch.nn.Module) -> dict[str, Any]:
    return {
        k: v for k, v in vars(module).items() if isinstance(v, _PLAIN) and k not in ("training",)
    }


def _config_flags(config: Any) -> dict[str, Any]:
    if not dataclasses.is_dataclass(config):
        return {}
    out = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name, None)
        if isinstance(value, _PLAIN) or (
            isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value)
        ):
            out[field.name] = value
    return out


def module_differences(stock: torch.nn.Module, hsp: torch.nn.Module) -> list[Difference]:
    """Every place the two instantiated models differ: the module tree (names, types), each
    parameter and buffer (name, shape, dtype, value), each module's plain attributes (e.g.
    ``layer_number``, ``attn_mask_type``) and its ``config``'s plain fields (``qk_l2_norm``,
    ``qk_layernorm``, ...). Inside HSP's own replacements only the parameters are compared
    (their internals are HSP's)."""
    out: list[Difference] = []
    stock_modules, hsp_modules = dict(stock.named_modules()), dict(hsp.named_modules())
    replaced = [
        name
        for name in stock_modules.keys() & hsp_modules.keys()
        if type(stock_modules[name]) is not type(hsp_modules[name])
        and is_hsp_replacement(
            Difference(f"{name} (type)", type(stock_modules[name]), type(hsp_modules[name]))
        )
    ]

    def inside_replacement(name: str) -> bool:
        return any(name == r or name.startswith(r + ".") for r in replaced)

    for name in sorted(stock_modules.keys() ^ hsp_modules.keys()):
        only = stock_modules.get(name) or hsp_modules.get(name)
        if inside_replacement(name) and not list(only.parameters()):
            # the replaced attention's parameterless helpers (stock's softmax and dropout,
            # HSP's own): their parameters, none, are compared below
            continue
        out.append(Difference(f"{name} (module)", stock_modules.get(name), hsp_modules.get(name)))
    for name in sorted(stock_modules.keys() & hsp_modules.keys()):
        s, h = stock_modules[name], hsp_modules[name]
        if type(s) is not type(h):
            out.append(Difference(f"{name} (type)", type(s), type(h)))
        if inside_replacement(name) and type(s) is not type(h):
            # HSP's subclass keeps the stock attributes it inherits; its own may differ.
            sa, ha = _plain_attributes(s), _plain_attributes(h)
            sa = {k: v for k, v in sa.items() if k in ha}
        else:
            sa, ha = _plain_attributes(s), _plain_attributes(h)
        if not (inside_replacement(name) and name.endswith("core_attention")):
            for key in sorted(sa.keys() | ha.keys()):
                if sa.get(key, KeyError) != ha.get(key, KeyError):
                    out.append(Difference(f"{name}.{key}", sa.get(key), ha.get(key)))
        sc = _config_flags(getattr(s, "config", None))
        hc = _config_flags(getattr(h, "config", None))
        for key in sorted(sc.keys() | hc.keys()):
            if sc.get(key, KeyError) != hc.get(key, KeyError):
                out.append(Difference(f"{name}.config.{key}", sc.get(key), hc.get(key)))
    for kind, stock_t, hsp_t in (
        ("parameter", dict(stock.named_parameters()), dict(hsp.named_parameters())),
        ("buffer", dict(stock.named_buffers()), dict(hsp.named_buffers())),
    ):
        for name in sorted(stock_t.keys() ^ hsp_t.keys()):
            out.append(Difference(f"{name} ({kind})", stock_t.get(name), hsp_t.get(name)))
        for name in sorted(stock_t.keys() & hsp_t.keys()):
            s, h = stock_t[name], hsp_t[name]
            if s.shape != h.shape or s.dtype != h.dtype:
                out.append(
                    Difference(f"{name} ({kind} shape)", (s.shape, s.dtype), (h.shape, h.dtype))
                )
            elif not torch.equal(s.detach(), h.detach()):
                out.append(Difference(f"{name} ({kind} value)", "initial value", "another"))
    return out

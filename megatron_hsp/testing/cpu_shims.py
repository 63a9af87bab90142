"""Device-placement shims that let stock megatron-core modules run on the CPU (tests, selftest,
demo). Each one only changes WHERE a tensor megatron-core allocates lives; none changes what is
computed. They are listed in the patch table of ``megatron_hsp/megatron/patches.py``.

This module imports nothing from ``megatron_hsp``: the selftest's independent reference
(``testing/reference.py``) uses it, and must not reach HSP code through it.

* ``use_cpu_rotary``: megatron-core 0.19.2's ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to
  ``torch.cuda.current_device()`` unconditionally on first use, so a CPU ``GPTModel`` with RoPE
  cannot run forward. The class of those instances is swapped for a subclass computing the
  identical table on the model's device (instance level, no global patch).
* ``cpu_attention_scores_buffer``: megatron-core's ``DotProductAttention`` (the local spec's core
  attention) takes its ``[b*np, sq, sk]`` score buffer from ``parallel_state``'s global memory
  buffer, which allocates on ``torch.cuda.current_device()``. Pre-allocating that named buffer on
  the CPU, large enough for every call, makes megatron's own ``get_tensor`` hand out CPU views.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch


def cpu_rotary_embedding_class() -> type:
    """A megatron ``RotaryEmbedding`` whose table stays on the CPU (see the module docstring)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class CpuRotaryEmbedding(RotaryEmbedding):
        def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
            freqs = self.get_freqs_non_repeated(max_seq_len, offset)
            if not self.rotary_interleaved:
                emb = torch.cat((freqs, freqs), dim=-1)
            else:
                emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(
                    freqs.shape[0], -1
                )
            return emb[:, None, None, :]

    return CpuRotaryEmbedding


def use_cpu_rotary(model: torch.nn.Module) -> torch.nn.Module:
    """Make a CPU-built ``GPTModel``'s RoPE usable without CUDA (instance-level, no global patch).

    Only for CPU runs (tests, selftest, demo); on CUDA megatron's own class is kept.
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    for module in model.modules():
        if type(module) is RotaryEmbedding:
            module.__class__ = cpu_rotary_embedding_class()
    return model


def cpu_attention_scores_buffer(numel: int, dtype: torch.dtype = torch.float32) -> None:
    """Give megatron's ``DotProductAttention`` a CPU score buffer of at least ``numel`` elements.

    ``numel`` must cover ``batch * heads_per_partition * seq_len**2`` of the largest call (a
    smaller buffer would make megatron allocate a new one on CUDA). Only for models that run on
    the CPU; must be called again after ``parallel_state`` is re-initialised (that drops it).
    """
    from megatron.core import parallel_state

    buffers = parallel_state.get_global_memory_buffer().buffer
    current = buffers.get(("mpu", dtype))
    if current is None or current.numel() < numel:
        buffers[("mpu", dtype)] = torch.empty(numel, dtype=dtype, device="cpu")


def _names_cuda(device: object) -> bool:
    if isinstance(device, int):  # torch.cuda.current_device() is an index into CUDA devices
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class CpuPlacement(torch.overrides.TorchFunctionMode):
    """Places on the CPU every tensor megatron-core's training path asks for on CUDA.

    Megatron's DDP grad buffers, distributed-optimizer buffers, loss/grad-norm reductions and
    scheduler bookkeeping allocate with ``device=torch.cuda.current_device()`` or call
    ``.cuda()`` unconditionally. Under this mode a ``device=`` naming CUDA becomes the CPU and
    ``Tensor.cuda()`` is the identity; ``Tensor.type()`` (no argument) names the CPU as the
    training device, ``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``, because
    ``clip_grad_by_total_norm_fp32`` asserts the gradient's type string (its dtype part is still
    checked). Nothing else about any call changes. Used by
    ``testing/megatron_loop/`` only, inside ``cpu_megatron_training()``.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if _names_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _names_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _NullEvent:
    """Stands in for ``torch.cuda.Event`` (recorded on a ``_NullStream``): nothing to wait for."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` on the CPU: CPU work is ordered already.

    All null streams compare equal: there is one CPU stream. (megatron-core's MoE alltoall
    dispatcher asks ``current_stream() != its side stream`` before recording tensors on it.)
    """

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NullStream)

    def __hash__(self) -> int:
        return 0

    def record_event(self, event: object = None) -> _NullEvent:
        return _NullEvent()

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class cpu_megatron_training:
    """Run megatron-core's training path (DDP, optimizer, ``train_step``) on the CPU.

    Device placement only: ``CpuPlacement`` for allocations, and these ``torch.cuda`` entry points
    answered for a machine whose only device is the CPU -- ``current_device`` (index 0, which
    ``CpuPlacement`` maps to the CPU), ``Stream``/``current_stream``/``stream`` (no-op streams:
    CPU work is ordered), ``synchronize`` (nothing to wait for), ``empty_cache``, ``get_rng_state``
    (the CPU generator's: ``save_checkpoint`` records the device's). Restored on exit.
    """

    _REPLACED: ClassVar[dict[str, Any]] = {
        "current_device": lambda: 0,
        "Stream": lambda *a, **k: _NullStream(),
        "current_stream": lambda *a, **k: _NullStream(),
        "stream": lambda s=None: _NullStream(),
        "synchronize": lambda *a, **k: None,
        "empty_cache": lambda: None,
        # Megatron's save_checkpoint stores the "CUDA" generator's state beside the CPU one,
        # unconditionally: here the device's generator is the CPU's.
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
    }

    def __enter__(self) -> cpu_megatron_training:
        if torch.cuda.is_available():
            raise RuntimeError("cpu_megatron_training is for machines without CUDA")
        self._saved = {name: getattr(torch.cuda, name) for name in self._REPLACED}
        for name, fn in self._REPLACED.items():
            setattr(torch.cuda, name, fn)
        from megatron.core.transformer.moe import token_dispatcher

        self._dtoh = token_dispatcher.maybe_move_tensor_to_cpu
        token_dispatcher.maybe_move_tensor_to_cpu = _cpu_dtoh
        self._mode = CpuPlacement()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        from megatron.core.transformer.moe import token_dispatcher

        self._mode.__exit__(None, None, None)
        token_dispatcher.maybe_move_tensor_to_cpu = self._dtoh
        for name, fn in self._saved.items():
            setattr(torch.cuda, name, fn)


def _cpu_dtoh(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron-core's ``moe_utils.maybe_move_tensor_to_cpu`` for tensors already on the CPU.

    The original converts only CUDA tensors (to numpy when ``as_numpy``); a CPU tensor stays a
    tensor, and the MoE alltoall dispatcher then hands it to ``all_to_all_single`` as its split
    sizes, which torch refuses (it takes a sequence of ints, as numpy gives). Here a CPU tensor
    asked ``as_numpy`` becomes numpy too, as a CUDA one would. Placement only.
    """
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


class cpu_device_arch_version:
    """Answer Megatron's GPU-architecture query on a machine without CUDA (``validate_args``).

    megatron-core 0.19.2's ``validate_args`` asks ``get_device_arch_version()`` (the major
    compute capability of ``cuda:0``) whenever tensor or context parallelism is on, to decide
    whether ``CUDA_DEVICE_MAX_CONNECTIONS=1`` is required (before Blackwell, 10) or not; on a CPU
    the query raises. Inside this context the name ``validate_args`` calls answers ``major``
    (default 9, Hopper: the strict branch, so the run needs the variable set as a user on an H100
    would). Nothing else changes; restored on exit, refused where CUDA exists.
    """

    def __init__(self, major: int = 9) -> None:
        self.major = major

    def __enter__(self) -> cpu_device_arch_version:
        import megatron.training.arguments as arguments

        if torch.cuda.is_available():
            raise RuntimeError("cpu_device_arch_version is for machines without CUDA")
        self._saved = arguments.get_device_arch_version
        arguments.get_device_arch_version = lambda: self.major
        return self

    def __exit__(self, *exc: object) -> None:
        import megatron.training.arguments as arguments

        arguments.get_device_arch_version = self._saved


class torch_adam_distributed_optimizer_load:
    """Let megatron-core 0.19.2 load a legacy (``--ckpt-format torch``) distributed-optimizer
    checkpoint into ``torch.optim.Adam`` for an fp32 model, as this CPU machine has it (no
    Transformer Engine or Apex ``FusedAdam``, no ``--bf16``). Three things break on that path
    that a GPU run with TE's ``FusedAdam`` (whose step lives in ``param_groups``) never meets:

    * ``DistributedOptimizer.load_state_dict`` gives every parameter's state the *same* ``step``
      tensor, and torch's Adam increments it in place once per parameter: after a resume the
      bias correction runs ahead (found by ``selftest --megatron``'s resume: the weights after
      the first resumed step were 139x over tolerance). Here each parameter gets its own copy.
    * ``load_parameter_state_from_dp_zero`` copies the saved ``param``/``exp_avg``/``exp_avg_sq``
      into every tensor of the state, ``step`` included, which the file does not hold
      (``KeyError: 'step'``): ``_set_main_param_and_optimizer_states`` gets ``step: None`` for a
      missing one (megatron's own "not a tensor: skip" branch; ``step`` came from
      ``load_state_dict``).
    * an fp32 model's main parameters are views of its leaf parameters, so that ``copy_``
      needs ``no_grad``.

    No loaded value changes: each is the checkpoint's. Restored on exit; refused where CUDA, TE
    or Apex exist.
    """

    def __enter__(self) -> torch_adam_distributed_optimizer_load:
        from megatron.core.optimizer import distrib_optimizer

        if torch.cuda.is_available() or distrib_optimizer.HAVE_APEX_OR_TE:
            raise RuntimeError(
                "torch_adam_distributed_optimizer_load is for CPU runs with torch's Adam"
            )
        cls = distrib_optimizer.DistributedOptimizer
        self._saved = {
            name: getattr(cls, name)
            for name in ("load_state_dict", "_set_main_param_and_optimizer_states")
        }
        load_state_dict = self._saved["load_state_dict"]
        set_states = self._saved["_set_main_param_and_optimizer_states"]

        def own_steps(optimizer: Any, state_dict: Any) -> None:
            load_state_dict(optimizer, state_dict)
            for state in optimizer.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()

        def set_states_without_step(
            optimizer: Any, model_param: Any, tensors: dict[str, Any]
        ) -> None:
            with torch.no_grad():
                set_states(optimizer, model_param, {"step": None, **tensors})

        cls.load_state_dict = own_steps
        cls._set_main_param_and_optimizer_states = set_states_without_step
        return self

    def __exit__(self, *exc: object) -> None:
        from megatron.core.optimizer import distrib_optimizer

        for name, fn in self._saved.items():
            setattr(distrib_optimizer.DistributedOptimizer, name, fn)

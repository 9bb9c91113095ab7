"""FLOPs of a training step, counted once, and the peak FLOP/s of the device they run on.

What is counted: :class:`torch.utils.flop_counter.FlopCounterMode` sees every
operator dispatched between the first forward of one optimizer step and that
step (all micro-batches of gradient accumulation, forward and backward) and
adds the FLOPs of the matrix products (mm, addmm, bmm, baddbmm, convolutions,
scaled-dot-product attention, forward and backward); element-wise work is not
counted, as in the usual 6 x parameters x tokens estimate. Activation
checkpointing's recomputed forwards run inside the step, so they are counted:
the figure is then closer to hardware FLOPs than model FLOPs, and a user who
wants model FLOPs gives ``throughput.flops_per_step``.

Where torch.compile is in use the mode must stay off the user's step (a compiled
region under a dispatch mode falls back to eager, or raises with ``fullgraph=True``):
:func:`count_on_meta` instead replays the step's forward, eagerly, on meta tensors
of the same shapes (no device work, no memory) and backpropagates every floating
output, at the step's optimizer step. The count is the same operators' FLOPs; SDPA
then runs its math path, whose matrix products count as the fused kernels' do
(without the flash backward's recompute of QK^T).

The peak table holds dense (not 2:4-sparse) tensor-core FLOP/s from NVIDIA's
data sheets, per dtype; fp16 and bf16 are the rates with fp32 accumulation,
which PyTorch uses. A GPU not in the table has no MFU unless
``throughput.peak_flops`` is set.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "FlopCount",
    "compile_in_use",
    "compute_dtype",
    "count_on_meta",
    "meta_like",
    "peak_flops",
]

_T = 1e12
#: (pattern on torch.cuda.get_device_name(), {dtype: dense FLOP/s}); the first match wins, so
#: the more specific names come first ("H100 NVL" before "H100").
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"B200", {"fp8": 4500 * _T, "bf16": 2250 * _T, "fp16": 2250 * _T, "tf32": 1100 * _T,
               "fp32": 75 * _T}),
    (r"H200 NVL", {"fp8": 1671 * _T, "bf16": 835.5 * _T, "fp16": 835.5 * _T,
                   "tf32": 417.5 * _T, "fp32": 60 * _T}),
    (r"H100 NVL", {"fp8": 1671 * _T, "bf16": 835.5 * _T, "fp16": 835.5 * _T,
                   "tf32": 417.5 * _T, "fp32": 60 * _T}),
    (r"H100 PCIe", {"fp8": 1513 * _T, "bf16": 756.5 * _T, "fp16": 756.5 * _T,
                    "tf32": 378 * _T, "fp32": 51.2 * _T}),
    (r"H100|H200|GH200|H800", {"fp8": 1979 * _T, "bf16": 989.5 * _T, "fp16": 989.5 * _T,
                               "tf32": 494.7 * _T, "fp32": 66.9 * _T}),
    (r"A100|A800", {"bf16": 312 * _T, "fp16": 312 * _T, "tf32": 156 * _T, "fp32": 19.5 * _T}),
    (r"L40S", {"fp8": 733 * _T, "bf16": 362 * _T, "fp16": 362 * _T, "tf32": 183 * _T,
               "fp32": 91.6 * _T}),
    (r"L40\b", {"fp8": 362 * _T, "bf16": 181 * _T, "fp16": 181 * _T, "tf32": 90.5 * _T,
                "fp32": 90.5 * _T}),
    (r"\bL4\b", {"fp8": 242.5 * _T, "bf16": 121 * _T, "fp16": 121 * _T, "tf32": 60 * _T,
                 "fp32": 30.3 * _T}),
    (r"\bA10\b", {"bf16": 125 * _T, "fp16": 125 * _T, "tf32": 62.5 * _T, "fp32": 31.2 * _T}),
    (r"V100.*PCIE|V100S", {"fp16": 112 * _T, "fp32": 14 * _T}),
    (r"V100", {"fp16": 125 * _T, "fp32": 15.7 * _T}),
    (r"\bT4\b", {"fp16": 65 * _T, "fp32": 8.1 * _T}),
    (r"RTX 6000 Ada", {"fp8": 728.5 * _T, "bf16": 364 * _T, "fp16": 364 * _T,
                       "tf32": 182 * _T, "fp32": 91.1 * _T}),
    (r"RTX A6000", {"bf16": 154.8 * _T, "fp16": 154.8 * _T, "tf32": 77.4 * _T,
                    "fp32": 38.7 * _T}),
    (r"RTX 4090", {"fp8": 330.3 * _T, "bf16": 165.2 * _T, "fp16": 165.2 * _T,
                   "tf32": 82.6 * _T, "fp32": 82.6 * _T}),
    (r"RTX 3090", {"bf16": 71 * _T, "fp16": 71 * _T, "tf32": 35.6 * _T, "fp32": 35.6 * _T}),
)  # fmt: skip


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of the GPU called ``device_name`` for ``dtype``, or None if unknown.

    A dtype the GPU has no tensor-core rate for (TF32 on a V100) falls back to fp32's rate.
    """
    for pattern, rates in PEAK_FLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            rate = rates.get(dtype)
            if rate is None and dtype == "tf32":
                rate = rates.get("fp32")
            return rate
    return None


def compile_in_use(model: torch.nn.Module) -> bool:
    """Whether torch.compile compiled anything in this process, or wraps part of ``model``.

    A compiled region that runs while a dispatch mode is active falls back to eager, and
    with ``fullgraph=True`` raises: the count must never be what breaks a compiled step.
    """
    convert = sys.modules.get("torch._dynamo.convert_frame")
    frames: object = getattr(convert, "FRAME_COUNTER", 0)  # frames compiled so far
    if isinstance(frames, int) and frames > 0:
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def compute_dtype(device_type: str, parameter_dtype: torch.dtype) -> str:
    """The dtype the matrix products run in now: autocast's, else the parameters'.

    fp32 matmuls that PyTorch lets use TF32 (``torch.set_float32_matmul_precision("high")``
    or ``torch.backends.cuda.matmul.allow_tf32``) count as tf32.
    """
    dtype = parameter_dtype
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8"
    if device_type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def _cpu_attention() -> dict[Any, Any]:
    """PyTorch's counter knows the CUDA attention kernels but not the CPU flash kernel."""
    from torch.utils import flop_counter

    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is None or backward is None:
        return {}

    def forward_flops(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        count = flop_counter.sdpa_flop_count  # untyped in torch; shapes in, an int out
        return int(count(query, key, value))  # type: ignore[no-untyped-call]  # torch's own

    def backward_flops(
        grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any
    ) -> int:
        count = flop_counter.sdpa_backward_flop_count
        return int(count(grad_out, query, key, value))  # type: ignore[no-untyped-call]  # torch's

    return {forward: forward_flops, backward: backward_flops}


def _contained_counter() -> Any:
    """``FlopCounterMode`` whose formulas cannot fail the user's operator.

    The mode counts inside each operator of the step; a formula that raises (a shape it
    does not expect) would raise out of the user's forward. Here it marks the count failed.
    """
    from torch.utils.flop_counter import FlopCounterMode  # only for the one step counted

    class ContainedFlopCounter(FlopCounterMode):
        failed = False

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            try:
                count = super()._count_flops
                return count(func_packet, out, args, kwargs)  # type: ignore[no-untyped-call]  # torch's
            except Exception:  # a formula's error voids the count, never the operator's result
                self.failed = True
                return out

    return ContainedFlopCounter


class FlopCount:
    """One step's FLOPs: :meth:`start` at its first forward, :meth:`stop` at its optimizer step.

    Between the two, every operator of this thread (and of the autograd threads working
    for it) goes through ``FlopCounterMode``: the step counted is slower, the others are
    untouched.
    """

    def __init__(self, formulas: Mapping[Any, Any] | None = None) -> None:
        #: Extra or replacement formulas, operator -> f(*shapes, **kwargs) -> FLOPs.
        self._formulas = dict(formulas or {})
        self._mode: Any = None  # a FlopCounterMode while a step is counted
        #: Whether the last :meth:`stop` found a formula that failed on an operator.
        self.failed = False

    @property
    def counting(self) -> bool:
        return self._mode is not None

    def start(self) -> None:
        formulas = {**_cpu_attention(), **self._formulas}
        mode: Any = _contained_counter()(display=False, custom_mapping=formulas)
        mode.__enter__()
        self._mode = mode

    def stop(self) -> int:
        """Leave the mode; the FLOPs counted since :meth:`start` (0 if a formula failed,
        and :attr:`failed` says so)."""
        mode, self._mode = self._mode, None
        if mode is None:
            return 0
        mode.__exit__(None, None, None)
        self.failed = bool(mode.failed)
        return 0 if mode.failed else int(mode.get_total_flops())

    def abandon(self) -> None:
        """Leave the mode without a result (the step was skipped, or a phase began)."""
        self.stop()


def meta_like(value: Any, depth: int = 0) -> Any:
    """``value`` with every tensor in it (tuples, lists, dicts) replaced by a meta tensor of
    the same shape and dtype: what :func:`count_on_meta` replays, holding no memory."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta").requires_grad_(value.requires_grad)
    if depth >= 4:
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(meta_like(item, depth + 1) for item in value)
    if isinstance(value, dict):
        return {key: meta_like(item, depth + 1) for key, item in value.items()}
    return value


def _floating_outputs(value: object, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.requires_grad and value.is_floating_point():
            yield value
    elif depth < 4 and isinstance(value, (tuple, list, dict)):
        items = value.values() if isinstance(value, dict) else value
        for item in items:
            yield from _floating_outputs(item, depth + 1)
    elif depth < 4 and hasattr(value, "values") and callable(value.values):
        for item in value.values():  # a ModelOutput (an OrderedDict subclass) or alike
            yield from _floating_outputs(item, depth + 1)


def count_on_meta(model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """FLOPs of ``model``'s forward on ``args``/``kwargs`` (meta tensors, from
    :func:`meta_like`) and of the backward of its floating outputs, run eagerly on meta
    parameters: nothing runs on the device and the real parameters are untouched.

    Raises what the model raises on meta tensors (a data-dependent shape, ``.item()``,
    an operator without a meta kernel): the caller reports it and counts nothing.
    """
    from torch.nn.utils.stateless import _reparametrize_module  # what functional_call uses

    named = [*model.named_parameters(), *model.named_buffers()]  # tied ones once, then tied
    meta = {name: meta_like(tensor) for name, tensor in named}
    counter = FlopCount()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.compiler.set_stance("force_eager"))  # compiled parts: eager
        stack.enter_context(torch.device("meta"))  # tensors the forward makes (arange)
        stack.enter_context(_reparametrize_module(model, meta, tie_weights=True))
        stack.enter_context(torch.enable_grad())
        counter.start()
        try:
            # forward(), not __call__: the root's hooks (this Monitor's among them) stay out.
            out = model.forward(*args, **kwargs)
            outputs = list(_floating_outputs(out))
            if outputs:
                torch.autograd.backward([t.sum() for t in outputs])
        finally:
            flops = counter.stop()
    if counter.failed:
        raise RuntimeError("a FLOP formula failed on an operator of the replayed step")
    return flops

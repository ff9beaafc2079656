"""Run a module with the rounding the ``int8`` variant makes, so that PyTorch itself says
how far a right int8 graph may be from the float32 module on each case.

``onnxruntime.quantization.quantize_dynamic`` (``exporter/variants/int8.py``) rounds every
MatMul whose second operand is a constant: the weight to 7-bit symmetric integers with one
scale per tensor, the other operand to 8-bit asymmetric integers with a scale and zero point
taken from that tensor's range on each call. How much that moves the output depends on the
model and the values, not on the graph: past 4096 cached keys, the seed attention's error
grows to 6 % of its output's rms (0.5 x at its worst element), four times what a short
context gives. Under this mode every ``F.linear`` and every matmul whose second operand is
one of the module's own tensors whole (a weight, or its transpose) and whose first is not is
rounded so. A slice or chunk of one is left alone: the export keeps the ``Split`` before its
MatMul, which then has no constant to quantize (``nn.MultiheadAttention``'s packed
projection, a table of relative positions cut to the length). What the simulation misses
(a module computing its weight, ``addmm``, code under a function of its own such as
``F.multi_head_attention_forward``) leaves an int8 graph to the shares of the rms alone.

``bits=4`` rounds as the ``int4`` variant (``MatMulNBitsQuantizer``, symmetric, blocks of
``INT4_BLOCK`` along the reduced axis) does: each block of a weight to integers -8..7 times
the block's largest-magnitude element over -8, the other operand left in float (MatMulNBits
at its default accuracy level computes in float32). The same MatMuls are rounded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from attn_export._deps import require

__all__ = ["in_int8", "rounded"]

#: ``reduce_range``: 7-bit symmetric weights, as ORT quantizes them for CPUs without VNNI.
WEIGHT_LEVELS = 64
#: DynamicQuantizeLinear: uint8 activations over [min(0, x), max(0, x)].
ACTIVATION_LEVELS = 255
#: MatMulNBits: the weights' block along the reduced axis, as onnxruntime-genai's CPU int4.
INT4_BLOCK = 32


def in_int8(module: Any, *args: Any, bits: int = 8) -> Any:
    """``module(*args)`` with every matmul on one of its own tensors rounded as the int8
    variant (``bits=8``) or the int4 variant (``bits=4``) rounds it; the rest of the module
    in its own precision."""
    with rounded(module, bits):
        return module(*args)


@contextlib.contextmanager
def rounded(module: Any, bits: int = 8) -> Iterator[None]:
    """Inside, every call of ``module`` (its ``generate()`` too) rounds as ``in_int8`` does."""
    torch = require("torch", "running the PyTorch original")
    from torch.overrides import TorchFunctionMode

    F = torch.nn.functional
    owned = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()}
    matmuls = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.bmm)
    slicing = (
        torch.Tensor.__getitem__,
        torch.Tensor.narrow,
        torch.narrow,
        torch.Tensor.split,
        torch.split,
        torch.Tensor.chunk,
        torch.chunk,
        torch.Tensor.unbind,
        torch.unbind,
    )

    def weight(w: Any) -> Any:
        scale = w.abs().amax().clamp_min(torch.finfo(w.dtype).tiny) / WEIGHT_LEVELS
        return torch.round(w / scale).clamp(-WEIGHT_LEVELS, WEIGHT_LEVELS) * scale

    def blocks(w: Any, axis: int) -> Any:
        """``w`` rounded as MatMulNBits stores it: blocks of ``INT4_BLOCK`` along ``axis`` (the
        reduced one), each scaled by its largest-magnitude element over -8, to -8..7."""
        moved = w.movedim(axis, -1)
        length = moved.shape[-1]
        padded = torch.nn.functional.pad(moved, (0, -length % INT4_BLOCK))
        grouped = padded.reshape(*padded.shape[:-1], -1, INT4_BLOCK)
        peak = grouped.gather(-1, grouped.abs().argmax(-1, keepdim=True))
        scale = peak / -8
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        rounded = torch.round(grouped / safe).clamp(-8, 7) * scale
        return rounded.reshape(padded.shape)[..., :length].movedim(-1, axis)

    def activation(x: Any) -> Any:
        low, high = x.amin().clamp(max=0), x.amax().clamp(min=0)
        scale = ((high - low) / ACTIVATION_LEVELS).clamp_min(torch.finfo(x.dtype).tiny)
        zero = torch.round(-low / scale).clamp(0, ACTIVATION_LEVELS)
        return (torch.round(x / scale).add(zero).clamp(0, ACTIVATION_LEVELS) - zero) * scale

    def is_owned(t: Any) -> bool:
        """One of the module's tensors, or a view of one."""
        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.untyped_storage().data_ptr() in owned

    cut: list[Any] = []  # what a slicing op made of the module's tensors (kept alive: ids stay theirs)

    def is_weight(t: Any) -> bool:
        """One of the module's tensors whole (a transpose too), not what a slice made of one,
        even a slice as long as the table (the graph keeps the Slice before its MatMul)."""
        whole = t.storage_offset() == 0 and t.numel() * t.element_size() == t.untyped_storage().nbytes()
        return is_owned(t) and whole and all(t is not c for c in cut)

    class Rounded(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = dict(kwargs or {})
            if func in (F.linear, *matmuls) and len(args) >= 2 and is_weight(args[1]) and not is_owned(args[0]):
                if (
                    bits == 4
                ):  # MatMulNBits takes 2-D weights; F.linear reduces over their last axis, a matmul the first
                    if args[1].dim() != 2:
                        return func(*args, **kwargs)
                    return func(args[0], blocks(args[1], -1 if func is F.linear else -2), *args[2:], **kwargs)
                return func(activation(args[0]), weight(args[1]), *args[2:], **kwargs)
            result = func(*args, **kwargs)
            if func in slicing and args and is_owned(args[0]):
                cut.extend(result if isinstance(result, tuple | list) else [result])
            return result

    with Rounded():
        yield

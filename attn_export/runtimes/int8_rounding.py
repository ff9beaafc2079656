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
the block's largest-magnitude element over -8; and the other operand as MatMulNBits at
accuracy level 4 rounds it on a CPU (ONNX Runtime's int8 kernels, what onnxruntime-genai's
model builder sets): each block of ``INT4_BLOCK`` to integers -127..127 times its largest
magnitude over 127. The same MatMuls are rounded, and ``addmm`` of a weight too (the
variant quantizes a Gemm as a MatMul and an Add: GPT-2's ``Conv1D``). ONNX Runtime's CUDA kernels compute such
a graph in float, nearer the module than this (``verify --generate`` holds them to int4's
tolerance, not float32's).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from attn_export._deps import require
from attn_export.model_spec.tolerance import Rounding, rounding_key

__all__ = [
    "FLOAT16",
    "INT4_CASE_TIES",
    "INT4_TIE_FACTOR",
    "INT4_TIES",
    "float16_twin",
    "in_float16",
    "in_int8",
    "int4_activation",
    "int4_weight",
    "rounded",
    "with_ties",
]

#: The ``bits`` that stand for the ``fp16`` variant's rounding: float16 inside, not integers.
FLOAT16 = 16
#: float16's largest finite value: the fp16 converter clamps larger constants to it.
HALF_MAX = 65504.0

#: ``reduce_range``: 7-bit symmetric weights, as ORT quantizes them for CPUs without VNNI.
WEIGHT_LEVELS = 64
#: DynamicQuantizeLinear: uint8 activations over [min(0, x), max(0, x)].
ACTIVATION_LEVELS = 255
#: MatMulNBits: the weights' block along the reduced axis, as onnxruntime-genai's CPU int4.
INT4_BLOCK = 32
#: MatMulNBits' accuracy level: 4, int8 compute on a CPU, onnxruntime-genai's CPU default.
INT4_ACCURACY_LEVEL = 4
#: At that level, the activations' codes per block, symmetric.
INT8_CODES = 127
#: Near ties of those codes: an activation a unit or two in the last place from halfway
#: between two codes rounds one way in the module and the other in the graph, whose float
#: ops (a fused norm, another summation order) differ by that much. One such flip moved a
#: tiny Gemma's int4 logit by 3.5e-4 at the prompt's step (|logits| 0.17 rms), 35 times the
#: float32 tolerance, and the module with its codes nudged by 1e-6 of their size gave the
#: graph's logit to 1e-7. The simulation nudged each way bounds what such flips do.
INT4_TIES = (1e-6, -1e-6)
#: How many times the widest logit a nudge moves (in a row, at a step) every logit of that row
#: may stray: a graph's float rounding flips other codes than the nudges do, and those move
#: other logits. Against onnxruntime-genai's int4 graphs of a 4-layer Mistral (hidden 128, 16
#: tokens) and a 3-layer Llama (31 tokens), seeds 0 and 1, 20 rows: a row's largest
#: |graph - simulation| at a step was up to 1.65 x the widest its nudges moved (element by
#: element the nudges' room missed by up to 5e-3, nudged by 1e-6 or 1e-4 alike).
INT4_TIE_FACTOR = 2.0
#: The nudges of a verify case's activation codes (``with_ties``): a case's values reach far
#: past a trained model's (``large``, ``outliers``: rms 50-90), where a graph's float rounding
#: differs from PyTorch's by more than 1e-6 of a code. The tiny zoo's mha_kv_cache int4 graph
#: at seeds 0-4 (70 cases): nudged by 1e-6, 3 cases had an output 0.018 off the simulation
#: where the nudges moved nothing; by 1e-5, none was off by more than 2 x the nudges' widest,
#: and an output projection's block scales 1 % off was red on 65 cases.
INT4_CASE_TIES = (1e-5, -1e-5)


def with_ties(
    found: Mapping[str, Rounding], simulated: Mapping[str, np.ndarray], nudged: Sequence[Mapping[str, np.ndarray]]
) -> dict[str, Rounding]:
    """int4's roundings in ``found`` (by ``rounding_key``) with the ``simulated`` module's
    float values, and as ``Rounding.ties`` the widest any of its ``nudged`` runs
    (``INT4_CASE_TIES``) moves an element of them: where the simulated module is what a right
    graph gives to float32 noise, those flips are what else may part them."""
    out = {}
    for name, value in simulated.items():
        key = rounding_key(4, name)
        if key in found and value.dtype.kind == "f":
            ties = max((Rounding.between(value, run[name]).max for run in nudged if name in run), default=0.0)
            out[key] = dataclasses.replace(found[key], ties=ties, values=value)
    return out


def in_int8(module: Any, *args: Any, bits: int = 8, activations: bool = True) -> Any:
    """``module(*args)`` with every matmul on one of its own tensors rounded as the int8
    variant (``bits=8``) or the int4 variant (``bits=4``) rounds it; the rest of the module
    in its own precision. int4 without ``activations``: the weights alone, as a CPU computes
    MatMulNBits at accuracy level 0 or 1 (in float)."""
    with rounded(module, bits, activations=activations):
        return module(*args)


def _storages(module: Any) -> set[int]:
    """Where ``module``'s float parameters and buffers live: a tensor in one of these is the
    module's own, or a view of it."""
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()}


def int4_weight(w: Any, axis: int) -> Any:
    """``w`` rounded as MatMulNBits stores it: blocks of ``INT4_BLOCK`` along ``axis`` (the
    reduced one), each scaled by its largest-magnitude element over -8, to -8..7."""
    torch = require("torch", "running the PyTorch original")
    moved = w.movedim(axis, -1)
    length = moved.shape[-1]
    padded = torch.nn.functional.pad(moved, (0, -length % INT4_BLOCK))
    grouped = padded.reshape(*padded.shape[:-1], -1, INT4_BLOCK)
    peak = grouped.gather(-1, grouped.abs().argmax(-1, keepdim=True))
    scale = peak / -8
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    rounded = torch.round(grouped / safe).clamp(-8, 7) * scale
    return rounded.reshape(padded.shape)[..., :length].movedim(-1, axis)


def int4_activation(x: Any, tie: float = 0.0) -> Any:
    """``x`` as MatMulNBits at accuracy level 4 rounds it on a CPU (MLAS's CompInt8): blocks
    of ``INT4_BLOCK`` along the reduced (last) axis, each to integers -127..127 times the
    block's largest magnitude over 127, rounded half to even; with ``tie``, the codes taken
    ``1 + tie`` times as large before rounding (``INT4_TIES``)."""
    torch = require("torch", "running the PyTorch original")
    length = x.shape[-1]
    padded = torch.nn.functional.pad(x, (0, -length % INT4_BLOCK))
    grouped = padded.reshape(*padded.shape[:-1], -1, INT4_BLOCK)
    peak = grouped.abs().amax(-1, keepdim=True)
    inverse = torch.where(peak == 0, torch.zeros_like(peak), INT8_CODES / peak) * (1 + tie)
    codes = torch.round(grouped * inverse)
    return (codes * (peak / INT8_CODES)).reshape(padded.shape)[..., :length]


@contextlib.contextmanager
def rounded(module: Any, bits: int = 8, tie: float = 0.0, activations: bool = True) -> Iterator[None]:
    """Inside, every call of ``module`` (its ``generate()`` too) rounds as ``in_int8`` does;
    with ``tie``, int4's activation codes are taken ``1 + tie`` times as large before rounding
    (``INT4_TIES``); without ``activations``, int4 rounds the weights alone."""
    torch = require("torch", "running the PyTorch original")
    from torch.overrides import TorchFunctionMode

    F = torch.nn.functional
    owned = _storages(module)
    matmuls = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.bmm)
    addmms = (torch.addmm, torch.Tensor.addmm)  # int4 takes them as MatMul and Add (GPT-2's Conv1D)
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

    def is_plain_addmm(args: Any, kwargs: dict[str, Any]) -> bool:
        """``bias + x @ w`` with ``w`` one of the module's 2-D weights, as the int4 variant
        turns a Gemm into a MatMul it quantizes and an Add."""
        unscaled = kwargs.get("alpha", 1) == kwargs.get("beta", 1) == 1
        return len(args) >= 3 and unscaled and is_weight(args[2]) and args[2].dim() == 2 and not is_owned(args[1])

    def codes(x: Any) -> Any:
        """An int4 MatMul's activations as the graph's compute takes them."""
        return int4_activation(x, tie) if activations else x

    class Rounded(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = dict(kwargs or {})
            if bits == 4 and func in addmms and is_plain_addmm(args, kwargs):
                return func(args[0], codes(args[1]), int4_weight(args[2], -2), **kwargs)
            if func in (F.linear, *matmuls) and len(args) >= 2 and is_weight(args[1]) and not is_owned(args[0]):
                if (
                    bits == 4
                ):  # MatMulNBits takes 2-D weights; F.linear reduces over their last axis, a matmul the first
                    if args[1].dim() != 2:
                        return func(*args, **kwargs)
                    weights = int4_weight(args[1], -1 if func is F.linear else -2)
                    return func(codes(args[0]), weights, *args[2:], **kwargs)
                return func(activation(args[0]), weight(args[1]), *args[2:], **kwargs)
            result = func(*args, **kwargs)
            if func in slicing and args and is_owned(args[0]):
                cut.extend(result if isinstance(result, tuple | list) else [result])
            return result

    with Rounded():
        yield


def float16_twin(module: Any) -> Any:
    """A copy of ``module`` with float16 parameters, for ``in_float16`` (made once per module
    by its caller). Buffers keep their dtype: what the module computes from them alone
    (rotary frequencies times positions) stays float32, as the fp16 variant keeps the angles."""
    import copy

    twin = copy.deepcopy(module).eval()
    for parameter in twin.parameters():
        if parameter.is_floating_point():
            parameter.data = parameter.data.half()
    return twin


def in_float16(twin: Any, *args: Any, scale_scores: bool = False, dither: int | None = None) -> Any:
    """``twin`` (``float16_twin``) on ``args`` as the ``fp16`` variant computes: float inputs
    cast to float16, every op in float16 but Softmax (kept in float32, as the variant keeps
    it; SDPA is taken apart as the export takes it, where PyTorch's own kernel would keep
    more precision than the graph), float outputs cast back to float32. An op that reads a
    float16 tensor gives float16, as the converted graph's does: the module's own upcasts
    (a norm's variance in float32, float16 times a float32 buffer) are the graph's Casts to
    float16; only what is computed from float32 values alone stays float32 (the angles).

    Where float16 overflows (an op of finite float16 values giving +inf or NaN: scores past
    65504, a norm's squares of values past 256), the op keeps its float32 result, and what
    is computed from it alone (the scores' scale, Softmax) stays float32 until it meets a
    float16 tensor: ONNX Runtime's CPU has no float16 kernels for such ops and runs them in
    float32, without Casts between consecutive ones, so a right graph stays finite there. A
    GPU computes them in float16 and its graph gives Inf/NaN, which fails whatever the room
    (``compare.outputs.output_passed``).

    ``scale_scores`` scales SDPA's scores once, after their MatMul, where the export scales the
    query and the key by the root each: the same arithmetic rounded elsewhere, as valid a
    float16 graph. Where an output hangs on near ties (large scores, an attention row whose
    winner a last bit decides), which elements flip differs from one rounding to the other;
    the larger error of the two says how far a right graph's own flips may go.

    ``dither`` (a seed) moves each finite float16 score entering a Softmax to a neighbouring
    float16 value, up, down or not at all, drawn per element: a right graph's MatMul rounds
    its scores within about a unit in the last place of PyTorch's, and where two keys' scores
    are closer than that (large values: a unit is 4 at scores of 5000), which of them wins is
    its rounding's choice. Both decompositions above may settle such a tie alike.

    With ``dither``, the operands of each product of two computed float16 tensors (the
    query and the key, neither one of the module's own nor a Softmax's probabilities) are
    moved so too, before it: a right graph rounds its query and key from other values (ONNX
    Runtime's CPU keeps the input and the projection's sum in float32), within about a unit
    of PyTorch's, and the score carries that unit times the other operand, many units of the
    score where the dot product cancels: on large values, a score of 115 made of terms in
    the 1000s was 1.2 and 1.9 off in the graph (units of 0.06), and a two-key row that the
    reference gives 86 % to one key went 79 % to the other."""
    torch = require("torch", "running the PyTorch original")
    from torch.overrides import TorchFunctionMode

    F = torch.nn.functional
    softmaxes = (F.softmax, torch.softmax, torch.Tensor.softmax)
    fills = (torch.masked_fill, torch.Tensor.masked_fill, torch.Tensor.masked_fill_, torch.full_like)
    products = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm)
    owned = _storages(twin)
    probabilities: list[Any] = []  # each Softmax's output (kept alive: storage ids stay theirs)
    softmaxed: set[int] = set()  # their storages

    def computed(value: Any) -> bool:
        """A float16 tensor a right graph rounds itself, in a product whose rounding may
        decide a tie: not one of the module's own (the converter rounds those as PyTorch
        does), nor a Softmax's output (its product with the values is linear in each)."""
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float16:
            return False
        storage = value.untyped_storage().data_ptr()
        return storage not in owned and storage not in softmaxed

    def attention(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: Any = None, enable_gqa: bool = False) -> Any:  # fmt: skip
        """SDPA as the exported graph computes it: the query and key each scaled by the root of
        the scale, the MatMuls in float16, Softmax in float32."""
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
        factor = scale if scale is not None else q.shape[-1] ** -0.5
        if scale_scores:
            scores = matmul(nearby(q), nearby(k).transpose(-2, -1)) * factor
        else:  # on each side, as the export scales
            scores = matmul(nearby(q * factor**0.5), nearby(k * factor**0.5).transpose(-2, -1))
        if is_causal:
            keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        if attn_mask is not None:
            scores = (
                scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
            )
        return in_float32(scores).softmax(-1).half() @ v

    def matmul(a: Any, b: Any) -> Any:
        """``a @ b`` in float16, or in float32 where float16 overflows (as every op here)."""
        result = a @ b
        return a.float() @ b.float() if overflowed(result, [a, b]) else result

    generator = None if dither is None else torch.Generator().manual_seed(dither)

    def in_float32(scores: Any) -> Any:
        """Scores as Softmax reads them, in float32; with ``dither``, each finite one moved
        by a float16 unit in the last place or kept, as another valid rounding may leave it
        (float16 scores within float16's range; scores kept in float32 where float16
        overflowed, at any size)."""
        wide = scores.float()
        return wide if generator is None else moved(wide, within_half=scores.dtype == torch.float16)

    def nearby(value: Any) -> Any:
        """A float16 operand as another valid rounding may leave it: with ``dither``, each
        finite element moved to a float16 neighbour or kept."""
        return value if generator is None else moved(value.float(), within_half=True).half()

    def moved(wide: Any, within_half: bool) -> Any:
        """``wide`` with each finite element moved by a float16 unit in the last place, up,
        down or not at all (seeded); ``within_half``: not past float16's largest value."""
        finite = wide.isfinite()
        magnitude = wide.abs().clamp(min=2.0**-14).where(finite, torch.ones_like(wide))
        unit = torch.exp2(torch.floor(torch.log2(magnitude)) - 10)
        step = torch.randint(-1, 2, wide.shape, generator=generator).to(wide.dtype)
        kept = finite & (wide.abs() + unit <= HALF_MAX) if within_half else finite
        return wide + (step * unit).where(kept, torch.zeros_like(wide))

    def clamped(value: Any) -> Any:
        """A fill beyond float16's range (-1e9) as the converter's constant: clamped to +-65504."""
        return max(-HALF_MAX, min(HALF_MAX, float(value))) if isinstance(value, int | float) else value

    class Float32Softmax(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = dict(kwargs or {})
            if func in softmaxes and args and args[0].dtype in (torch.float16, torch.float32):
                kwargs.pop("dtype", None)
                probabilities.append(func(in_float32(args[0]), *args[1:], **kwargs).half())
                softmaxed.add(probabilities[-1].untyped_storage().data_ptr())
                return probabilities[-1]
            if func is F.scaled_dot_product_attention and args and args[0].dtype == torch.float16:
                return attention(*args, **kwargs)
            if func in products and len(args) >= 2 and computed(args[0]) and computed(args[1]):
                args = (nearby(args[0]), nearby(args[1]), *args[2:])
            halves = _halves(args, kwargs)
            if func in fills and halves:
                args = (*args[:2], *(clamped(a) for a in args[2:]))
                kwargs = {k: clamped(v) if k == "value" else v for k, v in kwargs.items()}
            elif func is torch.where and halves:
                args = tuple(clamped(a) for a in args)
            result = func(*args, **kwargs)
            if not isinstance(result, torch.Tensor) or not halves:
                return result
            wide = result if result.dtype == torch.float32 else None
            narrow = result if wide is None else wide.half()
            if func in fills or func is torch.where or not overflowed(narrow, halves):
                return narrow
            if wide is not None:
                return wide
            return func(*cast(args, torch.float32), **{k: cast(v, torch.float32) for k, v in kwargs.items()})

    def _halves(args: Any, kwargs: dict[str, Any]) -> list[Any]:
        """The float16 tensors among an op's arguments."""
        found, values = [], [*args, *kwargs.values()]
        while values:
            value = values.pop()
            if isinstance(value, torch.Tensor) and value.dtype == torch.float16:
                found.append(value)
            elif isinstance(value, tuple | list):
                values += value
        return found

    def overflowed(result: Any, halves: list[Any]) -> bool:
        """Whether float16 overflowed: a float16 ``result`` holds +inf or NaN though the
        float16 values it was computed from are finite (-inf is a mask's fill, kept)."""
        bad = result.dtype == torch.float16 and bool((torch.isnan(result) | torch.isposinf(result)).any())
        return bad and all(bool(h.isfinite().all()) for h in halves)

    def cast(value: Any, dtype: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(dtype) if value.is_floating_point() else value
        if isinstance(value, tuple | list):
            return type(value)(cast(v, dtype) for v in value)
        return value

    with Float32Softmax():
        result = twin(*(cast(a, torch.float16) for a in args))
    return cast(result, torch.float32)

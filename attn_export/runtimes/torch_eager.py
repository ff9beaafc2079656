"""PyTorch eager: the original module, on CPU or CUDA."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from attn_export._deps import require
from attn_export.errors import NondeterministicModule, RuntimeFailure, first_line
from attn_export.model_spec import DimRange, Rounding, TensorSpec
from attn_export.model_spec.tolerance import rounding_key, rounding_name
from attn_export.runtimes.base import Runtime, check_feeds, describe_inputs
from attn_export.runtimes.float64 import in_float64
from attn_export.runtimes.int8_rounding import (
    FLOAT16,
    INT4_CASE_TIES,
    float16_twin,
    in_float16,
    in_int8,
    rounded,
    with_ties,
)
from attn_export.runtimes.target import PROVIDERS

if TYPE_CHECKING:
    from attn_export.runtimes.decoders import Decoder, DecodeWindow

__all__ = ["TorchRuntime", "same_answer", "torch_device_for"]


def torch_device_for(provider: str | None) -> str:
    """The torch device matching an ONNX Runtime provider, where this torch has it, else
    CPU (reports name the device, so a CPU-only torch is visible)."""
    torch = require("torch", "running the PyTorch original")
    device = PROVIDERS[provider].torch_device if provider in PROVIDERS else "cpu"
    available = device == "cpu" or getattr(torch, device).is_available()
    return device if available else "cpu"


class TorchRuntime(Runtime):
    """The module in eval mode under ``torch.no_grad``; outputs map to names in order."""

    def __init__(
        self,
        module: Any,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        dims: Mapping[str, DimRange] | None = None,
        *,
        device: str = "cpu",
        threads: int | None = None,
        weight_bits: int | None = None,
        rounding_bits: tuple[int, ...] = (8,),
        tie: float = 0.0,
        int4_activations: bool = True,
    ) -> None:
        super().__init__(inputs, outputs, dims)
        self.module = module
        self.device = device
        self.threads = threads
        #: Run with the weight rounding of the int8 (8) or int4 (4) variant (``in_int8``); None: as it is.
        self.weight_bits = weight_bits
        #: int4's activation codes taken ``1 + tie`` times as large (``rounded``); 0: as rounded.
        self.tie = tie
        #: Whether int4's rounding takes the activations to int8 codes (MatMulNBits at accuracy
        #: level 4 on a CPU) or leaves them float (levels 0 and 1; ``int4.int4_compute``).
        self.int4_activations = int4_activations
        #: The quantizations whose rounding ``int8_rounding`` simulates (``model_spec.tolerance.rounding_bits``).
        self.rounding_bits = rounding_bits
        self.name = f"torch[{device}]" + (f"[{rounding_name(weight_bits)} rounding]" if weight_bits else "")
        self._saved_threads: int | None = None
        self._double: Any = None
        self._float16: Any = None

    def _activate(self) -> None:
        torch = require("torch", "running the PyTorch original")
        self.module = self.module.to(self.device).eval()
        if self.threads:
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(self.threads)

    def _deactivate(self) -> None:
        if self._saved_threads is not None:
            require("torch", "running the PyTorch original").set_num_threads(self._saved_threads)
            self._saved_threads = None

    def _tensors(self, feeds: Mapping[str, np.ndarray]) -> list[Any]:
        torch = require("torch", "running the PyTorch original")
        # copies: a forward() that writes to its inputs must not change the feeds the graph is given
        return [torch.from_numpy(np.array(feeds[t.name], order="C")).to(self.device) for t in self.inputs]

    def _call(self, args: list[Any]) -> dict[str, np.ndarray]:
        torch = require("torch", "running the PyTorch original")
        bits = self.weight_bits
        quantized = (
            rounded(self.module, bits, self.tie, self.int4_activations)
            if bits and bits != FLOAT16
            else contextlib.nullcontext()
        )
        try:
            with torch.no_grad(), quantized:
                result = in_float16(self._half(), *args) if bits == FLOAT16 else self.module(*args)
        except (Exception, SystemExit) as e:
            raise RuntimeFailure(f"{self.name}: forward failed on {_drawn(self.inputs, args)}: {_why(e)}") from e
        values = _values(result)
        names = [t.name for t in self.outputs]
        if len(values) != len(names):
            raise RuntimeFailure(
                f"{self.name}: module returned {len(values)} outputs, spec declares {len(names)} "
                "(choose with pick = <index or name> in each [[outputs]])"
            )
        return {n: v.detach().cpu().numpy() for n, v in zip(names, values, strict=True)}

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._call(self._tensors(feeds))

    def decoder(self, plan: DecodeWindow) -> Decoder:
        """The presents stay torch tensors on the device between steps."""
        from attn_export.runtimes.decoders import EagerDecoder

        return EagerDecoder(self.module, self, plan, self.device)

    def precision_floor(self, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> dict[str, float]:
        """How far PyTorch's own float32 ``outputs`` are from the module run in float64 on
        ``feeds``, per output: the error float32 itself makes on these values, at this
        runtime's threads or at one thread, whichever is larger (it changes with the thread
        count, and a graph may round like either).

        The float64 run is made twice, cast to double as a whole and with every op widened
        (``in_float64``), and the nearer one counts: each can be wrong where the other is
        right, and a wrong one widens the tolerance. Cast as a whole, a float32 mask the code
        makes meets float64 SDPA, which reads it wrong from 16 keys on; widened, a cast the
        module makes on purpose (keys rounded to bfloat16) is gone.

        First the module must agree with itself: a second run that differs from
        ``outputs`` raises ``NondeterministicModule``; randomness never becomes tolerance."""
        same_answer(outputs, self._run(feeds))
        exact = [e for e in (self._float64(feeds, widened) for widened in (True, False)) if e is not None]
        if not exact:  # a module that cannot run in float64 has no floor to offer
            return {name: 0.0 for name in outputs}
        runs = [outputs]
        if self.threads != 1:
            torch = require("torch", "running the PyTorch original")
            saved = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                runs.append(self._run(feeds))
            finally:
                torch.set_num_threads(saved)
        return {name: min(max(_error(run[name], e.get(name)) for run in runs) for e in exact) for name in outputs}

    def allowances(
        self, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray], ties: bool = True
    ) -> tuple[dict[str, float], dict[str, Rounding]]:
        """What a graph's tolerance is widened by on ``feeds`` (``compare.judge_value``):
        PyTorch's own float32 error (``precision_floor``), and what int8 rounding does to the
        module (``int8_rounding``; int4's simulated values and ties where ``ties``)."""
        return self.precision_floor(feeds, outputs), self.int8_rounding(feeds, outputs, ties)

    def _half(self) -> Any:
        """The module's float16 twin (``float16_twin``), made on first use."""
        if self._float16 is None:
            self._float16 = float16_twin(self.module)
        return self._float16

    def rounding(self, bits: int, tie: float = 0.0) -> TorchRuntime:
        """This module run with the ``bits``-bit variant's weight rounding (int4's activation
        codes nudged by ``tie``, ``rounded``), as a runtime of its own."""
        rounded = TorchRuntime(
            self.module,
            self.inputs,
            self.outputs,
            self.dims,
            device=self.device,
            threads=self.threads,
            weight_bits=bits,
            tie=tie,
            int4_activations=self.int4_activations,
        )
        rounded._float16 = self._half() if bits == FLOAT16 else None  # one float16 copy per module
        return rounded

    def int8_rounding(
        self, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray], ties: bool = True
    ) -> dict[str, Rounding]:
        """How far the module run with each quantizing variant's rounding (``in_int8``: int8,
        int4) is from its ``outputs`` on ``feeds``, per float output and by
        ``rounding_key``: how far a right graph of that variant strays here, the widest of
        the runs that ran (fp16 has several, ``FLOAT16_ROUNDINGS``); with ``ties``, int4's
        simulated values and how far its near ties move them (``with_ties``). Zero where none ran,
        with the first one's error as ``Rounding.unsimulated``: such graphs are then judged
        by the shares of the rms alone."""
        found: dict[str, Rounding] = {}
        for bits in self.rounding_bits:
            results, why = self._rounded_runs(bits, feeds)
            found |= {rounding_key(bits, t.name): Rounding(unsimulated=why) for t in self.outputs if t.name in outputs}
            for result in results:
                for t, v in zip(self.outputs, _values(result), strict=False):
                    if t.name in outputs:
                        key = rounding_key(bits, t.name)
                        found[key] = found[key].widest(Rounding.between(outputs[t.name], v.detach().cpu().numpy()))
            if bits == 4 and results and ties:
                values = zip(self.outputs, _values(results[0]), strict=False)
                simulated = {t.name: v.detach().cpu().numpy() for t, v in values}
                found |= self._with_ties(feeds, found, simulated)
        return found

    def _with_ties(
        self, feeds: Mapping[str, np.ndarray], found: Mapping[str, Rounding], simulated: Mapping[str, np.ndarray]
    ) -> dict[str, Rounding]:
        """int4's roundings in ``found`` with the ``simulated`` module's float values and how
        far its activations' near ties move them (``with_ties``): a right graph on a CPU
        gives those values to float32 noise. Empty where a nudged run fails. Where the
        activations are not rounded (a CPU computing MatMulNBits in float), the ties are the
        float32 error of the simulation itself (against it in float64): with its weights
        rounded, a module may sit on a near tie its float module does not (a Softmax of large
        scores), and a right graph's float32 rounding settles it as its own does."""
        if not self.int4_activations:
            with rounded(self._doubled(), 4, activations=False):
                exact = self._float64(feeds, widened=False)
            return with_ties(found, simulated, [exact] if exact is not None else [])
        nudged = []
        for tie in INT4_CASE_TIES:
            try:
                with self.rounding(4, tie) as run:
                    nudged.append(run.run(feeds))
            except RuntimeFailure:
                return {}
        return with_ties(found, simulated, nudged)

    def _rounded_runs(self, bits: int, feeds: Mapping[str, np.ndarray]) -> tuple[list[Any], str]:
        """The module's results with the ``bits``-bit variant's rounding, one per run that ran
        (a rounded weight may break code the float one runs, one fp16 run fail where another
        does not), and why none ran ('' where one did)."""
        torch = require("torch", "running the PyTorch original")
        tensors = self._tensors(feeds)
        if bits == FLOAT16:
            try:
                half = self._half()  # a module that cannot be copied or cast has no float16 run
            except Exception as e:  # noqa: BLE001 - the verdict says why, as a failed run's does
                return [], _not_run(bits, e)
            runs = [partial(in_float16, half, *tensors, scale_scores=s, dither=d) for s, d in FLOAT16_ROUNDINGS]
        else:
            runs = [partial(in_int8, self.module, *tensors, bits=bits, activations=self.int4_activations)]
        results, errors = [], []
        for run in runs:
            try:
                with torch.no_grad():
                    results.append(run())
            except Exception as e:  # noqa: BLE001 - whatever fails, the other runs still say something
                errors.append(e)
        if results:
            return results, ""
        return (
            [],
            f"{rounding_name(bits)}'s simulation could not run ({type(errors[0]).__name__}: {first_line(errors[0])})",
        )

    def _doubled(self) -> Any:
        """The module's float64 copy, made on first use."""
        import copy

        if self._double is None:
            self._double = copy.deepcopy(self.module).double()
        return self._double

    def _float64(self, feeds: Mapping[str, np.ndarray], widened: bool) -> dict[str, np.ndarray] | None:
        """The module's outputs in float64, every op ``widened`` or cast as a whole; None
        where it cannot run so."""
        torch = require("torch", "running the PyTorch original")
        double = self._doubled()
        args = [
            a.double() if a.is_floating_point() else a
            for a in (torch.from_numpy(np.array(feeds[t.name], order="C")).to(self.device) for t in self.inputs)
        ]
        try:
            with torch.no_grad():
                result = in_float64(double, *args) if widened else double(*args)
        except Exception:  # noqa: BLE001 - code that names float32 itself fails the cast as a whole
            return None
        return {t.name: v.detach().cpu().numpy() for t, v in zip(self.outputs, _values(result), strict=False)}

    def prepare(self, feeds: Mapping[str, np.ndarray]) -> Callable[[], object]:
        """Inputs already on the device; on CUDA the call synchronizes before returning."""
        torch = require("torch", "running the PyTorch original")
        check_feeds(feeds, self.inputs, self.dims)
        args = self._tensors(feeds)
        module = self.module
        sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)

        def call() -> None:
            with torch.no_grad():
                module(*args)
            sync()

        return call


#: fp16's simulated roundings (``in_float16``): the scores scaled on each side and after their
#: MatMul, then each with its Softmax inputs, and its query and key before their product,
#: dithered by a unit in the last place (seeded), where near ties go the other way; the
#: widest is the room. Where a row's scores are large
#: (outliers: 100s), its Softmax turns a last bit into a percent, and what one rounding does
#: there is a draw of a wide spread: on mha_cross (outliers, case seed 24) six dithers gave
#: 0.017-0.033 in the row where the right graph gave 0.045, so six, not two. The cost: verify
#: of the tiny zoo's 22 fp16 graphs at seed 0 (``--no-latency``) took 17.0-18.1 s with eight
#: runs against 12.3-14.1 s with four, alternating runs on an idle 2-core box.
FLOAT16_ROUNDINGS = ((False, None), (True, None), *(((k % 2 == 0), k) for k in range(1, 7)))


def _not_run(bits: int, error: BaseException) -> str:
    """Why the ``bits``-bit variant's simulation gave no run: ``Rounding.unsimulated``."""
    return f"{rounding_name(bits)}'s simulation could not run ({type(error).__name__}: {first_line(error)})"


def _drawn(inputs: Sequence[TensorSpec], args: Sequence[Any]) -> str:
    """Each input's shape and dtype, and the values an integer one holds: a module that
    takes fewer ids than were drawn fails on them, and must see which."""
    held = {t.name: (int(a.min()), int(a.max())) for t, a in zip(inputs, args, strict=True) if t.is_ids and a.numel()}
    return describe_inputs(inputs, args, held)


def _why(error: BaseException) -> str:
    """The error's first line, and where the spec or the module can avoid it, what to change."""
    hint = ""
    if isinstance(error, IndexError) or "out of range" in str(error) or "out of bounds" in str(error):
        hint = "; where an integer input takes fewer values than drawn, declare values = { min, max } on it"
    elif "to_padded_tensor" in str(error) or "nested tensor" in str(error).lower():
        hint = (
            "; PyTorch's fast path packed the batch as nested tensors, which fails where a padding mask hides "
            "every sequence (the mask probe draws such a batch): build nn.TransformerEncoder with "
            "enable_nested_tensor=False; the exported graph takes the padded batch either way"
        )
    return f"{type(error).__name__}: {first_line(error)}{hint}"


def _error(got: np.ndarray, exact: np.ndarray | None) -> float:
    """The largest finite |got - exact|; 0 where there is nothing to compare."""
    return 0.0 if exact is None else Rounding.between(exact, got).max


def _values(result: Any) -> tuple[Any, ...] | list[Any]:
    """A forward's outputs as a sequence: one tensor is one output."""
    return result if isinstance(result, tuple | list) else (result,)


#: Two runs of a deterministic module agree to float32 rounding of their order of summation.
_SAME = 1e-5


def same_answer(first: Mapping[str, np.ndarray], second: Mapping[str, np.ndarray]) -> None:
    """Raise ``NondeterministicModule`` when two runs on one input differ beyond rounding."""
    for name, a in first.items():
        b = second[name]
        if a.dtype.kind != "f":
            differ = not np.array_equal(a, b)
            by = "" if not differ else " (integer outputs differ)"
        else:
            both = np.isfinite(a) & np.isfinite(b)
            gap = float(np.abs(a[both].astype(np.float64) - b[both]).max()) if both.any() else 0.0
            scale = float(np.abs(a[both]).max()) if both.any() else 0.0
            differ = gap > _SAME * max(1.0, scale) or not np.array_equal(np.isfinite(a), np.isfinite(b))
            by = f" by {gap:.3g}"
        if differ:
            raise NondeterministicModule(
                f"PyTorch is not deterministic in eval mode: two runs of the module on one input differ{by} in "
                f"output '{name}', so it cannot be the reference; look for dropout_p passed to "
                "F.scaled_dot_product_attention whatever the mode, F.dropout(..., training=True), "
                "torch.rand/randn in forward(), or a buffer forward() updates"
            )

"""What every variant of one spec shares during a build: the module, its exports (one per
opset), PyTorch's outputs at the golden shapes, each variant's checked graph and the smoke
check that runs it in ONNX Runtime. Each is computed once, and a failure is remembered."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

import numpy as np
import onnx

from attn_export.artifacts.genai_folder import eos_tokens, logits_vocab, pad_token, special_tokens
from attn_export.artifacts.generations import Recorded, RecordedGenerations, encode_generations
from attn_export.artifacts.golden import GoldenCase, Sight, encode_golden
from attn_export.artifacts.intermediates import encode_intermediates
from attn_export.checks.causality import sights
from attn_export.checks.decode.plan import DEFAULT_STEPS
from attn_export.checks.decode.recording import record_trajectory, split_recorded_label
from attn_export.checks.decode.run import pytorch_trajectories
from attn_export.checks.fully_masked import judge
from attn_export.checks.generate import generate_prompts, is_causal_lm, stacked, torch_generate
from attn_export.checks.spec_learning import LEARN_SEED, learn_ranges, read_masks
from attn_export.errors import (
    AttnExportError,
    ExportFailure,
    GraphCheckError,
    RuntimeFailure,
    SpecError,
    UsageError,
    first_line,
)
from attn_export.exporter.factory import build_config, instantiate
from attn_export.exporter.graph_checks import check_deterministic, check_model, check_spec_axes
from attn_export.exporter.shape_paths import path_difference
from attn_export.exporter.source import module_sources
from attn_export.exporter.torch_export import export_onnx_program, refuse_misfit, stamp_metadata
from attn_export.exporter.variants import make_variant
from attn_export.exporter.variants.int4 import int4_compute, quantized_projections
from attn_export.model_spec import ModelSpec, variant_chain, variant_key
from attn_export.model_spec.cache import cache_of, counted_positions, fed_sizes
from attn_export.model_spec.distributions import DEFAULT as DEFAULT_DISTRIBUTION
from attn_export.model_spec.distributions import case_label, split_label
from attn_export.model_spec.inputs import make_feeds
from attn_export.model_spec.masks import CASES
from attn_export.model_spec.memory import check_memory, format_bytes, memory_budget
from attn_export.model_spec.shapes import ShapePoint, example_sizes, format_sizes, golden_plan, golden_points
from attn_export.model_spec.tolerance import on_a_cpu, rounding_bits, rounding_name
from attn_export.pipelines.building.results import BuildOptions
from attn_export.pipelines.localize.values import recorded_values
from attn_export.runtimes.ort import OnnxRuntime
from attn_export.runtimes.timing import physical_cores
from attn_export.runtimes.torch_eager import TorchRuntime

__all__ = ["BUILD_SEED", "Graph", "Once", "SpecBuild"]

#: Feeds for export examples and golden vectors use this seed (recorded in the golden file):
#: the one the spec is learned from.
BUILD_SEED = LEARN_SEED
#: Recorded intermediates are at most this large (or the memory budget, if smaller): they
#: are for one small case, to be copied to a deploy box beside the graph.
INTERMEDIATES_LIMIT = 256 << 20
#: New tokens a causal LM's recorded generations hold: ``verify --golden --generate N`` takes N up to it.
RECORDED_STEPS = 8

V = TypeVar("V")


class Once(Generic[V]):
    """A lazily computed value whose failure is remembered, so shared stages run once."""

    def __init__(self, compute: Callable[[], V]) -> None:
        self._compute = compute
        self._done = False
        self._value: V | None = None
        self._error: AttnExportError | None = None

    def get(self) -> V:
        if not self._done:
            self._done = True
            try:
                self._value = self._compute()
            except AttnExportError as e:
                self._error = e
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


@dataclass
class Graph:
    """A variant's serialized graph with metadata, checked but not yet smoke-tested."""

    model: bytes
    info: dict[str, Any]
    warnings: list[str]


class SpecBuild:
    """What every variant of one spec shares: the module, its exports, PyTorch's outputs."""

    def __init__(self, spec: ModelSpec, vers: dict[str, str], options: BuildOptions) -> None:
        self.spec = spec
        self.vers = vers
        self.options = options
        self.sizes = example_sizes(spec)
        self.sources = module_sources(spec)
        self.module = Once(self._instantiate)
        #: The positions a query sees, once every mask is read as the spec says.
        self.masks = Once(self._probe_masks)
        self.exports: dict[int, Once[onnx.ModelProto]] = {}
        #: The FX program each export converted (dynamo only), for recorded intermediates.
        self.programs: dict[int, Any] = {}
        self.example = Once(self._example)
        self.golden = Once(self._golden_cases)
        #: The golden file's bytes, shared by every variant.
        self.golden_file = Once(lambda: encode_golden(self.golden.get()))
        #: A causal LM's recorded generations (the file's bytes), or why none are recorded.
        self.generations = Once(self._generations)
        self.graphs: dict[str, Once[Graph]] = {}

    def check_budget(self) -> None:
        """Every golden case fits the memory budget: refused before the export, not after it."""
        check_memory(self.spec, golden_points(self.spec), memory_budget(self.options.max_memory, self.spec))

    def _instantiate(self) -> Any:
        """The module, run once on the example inputs (a spec error where it cannot take
        them); the spec as built learns first which values of its ids reach the tables they index."""
        module = instantiate(self.spec)
        self.spec = learn_ranges(module, self.spec)
        refuse_misfit(module, self.spec, make_feeds(self.spec, self.sizes, BUILD_SEED))
        return module

    def _probe_masks(self) -> dict[str, Sight]:
        """The module reads every mask as the spec says (``mask_probe``); and the positions a
        query sees (``causality``), which each golden case records."""
        with self._eager() as eager:
            read_masks(self.spec, eager)
            return sights(self.spec, eager, self.sizes, [p.sizes for p in golden_points(self.spec)])

    def _eager(self) -> TorchRuntime:
        """PyTorch's module on this machine's physical cores, in whichever process builds it:
        its float32 results depend on the thread count, and a Ray task's process has one
        thread unless told, so a folder built there differed from a serial build's bytes."""
        module = self.module.get()  # first: it completes the spec
        spec = self.spec
        # golden files record int8's rounding, and the others' where the build makes such a graph
        bits = tuple(sorted({8, *self._asked_bits()}, reverse=True))
        return TorchRuntime(module, spec.inputs, spec.outputs, spec.dims, threads=physical_cores(), rounding_bits=bits)

    def _asked_bits(self) -> tuple[int, ...]:
        """The roundings of the variants this build makes (``Tolerance.weight_bits``)."""
        spec = self.spec
        return rounding_bits(
            t for v in self.options.variants if not variant_chain(v).chooser for t in spec.tolerances(v).values()
        )

    def _generations(self) -> tuple[bytes | None, str | None]:
        """A causal LM's generations of seeded prompts (``artifacts.generations``), greedy, for
        as many steps as ``RECORDED_STEPS`` and the spec's ranges allow, by the module and by
        it with each quantizing variant's rounding this build makes; or None and why none."""
        spec = self.spec
        if not is_causal_lm(spec):
            return None, None
        module = self.module.get()
        cache = cache_of(spec)
        assert cache is not None
        steps = min(RECORDED_STEPS, spec.dims[cache.past_dim].max)
        try:
            config = build_config(spec)
            if config is None:
                raise SpecError("the module is not built from a transformers config")
            vocab = logits_vocab(spec)
            prompts = generate_prompts(spec, steps, BUILD_SEED, special_tokens(config, vocab))
            pad = pad_token(config, vocab)
            recorded = RecordedGenerations(pad, eos_tokens(config), steps, prompts)
            with self._eager():  # this machine's physical cores, in whichever process builds it
                self._record(recorded, module, spec, pad)
        except (SpecError, UsageError) as e:
            return None, f"no generations recorded for verify --golden --generate: {e}"
        except Exception as e:  # noqa: BLE001 - the graph is built; only its recorded generations are missing
            return None, (
                "no generations recorded for verify --golden --generate: PyTorch's generate() of the module failed "
                f"({type(e).__name__}: {first_line(e)})"
            )
        return encode_generations(recorded), None

    def _record(self, recorded: RecordedGenerations, module: Any, spec: ModelSpec, pad: int) -> None:
        """Each layout's generation as one batch and each prompt alone, by the module and by it
        with each rounding the build's quantized variants make."""
        steps, prompts = recorded.steps, recorded.prompts
        for bits in (None, *(b for b in self._asked_bits() if b in (8, 4))):
            rounding = "none" if bits is None else rounding_name(bits)
            for layout, rows in prompts.items():
                batch = torch_generate(module, spec, rows, steps, pad, bits)
                alone = stacked([torch_generate(module, spec, [row], steps, pad, bits) for row in rows])
                for how, made in (("batch", batch), ("alone", alone)):
                    recorded.runs[(rounding, layout, how)] = Recorded(made.tokens, made.logits, made.room)

    def export(self, opset: int) -> onnx.ModelProto:
        """The module exported at ``opset``, checked; exported once per opset."""
        if opset not in self.exports:
            self.exports[opset] = Once(lambda: self._export(opset))
        return self.exports[opset].get()

    def _export(self, opset: int) -> onnx.ModelProto:
        module = self.module.get()  # first: it completes the spec the example is drawn from
        example = make_feeds(self.spec, self.sizes, BUILD_SEED)
        try:
            exported = export_onnx_program(module, self.spec, example, opset=opset)
        except SystemExit as e:  # forward() exited: a failed export, not a successful build
            raise ExportFailure(f"{self.spec.name}: export failed: forward raised SystemExit: {e}") from e
        self.programs[opset] = exported.program
        if opset == self.spec.opset and exported.guards:
            # the spec as built: golden cases and the manifest's copy hold where the guards fail
            self.spec = replace(self.spec, guards=exported.guards)
        check_model(exported.proto, self.spec.name)
        check_spec_axes(exported.proto, self.spec.name, self.spec)
        return exported.proto

    def _cases(self, points: list[tuple[ShapePoint, str]], first_seed: int) -> list[GoldenCase]:
        spec = self.spec
        check_memory(spec, [p for p, _ in points], memory_budget(self.options.max_memory, spec))
        cases: list[GoldenCase] = []
        seen = self.masks.get()
        with self._eager() as eager:
            for i, (point, distribution) in enumerate(points):
                feeds = make_feeds(spec, point.sizes, first_seed + i, case=point.case, distribution=distribution)
                label = case_label(point.label, distribution)
                outputs = eager.run(feeds)
                floors, int8 = eager.allowances(feeds, outputs)
                cases.append(GoldenCase(label, dict(point.sizes), feeds, outputs, floors, int8, dict(seen)))
        return cases

    def _example(self) -> GoldenCase:
        """The smoke check's first case: the export's sizes as the graph is fed them (a
        cache's ``extend_batch`` takes several new tokens on a filled cache at that batch)."""
        sizes = fed_sizes(self.spec, self.sizes)
        return self._cases([(ShapePoint("example", sizes), DEFAULT_DISTRIBUTION)], BUILD_SEED)[0]

    def _golden_cases(self) -> list[GoldenCase]:
        """PyTorch's outputs at the golden shapes with unit-normal values (smoke-checked and
        recorded), at the distinct shape with each other distribution (recorded only: those
        are verify's to judge), and at the named mask cases (they settle fully masked rows)."""
        return self._cases(golden_plan(self.spec), BUILD_SEED + 1) + self._trajectories()

    def _trajectories(self) -> list[GoldenCase]:
        """For a model with a cache: PyTorch's decode trajectories, recorded step by step."""
        cache = cache_of(self.spec)
        if cache is None:
            return []
        with self._eager() as eager:
            recorded = pytorch_trajectories(eager, self.spec, cache, DEFAULT_STEPS, BUILD_SEED)
        seen = self.masks.get()
        return [case for traj, outputs in recorded for case in record_trajectory(self.spec, traj, outputs, seen)]

    def intermediates(self, variant: str, model: bytes) -> tuple[bytes | None, str | None]:
        """``build --record-intermediates``: PyTorch's value of every FX node on the golden
        case ``distinct``, for ``localize --golden``; or None and why none is recorded."""
        spec = self.spec
        opset = max(spec.opset, variant_chain(variant).export_opset or 0)
        program = self.programs.get(opset)
        if program is None or b"pkg.torch.onnx.fx_node" not in model:
            return None, "no intermediates recorded: only a dynamo export names the FX node of each ONNX node"
        # the smallest golden case where every dim has its own size: a swapped axis shows
        case = next(c for c in self.golden.get() if c.label == "distinct")
        limit = min(memory_budget(self.options.max_memory, spec), INTERMEDIATES_LIMIT)
        # int4 as a CPU computes it: localize --golden judges its regions against the simulation
        int4 = 0
        if spec.simulated_tolerance("", variant) is not None:
            proto = onnx.load_model_from_string(model)
            int4 = quantized_projections(proto) if int4_compute(proto) == "int8" else 0
        try:
            recorded = recorded_values(program, spec, case, limit, int4)
            return encode_intermediates(recorded), None
        except UsageError:
            return None, (
                f"no intermediates recorded: PyTorch's values at {case.label} ({format_sizes(case.sizes)}) "
                f"hold more than {format_bytes(limit)}"
            )

    def graph(self, name: str) -> Graph:
        if name not in self.graphs:
            self.graphs[name] = Once(lambda: self._make_graph(name))
        return self.graphs[name].get()

    def _make_graph(self, name: str) -> Graph:
        spec = self.spec
        key = variant_key(spec.name, name)
        opset = max(spec.opset, variant_chain(name).export_opset or 0)
        try:
            positions = counted_positions(spec) if variant_chain(name).counts_positions else None
            graph = make_variant(name, self.export(opset), self.options.provider, positions)
        except (ExportFailure, GraphCheckError) as e:
            raise type(e)(f"{key}: {e}") from e
        proto = stamp_metadata(
            graph.proto,
            {
                "attn_export.model": spec.name,
                "attn_export.variant": name,
                "attn_export.source_module": spec.module,
                "attn_export.spec_hash": spec.content_hash(),
                "attn_export.exporter": spec.exporter,
                "attn_export.opset": str(opset),
                **{f"attn_export.version.{k}": v for k, v in self.vers.items()},
                **graph.metadata,
            },
        )
        check_model(proto, key)
        check_deterministic(proto, key)
        check_spec_axes(proto, key, spec)
        return Graph(proto.SerializeToString(deterministic=True), graph.info, graph.warnings)

    def _source_run(self, variant: str, feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], str] | None:
        """The outputs on ``feeds`` of the export a variant's graph was made from, and what
        its links made of it; None for a graph no link rewrote, or where that export fails
        to run too."""
        chain = variant_chain(variant)
        if all(link.maker is None for link in chain.links):
            return None
        source = self.export(max(self.spec.opset, chain.export_opset or 0)).SerializeToString()
        try:
            with OnnxRuntime(source, self.spec.inputs, self.spec.outputs, self.spec.dims, provider="cpu") as plain:
                got = plain.run(feeds)
        except RuntimeFailure:
            return None
        return got, "; ".join(f"{link.name}: {link.summary}" for link in chain.links if link.maker is not None)

    def _made_by(self, variant: str, feeds: dict[str, np.ndarray]) -> str:
        """Where ONNX Runtime cannot run a variant's graph but runs the export it was made
        from on the same feeds, what says that the variant's rewrite made the fault."""
        ran = self._source_run(variant, feeds)
        if ran is None:
            return ""
        refused = "so the rewrite made the graph ONNX Runtime refuses"
        return f"; the export it was made from runs there, {refused} ({ran[1]})"

    def _rewrite_differs(self, variant: str, case: GoldenCase) -> str | None:
        """Where a variant's graph fails a case that the export it was made from passes at
        the spec's own tolerance on the rows that see a key, what says that the variant made
        the difference (not an accepted guard failing at the case's sizes, which the export
        would show too)."""
        ran = self._source_run(variant, case.inputs)
        if ran is None:
            return None
        # the rows that see no key left out: the repair build made of the variant's graph is not in its export
        seen = replace(self.spec, fully_masked="ignore")
        comparisons, _ = judge(seen, case, ran[0], self.spec.tolerances("fp32"))
        if not all(c.passed for c in comparisons):
            return None
        chain = variant_chain(variant)
        rounding = (
            f", by a fault or by {'+'.join(chain.lossy)}'s rounding (where that is all it is, give "
            f"[{chain.table}] atol_rms and rms_rtol in the spec)"
            if chain.lossy
            else ""
        )
        agrees = "the export it was made from agrees here at the spec's own tolerance"
        return f"{agrees}, so the variant differs{rounding} ({ran[1]})"

    def smoke(self, variant: str, model: bytes) -> None:
        """ONNX Runtime (CPU) against PyTorch at the example and golden shapes, at the
        variant's tolerance."""
        spec = self.spec
        own = spec.tolerances(variant)
        # int4 against its simulation, except on a decode step's recorded case: its simulated
        # values are the rounded trajectory's, fed its own pasts, and the case feeds PyTorch's
        simulated = on_a_cpu(own, spec.simulated_tolerances(variant))
        cases = [c for c in self.golden.get() if c.label not in CASES]  # mask cases are settled, not smoked
        with OnnxRuntime(
            model, spec.inputs, spec.outputs, spec.dims, provider="cpu", capacity=spec.cache_max_seq
        ) as session:
            for case in [self.example.get(), *cases]:
                if split_label(case.label)[1] != DEFAULT_DISTRIBUTION:
                    continue
                where = f"{variant_key(spec.name, variant)}: smoke check at {case.label} ({format_sizes(case.sizes)})"
                try:
                    got = session.run(case.inputs)
                except RuntimeFailure as e:
                    raise GraphCheckError(f"{where} failed: {e}{self._made_by(variant, case.inputs)}") from e
                tolerances = own if split_recorded_label(case.label) else simulated
                comparisons, notes = judge(spec, case, got, tolerances)
                failed = [c.reason() for c in comparisons if not c.passed]
                if failed:
                    branch = path_difference(
                        self.module.get(), spec, make_feeds(spec, self.sizes, BUILD_SEED), case.inputs, case.sizes
                    )
                    guards = [g.describe() for g in spec.guards if g.fails_at(case.sizes)]
                    cause = branch.describe() if branch else None
                    if cause is None and guards:  # the path is the same, a value from a size is not
                        cause = self._rewrite_differs(variant, case) or (
                            f"the spec accepted the guard {'; '.join(guards)}, which fails here"
                        )
                    if cause is None and any(c.unexpected_nonfinite for c in comparisons):
                        cause = _undeclared_mask(spec, case)
                    why = [*([cause] if cause else []), failed[0], *notes]  # the cause first
                    raise GraphCheckError(f"{where} failed: {'; '.join(why)}")


def _undeclared_mask(spec: ModelSpec, case: GoldenCase) -> str | None:
    """Why a graph gives NaN where PyTorch is finite, where a boolean input of two axes or
    more is declared no mask and one of its rows, as drawn, is one value throughout: a row
    it hides whole is NaN in the graph's softmax and 0 in PyTorch's safe one, and verify
    neither draws its rows as a mask's nor knows which way it reads."""
    for t in spec.inputs:
        value = case.inputs.get(t.name)
        if t.dtype != "bool" or t.mask is not None or value is None or value.ndim < 2 or not value.shape[-1]:
            continue
        rows = value.reshape(-1, value.shape[-1])
        if (rows.all(axis=1) | ~rows.any(axis=1)).any():
            return (
                f"input '{t.name}' is bool and declared no mask, so its values were drawn at random and rows it "
                "hides whole are NaN in the graph; declare mask = \"random\" (or its pattern) and its convention "
                "on it (see masks.md)"
            )
    return None

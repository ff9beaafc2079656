"""The graph-variant table: the one list that spec validation, build keys, ``auto``, the
CLI's choices and the manifest read.

A variant is made by ``attn_export.exporter.variants.<maker>.make``; adding one is a new
file there plus one row here.

Variants compose: a variant name may be a chain ``a+b+c``, whose first link is made from
its source as a lone variant is (the plain export, or the re-export at its opset) and each
next link from its own copy of the graph the link before made. What may follow what is
data, not code: each row says which traits of a graph (``TRAITS``) its maker needs and
which it takes away, so a new row joins chains without a line anywhere else.
``variant_chain`` checks a chain before anything is exported:

- every link is a known variant that makes a graph (neither ``fp32``, the plain export
  every chain starts from, nor a chooser such as ``auto``), and none is repeated;
- at most one export opset: a link made from a re-export (``export_opset``) reads the
  export, not the graph of a link before it, so it can only be the first link;
- a link that rewrites another's graph (``after``: ``gqa-rotary``) comes after one of
  those, and is never made alone;
- each link's ``needs`` are traits that no link before it ``takes``: ``fp16`` after
  ``int8`` would cut the precision twice, anything after ``ort-optimized`` would rewrite
  kernels chosen for one provider, ``ort-fused`` after a graph whose attention is already
  one op has nothing left to fuse.

What the table cannot know, the build checks on the graphs themselves: a link that leaves
the graph it follows as it was (the same ops and attributes, weight, input and output
types) did nothing there (``int8`` after ``ort-fused`` where no MatMul weight is left
outside a fused op) and is refused, naming it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from attn_export.errors import UsageError
from attn_export.model_spec.tolerance import Tolerance

__all__ = [
    "AUTO",
    "CHAIN",
    "FP16_TOLERANCE",
    "INT4_TOLERANCE",
    "INT8_TOLERANCE",
    "TRAITS",
    "VARIANTS",
    "Chain",
    "VariantInfo",
    "auto_candidates",
    "variant_chain",
    "variant_key",
]

#: Joins the links of a chained variant: ``ort-past+int8``.
CHAIN = "+"

#: What a graph may have that a link needs and a link before it may take away: each says,
#: for the error that names a link that cannot follow, what a graph with it does.
TRAITS = {
    "float32": "computes in float32",
    "portable": "holds no kernels chosen for one provider",
    "plain-attention": "holds its attention as plain ops (MatMul, Softmax) that a fusion can match",
}
PORTABLE = frozenset({"portable"})


@dataclass(frozen=True)
class VariantInfo:
    """What every consumer needs to know about one graph variant."""

    name: str
    summary: str
    #: Module under ``attn_export.exporter.variants`` whose ``make`` derives it; None for the plain export.
    maker: str | None = None
    #: Default tolerance when the spec gives none; None means the model's own.
    tolerance: Tolerance | None = None
    #: Derived from a re-export at this opset instead of from the plain graph.
    export_opset: int | None = None
    #: The graph depends on ``--provider`` (part of the build key).
    provider_dependent: bool = False
    #: ``auto`` times it as a candidate.
    auto_candidate: bool = True
    #: ``auto`` tries it only when the target provider is CUDA.
    cuda_only: bool = False
    #: Chooses among the other variants instead of making a graph (``auto``).
    chooser: bool = False
    #: Traits (``TRAITS``) the graph it is made from must have: in a chain, no link before
    #: it may take them away.
    needs: frozenset[str] = PORTABLE
    #: Traits its graph no longer has.
    takes: frozenset[str] = frozenset()
    #: Writes the cache into a buffer of the spec's ``[cache] max_seq``, which must be declared.
    in_place: bool = False
    #: Counts each token's position itself, as the cache's filled length plus its index: its
    #: maker takes how many positions the graph reaches, and the spec's positions must be
    #: that count (``model_spec.cache.counted_positions``).
    counts_positions: bool = False
    #: The links whose graph it rewrites, one of which must come before it in a chain (it
    #: cannot be made alone); empty: any graph.
    after: frozenset[str] = frozenset()


AUTO = "auto"

#: Lossy variants' default tolerances scale with the output: their error grows with the
#: values (``Tolerance.atol_rms``, ``rms_rtol``). Measured on the test zoo (``tests/models``,
#: ``benchmarks/lossy_errors.py``), every case and decode step on normal and tiny values,
#: a right graph's worst element is off by 0.144 x the output's rms (int8) and 0.0055 x (fp16), its error's
#: rms 0.0245 x and 0.00077 x; the defaults hold 1.7-6.5 times that. A fixed int8 atol of
#: 0.1 was as large as the outputs and passed a weight scale 10 % off, which the rms shows.
INT8_TOLERANCE = Tolerance(1e-4, 0.05, atol_rms=0.25, rms_rtol=0.05, int8_rounding=True)
#: int4 rounds in blocks, more coarsely than int8: its rounding simulated on each case
#: (``weight_bits=4``) sets the room, the shares of the rms as int8's where it does not run.
INT4_TOLERANCE = Tolerance(1e-4, 0.05, atol_rms=0.25, rms_rtol=0.05, int8_rounding=True, weight_bits=4)
#: fp16's rounding grows with the values (a right graph's worst element reached 22 on large
#: ones): the module run in float16 (``in_float16``) sets the room, where it is more than the shares.
#: Its rms share: a right graph's error rms reached 0.0012 x the output's beyond what the
#: simulation gives (tiny zoo, seeds 0-9, every distribution and decode step); 0.005 let an
#: output projection 1 % off before BertAttention's LayerNorm pass (0.0016-0.0030 x).
FP16_TOLERANCE = Tolerance(1e-4, 0.01, atol_rms=0.02, rms_rtol=0.002, int8_rounding=True, weight_bits=16)

VARIANTS: dict[str, VariantInfo] = {
    v.name: v
    for v in (
        VariantInfo("fp32", "the plain export"),
        VariantInfo(
            "attention-op",
            "re-exported at opset 23 with the ONNX Attention op",
            "attention_op",
            export_opset=23,
            takes=frozenset({"plain-attention"}),
        ),
        VariantInfo(
            "ort-fused",
            "onnxscript's optimize_for_ort fusions",
            "ort_fused",
            needs=PORTABLE | {"plain-attention"},
            takes=frozenset({"plain-attention"}),
        ),
        VariantInfo(
            "ort-past",
            "a decoder's cache attention as ONNX Runtime's MultiHeadAttention or GroupQueryAttention with past inputs",
            "ort_past",
            export_opset=23,
            takes=frozenset({"plain-attention"}),
        ),
        VariantInfo(
            "int8",
            "dynamic int8 quantization of MatMuls",
            "int8",
            tolerance=INT8_TOLERANCE,
            needs=PORTABLE | {"float32"},
            takes=frozenset({"float32"}),
        ),
        VariantInfo(
            "int4",
            "int4 weight-only quantization of MatMuls (MatMulNBits, blocks of 32), as onnxruntime-genai's CPU int4",
            "int4",
            tolerance=INT4_TOLERANCE,
            auto_candidate=False,  # its rounding is never within a model's own tolerance: timing it is waste
            needs=PORTABLE | {"float32"},
            takes=frozenset({"float32"}),
        ),
        VariantInfo(
            "static-cache",
            "a decoder's cache as a fixed-capacity buffer written in place (GroupQueryAttention up to a length)",
            "static_cache",
            export_opset=23,
            auto_candidate=False,
            takes=frozenset({"plain-attention"}),
            in_place=True,
        ),
        VariantInfo(
            "gqa-rotary",
            "rotary folded into GroupQueryAttention and its projections packed into one MatMul, as "
            "onnxruntime-genai's graphs (after static-cache or ort-past; positions counted from the cache)",
            "gqa_rotary",
            auto_candidate=False,
            needs=PORTABLE | {"float32"},
            counts_positions=True,
            after=frozenset({"static-cache", "ort-past"}),
        ),
        VariantInfo(
            "fp16",
            "float16 inside, float32 inputs and outputs",
            "fp16",
            tolerance=FP16_TOLERANCE,
            cuda_only=True,
            needs=PORTABLE | {"float32"},
            takes=frozenset({"float32", "plain-attention"}),
        ),
        VariantInfo(
            "ort-optimized",
            "the graph ONNX Runtime optimizes for --provider",
            "ort_optimized",
            provider_dependent=True,
            takes=PORTABLE,
        ),
        VariantInfo(
            AUTO,
            "the fastest candidate within the model's own tolerance",
            provider_dependent=True,
            auto_candidate=False,
            chooser=True,
        ),
    )
}


@dataclass(frozen=True)
class Chain:
    """A variant name read as its links: one row of ``VARIANTS`` for a lone variant, each
    link's row, in order, for a chain. What the build and the manifest's readers need of
    the whole follows from the links."""

    name: str
    links: tuple[VariantInfo, ...]

    @property
    def table(self) -> str:
        """The spec's table of its tolerance, as TOML writes its header (``variants.fp16``,
        ``variants."ort-past+int8"``: ``+`` needs quotes)."""
        return f"variants.{self.name}" if re.fullmatch(r"[A-Za-z0-9_-]+", self.name) else f'variants."{self.name}"'

    @property
    def lossy(self) -> tuple[str, ...]:
        """The links that compute below float32 and bring a tolerance of their own (int8, fp16)."""
        return tuple(link.name for link in self.links if link.tolerance is not None)

    @property
    def composed(self) -> bool:
        """More than one link: ``ModelSpec.tolerance_for`` composes their tolerances."""
        return len(self.links) > 1

    @property
    def export_opset(self) -> int | None:
        """The opset of the re-export its first link is made from (None: the plain export)."""
        return self.links[0].export_opset

    @property
    def provider_dependent(self) -> bool:
        return any(link.provider_dependent for link in self.links)

    @property
    def in_place(self) -> bool:
        return any(link.in_place for link in self.links)

    @property
    def counts_positions(self) -> bool:
        return any(link.counts_positions for link in self.links)

    @property
    def chooser(self) -> bool:
        """``auto``: chooses a graph instead of making one (never a link of a longer chain)."""
        return self.links[0].chooser


def _unknown(name: str, where: str) -> UsageError:
    return UsageError(f"unknown variant {name}{where} (known: {', '.join(VARIANTS)})")


def _alone(info: VariantInfo, where: str) -> UsageError:
    after = sorted(info.after)
    return UsageError(
        f"{where}: {info.name} rewrites the graph {' or '.join(after)} makes; put one before it "
        f"({after[-1]}+{info.name})"
    )


def _taker(trait: str, before: Iterable[VariantInfo]) -> VariantInfo | None:
    """The last link of ``before`` that takes ``trait`` away."""
    return next((link for link in reversed(list(before)) if trait in link.takes), None)


def variant_chain(name: str) -> Chain:
    """``name`` (a variant, or links joined by ``+``) as its links, checked as the module
    docstring says; a UsageError naming the first link that cannot be, and why."""
    if not isinstance(name, str) or CHAIN not in name:
        if name not in VARIANTS:
            raise _unknown(name, "")
        if VARIANTS[name].after:
            raise _alone(VARIANTS[name], f"variant {name}")
        return Chain(name, (VARIANTS[name],))
    where = f"chain {name}"
    links: list[VariantInfo] = []
    for part in name.split(CHAIN):
        info = VARIANTS.get(part)
        if info is None:
            raise _unknown(part or repr(part), f" in {where}")
        if info.chooser:
            raise UsageError(f"{where}: {part} chooses among variants instead of making a graph; it cannot be a link")
        if info.maker is None:
            raise UsageError(f"{where}: {part} is the plain export every chain starts from; leave it out")
        if info in links:
            raise UsageError(f"{where}: {part} is repeated; a link applies once")
        opsets = {link.export_opset for link in links if link.export_opset} - {info.export_opset}
        if info.export_opset and opsets:
            raise UsageError(
                f"{where}: {part} needs the opset-{info.export_opset} export, a link before it "
                f"the opset-{opsets.pop()} one: a chain has one export"
            )
        if links and info.export_opset:
            raise UsageError(
                f"{where}: {part} cannot follow {links[-1].name}: it is made from the opset-{info.export_opset} "
                "re-export, not from another link's graph, so it can only be the first link"
            )
        if info.after and not info.after & {link.name for link in links}:
            raise _alone(info, where)
        for trait in sorted(info.needs):
            taker = _taker(trait, links)
            if taker is not None:
                raise UsageError(
                    f"{where}: {part} cannot follow {taker.name}: {part} needs a graph that {TRAITS[trait]}, "
                    f"and {taker.name}'s does not"
                )
        links.append(info)
    return Chain(name, tuple(links))


def auto_candidates(provider: str) -> list[str]:
    """The variants ``auto`` times on ``provider``, in table order."""
    return [v.name for v in VARIANTS.values() if v.auto_candidate and (provider == "cuda" or not v.cuda_only)]


def variant_key(model: str, variant: str) -> str:
    """Manifest key and file stem: the plain graph keeps the model's name; a chain's
    ``+`` is safe in file names and kept (``mha.ort-past+int8.onnx``)."""
    return model if variant == "fp32" else f"{model}.{variant}"

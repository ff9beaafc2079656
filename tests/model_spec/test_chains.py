"""Chains of variants as the table reads them: which links may follow which (checked before
anything is exported, refused in one line naming the link), and the composed tolerance."""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from attn_export.cli import cli
from attn_export.errors import SpecError, UsageError
from attn_export.model_spec import VARIANTS, Tolerance, VariantInfo, load_spec, variant_chain
from attn_export.model_spec.variants import INT8_TOLERANCE, TRAITS
from attn_export.pipelines.building import BuildOptions
from tests.conftest import TINY_ZOO, tiny_spec

REFUSED = [
    (
        "int8+fp16",
        "chain int8+fp16: fp16 cannot follow int8: fp16 needs a graph that computes in float32, and int8's does not",
    ),
    (
        "fp16+int8",
        "chain fp16+int8: int8 cannot follow fp16: int8 needs a graph that computes in float32, and fp16's does not",
    ),
    (
        "ort-optimized+int8",
        "chain ort-optimized+int8: int8 cannot follow ort-optimized: int8 needs a graph that holds no kernels "
        "chosen for one provider, and ort-optimized's does not",
    ),
    (
        "attention-op+ort-fused",
        "chain attention-op+ort-fused: ort-fused cannot follow attention-op: ort-fused needs a graph that holds "
        "its attention as plain ops (MatMul, Softmax) that a fusion can match, and attention-op's does not",
    ),
    (
        "int8+attention-op",
        "chain int8+attention-op: attention-op cannot follow int8: it is made from the opset-23 re-export, not "
        "from another link's graph, so it can only be the first link",
    ),
    ("auto+int8", "chain auto+int8: auto chooses among variants instead of making a graph; it cannot be a link"),
    ("fp32+int8", "chain fp32+int8: fp32 is the plain export every chain starts from; leave it out"),
    ("int8+ort-fused+int8", "chain int8+ort-fused+int8: int8 is repeated; a link applies once"),
    ("int8+int2", f"unknown variant int2 in chain int8+int2 (known: {', '.join(VARIANTS)})"),
    (
        "int8+int4",
        "chain int8+int4: int4 cannot follow int8: int4 needs a graph that computes in float32, and int8's does not",
    ),
    ("int8+", f"unknown variant '' in chain int8+ (known: {', '.join(VARIANTS)})"),
    (
        "int8+gqa-rotary",
        "chain int8+gqa-rotary: gqa-rotary rewrites the graph ort-past or static-cache makes; put one before it "
        "(static-cache+gqa-rotary)",
    ),
    (
        "static-cache+int4+gqa-rotary",
        "chain static-cache+int4+gqa-rotary: gqa-rotary cannot follow int4: gqa-rotary needs a graph that computes "
        "in float32, and int4's does not",
    ),
]


@pytest.mark.parametrize(("chain", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_an_impossible_chain_is_one_line_naming_the_link(tmp_path: Path, chain: str, message: str) -> None:
    with pytest.raises(UsageError) as refused:
        BuildOptions(tmp_path, variants=("fp32", chain)).check()
    assert str(refused.value) == message
    result = CliRunner().invoke(cli, ["build", "--out", str(tmp_path / "out"), "--variant", chain])
    assert (result.exit_code, result.output) == (2, f"Error: {message}\n")
    assert not (tmp_path / "out").exists()  # refused before anything is exported


def test_every_two_links_either_chain_or_are_refused_by_the_table() -> None:
    """What the table allows of every pair: the links that change precision exclude each
    other, nothing follows ort-optimized, ort-fused follows nothing that fused or cast the
    attention, and the re-exports come first."""
    makers = [name for name, v in VARIANTS.items() if v.maker]
    allowed = set()
    for a, b in itertools.permutations(makers, 2):
        try:
            variant_chain(f"{a}+{b}")
            allowed.add(f"{a}+{b}")
        except UsageError:
            pass
    assert allowed == {
        "attention-op+int8", "attention-op+int4", "attention-op+fp16", "attention-op+ort-optimized",
        "ort-past+int8", "ort-past+int4", "ort-past+fp16", "ort-past+ort-optimized",
        "ort-fused+int8", "ort-fused+int4", "ort-fused+fp16", "ort-fused+ort-optimized",
        "static-cache+int8", "static-cache+int4", "static-cache+fp16", "static-cache+ort-optimized",
        "int8+ort-fused", "int8+ort-optimized", "int4+ort-fused", "int4+ort-optimized", "fp16+ort-optimized",
        "ort-past+gqa-rotary", "static-cache+gqa-rotary",
    }  # fmt: skip
    assert variant_chain("static-cache+gqa-rotary+int4").in_place  # a link after the one it rewrites
    assert all(trait in TRAITS for v in VARIANTS.values() for trait in v.needs | v.takes)


def test_a_chain_is_read_link_by_link() -> None:
    chain = variant_chain("ort-past+int8+ort-optimized")
    assert [link.name for link in chain.links] == ["ort-past", "int8", "ort-optimized"]
    assert chain.export_opset == 23 and chain.provider_dependent and not chain.chooser
    assert variant_chain("int8").links == (VARIANTS["int8"],) and not variant_chain("int8").provider_dependent


def test_two_approximations_compose_into_the_sum_of_their_errors() -> None:
    first, second, third = Tolerance(1e-5, 1e-4), Tolerance(0.1, 0.1), Tolerance(1e-2, 2e-2)
    both = first.then(second)
    assert both.atol == pytest.approx(1e-5 + 0.1 + 0.1 * 1e-5) and both.rtol == pytest.approx(1e-4 + 0.1 + 1e-5)
    left, right = both.then(third), first.then(second.then(third))  # a chain folds either way
    assert (left.atol, left.rtol) == pytest.approx((right.atol, right.rtol))
    assert not Tolerance(0, 0, allow_nan=True).then(Tolerance(0, 0)).allow_nan
    # the bound holds where both links reach theirs, in the same direction: the larger would not
    rng = np.random.default_rng(0)
    truth = rng.standard_normal(10_000) * 10
    once = truth + first.atol + first.rtol * np.abs(truth)
    twice = once + second.atol + second.rtol * np.abs(once)
    assert np.all(np.abs(twice - truth) <= both.atol + both.rtol * np.abs(truth) + 1e-9)
    widest = max((first, second), key=lambda t: t.atol)
    assert np.any(np.abs(twice - truth) > widest.atol + widest.rtol * np.abs(truth))
    # with shares of the rms, each link's taken of the value it approximates
    a, b = Tolerance(1e-3, 0.01, atol_rms=0.2), Tolerance(1e-4, 0.05, atol_rms=0.25)
    ab = a.then(b)

    def rms(v: np.ndarray) -> float:
        return float(np.sqrt(np.mean(v**2)))

    once = truth + (a.atol + a.atol_rms * rms(truth)) + a.rtol * np.abs(truth)
    twice = once + (b.atol + b.atol_rms * rms(once)) + b.rtol * np.abs(once)
    assert np.all(np.abs(twice - truth) <= (ab.atol + ab.atol_rms * rms(truth)) + ab.rtol * np.abs(truth) + 1e-9)
    left, right = ab.then(first), a.then(b.then(first))  # still folds either way
    assert (left.atol, left.rtol, left.atol_rms) == pytest.approx((right.atol, right.rtol, right.atol_rms))


def test_a_chain_is_judged_at_its_links_tolerances_composed_unless_the_spec_names_it(tmp_path: Path) -> None:
    spec = load_spec(TINY_ZOO / "mha_kv_cache.toml")
    own = spec.tolerance
    assert spec.tolerance_for("output", "ort-past+int8") == own.then(VARIANTS["int8"].tolerance)  # type: ignore[arg-type]
    assert spec.tolerance_for("output", "attention-op+fp16") == own.then(VARIANTS["fp16"].tolerance)  # type: ignore[arg-type]
    text = (TINY_ZOO / "mha_kv_cache.toml").read_text()
    text += '\n[variants.int8]\natol = 0.5\nrtol = 0.25\n\n[variants."attention-op+fp16"]\natol = 0.03\nrtol = 0.02\n'
    named = load_spec(tiny_spec(tmp_path, "mha_kv_cache", body=text))
    # a key the table leaves out keeps the variant's own default: int8's shares of the rms
    assert named.tolerance_for("output", "ort-past+int8") == own.then(
        dataclasses.replace(INT8_TOLERANCE, atol=0.5, rtol=0.25)
    )
    # fp16's simulated rounding stays with its graphs, whatever table sets the rest
    half = Tolerance(0.03, 0.02, int8_rounding=True, weight_bits=16)
    assert named.tolerance_for("output", "attention-op+fp16") == half
    assert named.tolerance_for("output", "ort-past") == own
    # the rms shares are read from any table, and hashed only where set (older specs keep theirs)
    text += "\n[variants.fp16]\natol = 0.001\nrtol = 0.01\natol_rms = 0.03\nrms_rtol = 0.004\n"
    shares = load_spec(tiny_spec(tmp_path, "mha_kv_cache", body=text))
    assert shares.tolerance_for("output", "fp16") == Tolerance(
        0.001, 0.01, atol_rms=0.03, rms_rtol=0.004, int8_rounding=True, weight_bits=16
    )
    assert shares.to_dict()["variants"]["fp16"] == {"atol": 0.001, "rtol": 0.01, "atol_rms": 0.03, "rms_rtol": 0.004}
    assert "atol_rms" not in named.to_dict()["tolerance"]


def test_int4_on_a_cpu_is_held_to_its_chains_other_links_unless_the_spec_names_its_room(tmp_path: Path) -> None:
    """Against its simulation an int4 link takes nothing away: the chain is judged at its
    other links' tolerances composed (ort-past's own where the spec sets one), the output's
    where none is left; where the spec names int4's tolerance or the chain's, the user's
    room judges (no simulated tolerance)."""
    spec = load_spec(TINY_ZOO / "mha_kv_cache.toml")
    assert spec.simulated_tolerances("fp32") is None and spec.simulated_tolerances("ort-past+int8") is None
    assert spec.simulated_tolerances("int4") == spec.tolerances("fp32")
    text = (TINY_ZOO / "mha_kv_cache.toml").read_text() + "\n[variants.ort-past]\natol = 0.001\nrtol = 0.002\n"
    past = load_spec(tiny_spec(tmp_path, "mha_kv_cache", body=text))
    assert past.simulated_tolerances("ort-past+int4") == past.tolerances("ort-past")
    for named in ("[variants.int4]\natol = 0.1\nrtol = 0.1\n", '[variants."ort-past+int4"]\natol = 0.1\nrtol = 0.1\n'):
        own = load_spec(tiny_spec(tmp_path, "mha_kv_cache", body=text + named))
        assert own.simulated_tolerances("ort-past+int4") is None


@pytest.mark.parametrize(
    ("table", "at", "message"),
    [
        ('[variants."int8+fp16"]\natol = 0.1', 0, "chain int8+fp16: fp16 cannot follow int8: fp16 needs a graph that "),
        ('[variants."ort-fused+int8"]\natol = -1', 1, 'variants."ort-fused+int8".atol must be a finite non-negative'),
        ("[variants.int8]\nrms_rtol = -0.1", 1, "variants.int8.rms_rtol must be a finite non-negative"),
    ],
)
def test_a_spec_s_chain_table_is_checked_and_its_errors_name_its_line(
    tmp_path: Path, table: str, at: int, message: str
) -> None:
    path = tiny_spec(tmp_path)
    text = path.read_text()
    path.write_text(f"{text}\n{table}\n")
    line = text.count("\n") + 2 + at  # the table's header, or its line ``at`` below
    with pytest.raises(SpecError, match=re.escape(f"tiny.toml:{line}: {message}")):
        load_spec(path)


def test_a_new_variant_joins_chains_with_no_other_code(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """One row, as another variant will add it (its maker's file aside): the checks, the
    tolerance and the CLI know its chains."""
    row = VariantInfo("static-cache", "a cache of fixed size", "static_cache", Tolerance(1e-3, 1e-3), export_opset=23)
    monkeypatch.setitem(VARIANTS, row.name, row)
    assert [link.name for link in variant_chain("static-cache+int8").links] == ["static-cache", "int8"]
    with pytest.raises(UsageError, match="static-cache cannot follow int8: it is made from the opset-23 re-export"):
        variant_chain("int8+static-cache")
    with pytest.raises(UsageError, match="static-cache cannot follow ort-past: "):
        variant_chain("ort-past+static-cache")
    monkeypatch.setitem(VARIANTS, row.name, dataclasses.replace(row, export_opset=24))
    with pytest.raises(UsageError) as two:
        variant_chain("ort-past+static-cache")
    assert str(two.value) == (
        "chain ort-past+static-cache: static-cache needs the opset-24 export, a link before it the opset-23 one: "
        "a chain has one export"
    )
    monkeypatch.setitem(VARIANTS, row.name, row)
    spec = load_spec(TINY_ZOO / "mha_kv_cache.toml")
    assert spec.tolerance_for("output", "static-cache+int8") == Tolerance(1e-3, 1e-3).then(INT8_TOLERANCE)
    BuildOptions(tmp_path, variants=("static-cache+int8",)).check()
    result = CliRunner().invoke(cli, ["build", "--out", str(tmp_path / "out"), "--variant", "int8+static-cache"])
    assert result.exit_code == 2 and "Error: chain int8+static-cache: static-cache cannot follow int8" in result.output


def test_a_chain_with_a_link_that_cannot_be_made_alone_has_its_links_tolerances() -> None:
    """gqa-rotary is a link only (``variant_chain("gqa-rotary")`` refuses it): a chain of it is
    judged by its links' tolerances all the same, int4's here."""
    spec = load_spec(TINY_ZOO / "llama_causal_lm.toml")
    own, int4 = spec.tolerance_for("logits", "static-cache"), spec.tolerance_for("logits", "int4")
    with_rotary = spec.tolerance_for("logits", "static-cache+gqa-rotary+int4")
    assert with_rotary == own.then(own).then(int4) and with_rotary.weight_bits == 4

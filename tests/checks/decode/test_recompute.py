"""Decode compares every row of every step with the same row of one pass over the whole
sequence, so a decoder whose later tokens change earlier outputs, or whose result depends on
how many keys it sees, fails verify --decode even without an attention mask."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from attn_export.artifacts.manifest import load_manifest
from attn_export.pipelines.localize import LocalizeOptions, LocalizeReport, localize_failures, localize_model
from attn_export.pipelines.verify import VerifyOptions, verify_artifacts
from attn_export.report.localize_text import format_localize
from tests.conftest import ROOT, TINY_ZOO, Built, built_on_demand, write_spec

ZOO_CODE = ROOT / "attn_export" / "zoo"
MASK_INPUT = re.compile(r'\[\[inputs\]\]\nname = "attention_mask"\n.*?(?=\[\[inputs\]\])', re.S)


#: Each decoder without a mask, by the name it is built as: its module class.
CLASSES = {"withoutmask": "WithoutMask", "nocausalmask": "NoCausalMask", "keycountscale": "KeyCountScale"}


def _without_mask(folder: Path, name: str) -> Path:
    cls = CLASSES[name]
    text = (TINY_ZOO / "mha_kv_cache.toml").read_text()
    text = MASK_INPUT.sub("", text).replace("attn_export.zoo.kv_cache:MHAKVCache", f"tests.faulty_decoders:{cls}")
    assert "attention_mask" not in text
    return write_spec(folder, name, text)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    """Each decoder built when a test first asks for it."""
    return built_on_demand(tmp_path_factory, _without_mask)


def _decode(built: Callable[[str], Built], name: str) -> list[str]:
    done = built(name)
    assert done.errors[name] is None, done.errors
    options = VerifyOptions(
        models_dir=done.models, latency=False, distributions=("normal",), n_random=0, decode_steps=8
    )
    report = verify_artifacts(done.out, load_manifest(done.out), [name], options)
    assert report.decode, "the spec declares a cache: verify decodes it"
    return [r for d in report.decode for r in d.reasons()]


def test_a_correct_decoder_without_a_mask_agrees_with_one_pass(built: Callable[[str], Built]) -> None:
    assert _decode(built, "withoutmask") == []


@pytest.mark.parametrize("name", [pytest.param("nocausalmask", marks=pytest.mark.slow), "keycountscale"])
def test_a_decoder_wrong_over_the_sequence_fails_from_the_prompt_on(built: Callable[[str], Built], name: str) -> None:
    reasons = _decode(built, name)
    assert reasons, f"{name} passed verify --decode"
    assert reasons[0].startswith(
        "module bug: with its cache the module disagrees with one pass over every token, from step 1 (past 0, seq "
    ), reasons[0]
    assert "its rows 0 to " in reasons[0] and "differ from the same rows of the pass: output: " in reasons[0]


@pytest.mark.parametrize(
    ("name", "fx_node", "step"),
    [
        ("keycountscale", "sum_1", 1),
        pytest.param("nocausalmask", "scaled_dot_product_attention", 3, marks=pytest.mark.slow),
    ],
)
def test_localize_names_the_first_fx_node_where_the_cached_module_parts_from_its_one_pass(
    built: Callable[[str], Built], name: str, fx_node: str, step: int
) -> None:
    done = built(name)
    out, models = done.out, done.models
    report = localize_model(out, name, LocalizeOptions(models_dir=models, decode_step=step))
    bug = report.module_bug
    assert report.graph_agrees and not report.agrees, "the graph does as the module does; the module is wrong"
    assert bug is not None and bug.fx_node == fx_node and bug.local is not None and not bug.local.passed
    assert bug.source.startswith(str(ZOO_CODE / "kv_cache.py") + ":"), bug.source
    assert "THE MODULE disagrees with itself at this step" in format_localize(report)
    assert LocalizeReport.from_dict(report.to_dict()).module_bug == bug
    if step == 1:  # verify --localize localizes the step its decode check says the module bug starts at
        options = VerifyOptions(models_dir=models, latency=False, distributions=("normal",), n_random=0, decode_steps=8)
        verified = verify_artifacts(out, load_manifest(out), [name], options)
        [found] = localize_failures(verified, options)
        assert found.decode_step == 1 and found.module_bug is not None and found.module_bug.fx_node == fx_node


@pytest.mark.slow  # the zoo decoders' five-seed localize sweep covers it too; CI runs it
def test_localize_finds_no_module_bug_in_a_correct_decoder(built: Callable[[str], Built]) -> None:
    done = built("withoutmask")
    out, models = done.out, done.models
    report = localize_model(out, "withoutmask", LocalizeOptions(models_dir=models, decode_step=3))
    assert report.agrees and report.module_bug is None

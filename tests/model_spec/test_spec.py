"""Spec loading: the zoo loads, and every bad spec is one clear SpecError naming file and cause."""

from __future__ import annotations

from pathlib import Path

import pytest

from attn_export.errors import SpecError
from attn_export.model_spec import ModelSpec, TensorSpec, load_spec, spec_from_dict, spec_paths
from tests.conftest import TINY_ZOO, ZOO, tiny_spec, write_spec


def test_zoo_has_the_required_models() -> None:
    names = {p.stem for p in spec_paths(ZOO)}
    assert {"sdpa", "sdpa_masked", "mha", "mha_cross", "mha_causal", "mha_attention_op"} <= names
    for path in spec_paths(ZOO):
        spec = load_spec(path)
        assert spec.mode == "eval"
        assert spec_from_dict(spec.to_dict(), folder=ZOO.resolve()) == spec


def _form(spec: ModelSpec) -> dict[str, object]:
    """What a spec is, sizes aside: module, call, masks, the names and roles of its tensors and dims."""

    def tensor(t: TensorSpec) -> tuple[object, ...]:
        return t.name, t.dtype, tuple(d if isinstance(d, str) else int for d in t.shape), t.mask, t.arg, t.pick

    dims = {k: (r.min, r.parts) for k, r in spec.dims.items()}
    config = {k: v for k, v in (spec.config or {}).items() if not isinstance(v, int) or isinstance(v, bool)}
    fields = ("module", "opset", "exporter", "mode", "accept_guards", "call", "fully_masked", "tolerance")
    return {f: getattr(spec, f) for f in fields} | {
        "kwargs": sorted(spec.kwargs),
        "config": config,
        "inputs": [tensor(t) for t in spec.inputs],
        "outputs": [tensor(t) for t in spec.outputs],
        "dims": dims,
    }


@pytest.mark.parametrize("path", spec_paths(ZOO), ids=lambda p: p.stem)
def test_the_tiny_zoo_is_the_zoo_at_hidden_32_and_lengths_40(path: Path) -> None:
    """tests/models holds every model of models/ as the same spec at small sizes: hidden
    sizes (and every static size) at most 32, every length at most 40."""
    assert (TINY_ZOO / path.name).exists(), f"models/{path.name} has no tiny twin in tests/models"
    zoo, tiny = load_spec(path), load_spec(TINY_ZOO / path.name)
    assert _form(tiny) == _form(zoo)
    statics = [d for t in (*tiny.inputs, *tiny.outputs) for d in t.shape if isinstance(d, int)]
    assert max(statics, default=0) <= 32 and (tiny.config or {}).get("hidden_size", 0) <= 32
    assert all(r.max <= 40 for r in tiny.dims.values()), tiny.dims


def test_the_tiny_zoo_has_no_model_the_zoo_lacks() -> None:
    assert {p.name for p in spec_paths(TINY_ZOO)} == {p.name for p in spec_paths(ZOO)}


def test_mask_keys_round_trip_through_the_manifest_form(tmp_path: Path) -> None:
    text = (
        tiny_spec(tmp_path).read_text().replace('exporter = "dynamo"', 'exporter = "dynamo"\nfully_masked = "ignore"')
    )
    path = tmp_path / "new.toml"
    path.write_text(
        text
        + '[[inputs]]\nname = "pad"\ndtype = "int64"\nshape = ["batch", "kv_seq"]\n'
        + 'mask = "left-padding"\nconvention = "binary"\n'
    )
    spec = load_spec(path)
    assert spec_from_dict(spec.to_dict(), folder=tmp_path) == spec
    _, mask = spec.masks[0]
    assert mask.layout == "key-padding" and mask.convention.name == "binary"
    assert spec.fully_masked == "ignore"
    assert "fully_masked" not in load_spec(tiny_spec(tmp_path / "plain")).to_dict()  # old specs keep their hash


def test_call_keys_round_trip_and_leave_old_specs_alone(tmp_path: Path) -> None:
    text = (
        tiny_spec(tmp_path)
        .read_text()
        .replace(
            'exporter = "dynamo"',
            'exporter = "dynamo"\nconfig = { class = "a.b:C", size = 4 }\n'
            'call = { flag = true, pos = { positions_of = "query" } }',
        )
        .replace('name = "output"', 'name = "output"\npick = "last_hidden_state"')
        .replace('name = "keys"', 'name = "keys"\narg = "key"')
    )
    spec = load_spec(write_spec(tmp_path, "new", text))
    assert spec_from_dict(spec.to_dict(), folder=tmp_path) == spec
    assert spec.inputs[1].arg == "key" and spec.outputs[0].pick == "last_hidden_state"
    assert spec.config == {"class": "a.b:C", "size": 4} and spec.call["pos"] == {"positions_of": "query"}
    assert not {"config", "call"} & set(load_spec(tiny_spec(tmp_path / "plain")).to_dict())
    twice = text.replace("flag = true", "key = 1")
    with pytest.raises(SpecError, match=r"call.key: not a keyword name, or an input is already passed as it"):
        load_spec(write_spec(tmp_path, "twice", twice))


def test_attention_op_model_uses_opset_23() -> None:
    assert load_spec(ZOO / "mha_attention_op.toml").opset == 23


def test_content_hash_ignores_location_but_not_content(tmp_path: Path) -> None:
    a = load_spec(tiny_spec(tmp_path / "a"))
    b = load_spec(tiny_spec(tmp_path / "b"))
    assert a.content_hash() == b.content_hash()
    c = load_spec(tiny_spec(tmp_path / "c", exporter="torchscript"))
    assert a.content_hash() != c.content_hash()


BAD = [
    ("toml", 'module = "x:Y"\n[[inputs]\n', r"invalid TOML: .*line 2"),
    ("unknown_key", 'module = "a.b:C"\ncolour = 1\n', r"bad.toml:2: unknown key 'colour' in the spec"),
    (
        "name_key",
        'name = "other"\n',
        r"bad.toml:1: unknown key 'name' in the spec \(the model's name is the file's name\)",
    ),
    ("module_form", 'module = "not a path"\n', r"'module' must look like 'package.module:Class'"),
]


@pytest.mark.parametrize(("case", "text", "pattern"), BAD, ids=[b[0] for b in BAD])
def test_bad_spec_text(tmp_path: Path, case: str, text: str, pattern: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SpecError, match=pattern):
        load_spec(path)


def _tokenizer_mask(old: str = "", new: str = "") -> tuple[str, str]:
    """An edit adding a tokenizer's mask to expand after the tiny spec's last input, with
    ``old`` replaced by ``new`` in it."""
    added = (
        '[[inputs]]\nname = "m"\ndtype = "int64"\nshape = ["batch", "kv_seq"]\n'
        'mask = "padding"\nconvention = "binary"\nexpand = "causal"\n'
    )
    at = 'shape = ["batch", "kv_seq", 16]\n\n[[outputs]]'
    return at, at.replace("\n\n", "\n" + added.replace(old, new) + "\n")


EDITS = [
    (
        "min_gt_max",
        ("seq = { min = 1, max = 24 }", "seq = { min = 30, max = 24 }"),
        r"tiny.toml:\d+: dim 'seq': min 30 is greater than max 24",
    ),
    (
        "min_eq_max",
        ("seq = { min = 1, max = 24 }", "seq = { min = 2, max = 2 }"),
        r"tiny.toml:\d+: dim 'seq': min and max are both 2: a dim of one size is static; write 2 in the shapes",
    ),
    (
        "undeclared_dim",
        ('shape = ["batch", "seq", 16]\n[[inputs]]', 'shape = ["batch", "len", 16]\n[[inputs]]'),
        r"'query' uses dim 'len', which \[dims\] does not declare",
    ),
    ("bad_dtype", ('name = "query"', 'name = "query"\ndtype = "complex64"'), r"dtype 'complex64' is not one of"),
    (
        "float_values",
        ('name = "query"', 'name = "query"\nvalues = { min = 0, max = 9 }'),
        r"input 'query': values applies to an integer input that is not a mask",
    ),
    ("bad_exporter", ('exporter = "dynamo"', 'exporter = "jit"'), r"exporter 'jit' is not one of dynamo, torchscript"),
    (
        "unknown_dim_key",
        ("batch = { min = 1, max = 4 }", "batch = { min = 1, max = 4, step = 2 }"),
        r"unknown key 'step' in dims.batch",
    ),
    (
        "float_mask_without_convention",
        ('name = "values"', 'name = "values"\nmask = "random"'),
        r"input 'values': a float32 mask needs a convention \(additive, additive-min\)",
    ),
    (
        "convention_dtype",
        ('name = "values"', 'name = "values"\nmask = "random"\nconvention = "binary"'),
        r"a mask with convention 'binary' must have dtype int32, int64, not float32",
    ),
    (
        "unknown_convention",
        ('name = "values"', 'name = "values"\nmask = "random"\nconvention = "inverted"'),
        r"convention 'inverted' is not one of attend, ignore, additive, additive-min, binary",
    ),
    (
        "convention_without_mask",
        ('name = "values"', 'name = "values"\nconvention = "additive"'),
        r"'convention' applies to masks; add mask = one of random, padding, left-padding, causal",
    ),
    (
        "layout_rank",
        ('name = "values"', 'name = "values"\nmask = "random"\nconvention = "additive"\nlayout = "key-padding"'),
        r"layout 'key-padding' does not fit its 3 dims \(fits: batch-query-key\)",
    ),
    (
        "causal_key_padding",
        (
            'shape = ["batch", "kv_seq", 16]\n\n[[outputs]]',
            'shape = ["batch", "kv_seq", 16]\n[[inputs]]\nname = "m"\n'
            'dtype = "bool"\nshape = ["batch", "kv_seq"]\nmask = "causal"\n\n[[outputs]]',
        ),
        r"input 'm': a causal mask needs a query axis; key-padding has none",
    ),
    (
        "expand_unknown",
        _tokenizer_mask('expand = "causal"', 'expand = "upper"'),
        r"input 'm': expand 'upper' is not one of bidirectional, causal, sliding-window",
    ),
    (
        "expand_without_config",
        _tokenizer_mask(),
        r"input 'm': expand builds the mask as the model class does, from the spec's config; add config = ",
    ),
    (
        "expand_4d",
        _tokenizer_mask('shape = ["batch", "kv_seq"]', 'shape = ["batch", 1, "kv_seq", "kv_seq"]'),
        r"input 'm': expand applies to a 2-D \[batch, seq\] mask, as a tokenizer gives it",
    ),
    (
        "expand_additive",
        _tokenizer_mask(
            'dtype = "int64"\nshape = ["batch", "kv_seq"]\nmask = "padding"\nconvention = "binary"',
            'dtype = "float32"\nshape = ["batch", "kv_seq"]\nmask = "padding"\nconvention = "additive"',
        ),
        r"input 'm': expand takes a tokenizer's mask, convention 'binary' \(or 'attend'\)",
    ),
    ("bad_pick", ('name = "output"', 'name = "output"\npick = -1'), r"pick must be an index \(0, 1, ...\) or an attr"),
    (
        "config_class",
        ('exporter = "dynamo"', 'exporter = "dynamo"\nconfig = { hidden_size = 4 }'),
        r"config needs class = 'package.module:Class', got None",
    ),
    (
        "call_positions_of",
        ('exporter = "dynamo"', 'exporter = "dynamo"\ncall = { position_ids = { positions_of = "x" } }'),
        r"call.position_ids: positions_of must name an input \(keys, query, values\)",
    ),
    (
        "bad_fully_masked",
        ('exporter = "dynamo"', 'exporter = "dynamo"\nfully_masked = "nan"'),
        r"fully_masked 'nan' is not one of match, ignore",
    ),
    ("unused_dim", ("[dims]", "[dims]\nextra = { min = 1, max = 4 }"), r"dim 'extra' is declared but no input"),
    (
        "tolerance_output",
        ("[dims]", "[tolerance.outputs.nope]\natol = 1.0\n[dims]"),
        r"tolerance for unknown output 'nope' \(outputs: output\)",
    ),
    ("typical_outside", ("[dims]", "[typical]\nbatch = 99\n[dims]"), r"typical.batch = 99 is outside its range 1..4"),
    (
        "missing_weights",
        ("[dims]", '[weights]\npath = "nowhere.pt"\n[dims]'),
        r"weights file nowhere.pt does not exist",
    ),
    (  # torch's seeding raised a traceback at build, verify, localize and bench
        "seed_past_torch",
        ("[dims]", "[weights]\nseed = 18446744073709551616\n[dims]"),
        r"weights.seed must be 0 to 2\*\*63 - 1, got 18446744073709551616",
    ),
]


@pytest.mark.parametrize(("case", "edit", "pattern"), EDITS, ids=[e[0] for e in EDITS])
def test_bad_spec_fields(tmp_path: Path, case: str, edit: tuple[str, str], pattern: str) -> None:
    path = tiny_spec(tmp_path)
    text = path.read_text()
    assert edit[0] in text
    path.write_text(text.replace(edit[0], edit[1], 1))
    with pytest.raises(SpecError, match=pattern):
        load_spec(path)


def test_a_mask_whose_keys_may_be_none_is_refused(tmp_path: Path) -> None:
    """No query attends to zero keys: the mask's fill has no key to keep."""
    path = tiny_spec(tmp_path)
    mask = '[[inputs]]\nname = "m"\ndtype = "bool"\nshape = ["batch", "kv_seq"]\nmask = "padding"\n'
    text = path.read_text().replace("\n[[outputs]]", mask + "\n[[outputs]]", 1)
    path.write_text(text.replace("kv_seq = { min = 1,", "kv_seq = { min = 0,"))
    with pytest.raises(SpecError, match=r"mask 'm': its key dim 'kv_seq' has min = 0, and a query needs a key"):
        load_spec(path)


def test_spec_paths_unknown_name(tmp_path: Path) -> None:
    tiny_spec(tmp_path)
    with pytest.raises(SpecError, match=r"unknown model 'nope' \(known: tiny; or give a spec file's path\)"):
        spec_paths(tmp_path, ("nope",))


def test_spec_paths_take_spec_files_anywhere(tmp_path: Path) -> None:
    one = tiny_spec(tmp_path / "elsewhere", "one")
    tiny_spec(tmp_path / "models", "two")
    assert spec_paths(tmp_path / "absent", (str(one),)) == [one]  # no model folder needed
    assert spec_paths(tmp_path / "models", ("two", str(one))) == [tmp_path / "models" / "two.toml", one]
    with pytest.raises(SpecError, match=r"nowhere.toml: no such spec file"):
        spec_paths(tmp_path / "models", (str(tmp_path / "nowhere.toml"),))


def test_spec_paths_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such model directory"):
        spec_paths(tmp_path / "absent")


def _line(text: str, needle: str, occurrence: int = 1) -> int:
    hits = [i for i, line in enumerate(text.splitlines(), 1) if line.strip() == needle]
    return hits[occurrence - 1]


def test_errors_cite_the_exact_line_or_the_table(tmp_path: Path) -> None:
    """A key that occurs once is cited by its line; one that occurs several times by the
    header of the table that holds the bad value (never the first occurrence elsewhere)."""
    path = tiny_spec(tmp_path)
    base = path.read_text()
    text = base + "\n[tolerance]\natol = 1e-5\n\n[tolerance.outputs.output]\natol = -1\n"
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert str(err.value).startswith(f"{path}:{_line(text, '[tolerance.outputs.output]')}: ")

    text = base.replace('name = "values"', 'name = "values"\ndtype = "complex64"')
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    bad_dtype = 'dtype = "complex64"'
    assert str(err.value).startswith(f"{path}:{_line(text, bad_dtype)}: ")

    text = base.replace(
        'shape = ["batch", "kv_seq", 16]\n\n[[outputs]]', 'shape = ["batch", "kv_seq", 0]\n\n[[outputs]]'
    )
    assert text != base
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert str(err.value).startswith(f"{path}:{_line(text, '[[inputs]]', 3)}: ")

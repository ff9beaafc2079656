"""The CLI for list and build: exit codes and exact messages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from attn_export import __version__
from attn_export.cli import cli
from tests.conftest import TINY_ZOO, ZOO, tiny_spec


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_version_and_module_entry_point() -> None:
    assert invoke("--version").output == f"attn-export, version {__version__}\n"
    done = subprocess.run([sys.executable, "-m", "attn_export", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"attn-export, version {__version__}"


def test_list_shows_the_zoo() -> None:
    result = invoke("list", "--models", str(ZOO))
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert lines[0].split() == ["NAME", "MODULE", "INPUTS", "OPSET", "EXPORTER"]
    row = next(line for line in lines if line.startswith("mha_attention_op"))
    assert "keys[batch, kv_seq, 256]" in row and row.split()[-2:] == ["23", "dynamo"]


def test_build_progress_summary_and_incremental_skip(tmp_path: Path) -> None:
    # torchscript, the fastest exporter: what is tested here is not the export
    tiny_spec(tmp_path / "models", exporter="torchscript")
    args = ("build", "--models", str(tmp_path / "models"), "--out", str(tmp_path / "out"))
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    assert first.output.startswith("built   tiny ")
    assert first.output.splitlines()[-1].startswith("1 graphs: 1 built, 0 skipped, 0 failed in ")
    second = invoke(*args)
    assert "skipped tiny" in second.output and "(unchanged; --force rebuilds)" in second.output
    forced = invoke(*args, "--force", "--json")
    doc = json.loads(forced.output)
    assert doc["counts"] == {"built": 1, "skipped": 0, "failed": 0} and doc["exit_code"] == 0
    assert doc["results"][0]["stages"]["axes"] is True


def test_one_spec_file_is_enough_for_list_and_build(tmp_path: Path) -> None:
    # torchscript, the fastest exporter: what is tested here is not the export
    spec = tiny_spec(tmp_path / "specs", "llama_gqa", exporter="torchscript")
    listed = invoke("list", str(spec), "--models", str(tmp_path / "absent"))
    assert listed.exit_code == 0 and listed.output.splitlines()[1].startswith("llama_gqa ")
    built = invoke("build", str(spec), "--out", str(tmp_path / "out"))
    assert built.exit_code == 0, built.output
    assert built.output.startswith("built   llama_gqa ")
    missing = invoke("build", str(tmp_path / "specs" / "nope.toml"))
    assert (missing.exit_code, missing.output) == (2, f"Error: {tmp_path / 'specs' / 'nope.toml'}: no such spec file\n")


def test_build_json_summary_round_trips(tmp_path: Path) -> None:
    from attn_export.pipelines.building import BuildSummary

    # torchscript, the fastest exporter: what is tested here is not the export
    tiny_spec(tmp_path / "models", exporter="torchscript")
    result = invoke("build", "--models", str(tmp_path / "models"), "--out", str(tmp_path / "out"), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    summary = BuildSummary.from_dict(doc)
    assert summary.to_dict() == doc
    assert summary.counts == {"built": 1, "skipped": 0, "failed": 0} and summary.results[0].status == "built"


def test_build_opset_and_exporter_overrides(tmp_path: Path) -> None:
    tiny_spec(tmp_path / "models")
    out = tmp_path / "out"
    result = invoke(
        "build",
        "--models",
        str(tmp_path / "models"),
        "--out",
        str(out),
        "--opset",
        "17",
        "--exporter",
        "torchscript",
        "--json",
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())["models"]["tiny"]
    assert (manifest["spec"]["opset"], manifest["spec"]["exporter"]) == (17, "torchscript")


BAD_SPECS = [
    ("toml", lambda t: t.replace('name = "query"', 'name = "query'), "[spec] {p}: invalid TOML: "),
    (
        "unknown_key",
        lambda t: "colour = 1\n" + t,
        "[spec] {p}:1: unknown key 'colour' in the spec (expected one of: accept_guards, cache, call, config,",
    ),
    (
        "unknown_module",
        lambda t: t.replace("attn_export.zoo.seed:", "no_such_pkg.attn:"),
        "tiny: cannot import module 'no_such_pkg.attn': No module named 'no_such_pkg'",
    ),
    (
        "unknown_class",
        lambda t: t.replace("seed:MultiHeadAttention", "seed:Nope"),
        "tiny: module 'attn_export.zoo.seed' has no attribute 'Nope'",
    ),
    (
        "bad_kwargs",
        lambda t: t.replace("num_heads = 2", "heads = 2"),
        "tiny: kwargs {'hidden_dim': 16, 'heads': 2} do not fit attn_export.zoo.seed:MultiHeadAttention",
    ),
    (
        "input_misfit",  # the module's first Linear takes 16 features: no exporter can fix that
        lambda t: t.replace('shape = ["batch", "seq", 16]\n[[inputs]]', 'shape = ["batch", "seq", 24]\n[[inputs]]', 1),
        "tiny: the module fails in PyTorch on inputs shaped as the spec declares them (query [2, 3, 24] float32, "
        "keys [2, 5, 16] float32, values [2, 5, 16] float32): RuntimeError: mat1 and mat2 shapes cannot be multiplied "
        "(6x24 and 16x16) at attn_export/zoo/seed.py:",
    ),
    (
        "mask_misfit",  # said before the masks are probed, which once reported it as their own failure
        lambda t: (TINY_ZOO / "torch_mha.toml").read_text().replace('["batch", "seq", 32]', '["batch", "seq", 24]', 1),
        "tiny: the module fails in PyTorch on inputs shaped as the spec declares them (query [2, 3, 24] float32, "
        "key [2, 5, 32] float32, value [2, 5, 32] float32, key_padding_mask [2, 5] bool): AssertionError:",
    ),
    (
        "config_typo",  # transformers keeps any keyword: the model would have LlamaConfig's 32 layers
        lambda t: (TINY_ZOO / "llama_causal_lm.toml").read_text().replace("hidden_layers = 2", "hidden_layer = 2"),
        "tiny: config key 'num_hidden_layer' is no field of LlamaConfig; did you mean 'num_hidden_layers'? (it would "
        "keep 'num_hidden_layer' aside and build with num_hidden_layers = 32)",
    ),
    (
        "min_gt_max",
        lambda t: t.replace("min = 1, max = 24", "min = 30, max = 24"),
        "[spec] {p}:21: dim 'seq': min 30 is greater than max 24",
    ),
]


@pytest.mark.parametrize(("case", "edit", "message"), BAD_SPECS, ids=[getattr(b, "values", b)[0] for b in BAD_SPECS])
def test_bad_spec_exits_2_with_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], case: str, edit, message: str
) -> None:
    path = tiny_spec(tmp_path / "models")
    path.write_text(edit(path.read_text()))
    result = invoke("build", "--models", str(tmp_path / "models"), "--out", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    failed = next(line for line in result.output.splitlines() if line.startswith("FAILED"))
    assert message.replace("{p}", str(path)) in failed
    # nothing built: no folder made, not even for a build's lock, and no traceback from
    # torch's loggers
    assert result.output.splitlines()[-1].endswith(f"(nothing written to {tmp_path / 'out'})")
    assert not (tmp_path / "out").exists()
    assert "Traceback" not in capfd.readouterr().err
    assert "Traceback" not in result.output


def test_a_spec_without_example_sizes_fails_alone_and_the_build_goes_on(tmp_path: Path) -> None:
    """Two dims with room for one size of 2 or more: the build stopped there, every spec
    after it unbuilt."""
    models = tmp_path / "models"
    bad = tiny_spec(models, "a_cramped")
    bad.write_text(
        bad.read_text()
        .replace("batch = { min = 1, max = 4 }", "batch = { min = 1, max = 2 }")
        .replace("kv_seq = { min = 1, max = 40 }", "kv_seq = { min = 1, max = 2 }")
    )
    tiny_spec(models, "b_fine", exporter="torchscript")
    result = invoke("build", "--models", str(models), "--out", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    assert "FAILED  a_cramped" in result.output and "[spec] a_cramped: no example size for dim 'kv_seq' in [1, 2]" in (
        result.output
    )
    assert "(taken: 16 in the shapes, batch = 2, seq = 3); widen its range" in result.output  # what it clashes with
    assert "built   b_fine" in result.output


def test_import_error_in_user_module_exits_2(tmp_path: Path) -> None:
    models = tmp_path / "models"
    path = tiny_spec(models)
    (models / "broken_mod.py").write_text("raise RuntimeError('boom at import')\n")
    path.write_text(path.read_text().replace("attn_export.zoo.seed:MultiHeadAttention", "broken_mod:X"))
    result = invoke("build", "--models", str(models), "--out", str(tmp_path / "out"))
    assert result.exit_code == 2
    assert "tiny: importing 'broken_mod' raised RuntimeError: boom at import" in result.output


def test_unknown_model_name_and_missing_folder_exit_2(tmp_path: Path) -> None:
    tiny_spec(tmp_path / "models")
    result = invoke("build", "nope", "--models", str(tmp_path / "models"))
    assert result.exit_code == 2
    assert result.output == "Error: unknown model 'nope' (known: tiny; or give a spec file's path)\n"
    result = invoke("build", "--models", str(tmp_path / "absent"))
    assert result.exit_code == 2
    assert result.output == f"Error: {tmp_path / 'absent'}: no such model directory (pass --models DIR)\n"


def test_a_build_folder_that_holds_the_specs_is_refused(tmp_path: Path) -> None:
    """Built there, verify refused the folder for good (it never runs code from a build folder)."""
    models = tmp_path / "models"
    tiny_spec(models)
    for out in (models, tmp_path):
        result = invoke("build", "--models", str(models), "--out", str(out))
        assert result.exit_code == 2, result.output
        assert result.output.startswith(f"Error: --out {out} holds the spec {models / 'tiny.toml'}: verify runs code")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["models", "tiny.toml"]  # nothing written


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    result = invoke("--debug", "build", "--models", str(tmp_path / "absent"))
    assert result.exit_code != 0 and result.exception is not None
    late = invoke("build", "--models", str(tmp_path / "absent"), "--debug")
    assert late.exit_code == 2 and "(--debug goes before the command: attn-export --debug COMMAND ...)" in late.output


def test_spec_named_like_a_variant_is_refused(tmp_path: Path) -> None:
    models = tmp_path / "models"
    tiny_spec(models, exporter="torchscript")
    tiny_spec(models, "tiny.int8", exporter="torchscript")  # would be replaced by tiny's int8 variant
    out = tmp_path / "out"
    result = invoke("build", "--models", str(models), "--out", str(out), "--variant", "fp32", "--variant", "int8")
    assert result.exit_code == 2, result.output
    failed = [line for line in result.output.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1
    assert failed[0].endswith(
        f"{models / 'tiny.int8.toml'}: model name 'tiny.int8' ends in the variant name '.int8'; rename the spec"
    )
    assert result.output.splitlines()[-1].startswith("3 graphs: 2 built, 0 skipped, 1 failed")
    manifest = json.loads((out / "manifest.json").read_text())["models"]
    assert sorted(manifest) == ["tiny", "tiny.int8"] and manifest["tiny.int8"]["spec"]["name"] == "tiny"


QUITTER = """
import sys
import torch

class QuitInInit(torch.nn.Module):
    def __init__(self, **kwargs):
        sys.exit(0)

class QuitInForward(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()

    def forward(self, query, keys, values):
        sys.exit(0)
"""


@pytest.mark.parametrize(
    ("cls", "code", "message"),
    [
        ("QuitInInit", 2, "tiny: constructing quitting_mod:QuitInInit raised SystemExit: 0"),
        ("QuitInForward", 1, "[module] tiny: forward raised SystemExit: 0"),
    ],
)
def test_module_that_calls_sys_exit_fails_the_build(tmp_path: Path, cls: str, code: int, message: str) -> None:
    models = tmp_path / "models"
    path = tiny_spec(models, exporter="torchscript")
    (models / "quitting_mod.py").write_text(QUITTER)
    path.write_text(path.read_text().replace("attn_export.zoo.seed:MultiHeadAttention", f"quitting_mod:{cls}"))
    result = invoke("build", "--models", str(models), "--out", str(tmp_path / "out"))
    assert result.exit_code == code, result.output
    assert message in result.output
    assert not (tmp_path / "out").exists()  # the folder made for it goes with its lock file


NAN_MODULE = """
import torch

class NaNProjection(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return self.proj(x) * float("nan")
"""

NAN_SPEC = """
module = "nan_projection:NaNProjection"
kwargs = { dim = 8 }
exporter = "torchscript"
[[inputs]]
name = "x"
shape = ["batch", "seq", 8]
[[outputs]]
name = "y"
shape = ["batch", "seq", 8]
[dims]
batch = { min = 1, max = 4 }
seq = { min = 1, max = 16 }
"""


def test_output_that_is_nan_on_both_sides_fails_unless_the_spec_allows_it(tmp_path: Path) -> None:
    models, out = tmp_path / "models", tmp_path / "out"
    models.mkdir()
    (models / "nan_projection.py").write_text(NAN_MODULE)
    spec = models / "nan.toml"
    spec.write_text(NAN_SPEC)
    result = invoke("build", "--models", str(models), "--out", str(out))
    assert result.exit_code == 1, result.output
    assert (
        "nan: smoke check at example (batch=2,seq=3) failed: y: 48/48 elements NaN on both sides, first at "
        "[0, 0, 0] (set [tolerance] allow_nan = true in the spec if that is expected)" in result.output
    )
    spec.write_text(NAN_SPEC + "[tolerance]\nallow_nan = true\n")
    assert invoke("build", "--models", str(models), "--out", str(out)).exit_code == 0
    result = invoke("verify", str(out), "--models", str(models), "--no-latency", "--json", str(tmp_path / "r.json"))
    assert result.exit_code == 0, result.output
    cases = json.loads((tmp_path / "r.json").read_text())["cases"]
    n = len(cases)
    assert f"note: nan: NaN or Inf on both sides in {n} of {n} cases, accepted by the spec's allow_nan" in result.output
    assert all(c["comparisons"][0]["shared_nan"] == c["comparisons"][0]["total"] > 0 for c in cases)


def test_output_that_is_inf_on_both_sides_fails_like_nan(tmp_path: Path) -> None:
    models, out = tmp_path / "models", tmp_path / "out"
    models.mkdir()
    (models / "nan_projection.py").write_text(NAN_MODULE.replace('* float("nan")', '* 0 + float("inf")'))
    (models / "nan.toml").write_text(NAN_SPEC)
    result = invoke("build", "--models", str(models), "--out", str(out))
    assert result.exit_code == 1, result.output
    assert "y: 48/48 elements Inf on both sides, first at [0, 0, 0] (set [tolerance] allow_nan = true" in result.output


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["build", "--out", ""], "'--out': an empty path; name a folder."),
        (["build", "--models", " "], "'--models': an empty path; name a folder."),
        (["verify", "x", "--json", ""], "'--json': an empty path; name a file."),
        (["inspect", ""], "'FILE': an empty path; name a file or folder."),
    ],
)
def test_an_empty_path_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], said: str
) -> None:
    """An empty value (an unset ``$VAR`` in a CI script) read as ``.``: build wrote its graphs
    into the working directory, and ``--json ''`` said ". is a directory"."""
    monkeypatch.chdir(tmp_path)
    result = invoke(*args)
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == f"Error: Invalid value for {said}"
    assert list(tmp_path.iterdir()) == []


def test_an_unexpected_error_is_one_line_and_exit_3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A bug (as count_flops once raised on a decoder) printed a traceback; --debug shows it."""
    import attn_export.model_spec

    def broken(*args: object) -> object:
        raise RuntimeError("The size of tensor a (16) must match\nthe size of tensor b (8)")

    monkeypatch.setattr(attn_export.model_spec, "spec_paths", broken)
    result = invoke("list", "--models", str(ZOO))
    assert result.exit_code == 3
    assert result.output == (
        "Error: internal error (RuntimeError: The size of tensor a (16) must match); attn-export --debug shows the "
        "traceback: please report it\n"
    )
    debug = invoke("--debug", "list", "--models", str(ZOO))
    assert isinstance(debug.exception, RuntimeError)

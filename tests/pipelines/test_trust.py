"""A build folder is data: verify runs only code from the checkout, notices when the
checkout changed since the build, and golden mode works on a folder moved anywhere."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from attn_export.cli import cli
from attn_export.model_spec import load_spec
from tests.conftest import ROOT, ZOO, Built, copy_build, needs_transformers, shared_build, tiny_spec, unchanged

FAST = ("--no-latency",)


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def _user_specs(models: Path) -> list[Path]:
    """A user's own module next to its spec, with a trained state_dict."""
    models.mkdir(parents=True)
    (models / "my_attention.py").write_text(
        "from attn_export.zoo.seed import MultiHeadAttention\n\n\nclass MyAttention(MultiHeadAttention):\n    pass\n"
    )
    from attn_export.zoo import MultiHeadAttention

    torch.manual_seed(7)
    torch.save(MultiHeadAttention(16, 2).state_dict(), models / "w.pt")
    # torchscript, the fastest exporter: what is tested here is not the export
    spec = tiny_spec(models, "mine", exporter="torchscript")
    text = spec.read_text().replace("attn_export.zoo.seed:MultiHeadAttention", "my_attention:MyAttention")
    spec.write_text(text + '\n[weights]\npath = "w.pt"\n')
    return [spec]


@pytest.fixture(scope="module")
def shared_user_build(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    built = shared_build(tmp_path_factory, "user", _user_specs)
    assert built.errors == {"mine": None}, built.errors
    with unchanged(built.out), unchanged(built.models):
        yield built


@pytest.fixture
def user_build(shared_user_build: Built, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the user's build, built once: its spec folder and its build folder."""
    built = copy_build(shared_user_build, tmp_path)
    return built.models, built.out


def _verify(models: Path, out: Path, *extra: str):
    return invoke("verify", str(out), "--models", str(models), *FAST, *extra)


def test_an_edited_forward_is_a_stale_build_and_rebuilds(user_build: tuple[Path, Path]) -> None:
    models, out = user_build
    assert _verify(models, out).exit_code == 0
    source = models / "my_attention.py"
    source.write_text(
        source.read_text().replace(
            "    pass\n", "    def forward(self, q, k, v):\n        return 2 * super().forward(q, k, v)\n"
        )
    )
    result = _verify(models, out)
    assert result.exit_code == 1
    assert (
        f"FAIL mine: stale build: module source my_attention.py changed since it was built from "
        f"{models / 'mine.toml'}; run attn-export build"
    ) in result.output
    assert "0 of 0 cases" in result.output  # no numbers before the build is fresh
    rebuilt = invoke("build", "--models", str(models), "--out", str(out))
    assert rebuilt.output.startswith("built"), rebuilt.output
    assert _verify(models, out).exit_code == 0


def test_an_edited_weights_file_is_a_stale_build(user_build: tuple[Path, Path]) -> None:
    models, out = user_build
    weights = torch.load(models / "w.pt")
    torch.save({k: v + 0.01 for k, v in weights.items()}, models / "w.pt")
    result = _verify(models, out)
    assert result.exit_code == 1
    assert "FAIL mine: stale build: weights file w.pt changed since it was built" in result.output


def _edit_manifest(out: Path, **spec_changes: object) -> None:
    path = out / "manifest.json"
    doc = json.loads(path.read_text())
    doc["models"]["mine"]["spec"].update(spec_changes)
    path.write_text(json.dumps(doc))


def test_a_manifest_naming_os_system_runs_nothing(user_build: tuple[Path, Path], tmp_path: Path) -> None:
    models, out = user_build
    marker = tmp_path / "pwned"
    _edit_manifest(out, module="os:system", kwargs={"command": f"touch {marker}"})
    for extra in ((), ("--golden",)):
        result = _verify(models, out, *extra)
        assert not marker.exists()
    result = _verify(models, out)
    assert result.exit_code == 1
    assert "FAIL mine: stale build: spec fields kwargs, module differ since it was built" in result.output


def test_a_module_planted_next_to_the_manifest_is_never_imported(user_build: tuple[Path, Path], tmp_path: Path) -> None:
    models, out = user_build
    marker = tmp_path / "pwned"
    (out / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Evil: pass\n")
    _edit_manifest(out, module="evil:Evil")
    for args in ((str(out), "--models", str(models)), (str(out), "--models", str(models), "--golden"), (str(out),)):
        invoke("verify", *args, *FAST)
    done = subprocess.run(
        [sys.executable, "-m", "attn_export", "verify", str(out), "--models", str(models), *FAST],
        capture_output=True,
        text=True,
        cwd=out,  # even with the build folder as the working directory
    )
    assert done.returncode == 1 and "stale build: spec field module differ" in done.stdout
    assert not marker.exists()


def test_verify_without_the_models_spec_says_where_it_looked(user_build: tuple[Path, Path], tmp_path: Path) -> None:
    _, out = user_build
    result = invoke("verify", str(out), "--models", str(tmp_path / "elsewhere"), *FAST)
    assert result.exit_code == 2
    elsewhere = tmp_path / "elsewhere"
    missing = f"Error: --models {elsewhere}: no such model directory: PyTorch originals are rebuilt"
    assert result.output.startswith(missing)
    assert "(pass --models DIR, the folder the build read), or compare with the build's golden vectors" in result.output
    (tmp_path / "elsewhere").mkdir()
    result = invoke("verify", str(out), "--models", str(tmp_path / "elsewhere"), *FAST)
    assert result.exit_code == 2
    assert result.output.splitlines()[-1].startswith(
        f"Error: no spec for model 'mine' in {tmp_path / 'elsewhere'}: PyTorch originals are rebuilt only"
    )


TORCH_FREE = """
import sys
for name in ("torch", "onnxscript"):
    sys.modules[name] = None  # any import of them now raises ImportError
from attn_export.cli import main
main(sys.argv[1:])
"""


def test_a_moved_build_folder_verifies_in_golden_mode_without_torch(
    shared_user_build: Built, user_build: tuple[Path, Path], tmp_path: Path
) -> None:
    models, out = user_build
    deploy = tmp_path / "deploy" / "build"
    shutil.move(out, deploy)
    shutil.rmtree(models)  # the deploy box has no checkout: no spec, no module, no weights
    manifest = (deploy / "manifest.json").read_text()
    built_in = shared_user_build.out.parent  # where it was built: its spec folder and build folder
    assert str(built_in) not in manifest and str(tmp_path) not in manifest  # nothing points back to the build machine
    done = subprocess.run(
        [sys.executable, "-c", TORCH_FREE, "verify", str(deploy), "--golden", *FAST],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verify PASSED" in done.stdout


@needs_transformers
def test_a_module_from_an_installed_library_is_covered_by_its_version() -> None:
    import transformers

    from attn_export.exporter.source import module_sources

    sources = module_sources(load_spec(ZOO / "bert_attention.toml"))
    assert list(sources) == [f"transformers=={transformers.__version__} (installed)"]  # not 2,500 files walked


def test_models_inside_the_build_folder_are_never_run(
    tiny_build: Built, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    planted = tiny_build.out / "models"
    planted.mkdir()
    marker = tmp_path / "ran"
    (planted / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    spec = (tiny_build.models / "tiny.toml").read_text()
    (planted / "tiny.toml").write_text(spec.replace("attn_export.zoo.seed:MultiHeadAttention", "evil:Nothing"))
    monkeypatch.chdir(tiny_build.out)  # `cd build && attn-export verify .`: models/ is the folder's
    result = CliRunner().invoke(cli, ["verify", ".", "--no-latency"])
    assert result.exit_code == 2, result.output
    assert "--models models is inside the build folder .: verify runs code only from the checkout" in result.output
    assert not marker.exists()

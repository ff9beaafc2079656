"""The pre-commit hook (.pre-commit-hooks.yaml): it runs `attn-export check` on the files a
commit touches that the check reads, and the command it names passes a sound build and fails
a planted fault."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import onnx
import yaml
from click.testing import CliRunner

from attn_export.cli import cli
from tests.conftest import ROOT, Built

HOOKS = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())


def _run_hook(files: list[Path]) -> tuple[int, str]:
    """Run the hook as pre-commit would: its entry, then the staged files its pattern matches."""
    (hook,) = HOOKS
    matched = [f for f in files if re.search(hook["files"], f.as_posix())]
    program, *args = shlex.split(hook["entry"])
    assert program == "attn-export"  # the console script, i.e. attn_export.cli:main
    result = CliRunner().invoke(cli, [*args, *hook.get("args", []), *map(str, matched)])
    return result.exit_code, result.output


def test_the_hook_is_the_static_check_on_graphs_goldens_and_manifests() -> None:
    (hook,) = HOOKS
    assert hook["id"] == "attn-export-check" and hook["language"] == "python"
    pattern = re.compile(hook["files"])
    for path in ("model.onnx", "build/mha.onnx", "build/mha.golden.npz", "build/manifest.json", "manifest.json"):
        assert pattern.search(path), path
    for path in ("data.npz", "my_manifest.json", "model.onnx.txt", "README.md"):
        assert not pattern.search(path), path


def test_the_hook_passes_a_sound_build_and_fails_a_changed_graph(tiny_build: Built) -> None:
    staged = sorted(tiny_build.out.iterdir())
    code, output = _run_hook(staged)
    assert code == 0, output
    assert output.splitlines()[-1].startswith("check PASSED: 1 of 1 files pass every check")
    proto = onnx.load(tiny_build.out / "tiny.onnx")
    proto.graph.node[0].op_type = "NoSuchOp"
    onnx.save(proto, tiny_build.out / "tiny.onnx")
    code, output = _run_hook([tiny_build.out / "tiny.onnx"])
    assert code == 1
    assert "      hashes: tiny: tiny.onnx changed after the build" in output
    assert "      checker: tiny: onnx.checker rejected the graph" in output

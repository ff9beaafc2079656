"""The docs say what the tool does: the README stays short and starts with the two commands,
its links reach pages that exist, its quickstart runs as written and fails as shown, and the
Python API example on the docs site runs as written. `make test` also builds the site in
strict mode (a broken link or a missing reference fails there)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from attn_export.cli import cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"

#: A user's own module, as the README's quickstart describes it: ``x`` [batch, seq, 64] in,
#: ``y`` out. ``SOFTMAX`` is replaced to plant the README's failing example.
MODULE = """
import torch
from torch import nn


class MyAttention(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5
        return self.out((SOFTMAX @ v).transpose(1, 2).reshape(b, s, d))
"""


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = README.splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    assert lines[0] == "# attn-export"
    first = re.search(r"```(\w*)\n(.*?)```", README, re.S)
    assert first and first.group(1) == "sh"
    commands = [line.split("#")[0].strip() for line in first.group(2).splitlines()]
    assert commands == ["make demo", "make test"]


def test_readme_links_reach_files_that_exist() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local), "the README links into docs/"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


def test_every_docs_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert [p for p in pages if not re.search(rf":\s*{re.escape(p)}\s*$", nav, re.M)] == []


def _command_names() -> list[str]:
    """Every command as typed: ``verify``, and a group's as ``report merge``."""
    return [
        f"{name} {sub}" if sub else name
        for name, command in cli.commands.items()
        for sub in (sorted(command.commands) if isinstance(command, click.Group) else [""])
    ]


def test_the_commands_page_says_what_every_command_is_for() -> None:
    """The page's own list, not only the reference mkdocs-click generates under it."""
    listed = (DOCS / "cli.md").read_text().split("::: mkdocs-click", 1)[0]
    missing = [name for name in _command_names() if not re.search(rf"`attn-export {name}\b", listed)]
    assert "replay" in _command_names() and not missing, missing


def test_the_library_reference_titles_each_entry_apart() -> None:
    """mkdocstrings titles an entry by the module's last name: three ``results`` read alike."""
    page = (DOCS / "reference.md").read_text()
    entries = re.findall(r"^::: ([\w.]+)\n((?:    .*\n)*)", page, re.M)
    titles = [
        (re.findall(r"toc_label: (.+)", options) or [module.rsplit(".", 1)[-1]])[0] for module, options in entries
    ]
    assert len(titles) > 10 and len(set(titles)) == len(titles), sorted(t for t in titles if titles.count(t) > 1)


def _attn_export(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "attn_export", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def _cli(cwd: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> Result:
    """``attn-export ARGS`` typed in ``cwd``, run in this process: the same command without
    a new interpreter each time (tests/test_cli_build.py runs the entry point itself)."""
    monkeypatch.chdir(cwd)
    return CliRunner().invoke(cli, list(args))


@pytest.mark.slow
def test_readme_quickstart_passes_and_fails_as_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _blocks(README.split("## Quickstart", 1)[1], "toml")[0]
    models = tmp_path / "models"
    models.mkdir()
    (models / "my_attention.toml").write_text(spec)
    (models / "my_attention.py").write_text(MODULE.replace("SOFTMAX", "scores.softmax(-1)"))

    assert _cli(tmp_path, monkeypatch, "build").exit_code == 0
    passed = _cli(tmp_path, monkeypatch, "verify", "--no-latency")
    assert passed.exit_code == 0, passed.output
    assert "verify PASSED: 13 of 13 cases agree across 1 models" in passed.stdout
    assert "verify PASSED: 13 of 13 cases agree across 1 models" in README

    overflowing = "(scores.exp() / scores.exp().sum(-1, keepdim=True))"
    (models / "my_attention.py").write_text(MODULE.replace("SOFTMAX", overflowing))
    assert _cli(tmp_path, monkeypatch, "build").exit_code == 0
    failed = _cli(tmp_path, monkeypatch, "verify", "--no-latency")
    assert failed.exit_code == 1
    shown = [line for line in README.splitlines() if line.startswith(("FAIL ", "     reproduce: "))]
    assert len(shown) == 2 and all(line in failed.stdout.splitlines() for line in shown), failed.stdout
    reproduce = shown[1].split("reproduce: attn-export ", 1)[1].split()
    assert _cli(tmp_path, monkeypatch, *reproduce).exit_code == 1
    command = next(line for line in README.splitlines() if line.startswith("$ attn-export localize "))
    where = _cli(tmp_path, monkeypatch, *command.removeprefix("$ attn-export ").split())
    verdict = next(line for line in README.splitlines() if line.startswith("THE MODULE gives NaN"))
    assert where.exit_code == 1 and verdict in where.stdout.splitlines(), where.output


@pytest.mark.slow
def test_api_example_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    page = (DOCS / "api.md").read_text()
    code = re.search(r"## Python API\n.*?```python\n(.*?)```", page, re.S)
    assert code, "docs/api.md has a Python API example"
    (tmp_path / "models").mkdir()
    # the tiny zoo's torch_mha (the same spec, small: one test builds the production zoo)
    shutil.copy(ROOT / "tests" / "models" / "torch_mha.toml", tmp_path / "models")
    monkeypatch.chdir(tmp_path)
    exec(compile(code.group(1), str(DOCS / "api.md"), "exec"), {"__name__": "__main__"})  # as a script runs it
    out = capsys.readouterr().out
    assert "'was': {'fully-padded-sequence': 'NaN'}" in out
    assert out.strip().endswith(
        "True {'models': 1, 'cases': 14, 'failed_cases': 0, 'failed_checks': 0, 'noisy_timings': 0, "
        "'placement_fallbacks': 0, 'failed_placements': 0} True"
    )


@pytest.mark.slow
def test_the_gpt2_decoder_spec_of_the_decoders_page_builds_and_verifies(tmp_path: Path) -> None:
    (spec,) = [b for b in _blocks((DOCS / "decoders.md").read_text(), "toml") if "GPT2Config" in b]
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "gpt2_kv_cache.toml").write_text(spec)
    built = _attn_export(tmp_path, "build", "--models", "models", "--out", "out")
    assert built.returncode == 0, built.stdout + built.stderr
    verified = _attn_export(tmp_path, "verify", "out", "--models", "models", "--no-latency")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "2 of 2 decode trajectories agree" in verified.stdout

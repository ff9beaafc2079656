"""Every report format parses back and says the right thing."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from attn_export.cli import cli
from attn_export.report.json_report import dump_json_report, load_json_report
from attn_export.report.markdown import markdown_report
from tests.conftest import ROOT, TINY_ZOO, node, plant, set_initializer, zoo_cases

#: The models the report tests verify: the one they break, a layer beside it and a decoder (its
#: trajectories' rows); the formats say nothing more of a whole zoo.
REPORTED = [TINY_ZOO / f"{name}.toml" for name in ("sdpa", "mha_causal", "mha_kv_cache")]


@pytest.fixture(scope="module")
def failing_zoo(zoo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the zoo where sdpa's scale is wrong: one model x provider fails."""
    import shutil

    dest = tmp_path_factory.mktemp("failing") / "zoo"
    shutil.copytree(zoo_dir, dest)
    proto = onnx.load(dest / "sdpa.onnx")
    set_initializer(proto, node(proto, "Div").input[1], 2.0)  # sqrt(d_k) is 4
    plant(dest, "sdpa", proto)
    return dest


@pytest.fixture(scope="module")
def reports(failing_zoo: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("reports")
    paths = {k: folder / f"report.{k}" for k in ("json", "xml", "md")}
    summary = folder / "step_summary.md"
    summary.write_text("earlier step\n")
    result = CliRunner(env={"GITHUB_STEP_SUMMARY": str(summary)}).invoke(
        cli,
        [
            "verify",
            *(str(failing_zoo / f"{p.stem}.onnx") for p in REPORTED),
            "--models",
            str(TINY_ZOO),
            "--latency-budget",
            "0.002",
            "--json",
            str(paths["json"]),
            "--junit",
            str(paths["xml"]),
            "--markdown",
            str(paths["md"]),
        ],
    )
    assert result.exit_code == 1, result.output
    paths["summary"], paths["zoo"] = summary, failing_zoo
    return paths


def test_json_report_round_trips(reports: dict[str, Path]) -> None:
    text = reports["json"].read_text()
    report = load_json_report(text)
    assert dump_json_report(report) == text
    doc = json.loads(text)
    assert doc["passed"] is False
    summary = doc["summary"]
    assert (summary["models"], summary["cases"], summary["failed_checks"]) == (
        len(REPORTED),
        zoo_cases(reports["zoo"], REPORTED),
        0,
    )
    sdpa = [c for c in doc["cases"] if c["model"] == "sdpa"]
    assert 0 < summary["failed_cases"] < len(sdpa)  # kv_seq=1 hides a wrong scale
    failing = [c for c in doc["cases"] if not c["passed"]]
    assert {c["model"] for c in failing} == {"sdpa"}
    assert failing[0]["reproduce"].startswith("attn-export verify ")


def test_json_report_is_strict_json_even_with_nan() -> None:
    import numpy as np

    from attn_export.compare import compare_output
    from attn_export.model_spec import Tolerance
    from attn_export.pipelines.verify import CaseResult, ModelCheck, VerifyReport
    from attn_export.runtimes import Target

    nan_case = compare_output("o", np.zeros(2, np.float32), np.array([0, np.nan], np.float32), Tolerance(0, 0))
    report = VerifyReport(
        "out",
        0,
        {},
        [ModelCheck("m", "m.onnx")],
        [CaseResult("m", Target("onnxruntime", "cpu"), "min", {"seq": 1}, 0, "golden", [nan_case])],
    )
    text = dump_json_report(report)
    assert "NaN" not in text and "Infinity" not in text
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert load_json_report(text).cases[0].comparisons[0].min_passing_atol == float("inf")


def test_junit_counts_the_right_failures(reports: dict[str, Path]) -> None:
    root = ET.parse(reports["xml"]).getroot()
    suite = root.find("testsuite")
    assert suite is not None
    assert (suite.get("tests"), suite.get("failures")) == (str(len(REPORTED)), "1")
    cases = suite.findall("testcase")
    assert {c.get("classname") for c in cases} == {p.stem for p in REPORTED}
    failed = [c for c in cases if c.find("failure") is not None]
    assert [(c.get("classname"), c.get("name")) for c in failed] == [("sdpa", "onnxruntime[cpu]")]
    failure = failed[0].find("failure")
    assert "attn_weights" in failure.get("message") and "reproduce: attn-export verify" in failure.text


def test_markdown_table_and_step_summary(reports: dict[str, Path]) -> None:
    md = reports["md"].read_text()
    lines = md.splitlines()
    assert lines[0] == "### attn-export verify: ❌ failed"
    header = next(i for i, line in enumerate(lines) if line.startswith("| model |"))
    end = next(i for i, line in enumerate(lines) if i > header + 1 and not line.startswith("| "))
    rows = lines[header + 2 : end]
    assert len(rows) == zoo_cases(reports["zoo"], REPORTED) and all(row.count("|") == 11 for row in rows)
    failed = json.loads(reports["json"].read_text())["summary"]["failed_cases"]
    assert sum("**FAIL**" in row for row in rows) == failed
    assert "#### Max abs error by value distribution" in md
    assert "#### Failures" in md
    assert reports["summary"].read_text() == "earlier step\n" + md


def test_markdown_of_a_passing_report(zoo_dir: Path) -> None:
    from attn_export.artifacts.manifest import load_manifest
    from attn_export.pipelines.verify import VerifyOptions, verify_artifacts

    options = VerifyOptions(latency=False, models_dir=TINY_ZOO)
    report = verify_artifacts(zoo_dir, load_manifest(zoo_dir), ["sdpa"], options)
    md = markdown_report(report)
    assert md.startswith("### attn-export verify: ✅ passed") and "Failures" not in md


def test_markdown_notes_a_models_check_notes() -> None:
    """A note on a model that passes (the region check's) reaches the job summary too."""
    from attn_export.pipelines.verify import CaseResult, ModelCheck, VerifyReport
    from attn_export.runtimes import Target

    note = "OUTPUTS AGREE, but region linear_1 breaks its tolerance"
    case = CaseResult("m", Target("onnxruntime", "cpu"), "min", {"seq": 3}, 0, "golden")
    report = VerifyReport("out", 0, {}, [ModelCheck("m", "m.onnx", notes=[note])], [case])
    md = markdown_report(report)
    assert md.endswith(f"#### Notes\n\n- **m**: {note}\n") and "Failures" not in md


TORCH_FREE = """
import sys
for name in ("torch", "onnxscript"):
    sys.modules[name] = None  # any import of them now raises ImportError
from attn_export.cli import main
main(sys.argv[1:])
"""


def test_golden_mode_runs_without_torch(zoo_dir: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            TORCH_FREE,
            "verify",
            str(zoo_dir),
            "--golden",
            "--no-latency",
            "--runtime",
            "onnxruntime",
            "--runtime",
            "onnx-reference",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    assert "verify PASSED" in done.stdout and "Traceback" not in done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("mha_cross")]
    assert {r.split()[1] for r in rows} == {"onnxruntime[cpu]", "onnx-reference"}


def test_without_torch_a_torch_command_says_what_to_install(zoo_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", TORCH_FREE, "verify", str(zoo_dir), "--models", str(TINY_ZOO), "--no-latency"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stdout
    assert done.stderr.strip() == (
        "Error: building the PyTorch module needs torch, which is not installed (pip install 'attn-export[export]')"
    )


def test_golden_mode_catches_a_planted_fault(zoo_copy: Path) -> None:
    proto = onnx.load(zoo_copy / "sdpa.onnx")
    set_initializer(proto, node(proto, "Div").input[1], 2.0)  # sqrt(d_k) is 4
    plant(zoo_copy, "sdpa", proto)
    result = CliRunner().invoke(cli, ["verify", str(zoo_copy / "sdpa.onnx"), "--golden", "--no-latency"])
    assert result.exit_code == 1
    assert (
        f"reproduce: attn-export verify {zoo_copy / 'sdpa.onnx'} --provider cpu --golden --no-latency" in result.output
    )


def test_every_renderer_prints_the_same_numbers_for_a_shape_mismatch() -> None:
    from attn_export.compare import compare_output
    from attn_export.model_spec import Tolerance
    from attn_export.pipelines.verify import CaseResult, ModelCheck, VerifyReport
    from attn_export.report.verify_text import format_case
    from attn_export.runtimes import Target

    wrong_shape = compare_output("o", np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32), Tolerance(0, 0))
    case = CaseResult("m", Target("onnxruntime", "cpu"), "min", {"seq": 3}, 0, "golden", [wrong_shape])
    report = VerifyReport("out", 0, {}, [ModelCheck("m", "m.onnx")], [case])
    assert case.max_abs_error is None and case.max_rel_error is None  # nothing numeric was compared
    row = next(line for line in markdown_report(report).splitlines() if line.startswith("| m |"))
    assert row.split("|")[6:8] == [" - ", " - "]
    assert format_case(case).split()[5:7] == ["-", "-"]
    assert (
        json.loads(dump_json_report(report))["summary"]
        == report.summary
        == {
            "models": 1,
            "cases": 1,
            "failed_cases": 1,
            "failed_checks": 0,
            "noisy_timings": 0,
        }
    )


def test_a_tolerance_set_by_pytorchs_own_error_is_said_beside_the_rows() -> None:
    from attn_export.compare import compare_outputs
    from attn_export.model_spec import Tolerance
    from attn_export.pipelines.verify import CaseResult, ModelCheck
    from attn_export.report.verify_text import format_model_rows
    from attn_export.runtimes import Target

    expected = {"o": np.full(4, 1000.0, np.float32)}
    actual = {"o": np.full(4, 1000.5, np.float32)}
    tol = {"o": Tolerance(1e-3, 0.0)}

    def rows(floor: float) -> str:
        compared = compare_outputs(expected, actual, tol, {"o": floor})
        case = CaseResult("m", Target("onnxruntime", "cpu"), "large", {"seq": 3}, 0, "torch[cpu]", compared)
        assert case.passed == (floor > 0)
        return format_model_rows("m", [case], ModelCheck("m", "m.onnx"))

    assert "note" not in rows(0.0)
    assert (
        "note: m: PyTorch's own rounding error (against float64) set the tolerance of 1 outputs in 1 cases: "
        "atol = spec + 10x that error, up to 0.601 at onnxruntime[cpu] large" in rows(0.06)
    )


def test_the_verify_table_stays_aligned_for_long_names_and_shapes() -> None:
    """Columns were 18/18/30 wide: a decoder's four dims with a mask case, or a name such as
    mistral_sdpa_kv_cache, pushed every later column of its rows out of line."""
    from attn_export.compare import compare_outputs
    from attn_export.model_spec import Tolerance, load_spec
    from attn_export.model_spec.shapes import example_sizes
    from attn_export.pipelines.verify import CaseResult, ModelCheck
    from attn_export.report.verify_text import VERIFY_WIDTHS, format_model_rows, header
    from attn_export.runtimes import Target

    spec = load_spec(TINY_ZOO / "mistral_sdpa_kv_cache.toml")
    name = "mistral_sdpa_kv_cache.ort-past+int8"
    w = VERIFY_WIDTHS.fitting([(name, spec)], ["onnxruntime[cpu]"])
    compared = compare_outputs({"o": np.zeros(2, np.float32)}, {"o": np.zeros(2, np.float32)}, {"o": Tolerance(0, 0)})
    largest = {d: r.max for d, r in spec.dims.items()}
    cases = [
        CaseResult(name, Target("onnxruntime", "cpu"), shape, sizes, 0, "torch[cpu]", compared)
        for shape, sizes in [("max", largest), ("fully-padded-sequence", example_sizes(spec))]
        + [("fully-padded-sequence", largest)]  # --shapes at the max with --mask-case
    ]
    rows = format_model_rows(name, cases, ModelCheck(name, "m.onnx"), w).splitlines()
    assert "fully-padded-sequence" in rows[1] and "fully-padded-sequence" in rows[2]
    assert {row.index("normal") for row in rows} == {header(w).index("VALUES")}


def test_the_report_says_when_genais_generator_did_not_run() -> None:
    from attn_export.checks.generate import GenerateResult
    from attn_export.pipelines.verify import VerifyReport
    from attn_export.report.verify_text import format_generate

    def row(model: str, runner: str) -> GenerateResult:
        return GenerateResult(model, runner, "batch-1", [[5, 6]], 4, [[1, 2, 3, 4]], [[1, 2, 3, 4]], [0.0] * 4)

    report = VerifyReport("build", 0, {})
    report.generate = [row("lm", "onnxruntime[cpu]"), row("lm", "onnxruntime-genai"), row("other", "onnxruntime[cpu]")]
    text = format_generate(report)
    assert "note: onnxruntime-genai's generator did not run other: it is not installed" in text
    assert "did not run lm" not in text


def test_a_row_parted_on_a_near_tie_passes_with_its_tokens_counted_to_the_tie_and_a_note() -> None:
    from attn_export.checks.generate import GenerateResult
    from attn_export.pipelines.verify import VerifyReport
    from attn_export.report.verify_text import format_generate

    tie = "step 4, row 0: PyTorch picks token 4, the graph 7, on a near tie (...): the row is judged no further"
    parted = GenerateResult("lm", "onnxruntime[cpu]", "same-length", [[5, 6]], 4, [[1, 2, 3, 4]], [[1, 2, 3, 7]],
                            [0.0] * 4, parted=[tie], agreed=3)  # fmt: skip
    report = VerifyReport("build", 0, {})
    report.generate = [parted]
    lines = format_generate(report).splitlines()
    assert lines[1].split()[3:6] == ["2", "PASS", "3/4"], lines  # prompts, result, tokens as PyTorch's
    assert lines[2] == f"note: lm onnxruntime[cpu] generate same-length: {tie}"
    assert GenerateResult.from_dict(json.loads(json.dumps(parted.to_dict()))) == parted


def test_a_decode_failure_under_a_scenario_reproduces_with_its_steps() -> None:
    """A scenario run decodes only where --decode is given too: its trajectories' line named
    the scenario alone, and the run it printed decoded nothing (its cases agreed)."""
    from attn_export.checks.decode import DecodeResult
    from attn_export.pipelines.verify import ModelCheck, VerifyOptions, VerifyReport
    from attn_export.runtimes import Target

    options = VerifyOptions(models_dir=Path("models"), scenario="decode-early", decode_steps=4, latency=False)
    trajectory = DecodeResult("m", Target("onnxruntime", "cpu"), "batch-1", "torch-eager", [3], error="step 2: off")
    report = VerifyReport("out", 7, options.settings(), [ModelCheck("m", "m.onnx")], [], decode=[trajectory])
    assert report.reproduce_decode(trajectory) == (
        "attn-export verify out/m.onnx --provider cpu --scenario decode-early --decode 4 --seed 7 --no-latency"
    )

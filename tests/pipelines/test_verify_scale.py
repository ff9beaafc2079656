"""verify at scale: one report, byte for byte apart from timings, whether its cells run in
this process, in ``--jobs`` processes, as shards put together by ``report merge`` or on Ray;
timing runs when no other cell runs; merge refuses shards of different runs in one line."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from attn_export.artifacts.manifest import load_manifest
from attn_export.cli import cli
from attn_export.errors import RuntimeFailure
from attn_export.executors import EXECUTORS, ExecutorKind, Parallelism
from attn_export.pipelines.verify import VerifyOptions, verify_artifacts
from tests.conftest import TINY_SPECS, TINY_ZOO, Built, zoo_cases

#: A sample of the tiny zoo: a decoder with a cache (its decode cell), a masked model, a plain one.
SAMPLE = ("mha", "mha_kv_cache", "sdpa_masked")
#: The sweep's unit-normal cases and two decode steps, untimed (timings differ run to run).
NARROW = ("--distribution", "normal", "--random", "0", "--decode", "2", "--no-latency")


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def _verify(paths: list[Path], json_path: Path, *args: str, models: Path = TINY_ZOO) -> Result:
    result = invoke("verify", *map(str, paths), "--models", str(models), "--json", str(json_path), *args)
    assert result.exit_code == 0, result.output
    return result


def _timeless(text: str) -> str:
    """A report without its timings: the run's seconds (JSON, JUnit, Markdown)."""
    text = re.sub(r'"seconds": [0-9.e+-]+', '"seconds": -', text)
    text = re.sub(r' time="[0-9.]+"', ' time="-"', text)
    return re.sub(r"seed (\d+), [0-9.]+ s\.", r"seed \1, - s.", text)


def _merge(shards: list[Path], out: Path) -> Result:
    files = [str(p) for p in shards]
    outputs = ["--json", str(out / "merged.json"), "--junit", str(out / "merged.xml"), "--markdown", str(out / "m.md")]
    return invoke("report", "merge", *files, *outputs)


@pytest.fixture(scope="module")
def sample(zoo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sample verified serially (with every report) and as 2 shards, against PyTorch;
    and serially and with --jobs 2 against the golden vectors (processes that need no torch
    start fast: the slow test runs the zoo with --jobs 2 against PyTorch)."""
    out = tmp_path_factory.mktemp("scale")
    paths = [zoo_dir / f"{m}.onnx" for m in SAMPLE]
    reports = ["--junit", str(out / "serial.xml"), "--markdown", str(out / "serial.md")]
    _verify(paths, out / "serial.json", *NARROW, *reports)
    for i in (1, 2):
        _verify(paths, out / f"shard-{i}.json", *NARROW, "--shard", f"{i}/2")
    golden = ("--golden", "--decode", "2", "--no-latency")
    _verify(paths, out / "golden.json", *golden)
    _verify(paths, out / "golden-jobs.json", *golden, "--jobs", "2")
    return {p.stem: p for p in out.iterdir()}


def test_jobs_and_merged_shards_give_the_serial_report(sample: dict[str, Path], tmp_path: Path) -> None:
    serial = sample["serial"].read_text()
    doc = json.loads(serial)
    assert doc["summary"]["models"] == 3 and doc["decode"] and doc["shard"] is None
    golden = json.loads(sample["golden"].read_text())
    assert golden["summary"]["cases"] > 3 and golden["decode"] and golden["passed"]
    assert _timeless(sample["golden-jobs"].read_text()) == _timeless(sample["golden"].read_text())
    shards = [json.loads(sample[f"shard-{i}"].read_text()) for i in (1, 2)]
    assert [len(s["checks"]) for s in shards] == [2, 1] and shards[1]["shard"]["index"] == 2
    result = _merge([sample["shard-2"], sample["shard-1"]], tmp_path)  # in any order
    assert result.exit_code == 0, result.output
    assert "verify PASSED" in result.output
    assert _timeless((tmp_path / "merged.json").read_text()) == _timeless(serial)
    for suffix in (".xml", ".md"):
        merged = (tmp_path / ("merged.xml" if suffix == ".xml" else "m.md")).read_text()
        assert _timeless(merged) == _timeless(sample["serial"].with_suffix(suffix).read_text())


def _edited(path: Path, out: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    doc = json.loads(path.read_text())
    edit(doc)
    dest = out / f"edited-{path.name}"
    dest.write_text(json.dumps(doc))
    return dest


REFUSALS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "seed": (lambda d: d.update(seed=1), "seed 1 differs from {first}'s 0"),
    "build": (lambda d: d.update(manifest_sha256="0" * 64), "build 000000000000 differs from {first}'s "),
    "option": (lambda d: d["settings"].update(atol=0.1), "option atol 0.1 differs from {first}'s None"),
    "version": (lambda d: d["versions"].update(onnxruntime="0.1"), "onnxruntime version 0.1 differs from {first}'s"),
    "selection": (lambda d: d["shard"].update(selection="0" * 64), "shard 2/2 is of another selection of models"),
    "unrecorded build": (lambda d: d.pop("manifest_sha256"), "the report records no build"),
}


@pytest.mark.parametrize("what", REFUSALS)
def test_merge_refuses_shards_of_different_runs_in_one_line(sample: dict[str, Path], tmp_path: Path, what: str) -> None:
    edit, message = REFUSALS[what]
    first, second = sample["shard-1"], _edited(sample["shard-2"], tmp_path, edit)
    result = _merge([first, second], tmp_path)
    assert result.exit_code == 2
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1, result.output
    assert message.format(first=first) in result.output
    assert not (tmp_path / "merged.json").exists()


def test_merge_refuses_a_missing_or_repeated_shard(sample: dict[str, Path], tmp_path: Path) -> None:
    missing = _merge([sample["shard-1"]], tmp_path)
    assert missing.exit_code == 2 and missing.output == "Error: shard 2/2 missing: give every shard's report\n"
    twice = _merge([sample["shard-1"], sample["shard-1"], sample["shard-2"]], tmp_path)
    assert twice.exit_code == 2 and "shard 1/2 is given twice" in twice.output
    for i in (1, 2):
        (tmp_path / str(i)).mkdir()
    huge = [_edited(sample[f"shard-{i}"], tmp_path / str(i), lambda d: d["shard"].update(count=10**9)) for i in (1, 2)]
    many = _merge(huge, tmp_path)  # said at once, where it counted to a billion and ran out of memory
    assert many.output == (
        "Error: shards 3/1000000000, 4/1000000000, 5/1000000000 and 999999995 more missing: give every shard's report\n"
    )
    other = _merge([sample["shard-1"], sample["serial"]], tmp_path)
    assert other.exit_code == 2 and "shard count 1 differs" in other.output
    (tmp_path / "junk.json").write_text("[1, 2]")
    junk = _merge([tmp_path / "junk.json"], tmp_path)
    assert junk.exit_code == 2 and junk.output == f"Error: {tmp_path / 'junk.json'}: not an attn-export verify report\n"


MISTYPED: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "seconds": (lambda d: d.update(seconds="1.5"), "(seconds: a string, not float)"),
    "shard": (lambda d: d["shard"].update(index="2"), "(shard.index: a string, not int)"),
    "shard index": (lambda d: d["shard"].update(index=4), "(shard: index 4 is not one of 1..2)"),
    "case": (lambda d: d["cases"].__setitem__(0, 7), "(cases[0]: a number, not an object)"),
    "error": (
        lambda d: d["cases"][0]["comparisons"][0].update(max_abs_error=[0.5]),
        "(cases[0].comparisons[0].max_abs_error: a list, not float)",
    ),
    "placement": (
        lambda d: d["placement"][0]["by_provider"].update(CPUExecutionProvider="all"),
        "(placement[0].by_provider['CPUExecutionProvider']: a string, not int)",
    ),
    # each of these was converted without a word: dict() of a list of pairs, list() of a
    # string's letters, a target or timing of the wrong shape unpacked into its class
    "sizes": (
        lambda d: d["cases"][0].update(sizes=[["batch", 2], ["seq", 3]]),
        "(cases[0].sizes: a list, not dict[str, int])",
    ),
    "settings": (lambda d: d.update(settings=[["atol", None]]), "(settings: a list, not dict[str, Any])"),
    "notes": (lambda d: d["cases"][0].update(notes="rows left out"), "(cases[0].notes: a string, not list[str])"),
    "problems": (lambda d: d["checks"][0].update(problems="bad"), "(checks[0].problems: a string, not list[str])"),
    "target": (lambda d: d["cases"][0].update(target=["onnxruntime"]), "(cases[0].target: a list, not dict)"),
    "latency": (lambda d: d["cases"][0].update(latency=[1.0]), "(cases[0].latency: a list, not dict)"),
    "seed": (lambda d: d["cases"][0].update(seed="0"), "(cases[0].seed: a string, not int)"),
    "missing": (lambda d: d["cases"][0].pop("shape"), "(cases[0].shape: missing)"),
    "by_provider": (
        lambda d: d["placement"][0].update(by_provider=[["CPUExecutionProvider", 26]]),
        "(placement[0].by_provider: a list, not dict[str, int])",
    ),
    "stray model": (lambda d: d["cases"][0].update(model="x"), "holds results of model 'x', which none of its checks"),
}


@pytest.mark.parametrize("what", MISTYPED)
def test_merge_refuses_wrongly_typed_fields_in_one_line(sample: dict[str, Path], tmp_path: Path, what: str) -> None:
    """Each was an internal error (exit 3), in merging or in rendering the merged report."""
    edit, message = MISTYPED[what]
    result = _merge([sample["shard-1"], _edited(sample["shard-2"], tmp_path, edit)], tmp_path)
    assert result.exit_code == 2 and result.output.count("\n") == 1 and message in result.output, result.output
    assert not (tmp_path / "merged.json").exists()


#: A timing, a generation, a cache's growth and carry-over as their ``to_dict`` writes them.
_LATENCY = {"p50_ms": 1.0, "p90_ms": 1.2, "mean_ms": 1.1, "repeats": 5, "load": 0.5, "cores": 2}
_GENERATE = {
    **dict(model="mha_kv_cache", runner="onnxruntime", layout="batch1", prompts=[[1]], steps=2, expected=[[1, 2]]),
    **dict(got=[[1, 2]], max_abs_by_step=[0.0, 0.0], divergence="", step=None, passed=True),
}
_GROWTH = dict(
    output="present.0.key", past=1, seq=1, window=None, expected=[1, 2, 2, 4], graph=[1, 2, 3, 4], module=None
)
_CARRY = dict(output="present.0.key", past=1, seq=1, carried=1, max_abs_error=0.5, worst_index=[0, 0, 0, 0])


def _timed(doc: dict[str, Any], **onnx: Any) -> dict[str, Any]:
    """The first case's timings, the ONNX Runtime side's fields updated by ``onnx``."""
    latency = {"onnx": {**_LATENCY, **onnx}, "torch": dict(_LATENCY), "ratio": 1.0, "noise": None}
    doc["cases"][0]["latency"] = latency
    return latency


def _without(record: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != key}


def _step(doc: dict[str, Any]) -> dict[str, Any]:
    step: dict[str, Any] = doc["decode"][0]["steps"][1]
    return step


NESTED: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "latency typed": (lambda d: _timed(d, p50_ms="1.0"), "(cases[0].latency.onnx.p50_ms: a string, not float)"),
    "latency missing": (lambda d: _timed(d)["torch"].pop("repeats"), "(cases[0].latency.torch.repeats: missing)"),
    "latency extra": (lambda d: _timed(d, p50=1.0), "(cases[0].latency.onnx.p50: unknown field)"),
    "comparison missing": (
        lambda d: d["cases"][0]["comparisons"][0].pop("name"),
        "(cases[0].comparisons[0].name: missing)",
    ),
    "comparison extra": (
        lambda d: d["cases"][0]["comparisons"][0].update(max_abs=0.5),
        "(cases[0].comparisons[0].max_abs: unknown field)",
    ),
    "decode target": (lambda d: d["decode"][0].update(target=["onnxruntime"]), "(decode[0].target: a list, not dict)"),
    "decode target extra": (
        lambda d: d["decode"][0]["target"].update(device="cpu"),
        "(decode[0].target.device: unknown field)",
    ),
    "decode missing": (lambda d: d["decode"][0].pop("scenario"), "(decode[0].scenario: missing)"),
    "decode prompts": (
        lambda d: d["decode"][0].update(prompt_lengths="12"),
        "(decode[0].prompt_lengths: a string, not list[int])",
    ),
    "decode steps": (lambda d: d["decode"][0].update(steps="ab"), "(decode[0].steps: a string, not list)"),
    "step missing": (lambda d: _step(d).pop("seq"), "(decode[0].steps[1].seq: missing)"),
    "step comparison": (
        lambda d: _step(d)["recompute"].__setitem__(0, 7),
        "(decode[0].steps[1].recompute[0]: a number, not an object)",
    ),
    "growth extra": (
        lambda d: _step(d).update(growth=[{**_GROWTH, "shape": [1]}]),
        "(decode[0].steps[1].growth[0].shape: unknown field)",
    ),
    "carry missing": (
        lambda d: _step(d).update(carry=[_without(_CARRY, "carried")]),
        "(decode[0].steps[1].carry[0].carried: missing)",
    ),
    "generate missing": (
        lambda d: d.update(generate=[_without(_GENERATE, "runner")]),
        "(generate[0].runner: missing)",
    ),
    "generate extra": (
        lambda d: d.update(generate=[{**_GENERATE, "tokens": 2}]),
        "(generate[0].tokens: unknown field)",
    ),
    "case extra": (lambda d: d["cases"][0].update(verdict="pass"), "(cases[0].verdict: unknown field)"),
    "decode extra": (lambda d: d["decode"][0].update(passes=True), "(decode[0].passes: unknown field)"),
    "step extra": (lambda d: _step(d).update(total=3), "(decode[0].steps[1].total: unknown field)"),
    "placement extra": (lambda d: d["placement"][0].update(on="cpu"), "(placement[0].on: unknown field)"),
    "op count typed": (
        lambda d: d["placement"][0].update(fallbacks=[{"op_type": "MatMul", "provider": "CPU", "count": "1"}]),
        "(placement[0].fallbacks[0].count: a string, not int)",
    ),
    "op count extra": (
        lambda d: d["placement"][0].update(shape_ops=[{"op_type": "Shape", "provider": "CPU", "count": 1, "n": 1}]),
        "(placement[0].shape_ops[0].n: unknown field)",
    ),
}


@pytest.mark.parametrize("what", NESTED)
def test_merge_refuses_a_malformed_nested_record_naming_its_field(
    sample: dict[str, Path], tmp_path: Path, what: str
) -> None:
    """Each of these records was unpacked into its class: an extra or missing key came out as
    a TypeError's or KeyError's text naming no place in the report, a wrong type under the
    class's attribute (``onnx_latency``) instead of the report's key."""
    edit, message = NESTED[what]
    result = _merge([sample["shard-1"], _edited(sample["shard-2"], tmp_path, edit)], tmp_path)
    assert result.exit_code == 2 and result.output.count("\n") == 1 and message in result.output, result.output
    assert not (tmp_path / "merged.json").exists()


def test_merge_keeps_each_shards_generations(sample: dict[str, Path], tmp_path: Path) -> None:
    """The merged report dropped them: a shard whose generation failed merged into a pass."""
    from attn_export.checks.generate import GenerateResult

    def diverged(doc: dict[str, Any]) -> None:
        model = doc["checks"][0]["model"]
        got = GenerateResult(model, "onnxruntime", "batch1", [[1]], 2, [[1, 2]], [[1, 3]], [0.0, 9.0], "step 2", 2)
        doc["generate"] = [got.to_dict()]

    result = _merge([sample["shard-1"], _edited(sample["shard-2"], tmp_path, diverged)], tmp_path)
    assert result.exit_code == 1, result.output
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert [g["divergence"] for g in merged["generate"]] == ["step 2"] and not merged["passed"]


def test_an_empty_shard_writes_its_report_and_merges(shared_tiny: Built, tmp_path: Path) -> None:
    args = ("--distribution", "normal", "--random", "0", "--no-latency")
    _verify([shared_tiny.out], tmp_path / "whole.json", *args, models=shared_tiny.models)
    empty = _verify([shared_tiny.out], tmp_path / "s2.json", *args, "--shard", "2/2", models=shared_tiny.models)
    assert "shard 2/2 holds no model" in empty.output
    _verify([shared_tiny.out], tmp_path / "s1.json", *args, "--shard", "1/2", models=shared_tiny.models)
    result = _merge([tmp_path / "s1.json", tmp_path / "s2.json"], tmp_path)
    assert result.exit_code == 0, result.output
    assert _timeless((tmp_path / "merged.json").read_text()) == _timeless((tmp_path / "whole.json").read_text())


class _Deferred(Future[Any]):
    """A cell that runs only when its result is asked for: until then it is in flight."""

    def __init__(self, call: Callable[[], Any]) -> None:
        super().__init__()
        self._call = call

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            try:
                self.set_result(self._call())
            except Exception as e:
                self.set_exception(e)
        return super().result(timeout)


class _SideBySide(Executor):
    """Cells in flight side by side until their results are asked for; logs, as each timing
    cell is submitted, how many other cells were still in flight."""

    def __init__(self) -> None:
        self.submitted: list[_Deferred] = []
        self.in_flight_at_timing: list[int] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        if fn.__name__ == "time_case":
            self.in_flight_at_timing.append(sum(not f.done() for f in self.submitted))
        future = _Deferred(lambda: fn(*args, **kwargs))
        self.submitted.append(future)
        return future


def test_timing_waits_until_no_other_cell_runs(zoo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    executor = _SideBySide()
    monkeypatch.setitem(
        EXECUTORS, "side-by-side", ExecutorKind("side-by-side", lambda jobs, exclusive: executor, "a test's")
    )
    options = VerifyOptions(models_dir=TINY_ZOO, distributions=["normal"], n_random=0, latency_budget_s=0.002)
    names = ["mha", "sdpa"]
    report = verify_artifacts(zoo_dir, load_manifest(zoo_dir), names, options, parallelism=Parallelism("side-by-side"))
    timed = [c for c in report.cases if c.onnx_latency is not None]
    assert len(timed) == len(report.cases) > 0 and {c.model for c in timed} == set(names)
    assert executor.in_flight_at_timing == [0] * len(timed)  # each timing alone, and every case timed
    assert report.placement  # a placement cell too ran before, never beside, a timing


class _Shuffling(Executor):
    """Runs each cell at once but returns a batch of case records in reverse order, as a
    broken executor that lost track of which record is whose would."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        records = fn(*args, **kwargs)
        future.set_result(records[::-1] if fn.__name__ == "check_cases" else records)
        return future


def test_records_are_matched_to_their_cells_by_key(zoo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        EXECUTORS, "shuffling", ExecutorKind("shuffling", lambda jobs, exclusive: _Shuffling(), "a test's")
    )
    options = VerifyOptions(models_dir=TINY_ZOO, distributions=["normal"], n_random=0, latency=False)
    with pytest.raises(RuntimeFailure, match="^mha: the executor returned records of other cells than were sent$"):
        verify_artifacts(zoo_dir, load_manifest(zoo_dir), ["mha"], options, parallelism=Parallelism("shuffling"))


def _sweep(zoo_dir: Path, out: Path, *args: str) -> str:
    """The unit-normal sweep over the shared tiny zoo (no decode steps), its JSON report."""
    _verify([zoo_dir], out, "--distribution", "normal", "--decode", "0", "--no-latency", *args)
    return _timeless(out.read_text())


@pytest.mark.slow
def test_a_zoo_sweep_is_the_same_serially_with_jobs_and_as_four_shards_merged(zoo_dir: Path, tmp_path: Path) -> None:
    serial = _sweep(zoo_dir, tmp_path / "serial.json")
    summary = json.loads((tmp_path / "serial.json").read_text())["summary"]
    cases = zoo_cases(zoo_dir, TINY_SPECS, VerifyOptions(distributions=["normal"]))  # guards' sizes too
    assert (summary["models"], summary["cases"], summary["failed_cases"]) == (len(TINY_SPECS), cases, 0)
    assert _sweep(zoo_dir, tmp_path / "jobs.json", "--jobs", "2") == serial
    shards = [tmp_path / f"shard-{i}.json" for i in range(1, 5)]
    for i, shard in enumerate(shards, 1):
        _sweep(zoo_dir, shard, "--shard", f"{i}/4")
    assert _merge(shards, tmp_path).exit_code == 0
    assert _timeless((tmp_path / "merged.json").read_text()) == serial


@pytest.mark.slow
def test_a_zoo_sweep_is_the_same_on_a_local_ray_cluster(zoo_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
    serial = _sweep(zoo_dir, tmp_path / "serial.json")
    assert _sweep(zoo_dir, tmp_path / "ray.json", "--executor", "ray") == serial

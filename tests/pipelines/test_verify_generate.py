"""``verify --generate N``: greedy tokens of a whole causal LM against PyTorch's generate(), in
our own loop and in onnxruntime-genai's generator; a divergence names its step, row and logit."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper, numpy_helper

from attn_export.cli import cli
from attn_export.pipelines.verify import VerifyReport
from tests.conftest import TINY_ZOO, Built, needs_transformers

pytestmark = needs_transformers
HAS_GENAI = importlib.util.find_spec("onnxruntime_genai") is not None
SPEC = TINY_ZOO / "llama_causal_lm.toml"


def _verify(*args: str) -> object:
    return CliRunner().invoke(cli, ["verify", *args, "--no-latency", "--decode", "0"])


def test_the_graph_generates_pytorchs_tokens(causal_lm: Built, tmp_path: Path) -> None:
    result = _verify(
        str(causal_lm.out), "--models", str(causal_lm.models), "--generate", "6", "--json", str(tmp_path / "r.json")
    )
    assert result.exit_code == 0, result.output
    runners = {"onnxruntime[cpu]", *(["onnxruntime-genai"] if HAS_GENAI else [])}
    for model in ("llama_causal_lm", "llama_causal_lm.int4"):  # int4 against the module rounded as int4 rounds
        rows = [line for line in result.output.splitlines() if line.startswith(f"{model} ") and " 6/6 " in line]
        assert {line.split()[1] for line in rows} == runners and len(rows) == 2 * len(runners), result.output
    assert f"{4 * len(runners)} of {4 * len(runners)} generations give PyTorch's tokens" in result.output
    report = VerifyReport.from_dict(json.loads((tmp_path / "r.json").read_text()))
    assert report.to_dict()["generate"] == json.loads((tmp_path / "r.json").read_text())["generate"]
    padded = next(g for g in report.generate if g.layout == "padded" and g.model == "llama_causal_lm")
    assert len({len(p) for p in padded.prompts}) == 2

    def ended(row: list[int]) -> list[int]:  # a row is judged up to its eos (2), where a generator stops it
        return row[: row.index(2) + 1] if 2 in row else row

    assert [ended(r) for r in padded.got] == [ended(r) for r in padded.expected]


@pytest.mark.skipif(not HAS_GENAI, reason="onnxruntime-genai is not installed (pip install 'attn-export[genai]')")
def test_genais_generator_runs_on_the_threads_verify_is_given(
    causal_lm: Built, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--threads set PyTorch's and ONNX Runtime's threads, and genai's generator kept its
    config's (all the cores, spinning beside the next runner): it runs on them too, through
    its own config overlay, the folder left as it is."""
    import onnxruntime_genai as og

    overlays: list[dict[str, object]] = []
    real = og.Config.overlay
    monkeypatch.setattr(og.Config, "overlay", lambda self, text: (overlays.append(json.loads(text)), real(self, text)))
    folder = causal_lm.out / "genai" / "llama_causal_lm"
    before = (folder / "genai_config.json").read_bytes()
    args = ["--generate", "2", "--threads", "1", "--distribution", "normal", "--random", "0"]
    result = _verify(str(causal_lm.out / "llama_causal_lm.onnx"), "--models", str(causal_lm.models), *args)
    assert result.exit_code == 0 and "onnxruntime-genai" in result.output, result.output
    assert overlays and all(
        o == {"model": {"decoder": {"session_options": {"intra_op_num_threads": 1, "inter_op_num_threads": 1}}}}
        for o in overlays
    ), overlays
    assert (folder / "genai_config.json").read_bytes() == before


def _scale_the_second_layers_key(graph: Path, dest: Path) -> Path:
    """The graph with layer 1's key scaled by 1.05 where it leaves the cache's concatenation."""
    model = onnx.load(str(graph))
    nodes = model.graph.node
    at = next(i for i, n in enumerate(nodes) if "present.1.key" in n.output)
    outputs = nodes[at].output
    outputs[list(outputs).index("present.1.key")] = "present.1.key.unscaled"
    model.graph.initializer.append(numpy_helper.from_array(np.array(1.05, np.float32), "fault.scale"))
    nodes.insert(at + 1, helper.make_node("Mul", ["present.1.key.unscaled", "fault.scale"], ["present.1.key"]))
    onnx.save(model, str(dest))
    return dest


def test_a_graph_that_strays_is_named_at_its_first_step(causal_lm: Built, tmp_path: Path) -> None:
    edited = _scale_the_second_layers_key(causal_lm.out / "llama_causal_lm.onnx", tmp_path / "edited.onnx")
    result = _verify(str(edited), "--spec", str(SPEC), "--generate", "4")
    assert result.exit_code == 1, result.output
    fails = [line for line in result.output.splitlines() if " generate " in line and line.startswith("FAIL")]
    assert len(fails) == 2 * (2 if HAS_GENAI else 1), result.output
    assert all("step 1, row 0: " in line and " logit " in line and "atol=1e-05" in line for line in fails)


def test_a_run_without_a_causal_lm_is_one_line(zoo_dir: Path) -> None:
    result = _verify(str(zoo_dir / "mha.onnx"), "--models", str(TINY_ZOO), "--generate", "4")
    assert result.exit_code == 2
    assert result.output.strip() == (
        "Error: --generate runs causal LMs (a logits output and a KV cache): no model of this run is one"
    )


def test_more_tokens_than_the_declared_range_holds_is_one_line(causal_lm: Built) -> None:
    result = _verify(str(causal_lm.out), "--models", str(causal_lm.models), "--generate", "30")
    assert result.exit_code == 2
    assert result.output.count("\n") == 1
    assert "--generate 30" in result.output and "widen [dims] past_seq" in result.output


def test_golden_mode_judges_by_the_generations_the_build_recorded(
    causal_lm: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deployment box without torch: the build recorded PyTorch's generations, and genai runs
    the build's own genai folder."""
    from attn_export.pipelines.verify import greedy_generations

    def no_torch(*args: object, **kwargs: object) -> None:
        raise AssertionError("golden mode ran PyTorch")

    monkeypatch.setattr(greedy_generations, "torch_generate", no_torch)
    monkeypatch.setattr(greedy_generations, "_from_torch", no_torch)
    folder = tmp_path / "copy"
    shutil.copytree(causal_lm.out, folder)
    result = _verify(str(folder), "--golden", "--generate", "8")
    assert result.exit_code == 0, result.output
    runners = 2 if HAS_GENAI else 1
    assert f"{4 * runners} of {4 * runners} generations give PyTorch's tokens (8 tokens each)" in result.output
    too_many = _verify(str(folder), "--golden", "--generate", "9")
    assert too_many.exit_code == 2 and too_many.output.count("\n") == 1, too_many.output
    assert "llama_causal_lm's build recorded 8 new tokens; ask for 8 or fewer" in too_many.output


def test_golden_mode_refuses_recorded_generations_changed_after_the_build(causal_lm: Built, tmp_path: Path) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(causal_lm.out, folder)
    recorded = folder / "llama_causal_lm.generate.npz"
    data = bytearray(recorded.read_bytes())
    data[len(data) // 2] ^= 0xFF
    recorded.write_bytes(bytes(data))
    result = _verify(str(folder), "--golden", "--generate", "4")
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "llama_causal_lm.generate.npz changed after the build" in result.output


def test_golden_mode_fails_a_graph_changed_after_the_build_as_a_check(causal_lm: Built, tmp_path: Path) -> None:
    """An edited graph is a failure of that model (exit 1), with or without --generate: its
    generations are not run, and the recorded ones are still read."""
    folder = tmp_path / "copy"
    shutil.copytree(causal_lm.out, folder)
    _scale_the_second_layers_key(folder / "llama_causal_lm.onnx", folder / "llama_causal_lm.onnx")
    result = _verify(str(folder), "--golden", "--generate", "4")
    assert result.exit_code == 1, result.output
    assert "FAIL llama_causal_lm: llama_causal_lm.onnx changed after the build" in result.output


@pytest.mark.slow
def test_a_graph_that_takes_no_padding_decodes_and_generates_a_batch_of_one_length(
    causal_lm: Built, tmp_path: Path
) -> None:
    """A spec whose mask is ``full`` cannot run the padded layouts in our loop; a batch of rows of
    one length still checks that the graph keeps the rows apart, step after step."""
    spec = tmp_path / "llama_causal_lm.toml"
    spec.write_text(SPEC.read_text().replace('mask = "left-padding"', 'mask = "full"'))
    result = CliRunner().invoke(
        cli,
        ["verify", str(causal_lm.out / "llama_causal_lm.onnx"), "--spec", str(spec), "--no-latency", "--decode", "2",
         "--generate", "3", "--shapes", "batch=1,seq=2,past_seq=0", "--json", str(tmp_path / "r.json")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = VerifyReport.from_dict(json.loads((tmp_path / "r.json").read_text()))
    assert [(d.scenario, d.passed) for d in report.decode] == [("batch-1", True), ("full-batch", True)]
    same = [g for g in report.generate if g.layout == "same-length" and g.runner == "onnxruntime[cpu]"]
    assert len(same) == 1 and len(same[0].prompts) == 2 and len({len(p) for p in same[0].prompts}) == 1
    assert same[0].got == same[0].expected and same[0].got[0] != same[0].got[1]


def _gemma_spec(folder: Path) -> list[Path]:
    """A tiny Gemma (heads of 32, wider than hidden / heads) whose int4 generation at seed 0
    meets a near tie of the activations' int8 codes at its first step."""
    pairs = [(i, kv) for i in range(2) for kv in ("key", "value")]
    caches = "".join(
        f'[[{side}]]\nname = "{name}.{i}.{kv}"\nshape = ["batch", 2, "{dim}", 32]\n'
        for side, name, dim in (("inputs", "past_key_values", "past_seq"), ("outputs", "present", "total_seq"))
        for i, kv in pairs
    )
    text = (
        'module = "attn_export.zoo.hf_cache:CausalLMWithCache"\nkwargs = { positions = "mask" }\n'
        'config = { class = "transformers:GemmaConfig", hidden_size = 64, num_hidden_layers = 2, '
        "num_attention_heads = 4, num_key_value_heads = 2, intermediate_size = 128, vocab_size = 128, "
        "max_position_embeddings = 128, bos_token_id = 1, eos_token_id = 2, pad_token_id = 0, "
        'attn_implementation = "sdpa", head_dim = 32, tie_word_embeddings = false }\naccept_guards = true\n'
        '[[inputs]]\nname = "input_ids"\ndtype = "int64"\nshape = ["batch", "seq"]\n'
        '[[inputs]]\nname = "attention_mask"\ndtype = "int64"\nshape = ["batch", "total_seq"]\n'
        'mask = "full"\nconvention = "binary"\n'
        '[[outputs]]\nname = "logits"\nshape = ["batch", "seq", 128]\n'
        f"{caches}[dims]\nbatch = {{ min = 1, max = 4 }}\nseq = {{ min = 1, max = 16 }}\n"
        'past_seq = { min = 0, max = 24 }\ntotal_seq = "past_seq + seq"\n'
        "[tolerance]\natol = 1e-5\nrtol = 1e-4\n[cache]\nmax_seq = 40\nextend_batch = 1\n"
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gemma.toml").write_text(text)
    return [folder / "gemma.toml"]


@pytest.mark.slow  # a build and three verifies of a 2-layer model: about 60 s
def test_an_int4_graph_that_settles_a_near_tie_the_other_way_is_green(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Its logit at the first step was 3.5e-4 from the simulation's (float32's tolerance 1e-5):
    one activation code rounded the other way, as the module's with its codes nudged by 1e-6
    rounds it. The simulation's near ties (``INT4_TIES``) are its room, recorded for golden
    mode too; a key scaled by 1.05 still fails."""
    from tests.conftest import shared_build

    made = shared_build(tmp_path_factory, "gemma-int4", _gemma_spec, variants=("static-cache+int4",))
    assert made.errors == {"gemma.static-cache+int4": None}, made.errors
    for golden in ((), ("--golden",)):
        result = _verify(str(made.out), "--models", str(made.models), "--generate", "4", *golden)
        assert result.exit_code == 0, result.output
    edited = _scale_the_second_layers_key(
        made.out / "gemma.static-cache+int4.onnx", tmp_path_factory.mktemp("k") / "k.onnx"
    )
    result = _verify(
        str(edited), "--spec", str(made.models / "gemma.toml"), "--variant", "static-cache+int4", "--generate", "4"
    )
    assert result.exit_code == 1 and "FAIL" in result.output, result.output


@pytest.mark.slow  # a build of its own beside the causal LM's (5 s)
def test_a_shard_holding_no_causal_lm_runs_without_generations(causal_lm: Built, tmp_path: Path) -> None:
    """--generate asks the run for a causal LM: a shard of a run that holds one was refused
    for holding none itself (exit 2), and a sharded CI job with --generate could not merge."""
    from attn_export.pipelines.building import BuildOptions, build_models
    from tests.conftest import copy_build, tiny_spec

    out = copy_build(causal_lm, tmp_path).out
    models = tmp_path / "models"
    shutil.copytree(TINY_ZOO, models, ignore=shutil.ignore_patterns("*.py"))
    assert build_models([tiny_spec(models)], BuildOptions(out)).exit_code == 0
    args = ["verify", str(out), "--models", str(models), "--no-latency", "--generate", "2"]
    alone = CliRunner().invoke(cli, [*args, "--shard", "3/3"])  # names sorted: tiny, after both causal LMs
    assert alone.exit_code == 0 and "across 1 models" in alone.output and "generations" not in alone.output, (
        alone.output
    )
    none = CliRunner().invoke(cli, ["verify", str(out / "tiny.onnx"), "--models", str(models), "--generate", "2"])
    assert none.exit_code == 2 and "no model of this run is one" in none.output, none.output

"""``build --target genai``: a folder onnxruntime-genai loads as it is, whose generator gives
PyTorch's tokens; a spec it could not run is one line before anything is written."""

from __future__ import annotations

import importlib.util
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from attn_export.artifacts.files import sha256_file
from attn_export.artifacts.genai_folder import genai_config, provider_note, refuse_unfit
from attn_export.artifacts.manifest import load_manifest, save_manifest
from attn_export.cli import cli
from attn_export.errors import SpecError
from attn_export.exporter.factory import build_config, instantiate
from attn_export.model_spec import load_spec
from attn_export.pipelines.check import check_paths
from tests.conftest import TINY_ZOO, Built, copy_build, needs_transformers, shared_build

pytestmark = needs_transformers
HAS_GENAI = importlib.util.find_spec("onnxruntime_genai") is not None
needs_genai = pytest.mark.skipif(not HAS_GENAI, reason="needs onnxruntime-genai (pip install -e '.[genai]')")
LM = TINY_ZOO / "llama_causal_lm.toml"


def test_the_config_is_read_from_the_spec_and_its_transformers_config() -> None:
    spec = load_spec(LM)
    document = genai_config(spec, build_config(spec))
    model, decoder = document["model"], document["model"]["decoder"]
    assert (decoder["num_hidden_layers"], decoder["num_attention_heads"], decoder["num_key_value_heads"]) == (2, 4, 2)
    assert (decoder["head_size"], decoder["hidden_size"], model["vocab_size"]) == (8, 32, 32)
    assert (model["bos_token_id"], model["eos_token_id"], model["pad_token_id"]) == (1, 2, 0)
    assert model["context_length"] == document["search"]["max_length"] == 40  # past_seq 24 + seq 16
    assert set(decoder["inputs"]) == {
        "input_ids",
        "attention_mask",
        "position_ids",
        "past_key_names",
        "past_value_names",
    }
    assert document["search"]["past_present_share_buffer"] is False
    assert document["model"]["decoder"]["session_options"]["provider_options"] == []  # genai's default: the CPU
    assert genai_config(spec, build_config(spec), "static-cache+int4")["search"]["past_present_share_buffer"] is True


@pytest.mark.parametrize(
    ("spec", "variant", "says"),
    [
        ("llama_sdpa_kv_cache", "fp32", "give the spec a logits output"),
        ("mha", "fp32", "onnxruntime-genai runs a decoder with a KV cache"),
        ("mha_kv_cache", "fp32", "the spec also takes hidden_states"),
    ],
)
def test_a_graph_genai_could_not_run_is_refused_naming_what_to_change(spec: str, variant: str, says: str) -> None:
    with pytest.raises(SpecError, match=says):
        refuse_unfit(load_spec(TINY_ZOO / f"{spec}.toml"), variant)


def test_build_refuses_before_writing_anything(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli, ["build", str(TINY_ZOO / "llama_sdpa_kv_cache.toml"), "--out", str(out), "--target", "genai"]
    )
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "give the spec a logits output" in result.output
    assert not out.exists()


def test_each_graph_gets_a_folder_with_its_config(causal_lm: Built) -> None:
    assert sorted(p.name for p in (causal_lm.out / "genai").iterdir()) == ["llama_causal_lm", "llama_causal_lm.int4"]
    for name in ("llama_causal_lm", "llama_causal_lm.int4"):
        folder = causal_lm.out / "genai" / name
        assert sorted(p.name for p in folder.iterdir()) == ["genai_config.json", "model.onnx"]
        assert (folder / "model.onnx").read_bytes() == (causal_lm.out / f"{name}.onnx").read_bytes()
        assert json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]["filename"] == "model.onnx"


def test_the_manifest_holds_each_genai_folders_hashes_and_check_finds_a_changed_file(
    causal_lm: Built, tmp_path: Path
) -> None:
    """The folder a user ships is recorded with its graph: ``check`` (and verify) hold each
    of its files to its sha256. Before, no hash was kept and a changed folder passed."""
    entry = load_manifest(causal_lm.out).models["llama_causal_lm.int4"]
    folder = causal_lm.out / "genai" / "llama_causal_lm.int4"
    assert entry.genai == {p.name: sha256_file(p) for p in folder.iterdir()}
    copy = copy_build(causal_lm, tmp_path)
    config = copy.out / "genai" / "llama_causal_lm.int4" / "genai_config.json"
    config.write_text(config.read_text().replace('"context_length": ', '"context_length": 1'))
    found = {f.model: f for f in check_paths([copy.out]).files}
    assert found["llama_causal_lm"].problems == {}
    said = found["llama_causal_lm.int4"].problems["hashes"]
    assert said.startswith("llama_causal_lm.int4: genai/llama_causal_lm.int4/genai_config.json changed after the build")
    manifest = load_manifest(copy.out)
    del manifest.models["llama_causal_lm"].genai["model.onnx"]  # an entry that leaves the graph unhashed
    save_manifest(copy.out, manifest)
    (found,) = [f for f in check_paths([copy.out]).files if f.model == "llama_causal_lm"]
    assert found.problems["hashes"] == (
        "llama_causal_lm: the manifest records no sha256 of genai/llama_causal_lm/model.onnx"
    )


@needs_genai
def test_verify_runs_the_genai_folder_the_build_wrote_held_to_its_hashes(causal_lm: Built, tmp_path: Path) -> None:
    """verify --generate runs genai's generator on the folder a user ships, not on one it
    makes from the build's graph: a graph in it that differs fails its generations (here
    the logits' weight x1.1, its hash rewritten as if built so), and a file changed after
    the build is a FAIL row naming it. Before, both passed: 16 of 16 generations."""
    copy = copy_build(causal_lm, tmp_path)
    shipped = copy.out / "genai" / "llama_causal_lm" / "model.onnx"
    proto = onnx.load(str(shipped))
    logits = next(n for n in proto.graph.node if n.output[0] == "logits")
    weight = next(t for t in proto.graph.initializer if t.name in logits.input)
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * np.float32(1.1), weight.name))
    onnx.save(proto, str(shipped))
    args = ["verify", str(copy.out / "llama_causal_lm.onnx"), "--models", str(TINY_ZOO), "--generate", "2"]
    changed = CliRunner().invoke(cli, [*args, "--no-latency"])
    assert changed.exit_code == 1, changed.output
    assert "genai/llama_causal_lm/model.onnx changed after the build: sha256" in changed.output, changed.output
    manifest = load_manifest(copy.out)
    manifest.models["llama_causal_lm"].genai["model.onnx"] = sha256_file(shipped)
    save_manifest(copy.out, manifest)
    reports = ["--junit", str(tmp_path / "r.xml"), "--markdown", str(tmp_path / "r.md")]
    faulty = CliRunner().invoke(cli, [*args, "--no-latency", *reports])
    assert faulty.exit_code == 1, faulty.output
    rows = [line for line in faulty.output.splitlines() if line.startswith("llama_causal_lm ")]
    assert any("onnxruntime-genai" in r for r in rows), faulty.output
    assert all(("FAIL" in r) == ("onnxruntime-genai" in r) for r in rows), faulty.output
    # the reports name it too: JUnit counted no failure and Markdown had no word of the generations
    command = f"attn-export verify {copy.out / 'llama_causal_lm.onnx'} --models {TINY_ZOO} --generate 2 --decode 0"
    command += " --seed 0 --no-latency"  # genai's generator runs beside any target: no --provider
    assert faulty.output.count(f"     reproduce: {command}\n") == 2, faulty.output
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == "1", ET.tostring(suite)
    failure = suite.find("testcase[@name='onnxruntime-genai']/failure")
    assert failure is not None and (failure.text or "").count(f"  reproduce: {command}") == 2
    markdown = (tmp_path / "r.md").read_text()
    assert "| llama_causal_lm | onnxruntime-genai | padded | " in markdown and markdown.count(f"`{command}`") == 2


@needs_genai
def test_a_folder_for_cuda_names_cuda_and_verify_runs_it_on_the_cpu(causal_lm: Built, tmp_path: Path) -> None:
    """fp16 deploys on a GPU: ``build --target genai --provider cuda`` writes a config genai
    loads there as it is (CUDA, graph capture off, as genai's builder writes it); before, every
    folder named the CPU and a GPU user edited it by hand. verify runs genai's generator on the
    CPU whatever the folder names: genai without CUDA refuses to load such a config."""
    copy = copy_build(causal_lm, tmp_path)
    built = CliRunner().invoke(
        cli, ["build", str(LM), "--out", str(copy.out), "--target", "genai", "--provider", "cuda", "--variant", "fp32"]
    )
    assert built.exit_code == 0, built.output
    config = json.loads((copy.out / "genai" / "llama_causal_lm" / "genai_config.json").read_text())
    assert config["model"]["decoder"]["session_options"]["provider_options"] == [{"cuda": {"enable_cuda_graph": "0"}}]
    args = ["verify", str(copy.out / "llama_causal_lm.onnx"), "--models", str(TINY_ZOO), "--generate", "2"]
    verified = CliRunner().invoke(cli, [*args, "--no-latency"])
    assert verified.exit_code == 0, verified.output
    assert sum("onnxruntime-genai" in line and "PASS" in line for line in verified.output.splitlines()) == 2


def test_an_fp16_folder_for_the_cpu_says_the_gpu_is_named_by_provider() -> None:
    assert provider_note("static-cache+gqa-rotary+fp16", "cpu") == (
        "static-cache+gqa-rotary+fp16's genai_config.json names the CPU; --provider cuda names CUDA, "
        "the GPU fp16 is for"
    )
    assert provider_note("fp16", "cuda") is None and provider_note("static-cache+int4", "cpu") is None
    spec = load_spec(LM)
    with pytest.raises(SpecError, match="no genai provider options for rocm"):
        genai_config(spec, build_config(spec), "fp32", "rocm")


def _torch_tokens(prompt: list[int], steps: int) -> list[int]:
    import torch

    model = instantiate(load_spec(LM)).model
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def _generate(folder: Path, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """onnxruntime-genai's greedy tokens per row, the shorter prompts padded on the right with 0."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    longest = max(map(len, prompts))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=longest + steps, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([p + [0] * (longest - len(p)) for p in prompts], dtype=np.int32))
    tokens: list[list[int]] = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(generator.get_next_tokens().tolist())
    return np.array(tokens).T.tolist()


@needs_genai
def test_genai_generates_pytorchs_tokens_at_batch_one_and_padded_batches(causal_lm: Built) -> None:
    """onnxruntime-genai runs the folder unchanged; at batch 2 it pads the shorter prompt on
    the right (pad token 0) and masks it, so each row gives the tokens PyTorch gives that
    prompt alone."""
    prompts = [[5, 9, 13, 17], [7, 8, 9, 10, 11, 12]]
    want = [_torch_tokens(p, 12) for p in prompts]
    assert _generate(causal_lm.out / "genai" / "llama_causal_lm", prompts, 12) == want


@needs_genai
@pytest.mark.slow  # a build of its own; make test stays under four minutes
def test_a_static_cache_graph_reads_its_length_from_the_mask_and_shares_genais_buffer(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """genai feeds no past_length: the folder's graph derives it from the mask, and genai binds
    each past and its present to one buffer of max_length positions, as its own graphs do.
    GroupQueryAttention takes several new tokens on a filled cache only at batch 1, so the
    spec declares batch 1."""
    import onnx

    def batch_one(folder: Path) -> list[Path]:
        text = LM.read_text().replace('["batch", ', "[1, ").replace("batch = { min = 1, max = 4 }", "")
        folder.mkdir(parents=True)
        (folder / LM.name).write_text(text + "\n[cache]\nmax_seq = 40\n")
        return [folder / LM.name]

    built = shared_build(tmp_path_factory, "causal-lm-static", batch_one, target="genai", variants=("static-cache",))
    assert built.errors == {"llama_causal_lm.static-cache": None}, built.errors
    folder = built.out / "genai" / "llama_causal_lm.static-cache"
    graph = onnx.load(str(folder / "model.onnx"))
    assert "past_length" not in [i.name for i in graph.graph.input]
    assert json.loads((folder / "genai_config.json").read_text())["search"]["past_present_share_buffer"] is True
    assert _generate(folder, [[5, 9, 13, 17]], 12) == [_torch_tokens([5, 9, 13, 17], 12)]


def test_a_failed_write_leaves_the_folder_that_was_there(
    causal_lm: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from attn_export.artifacts import genai_folder
    from attn_export.errors import UsageError

    spec = load_spec(LM)
    dest = tmp_path / "genai" / "model"
    genai_folder.write_genai_folder(causal_lm.out / "llama_causal_lm.onnx", spec, build_config(spec), dest)
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    real = os.replace

    def full_disk(src: object, dst: object) -> None:
        if str(src).endswith(".tmp"):  # the new folder's move into place
            raise OSError(28, "No space left on device")
        real(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(genai_folder.os, "replace", full_disk)
    with pytest.raises(UsageError, match="cannot write the genai folder .*: No space left on device"):
        genai_folder.write_genai_folder(causal_lm.out / "llama_causal_lm.int4.onnx", spec, build_config(spec), dest)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model"]  # nothing left beside it


def test_the_pad_token_is_one_the_embedding_takes() -> None:
    """GPT-2's config names 50256 as its end of sequence whatever the vocabulary: padding with
    it indexed past a tiny model's embedding (an internal error in build and verify)."""
    from transformers import GPT2Config

    from attn_export.artifacts.genai_folder import pad_token

    assert pad_token(GPT2Config(vocab_size=32), 32) == 0
    assert pad_token(GPT2Config(), 50257) == 50256
    assert pad_token(GPT2Config(vocab_size=32, pad_token_id=5), 32) == 5


def test_verify_of_a_genai_folder_points_at_its_build_and_its_graph(tmp_path: Path) -> None:
    """The folder genai loads holds no manifest: the error names the build folder above it and
    the graph to give with --spec, not a build into the deploy folder."""
    folder = tmp_path / "build" / "genai" / "llama"
    folder.mkdir(parents=True)
    (folder / "genai_config.json").write_text("{}")
    result = CliRunner().invoke(cli, ["verify", str(folder), "--models", str(TINY_ZOO)])
    assert result.exit_code == 2, result.output
    assert result.output == (
        f"Error: {folder / 'manifest.json'}: no manifest; {folder} is a folder for onnxruntime-genai: verify its "
        f"build folder {tmp_path / 'build'} (--generate runs this folder in genai's generator), or verify "
        f"{folder / 'model.onnx'} --spec <its spec>\n"
    )

"""attn-export's whole-model graphs against onnxruntime-genai's own, both run by genai's generator.

    python benchmarks/genai_decode.py                  # about five minutes on 2 cores
    python benchmarks/genai_decode.py --repeats 5      # a tighter spread

For 1 and 2 layers of a random Llama (hidden 512, 8 heads, vocabulary 256, seeded) saved as a
local checkpoint, builds in a temporary folder:

* genai's graphs: its model builder (``onnxruntime_genai.models.builder``) at fp32 and int4, CPU;
* ours: ``attn-export build --target genai`` of ``CausalLMWithCache(positions="mask")`` with
  the checkpoint's weights (the spec genai's own graphs are judged by: positions counted from
  a mask that pads nothing), fp32 and int4, each written in place (``static-cache``,
  ``static-cache+int4``: genai binds past and present to one buffer) and in genai's graph
  shape (``static-cache+gqa-rotary``, ``static-cache+gqa-rotary+int4``: rotary inside
  GroupQueryAttention, packed projections, no mask bias),

then, at 1 thread (intra- and inter-op, written into each folder's ``genai_config.json``), batch
1, times greedy decoding in genai's generator after a prompt of 128, 512 and 2048 tokens: the
milliseconds per new token over ``--tokens`` tokens. The six graphs take turns, block after
block, in each repeat; a cell is the median over repeats of each repeat's ms/token, a ratio the
median of the repeats' ratios with the lowest and highest in brackets. It also says whether each
pair generated the same tokens. Nothing here asserts: figures are printed, from one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

PASTS = (128, 512, 2048)
HIDDEN, HEADS, VOCAB = 512, 8, 256
PRECISIONS = ("fp32", "int4")
#: Our graphs by column: each precision written in place, then in genai's graph shape.
VARIANTS = {
    "fp32 in place": "static-cache",
    "int4 in place": "static-cache+int4",
    "fp32 genai shape": "static-cache+gqa-rotary",
    "int4 genai shape": "static-cache+gqa-rotary+int4",
}


def _checkpoint(folder: Path, layers: int) -> None:
    """A seeded random LlamaForCausalLM and a word-level tokenizer (the builder reads one)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        intermediate_size=4 * HIDDEN, vocab_size=VOCAB, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="t3"
    ).save_pretrained(folder)


def _genai_builder(checkpoint: Path, out: Path, precision: str) -> Path:
    subprocess.run(
        [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out),
         "-p", precision, "-e", "cpu", "-c", str(out.parent / "cache")],
        check=True, capture_output=True,
    )  # fmt: skip
    return out


def _ours(checkpoint: Path, work: Path, layers: int) -> dict[str, Path]:
    """``attn-export build --target genai`` of the checkpoint's weights, each of ``VARIANTS``."""
    import torch
    from safetensors.torch import load_file

    weights = work / "weights.pt"
    state = load_file(str(checkpoint / "model.safetensors"))
    if "lm_head.weight" not in state:  # tied: the module's state_dict holds both
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    torch.save({f"model.{k}": v for k, v in state.items()}, weights)
    head = HIDDEN // HEADS
    pasts = "".join(
        f'[[inputs]]\nname = "past_key_values.{i}.{kv}"\nshape = [1, {HEADS}, "past_seq", {head}]\n'
        for i in range(layers) for kv in ("key", "value")
    )  # fmt: skip
    presents = "".join(
        f'[[outputs]]\nname = "present.{i}.{kv}"\nshape = [1, {HEADS}, "total_seq", {head}]\n'
        for i in range(layers) for kv in ("key", "value")
    )  # fmt: skip
    models = work / "models"
    models.mkdir()
    (models / "llama.toml").write_text(
        'module = "attn_export.zoo.hf_cache:CausalLMWithCache"\nkwargs = { positions = "mask" }\n'
        f'config = {{ class = "transformers:LlamaConfig", hidden_size = {HIDDEN}, num_hidden_layers = {layers}, '
        f"num_attention_heads = {HEADS}, num_key_value_heads = {HEADS}, intermediate_size = {4 * HIDDEN}, "
        f"vocab_size = {VOCAB}, max_position_embeddings = 4096, bos_token_id = 1, eos_token_id = 2, "
        'pad_token_id = 0, attn_implementation = "sdpa" }\naccept_guards = true\n'
        f'[weights]\npath = "{weights}"\n'
        '[[inputs]]\nname = "input_ids"\ndtype = "int64"\nshape = [1, "seq"]\n'
        '[[inputs]]\nname = "attention_mask"\ndtype = "int64"\nshape = [1, "total_seq"]\n'
        'mask = "full"\nconvention = "binary"\n'
        f'{pasts}[[outputs]]\nname = "logits"\nshape = [1, "seq", {VOCAB}]\n{presents}'
        "[dims]\nseq = { min = 1, max = 2048 }\npast_seq = { min = 0, max = 2112 }\n"
        'total_seq = "past_seq + seq"\n[cache]\nmax_seq = 4160\n'
    )
    out = work / "build"
    subprocess.run(
        [sys.executable, "-m", "attn_export", "build", "--models", str(models), "--out", str(out), "--target", "genai",
         *(a for v in VARIANTS.values() for a in ("--variant", v))],
        check=True, capture_output=True,
    )  # fmt: skip
    return {name: out / "genai" / f"llama.{v}" for name, v in VARIANTS.items()}


def _one_thread(folder: Path) -> None:
    path = folder / "genai_config.json"
    config = json.loads(path.read_text())
    options = config["model"]["decoder"]["session_options"]
    options |= {"intra_op_num_threads": 1, "inter_op_num_threads": 1}
    path.write_text(json.dumps(config, indent=2))


def _decode(model: object, prompt: np.ndarray, tokens: int) -> tuple[float, list[int]]:
    """Milliseconds per new token after the prompt, and the tokens."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=prompt.shape[1] + tokens + 1)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    generator.generate_next_token()  # the prompt's step: not a new token's cost
    out = [int(generator.get_next_tokens()[0])]
    start = time.perf_counter()
    for _ in range(tokens):
        generator.generate_next_token()
        out.append(int(generator.get_next_tokens()[0]))
    return (time.perf_counter() - start) * 1e3 / tokens, out


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens timed after each prompt")
    args = parser.parse_args()
    import onnxruntime_genai as og

    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, 1 thread, batch 1, ms per new token in genai's generator")
    columns = [
        c for p in PRECISIONS for c in (f"genai {p}", f"ours {p} in place", "ratio", f"ours {p} genai shape", "ratio")
    ]
    print(f"| layers | past | {' | '.join(columns)} | same tokens as genai's |")
    print("|---" * (len(columns) + 3) + "|")
    counts: dict[int, dict[str, int]] = {}
    for layers in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            _checkpoint(work / "hf", layers)
            folders = {
                **{f"genai {p}": _genai_builder(work / "hf", work / f"genai-{p}", p) for p in PRECISIONS},
                **{f"ours {k}": v for k, v in _ours(work / "hf", work, layers).items()},
            }
            for folder in folders.values():
                _one_thread(folder)
            counts[layers] = {
                name: len(onnx.load(str(f / "model.onnx"), load_external_data=False).graph.node)
                for name, f in folders.items()
            }
            loaded = {name: og.Model(str(folder)) for name, folder in folders.items()}
            rng = np.random.default_rng(0)
            for past in PASTS:
                prompt = rng.integers(3, VOCAB, size=(1, past), dtype=np.int32)
                times: dict[str, list[float]] = {name: [] for name in loaded}
                tokens: dict[str, list[int]] = {}
                for _ in range(args.repeats):  # alternating blocks: each graph once per repeat
                    for name, model in loaded.items():
                        ms, tokens[name] = _decode(model, prompt, args.tokens)
                        times[name].append(ms)
                cells = []
                for p in PRECISIONS:
                    cells.append(f"{statistics.median(times[f'genai {p}']):.3f}")
                    for ours in (f"ours {p} in place", f"ours {p} genai shape"):
                        ratios = [o / g for o, g in zip(times[ours], times[f"genai {p}"], strict=True)]
                        cells += [f"{statistics.median(times[ours]):.3f}", _spread(ratios)]
                same = [k for k in VARIANTS if tokens[f"ours {k}"] == tokens[f"genai {k[:4]}"]]
                print(f"| {layers} | {past} | {' | '.join(cells)} | {', '.join(same) or 'none'} |", flush=True)
    for layers, nodes in counts.items():
        print(f"# nodes at {layers} layer(s): " + ", ".join(f"{name} {n}" for name, n in nodes.items()))


if __name__ == "__main__":
    main()

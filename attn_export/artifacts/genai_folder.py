"""A model folder onnxruntime-genai loads as it is: the graph and its ``genai_config.json``.

onnxruntime-genai's generator feeds a decoder only the inputs its config names
(``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.%d.key/value``) and
reads ``logits`` and ``present.%d.key/value``; it computes the mask and the positions itself,
from the prompt's pad tokens. A graph fits when it takes nothing else (no ``past_length``) and
gives ``logits``; everything the config says is read from the spec (shapes, ranges) and its
transformers config (heads, hidden size, special tokens), never from the graph's file.

The folder is written whole or not at all: into a temporary folder beside it, renamed over it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attn_export.artifacts.json_text import json_text
from attn_export.errors import SpecError, UsageError
from attn_export.model_spec import ModelSpec, variant_chain
from attn_export.model_spec.cache import MASK, POSITIONS, cache_of

if TYPE_CHECKING:
    import onnx

__all__ = [
    "CONFIG_NAME",
    "GENAI_DIR",
    "GRAPH_NAME",
    "LOGITS",
    "eos_tokens",
    "genai_config",
    "logits_vocab",
    "pad_token",
    "provider_note",
    "refuse_unfit",
    "right_padded_window",
    "special_tokens",
    "write_genai_folder",
]

CONFIG_NAME = "genai_config.json"
#: Where ``build --target genai`` writes each graph's folder, in the build folder.
GENAI_DIR = "genai"
GRAPH_NAME = "model.onnx"
LOGITS = "logits"
#: The model types onnxruntime-genai runs as a plain decoder with these inputs; any other
#: family's graph (the inputs are the same) is declared as its generic ``decoder``.
_DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "granite", "olmo")
#: A transformers config's names for the sizes the config needs, in the order tried.
_HEADS = ("num_attention_heads", "n_head", "num_heads")
_HIDDEN = ("hidden_size", "n_embd", "d_model")
#: ``session_options.provider_options`` per ``build --provider``: the CPU is genai's default;
#: CUDA with graph capture off, as genai's builder writes it (under capture genai gives a mask
#: of ``max_length`` positions, where a length read off the mask is wrong).
_PROVIDER_OPTIONS: dict[str, list[dict[str, dict[str, str]]]] = {
    "cpu": [],
    "cuda": [{"cuda": {"enable_cuda_graph": "0"}}],
}


def right_padded_window(window: int) -> str:
    """What onnxruntime-genai's padded batch does to a graph whose sliding ``window`` counts
    positions (``model_spec.cache.short_window``): a limit of that deployment, not a fault."""
    return (
        f"onnxruntime-genai pads a batch's shorter prompts on the right, and the config's sliding_window = {window} "
        "counts positions, the pad slots after a shorter prompt among them (PyTorch pads on the left): past "
        f"{window} positions such a row attends to fewer of its own tokens than alone, and its tokens may differ; "
        "batch 1 and prompts of one length are not affected"
    )


def provider_note(variant: str, provider: str) -> str | None:
    """What the folder's provider leaves to change: an fp16 graph is for a GPU, and a folder
    built for the CPU names the CPU, where genai runs it as it is, slower than in float32."""
    if provider == "cpu" and "fp16" in variant_chain(variant).lossy:
        return f"{variant}'s genai_config.json names the CPU; --provider cuda names CUDA, the GPU fp16 is for"
    return None


def refuse_unfit(spec: ModelSpec, variant: str) -> None:
    """SpecError naming what to change where onnxruntime-genai could not run ``spec``'s
    ``variant`` graph unchanged."""
    where = f"{spec.name}.{variant}" if variant != "fp32" else spec.name

    def bad(why: str) -> SpecError:
        return SpecError(f"{where}: --target genai: {why}")

    cache = cache_of(spec)
    if cache is None:
        raise bad("onnxruntime-genai runs a decoder with a KV cache: declare past_key_values.{i}.key/value inputs")
    layers = len(cache.pairs) // 2
    expected_pasts = {f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")}
    if {past for past, _ in cache.pairs} != expected_pasts:
        raise bad(
            f"onnxruntime-genai names layers 0 to N-1: declare past_key_values.0 to .{layers - 1}, each key and value"
        )
    fed = {"input_ids", MASK, POSITIONS, *(past for past, _ in cache.pairs)}
    extra = [t.name for t in spec.inputs if t.name not in fed]
    if extra:
        raise bad(f"onnxruntime-genai feeds only {', '.join(sorted(fed))}; the spec also takes {', '.join(extra)}")
    if "input_ids" not in {t.name for t in spec.inputs}:
        raise bad("onnxruntime-genai feeds token ids: declare an input_ids input")
    if MASK not in {t.name for t in spec.inputs}:
        raise bad(f"onnxruntime-genai marks padding with the mask: declare an {MASK} input [batch, total_seq]")
    outputs = {t.name: t for t in spec.outputs}
    if LOGITS not in outputs:
        raise bad(
            f"onnxruntime-genai reads the next token from {LOGITS}: give the spec a {LOGITS} output "
            "(attn_export.zoo.hf_cache:CausalLMWithCache returns it)"
        )
    if not isinstance(outputs[LOGITS].shape[-1], int):
        raise bad(f"{LOGITS}' last axis is the vocabulary: declare its size as a number")
    if spec.config is None:
        raise bad("the config names the heads and special tokens: build the module from a transformers config")


def _first(config: Any, names: tuple[str, ...], what: str, spec: ModelSpec) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise SpecError(f"{spec.name}: --target genai: the config declares no {what} ({' or '.join(names)})")


def _token(config: Any, name: str) -> int | list[int] | None:
    value = getattr(config, name, None)
    if isinstance(value, int) or (isinstance(value, list) and value and all(isinstance(v, int) for v in value)):
        return value
    return None


def eos_tokens(config: Any) -> frozenset[int]:
    """The tokens that end a sequence: ``config``'s ``eos_token_id`` (one or a list)."""
    value = _token(config, "eos_token_id")
    return frozenset([value] if isinstance(value, int) else value or [])


def special_tokens(config: Any, vocab: int) -> frozenset[int]:
    """Pad, begin and end of sequence: tokens a prompt must not hold (a generator masks a pad)."""
    bos = _token(config, "bos_token_id")
    return frozenset({pad_token(config, vocab), *eos_tokens(config), *([bos] if isinstance(bos, int) else [])})


def pad_token(config: Any, vocab: int) -> int:
    """The token a padded prompt is filled with: the config's pad token, else its (first)
    end-of-sequence token, else 0 (the mask hides it either way); one inside the ``vocab``
    the embedding takes (GPT-2's config names 50256 for a model of any vocabulary)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = _token(config, name)
        token = value if isinstance(value, int) else value[0] if value else None
        if token is not None and 0 <= token < vocab:
            return token
    return 0


def genai_config(spec: ModelSpec, config: Any, variant: str = "fp32", provider: str = "cpu") -> dict[str, Any]:
    """The ``genai_config.json`` of ``spec``'s graph, from its shapes and dim ranges and from
    ``config`` (the transformers config object the module was built from). The context
    length is the longest present the spec's ranges declare (what verify proved); greedy
    search by default; the pad token is the config's, else its end-of-sequence token; the
    session runs on ``provider`` (``_PROVIDER_OPTIONS``)."""
    refuse_unfit(spec, variant)
    if provider not in _PROVIDER_OPTIONS:
        raise SpecError(f"{spec.name}: --target genai: no genai provider options for {provider}")
    cache = cache_of(spec)
    assert cache is not None
    inputs = {t.name: t for t in spec.inputs}
    key = inputs[cache.pairs[0][0]].shape
    kv_heads, head_size = key[1], key[3]
    if not (isinstance(kv_heads, int) and isinstance(head_size, int)):
        raise SpecError(f"{spec.name}: --target genai: declare the cache's heads and head size as numbers")
    eos = _token(config, "eos_token_id")
    if eos is None:
        raise SpecError(f"{spec.name}: --target genai: the config declares no eos_token_id; set one in config")
    pad = pad_token(config, logits_vocab(spec))
    bos = _token(config, "bos_token_id")
    context = spec.dims[cache.total_dim].max
    family = str(getattr(config, "model_type", "")).replace("_", "")
    names: dict[str, str] = {"input_ids": "input_ids", "attention_mask": MASK}
    if POSITIONS in inputs:
        names["position_ids"] = POSITIONS
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": _PROVIDER_OPTIONS[provider]},
        "filename": GRAPH_NAME,
        "head_size": head_size,
        "hidden_size": _first(config, _HIDDEN, "hidden size", spec),
        "inputs": {
            **names,
            "past_key_names": "past_key_values.%d.key",
            "past_value_names": "past_key_values.%d.value",
        },
        "outputs": {LOGITS: LOGITS, "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"},
        "num_attention_heads": _first(config, _HEADS, "attention heads", spec),
        "num_hidden_layers": len(cache.pairs) // 2,  # a key and a value per layer (refuse_unfit)
        "num_key_value_heads": kv_heads,
    }
    return {
        "model": {
            "bos_token_id": bos if bos is not None else pad,
            "context_length": context,
            "decoder": decoder,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "type": family if family in _DECODER_TYPES else "decoder",
            "vocab_size": logits_vocab(spec),
        },
        "search": {
            "do_sample": False,
            "early_stopping": True,
            "max_length": context,
            "min_length": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            # a growing cache's present is a new tensor; static-cache writes into its past's buffer
            "past_present_share_buffer": variant_chain(variant).in_place,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


def logits_vocab(spec: ModelSpec) -> int:
    """The vocabulary: ``logits``' last axis."""
    size = next(t.shape[-1] for t in spec.outputs if t.name == LOGITS)
    assert isinstance(size, int)
    return size


def write_genai_folder(
    graph: Path,
    spec: ModelSpec,
    config: Any,
    dest: Path,
    variant: str = "fp32",
    edit: Callable[[onnx.ModelProto], None] | None = None,
    provider: str = "cpu",
) -> Path:
    """``dest`` holding ``graph`` as ``model.onnx`` (with its external data file, if any) and
    its ``genai_config.json`` for ``provider``; an older folder there is replaced whole, and a
    failure leaves it as it was. ``edit`` (``exporter.variants.static_cache.fed_by_genai``)
    changes the graph into one genai can feed; a ValueError from it is the graph's misfit."""
    document = genai_config(spec, config, variant, provider)
    data = _external_data(graph)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"cannot write the genai folder {dest}: a file of that name is there")
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".old", dir=dest.parent)) / dest.name
    moved = False
    try:
        if edit is None:
            shutil.copyfile(graph, staging / GRAPH_NAME)
        else:
            _write_edited(graph, staging / GRAPH_NAME, edit)
        for name, path in data.items():
            shutil.copyfile(path, staging / name)
        (staging / CONFIG_NAME).write_text(json_text(document))
        if dest.exists():
            os.replace(dest, old)
            moved = True
        os.replace(staging, dest)
        moved = False  # the new folder is in place: the old one is not to be put back
    except OSError as e:
        if moved:  # put the folder that was there back where it was
            with contextlib.suppress(OSError):
                os.replace(old, dest)
                moved = False
        raise UsageError(f"cannot write the genai folder {dest}: {e.strerror or e}") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if not moved:  # else the only copy of the folder that was there: left beside it
            shutil.rmtree(old.parent, ignore_errors=True)
    return dest


def _write_edited(graph: Path, dest: Path, edit: Callable[[onnx.ModelProto], None]) -> None:
    """``graph`` at ``dest`` with ``edit`` made; its external data, if any, stays in the
    files copied beside it."""
    import onnx

    proto = onnx.load(str(graph), load_external_data=False)
    try:
        edit(proto)
    except ValueError as e:
        raise UsageError(f"{graph}: not a graph onnxruntime-genai can feed: {e}") from None
    onnx.save(proto, str(dest))


def _external_data(graph: Path) -> Mapping[str, Path]:
    """The files beside ``graph`` its initializers name as external data (a graph over 2 GB)."""
    import onnx

    proto = onnx.load(str(graph), load_external_data=False)
    names = {
        entry.value for tensor in proto.graph.initializer for entry in tensor.external_data if entry.key == "location"
    }
    for name in names:
        if Path(name).name != name:
            raise UsageError(f"{graph}: external data {name!r} is not a file beside the graph; refusing to copy it")
    return {name: graph.parent / name for name in sorted(names)}

"""Hugging Face decoders with their cache as flat tensors, the form ONNX Runtime users feed.

A ``DynamicCache`` is a Python object, not a tensor: these wrappers build one from the
``past_key_values.{i}.key/value`` inputs and return its layers as ``present.{i}.*``, so the
exported graph has the inputs and outputs Optimum and onnxruntime-genai expect. They take
any decoder whose model uses transformers' cache classes (GPT-2, Llama, Mistral, Qwen2,
Phi-3, GPT-NeoX, Gemma2, Bloom, ...), with any number of layers: the config names the
model, as ``AutoModel`` / ``AutoModelForCausalLM`` map it.

``DecoderWithCache`` returns the base model's last hidden state; ``CausalLMWithCache`` the
language-model head's ``logits``, the whole model a generator runs.

By default every layer keeps its whole cache, as a plain ``DynamicCache()`` does: a
sliding-window model (Mistral) still masks by its window, and each present grows by every
token. ``cache_from_config=True`` builds the cache from the config, as ``generate()`` does: a
sliding-window layer then keeps only its newest ``sliding_window - 1`` positions, which its
spec declares as ``[cache] window`` (``model_spec.cache``).

``positions="mask"`` takes no ``position_ids`` input: each token's position is counted from
the mask as ``generate()`` counts it (real tokens before it, from 0), the form of
onnxruntime-genai's model builder graphs, whose attention derives positions from the mask.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

__all__ = ["CausalLMWithCache", "DecoderWithCache"]

#: Where the positions come from: a ``position_ids`` input, or counted from the mask.
POSITIONS = ("input", "mask")
#: The cache layers whose whole state is one key and one value tensor (flat, as ONNX feeds them).
_FLAT_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")


def _layers(config: Any) -> int:
    count = getattr(config, "num_hidden_layers", getattr(config, "n_layer", None))
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"{type(config).__name__} declares no layer count (num_hidden_layers): got {count!r}")
    return count


def _refuse_stateful(model: type) -> None:
    """A model that keeps a recurrent state (Mamba) has no key/value cache to flatten: said
    before it is built, which may fail for another reason (no sdpa for it)."""
    if getattr(model, "_is_stateful", False):
        raise ValueError(
            f"{model.__name__} keeps a recurrent state, not a key/value cache; export its decoder "
            "with a wrapper of your own that passes that state as tensors"
        )


def _refuse_unflat_cache(model: nn.Module, config: Any) -> None:
    """A model whose cache is more than a key and a value per layer (a state-space or linear
    attention layer, an indexed cache) cannot be fed as flat past/present tensors."""
    from transformers import DynamicCache

    _refuse_stateful(type(model))
    kinds = {type(layer).__name__ for layer in DynamicCache(config=config).layers}
    odd = sorted(kinds - set(_FLAT_LAYERS))
    if odd:
        raise ValueError(
            f"{type(model).__name__}'s cache has {', '.join(odd)} layers, which hold more than one key and one "
            f"value tensor; these wrappers flatten {' and '.join(_FLAT_LAYERS)} only"
        )


class _FlatCache(nn.Module):
    """A transformers model of ``config`` fed its cache as flat tensors, any number of layers."""

    def __init__(self, config: Any, auto: str, output: str, cache_from_config: bool, positions: str) -> None:
        super().__init__()
        import transformers

        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {', '.join(map(repr, POSITIONS))}, got {positions!r}")
        self.positions = positions

        self.layers = _layers(config)
        factory = getattr(transformers, auto)
        known = getattr(factory, "_model_mapping", {})
        mapped = known.get(type(config), ())
        for model in mapped if isinstance(mapped, tuple) else (mapped,):  # a config may map to several
            _refuse_stateful(model)
        try:
            self.model = factory.from_config(config)
        except ValueError as e:
            raise ValueError(
                f"{auto} has no model for {type(config).__name__}: {str(e).splitlines()[0]}; "
                "give the config of a decoder transformers can build"
            ) from None
        _refuse_unflat_cache(self.model, config)
        self.output = output
        self.cache_from_config = cache_from_config

    def forward(self, input_ids: Tensor, attention_mask: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        from transformers import DynamicCache

        if self.positions == "input":
            position_ids, *past = rest
        else:  # the token's index among the real tokens, the last ``seq`` of them new
            past = list(rest)
            counted = attention_mask.long().cumsum(-1) - 1
            position_ids = counted.clamp(min=0)[:, -input_ids.shape[1] :]
        if len(past) != 2 * self.layers:
            inputs = "input_ids, attention_mask" + (", position_ids" if self.positions == "input" else "")
            counted = ' (kwargs = { positions = "mask" } counts positions from the mask instead)'
            raise ValueError(
                f"{self.layers} layers take {inputs}, then {2 * self.layers} past tensors "
                f"(past_key_values.{{i}}.key/value), got {len(rest)} inputs after attention_mask"
                + (counted if self.positions == "input" else "")
            )
        cache = DynamicCache(config=self.model.config) if self.cache_from_config else DynamicCache()
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        presents = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (getattr(out, self.output), *presents)


class DecoderWithCache(_FlatCache):
    """The base model of ``config`` (``AutoModel.from_config``: LlamaModel for a LlamaConfig,
    MistralModel for a MistralConfig, ...), its cache flat: forward takes ``input_ids``,
    ``attention_mask`` (1 = attend, left padding allowed), ``position_ids`` and each layer's
    past key and value in layer order; it returns the last hidden state and each layer's
    present key and value. ``cache_from_config``: the cache the config makes (a
    sliding-window layer trims), else one that keeps every position. ``positions``: "input"
    (a ``position_ids`` input after the mask) or "mask" (none: counted from the mask)."""

    def __init__(self, config: Any, cache_from_config: bool = False, positions: str = "input") -> None:
        super().__init__(config, "AutoModel", "last_hidden_state", cache_from_config, positions)


class CausalLMWithCache(_FlatCache):
    """The causal language model of ``config`` (``AutoModelForCausalLM.from_config``:
    LlamaForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel, ...) as ``DecoderWithCache`` feeds
    it, returning ``logits`` ``[batch, seq, vocab]`` and each layer's present key and value:
    the whole model a generator (onnxruntime-genai's, ``verify --generate``) runs."""

    def __init__(self, config: Any, cache_from_config: bool = False, positions: str = "input") -> None:
        super().__init__(config, "AutoModelForCausalLM", "logits", cache_from_config, positions)

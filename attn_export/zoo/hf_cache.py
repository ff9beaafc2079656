"""Hugging Face decoders with their cache as flat tensors, the form ONNX Runtime users feed.

A ``DynamicCache`` is a Python object, not a tensor: this wrapper builds one from the
``past_key_values.{i}.key/value`` inputs and returns its layers as ``present.{i}.*``, so the
exported graph has the inputs and outputs Optimum and onnxruntime-genai expect. It takes any
decoder whose base model uses transformers' cache classes (GPT-2, Llama, Mistral, Qwen2,
Gemma, ...): the config names the model, as ``AutoModel`` maps it.

By default every layer keeps its whole cache, as a plain ``DynamicCache()`` does: a
sliding-window model (Mistral) still masks by its window, and each present grows by every
token. ``cache_from_config=True`` builds the cache from the config, as ``generate()`` does: a
sliding-window layer then keeps only its newest ``sliding_window - 1`` positions, which its
spec declares as ``[cache] window`` (``spec.cache``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

__all__ = ["DecoderWithCache"]


class DecoderWithCache(nn.Module):
    """The one-layer base model of ``config`` (``AutoModel.from_config``: LlamaModel for a
    LlamaConfig, MistralModel for a MistralConfig, ...), its cache flat: forward takes
    ``input_ids``, ``attention_mask`` (1 = attend, left padding allowed), ``position_ids``
    and the layer's past key and value; it returns the last hidden state and the layer's
    present key and value. (torch.export matches dynamic shapes to named parameters, so
    the layer count is fixed by the signature.) ``cache_from_config``: the cache the config
    makes (a sliding-window layer trims), else one that keeps every position."""

    def __init__(self, config: Any, cache_from_config: bool = False) -> None:
        super().__init__()
        from transformers import AutoModel

        layers = getattr(config, "num_hidden_layers", getattr(config, "n_layer", None))
        if layers != 1:
            raise ValueError(f"{type(self).__name__} takes one layer, got {layers} in {type(config).__name__}")
        self.model = AutoModel.from_config(config)
        self.cache_from_config = cache_from_config

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, past_key: Tensor, past_value: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config) if self.cache_from_config else DynamicCache()
        cache.update(past_key, past_value, 0)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        layer = out.past_key_values.layers[0]
        return out.last_hidden_state, layer.keys, layer.values

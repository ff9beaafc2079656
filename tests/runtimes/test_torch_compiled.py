"""torch.compile's runtime: a compiler that fails is one line naming the backend's own error."""

from __future__ import annotations

import pytest

from attn_export.errors import RuntimeFailure
from attn_export.exporter.factory import instantiate
from attn_export.model_spec import load_spec
from attn_export.model_spec.inputs import make_feeds
from attn_export.runtimes.torch_compiled import CompiledTorchRuntime
from tests.conftest import tiny_spec


@pytest.mark.slow
def test_a_failing_compile_is_one_line_with_inductors_own_error(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    def planted(*args: object, **kwargs: object) -> None:
        raise RuntimeError("planted: no kernel\nsecond line")

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", planted)
    spec = load_spec(tiny_spec(tmp_path))
    with CompiledTorchRuntime(instantiate(spec), spec.inputs, spec.outputs, threads=1) as runtime:
        feeds = make_feeds(spec, {"batch": 1, "seq": 4, "kv_seq": 5}, 0)
        with pytest.raises(RuntimeFailure) as caught:
            runtime.prepare(feeds)
    assert str(caught.value) == "torch.compile[cpu]: compiling failed: RuntimeError: planted: no kernel"

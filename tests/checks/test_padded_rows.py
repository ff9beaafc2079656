"""Rows the module masks itself: a query row whose own token is padding may attend to
nothing under the module's own causal or window mask (a left-padded prompt), where PyTorch's
sdpa and any graph differ. Such rows are fully masked rows under the spec's rule: left out
under fully_masked = "ignore" (saying how many and why), and under "match" a failure found
only there says so."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from attn_export.artifacts.golden import GoldenCase, Sight
from attn_export.checks.fully_masked import padded_rows_agree
from attn_export.cli import cli
from attn_export.errors import ArtifactError
from attn_export.model_spec import load_spec
from tests.conftest import write_spec


class LeftPaddedCausalAttention(torch.nn.Module):
    """Self-attention through SDPA with a boolean mask: causal and key padding together, so
    a left-padded row has no key at all."""

    def __init__(self, hidden: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        mask = causal[None, None] & keep[:, None, None, :]
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, h))


class WrongOnKeylessRows(LeftPaddedCausalAttention):
    """Its exported graph adds 1 to the rows that see no key, where PyTorch gives 0: it
    differs there alone, and no rewrite of its Softmax mends that."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        y = super().forward(x, keep)
        if torch.compiler.is_exporting():
            y = torch.where((keep.cumsum(-1) == 0)[..., None], y + 1, y)
        return y


SPEC = f"""
module = "{__name__}:LeftPaddedCausalAttention"
{{rule}}
[[inputs]]
name = "x"
shape = ["batch", "seq", 16]
[[inputs]]
name = "keep"
dtype = "bool"
shape = ["batch", "seq"]
mask = "left-padding"
[[outputs]]
name = "y"
shape = ["batch", "seq", 16]
[dims]
batch = {{ min = 1, max = 3 }}
seq = {{ min = 1, max = 12 }}
"""


SPEC_MODULE = "LeftPaddedCausalAttention"


def _npy(value: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, value)
    return buf.getvalue()


def _build_and_verify(
    tmp_path: Path, rule: str, module: str = SPEC_MODULE, padding: str = "left-padding", body: str = SPEC
) -> tuple[object, object]:
    models = tmp_path / "models"
    text = body.replace("{rule}", rule).replace(SPEC_MODULE, module).replace('"left-padding"', f'"{padding}"')
    write_spec(models, "padded", text)
    built = CliRunner().invoke(cli, ["build", "--models", str(models), "--out", str(tmp_path / "out")])
    if built.exit_code:
        return built, None
    args = ["verify", str(tmp_path / "out"), "--models", str(models), "--no-latency"]
    return built, CliRunner().invoke(cli, args)


def test_padded_rows_under_match_are_repaired_to_give_pytorchs_result(tmp_path: Path) -> None:
    """PyTorch's sdpa gives 0 on a left-padded row and the graph does not: build rewrites the
    graph's Softmax before its smoke check, and verify compares every row."""
    built, verified = _build_and_verify(tmp_path, "")
    assert built.exit_code == 0, built.output
    info = json.loads((tmp_path / "out" / "manifest.json").read_text())["models"]["padded"]["variant_info"]
    assert info["fully_masked"]["repair"]["gives"] == "0"
    assert verified.exit_code == 0, verified.output
    assert "not compared" not in verified.output


def test_padded_rows_of_a_single_sequence_are_repaired_too(tmp_path: Path) -> None:
    """At batch 1 no mask case applies (a fully padded sequence would pad the only one):
    the golden cases' own padded rows show what each side gives, and build repairs the
    graph from them. Before, its smoke check failed on those rows: a false red on Hugging
    Face's decoders declared at batch 1."""
    built, verified = _build_and_verify(tmp_path, "", body=ONE_SEQUENCE)
    assert built.exit_code == 0, built.output
    info = json.loads((tmp_path / "out" / "manifest.json").read_text())["models"]["padded"]["variant_info"]
    assert info["fully_masked"]["repair"]["gives"] == "0"
    assert {"torch": "0", "onnxruntime": "mean of V"} in info["fully_masked"]["cases"].values()
    assert verified.exit_code == 0, verified.output
    assert "not compared" not in verified.output


#: The spec of one sequence: its mask ``[1, seq]`` (key padding beside inputs of batch 1).
ONE_SEQUENCE = SPEC.replace('shape = ["batch", "seq"', 'shape = [1, "seq"').replace("batch = { min = 1, max = 3 }", "")
#: Beside its attention's output, a sum over its rows.
POOLED = ONE_SEQUENCE.replace("{rule}", "") + '[[outputs]]\nname = "pooled"\nshape = [1, 16]\n'


def test_outputs_agree_on_padded_rows_only_where_every_output_does(tmp_path: Path) -> None:
    """localize leaves the rows that see no key out of its regions where the outputs agree
    on them: an output with those rows is compared there, one without them (a sum over the
    rows, which holds what they gave) whole. Judging only the first, a fault in the padded
    rows of the attention that reaches only the sum was blamed on the sum."""
    spec = load_spec(write_spec(tmp_path, "pooled", POOLED))
    keep = np.array([[False, False, True, True]])
    rng = np.random.default_rng(0)
    y, pooled = rng.standard_normal((1, 4, 16)).astype(np.float32), rng.standard_normal((1, 16)).astype(np.float32)
    case = GoldenCase("distinct", {"seq": 4}, {"x": y, "keep": keep}, {"y": y, "pooled": pooled})
    case.sights["keep"] = Sight(None, 0)  # causal: the two padded rows see no key
    tolerances = spec.tolerances("fp32")
    assert padded_rows_agree(spec, case, {"y": y, "pooled": pooled}, tolerances)
    other_padded = y.copy()
    other_padded[0, :2] += 1
    assert not padded_rows_agree(spec, case, {"y": other_padded, "pooled": pooled}, tolerances)
    assert padded_rows_agree(spec, case, {"y": y + keep[..., None].astype(np.float32), "pooled": pooled}, tolerances)
    assert not padded_rows_agree(spec, case, {"y": y, "pooled": pooled + 1}, tolerances)


@pytest.mark.slow  # a build (4 s); the repair beside it is make test's
def test_padded_rows_that_differ_fail_a_match_spec_saying_they_are_padding(tmp_path: Path) -> None:
    built, _ = _build_and_verify(tmp_path, "", module="WrongOnKeylessRows")
    assert built.exit_code == 1, built.output
    assert "[smoke] padded: smoke check at" in built.output
    assert (
        "every difference is in 2 padded query rows (padding that sees no real token under the module's own "
        "causal mask or window); "
        'set fully_masked = "ignore" in the spec to leave them out' in built.output
    )


@pytest.mark.slow  # a build and a verify (8 s); the window's beside it is make test's
def test_an_ignore_spec_builds_and_verifies_leaving_out_only_the_padded_rows(tmp_path: Path) -> None:
    built, verified = _build_and_verify(tmp_path, 'fully_masked = "ignore"')
    assert built.exit_code == 0, built.output
    assert verified.exit_code == 0, verified.output
    assert 'fully_masked = "ignore": ' in verified.output and "padded query rows not compared" in verified.output


class WrongOnPaddedTokens(torch.nn.Module):
    """A non-causal encoder whose exported graph doubles the rows of padded tokens: those
    rows still see every real token, so they are real rows and the fault is real."""

    def __init__(self, hidden: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(hidden, heads, batch_first=True)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        y = self.attention(x, x, x, key_padding_mask=~keep, need_weights=False)[0]
        if torch.compiler.is_exporting():
            y = torch.where(keep[..., None], y, 2 * y)
        return y


class TokenEncoder(torch.nn.Module):
    """An encoder fed token ids: its queries see later tokens, which only a change of the
    later ids shows."""

    def __init__(self, hidden: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, hidden)
        self.attention = torch.nn.MultiheadAttention(hidden, heads, batch_first=True)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.attention(x, x, x, key_padding_mask=~keep, need_weights=False)[0]


TOKEN_SPEC = SPEC.replace(
    'name = "x"\nshape = ["batch", "seq", 16]', 'name = "ids"\ndtype = "int64"\nshape = ["batch", "seq"]'
)


@pytest.mark.parametrize("padding", [pytest.param("padding", marks=pytest.mark.slow), "left-padding"])
def test_ignore_leaves_out_no_padded_row_that_sees_a_real_token(tmp_path: Path, padding: str) -> None:
    """An encoder's padded rows see real tokens: after them (right padding), and before
    them too, since its queries see later tokens (left padding, where a causal reading of
    "no real token at or before it" would call them keyless). So "ignore" compares them,
    and a graph wrong there fails; only a sequence with no real token at all is left out."""
    built, _ = _build_and_verify(tmp_path, 'fully_masked = "ignore"', "WrongOnPaddedTokens", padding)
    assert built.exit_code == 1, built.output
    assert "[smoke] padded: smoke check at" in built.output and "outside atol" in built.output


class WindowedEncoder(LeftPaddedCausalAttention):
    """Self-attention where each query sees the two tokens either side of it, and the key
    padding: a window of its own, which no [cache] declares."""

    reach = 2

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        positions = torch.arange(s, device=x.device)
        near = (positions[:, None] - positions[None, :]).abs() <= self.reach
        mask = near[None, None] & keep[:, None, None, :]
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, h))


class DistanceBiasedEncoder(LeftPaddedCausalAttention):
    """An encoder with a distance bias (ALiBi's, steep) and no window: among many keys a far
    one weighs nothing a float32 sum can hold, yet where padding leaves only far real keys,
    they carry the whole row."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        positions = torch.arange(s, device=x.device)
        bias = -8.0 * (positions[:, None] - positions[None, :]).abs().float()
        bias = bias[None, None].masked_fill(~keep[:, None, None, :], float("-inf"))
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, s, h))


class GloballyShiftedCausal(LeftPaddedCausalAttention):
    """Causal attention whose softmax shift is the largest score over every key, later ones
    too: causal in its arithmetic, not in its bits."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / h**0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        weights = torch.exp(scores - scores.amax(-1, keepdim=True)) * (causal[None] & keep[:, None, :])
        return self.out((weights / weights.sum(-1, keepdim=True)) @ v)


class WideWindowedEncoder(WindowedEncoder):
    """A window wider than the short probe's tokens: only a probe as long as the cases finds it."""

    reach = 14


#: Room for right padding longer than the wide window.
WIDE_SPEC = SPEC.replace("seq = { min = 1, max = 12 }", "seq = { min = 1, max = 40 }")
#: A sequence long enough that a far token's weight in a row falls below the tolerance.
LONG_LOOSE_SPEC = (
    SPEC.replace("seq = { min = 1, max = 12 }", "seq = { min = 1, max = 256 }") + "[tolerance]\natol = 1e-2\n"
)


@pytest.mark.parametrize(
    ("module", "body", "seen", "keep", "keyless"),
    [
        ("LeftPaddedCausalAttention", SPEC, (None, 0), "..xx....", "11000000"),
        ("LeftPaddedCausalAttention", WIDE_SPEC, (None, 0), "..xx" + "." * 28, "11" + "0" * 30),
        ("LeftPaddedCausalAttention", LONG_LOOSE_SPEC, (None, 0), "..xx" + "." * 252, "11" + "0" * 254),
        ("WrongOnPaddedTokens", SPEC, (None, None), "..xx....", "00000000"),
        ("TokenEncoder", TOKEN_SPEC, (None, None), "..xx....", "00000000"),  # ids change as vectors do
        ("WindowedEncoder", SPEC, (2, 2), "xx......", "00001111"),
        ("WideWindowedEncoder", WIDE_SPEC, (14, 14), "xx" + "." * 30, "0" * 16 + "1" * 16),
        ("DistanceBiasedEncoder", WIDE_SPEC, (None, None), "xx" + "." * 30, "0" * 32),
        ("GloballyShiftedCausal", SPEC, (None, 0), "..xx....", "11000000"),
    ],
    ids=[
        "causal",
        "long-causal",
        "faint-causal",
        "encoder",
        "token-ids",
        "window",
        "wide-window",
        "distance-bias",
        "shifted-causal",
    ],
)
def test_which_padded_rows_see_no_key_follows_what_the_module_sees(
    tmp_path: Path, module: str, body: str, seen: tuple[int | None, int | None], keep: str, keyless: str
) -> None:
    """PyTorch says which positions a query sees, probed at a few tokens and then as far as
    the cases judged; the golden file keeps the answer, and the padded rows left without a
    key follow it (a sequence with no real token has none)."""
    from attn_export.artifacts.golden import GoldenCase, Sight, read_golden, write_golden
    from attn_export.checks.causality import sights
    from attn_export.checks.fully_masked import padded_tokens
    from attn_export.exporter.factory import instantiate
    from attn_export.model_spec import load_spec
    from attn_export.runtimes.torch_eager import TorchRuntime

    spec = load_spec(write_spec(tmp_path, "padded", body.replace("{rule}", "").replace(SPEC_MODULE, module)))
    sizes = {"batch": 2, "seq": len(keep)}
    with TorchRuntime(instantiate(spec), spec.inputs, spec.outputs, spec.dims) as eager:
        assert sights(spec, eager, {"batch": 2, "seq": 2}, [sizes]) == {"keep": Sight(*seen)}
    mask = np.array([[c == "x" for c in keep], [False] * len(keep)])
    write_golden(tmp_path / "g.npz", [GoldenCase("c", sizes, {"keep": mask}, sights={"keep": Sight(*seen)})])
    [case] = read_golden(tmp_path / "g.npz")
    rows = padded_tokens(spec, case)
    assert rows is not None and rows[1].all()
    assert "".join("1" if r else "0" for r in rows[0]) == keyless
    # a case that records no sight counts every position as seen;
    # a sight that is not one is refused
    with zipfile.ZipFile(tmp_path / "g.npz", "a") as zf:
        zf.writestr("c/sight/bad.npy", _npy(np.asarray([1, -2])))
    with pytest.raises(ArtifactError, match="entry 'c/sight/bad' is not a sight: two ints of -1 or more"):
        read_golden(tmp_path / "g.npz")
    unseen = padded_tokens(spec, GoldenCase("c", sizes, {"keep": mask}))
    assert unseen is not None and unseen[1].all() and not unseen[0].any()


@pytest.mark.parametrize(
    ("module", "body", "length", "keyless"),
    [
        ("WindowedEncoder", SPEC, 8, 4),  # rows 4-7 see no real token within 2 of theirs
        pytest.param("WideWindowedEncoder", WIDE_SPEC, 32, 16, marks=pytest.mark.slow),  # rows 16-31, within 14
    ],
    ids=["window", "wide-window"],
)
def test_a_window_of_the_modules_own_under_ignore_leaves_out_only_rows_out_of_its_sight(
    tmp_path: Path, module: str, body: str, length: int, keyless: int
) -> None:
    """Right padding longer than the module's own window: the rows it leaves no key are
    left out (not failed, as when every padded row after a real one counted as seeing it),
    in golden mode too, where the user's recorded inputs are judged by what the build
    recorded the module sees; a window wider than the short probe included."""
    from attn_export.exporter.factory import instantiate
    from attn_export.model_spec import load_spec
    from attn_export.runtimes.torch_eager import TorchRuntime

    built, verified = _build_and_verify(tmp_path, 'fully_masked = "ignore"', module, "padding", body)
    assert built.exit_code == 0, built.output
    assert verified.exit_code == 0, verified.output
    spec = load_spec(tmp_path / "models" / "padded.toml")
    feeds = {"x": np.random.default_rng(0).standard_normal((1, length, 16), dtype=np.float32)}
    feeds["keep"] = np.array([[True, True] + [False] * (length - 2)])
    with TorchRuntime(instantiate(spec), spec.inputs, spec.outputs, spec.dims) as eager:
        outputs = eager.run(feeds)
    recorded = tmp_path / "recorded.npz"
    with zipfile.ZipFile(recorded, "w") as zf:
        for section, arrays in (("inputs", feeds), ("outputs", outputs)):
            for name, value in arrays.items():
                zf.writestr(f"real/{section}/{name}.npy", _npy(value))
    args = ["verify", str(tmp_path / "out"), "--golden", "--inputs", str(recorded), "--no-latency"]
    golden = CliRunner().invoke(cli, args)
    assert golden.exit_code == 0, golden.output
    assert f'fully_masked = "ignore": {keyless} padded query rows not compared' in golden.output


def test_sights_are_read_from_a_build_and_never_from_recorded_inputs(tmp_path: Path) -> None:
    """Golden mode takes what a query sees from the build's golden file, whose cases must
    agree; a file of recorded inputs is inputs and outputs: a sight in it is not read."""
    from attn_export.artifacts.golden import GoldenCase, Sight, read_sights, write_golden
    from attn_export.artifacts.recorded import read_recorded
    from attn_export.model_spec import load_spec

    spec = load_spec(write_spec(tmp_path, "padded", SPEC.replace("{rule}", "")))
    sizes, keep = {"batch": 1, "seq": 4}, {"keep": np.ones((1, 4), dtype=bool)}
    cases = [GoldenCase(c, sizes, keep, sights={"keep": Sight(None, s)}) for c, s in (("a", 0), ("b", 0))]
    write_golden(tmp_path / "agree.npz", cases)
    assert read_sights(tmp_path / "agree.npz", spec) == {"keep": Sight(None, 0)}
    cases[1] = GoldenCase("b", sizes, keep, sights={"keep": Sight(None, None)})
    write_golden(tmp_path / "differ.npz", cases)
    with pytest.raises(ArtifactError, match="its cases record different sights under mask 'keep'"):
        read_sights(tmp_path / "differ.npz", spec)
    with zipfile.ZipFile(tmp_path / "differ.npz", "a") as zf:
        zf.writestr("a/sight/bad.npy", _npy(np.zeros((512, 512))))  # refused from its header
    with pytest.raises(ArtifactError, match="entry 'a/sight/bad' is not a sight"):
        read_sights(tmp_path / "differ.npz", spec)
    assert [c.sights for c in read_recorded(tmp_path / "differ.npz", 2**30)] == [{}, {}]

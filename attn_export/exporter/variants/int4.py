"""int4: ONNX Runtime's ``MatMulNBitsQuantizer`` on MatMuls (4-bit weights in blocks of 32
along the reduced axis, symmetric; accuracy level 4: on a CPU the activations rounded to int8
per block and the products in integers), the quantization onnxruntime-genai deploys on CPU."""

from __future__ import annotations

import logging
from typing import Any

import onnx
import onnx.numpy_helper

from attn_export.errors import ExportFailure
from attn_export.exporter.cache_in_op import fresh_prefixes
from attn_export.exporter.packed_projections import keep_records, packed_records, projections
from attn_export.exporter.variants import VariantGraph, op_counts
from attn_export.exporter.variants.ort_past import keep_live
from attn_export.runtimes import Target
from attn_export.runtimes.int8_rounding import INT4_ACCURACY_LEVEL, INT4_BLOCK
from attn_export.runtimes.ort import KIND as ORT_KIND


def make(proto: onnx.ModelProto, provider: str) -> VariantGraph:
    """Symmetric blocks at accuracy level 4, as the simulated rounding (``in_int8(bits=4)``)
    rounds them and genai's model builder makes them for a CPU: its int8 kernels take half
    the time of the float32 ones at one token a step, and a right graph differs from the
    module by the weights' and activations' rounding alone."""
    DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer = _quantizer()
    _matmuls_of_gemms(proto)
    _transposed_weights(proto)
    records = packed_records(proto)  # the quantizer rewrites proto in place, dropping them
    quantizer_log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = quantizer_log.level
    quantizer_log.setLevel(logging.ERROR)  # it logs every MatMul it quantizes or skips
    try:
        config = DefaultWeightOnlyQuantConfig(
            block_size=INT4_BLOCK, is_symmetric=True, accuracy_level=INT4_ACCURACY_LEVEL
        )
        quantizer = MatMulNBitsQuantizer(proto, algo_config=config)
        quantizer.process()
        out = quantizer.model.model
    finally:
        quantizer_log.setLevel(level)
    counts = op_counts(out)
    if not counts.get("com.microsoft.MatMulNBits"):
        raise ExportFailure("variant int4: no MatMul has a constant weight to quantize (MatMulNBits needs one)")
    keep_records(records, out)  # localization still takes the packed projection apart
    info = {
        "quantized": (
            f"MatMul weights int4, symmetric blocks of {INT4_BLOCK}, accuracy level {INT4_ACCURACY_LEVEL} "
            "(int8 activations on a CPU)"
        ),
        "ops": dict(counts),
    }
    return VariantGraph(out, info)


def _quantizer() -> tuple[Any, Any]:
    """ONNX Runtime's int4 quantizer and its config, imported with the root logger left as it
    was: its module calls ``logging.basicConfig(level=INFO)`` on import, and every export
    after it printed hundreds of onnxscript INFO lines."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer
    finally:
        root.setLevel(level)
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
    return DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer


def _matmuls_of_gemms(proto: onnx.ModelProto) -> None:
    """Each plain ``Gemm`` of a constant weight (``A @ B + C``: GPT-2's ``Conv1D`` is
    ``torch.addmm``) as a MatMul and an Add, in place, so that the quantizer, which takes
    MatMuls alone, quantizes it: before, a GPT-2 int4 graph had its LM head quantized and
    every projection of its layers left in float32. The simulation rounds ``addmm`` alike."""
    constant = {t.name for t in proto.graph.initializer}
    nodes = []
    for node in proto.graph.node:
        if not _plain_gemm(node, constant):
            nodes.append(node)
            continue
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        product = f"{node.output[0]}_matmul" if bias else node.output[0]
        matmul = onnx.helper.make_node("MatMul", node.input[:2], [product], name=f"{node.name}_matmul")
        matmul.metadata_props.extend(node.metadata_props)
        nodes.append(matmul)
        if bias:
            add = onnx.helper.make_node("Add", [product, bias], [node.output[0]], name=f"{node.name}_bias")
            add.metadata_props.extend(node.metadata_props)
            nodes.append(add)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)


def _transposed_weights(proto: onnx.ModelProto) -> None:
    """Each MatMul whose weight is a ``Transpose`` of a 2-D constant given that transposed
    constant itself, in place, so that the quantizer, which takes a constant weight alone,
    quantizes it: a language-model head tied to the embedding (Gemma2, Bloom, Llama with
    ``tie_word_embeddings``) reads the table the Gather reads through a Transpose, was left
    in float32 and its int4 build failed the smoke check, the module rounding it. The table
    stays for the Gather; the head gets an int4 copy, as onnxruntime-genai's builder unties it."""
    inputs = {i.name for i in proto.graph.input}  # an initializer listed as an input may be fed instead
    constants = {t.name: t for t in proto.graph.initializer if t.name not in inputs}
    made = {n.output[0]: n for n in proto.graph.node if n.op_type == "Transpose" and not n.domain}
    prefixes = fresh_prefixes(proto, "int4_transposed")
    copies: dict[str, str] = {}  # each table's transposed copy, under a name no value has
    for node in proto.graph.node:
        transpose = made.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if transpose is None or transpose.input[0] not in constants:
            continue
        table = constants[transpose.input[0]]
        perm = [list(a.ints) for a in transpose.attribute if a.name == "perm"]
        if len(table.dims) != 2 or perm not in ([], [[1, 0]]):
            continue
        if table.name not in copies:
            copies[table.name] = f"{next(prefixes)}/{table.name}"
            weight = onnx.numpy_helper.to_array(table).T.copy()
            proto.graph.initializer.append(onnx.numpy_helper.from_array(weight, copies[table.name]))
        node.input[1] = copies[table.name]
    if copies:  # the Transposes no node reads now go, and a table no node reads either
        keep_live(proto, list(proto.graph.node))


def _plain_gemm(node: onnx.NodeProto, constant: set[str]) -> bool:
    """``A @ B + C`` with ``B`` a constant: no scale, no transpose."""
    if node.op_type != "Gemm" or node.domain or len(node.input) < 2 or node.input[1] not in constant:
        return False
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    scaled = attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0
    return not scaled and not attrs.get("transA", 0) and not attrs.get("transB", 0)


#: MatMulNBits' accuracy levels at which a CPU computes in float (0: unset, the quantizer's
#: default; 1: float32): the weights rounded alone.
FLOAT_LEVELS = (0, 1)


def int4_compute(proto: onnx.ModelProto) -> str | None:
    """How a CPU computes every MatMulNBits of a graph where the simulation of int4 stands
    for it to float32 noise (``in_int8(bits=4)``): ``"int8"`` at accuracy level
    ``INT4_ACCURACY_LEVEL`` (the activations rounded to int8 per block, the products in
    integers), ``"float"`` at levels 0 and 1 (the weights alone rounded,
    ``activations=False``); None where one is not 4 bits in symmetric blocks of
    ``INT4_BLOCK`` (no zero points), where their levels differ, or where there is none."""
    found = set()
    for node in (n for n in proto.graph.node if n.op_type == "MatMulNBits"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        level = attrs.get("accuracy_level", 0)
        shaped = attrs.get("bits", 0) == 4 and attrs.get("block_size", 0) == INT4_BLOCK
        if not shaped or (len(node.input) > 3 and node.input[3]):
            return None
        found.add("int8" if level == INT4_ACCURACY_LEVEL else "float" if level in FLOAT_LEVELS else None)
    return found.pop() if len(found) == 1 else None


def quantized_projections(proto: onnx.ModelProto) -> int:
    """How many of the module's projections a graph's MatMulNBits compute (a packed one each
    it packs): the matmuls a simulation standing for the graph rounds."""
    return sum(projections(n) for n in proto.graph.node if n.op_type == "MatMulNBits")


def simulated_on(target: Target, proto: onnx.ModelProto) -> bool:
    """Whether ``target`` computes ``proto``'s int4 as the simulation rounds it, to float32
    noise: ONNX Runtime's CPU provider, every MatMulNBits as ``int4_compute`` takes it. CUDA
    computes int4 in float with kernels of its own, not measured against it."""
    return (target.runtime, target.provider) == (ORT_KIND.name, "cpu") and int4_compute(proto) is not None

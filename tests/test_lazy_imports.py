"""--help stays fast: the CLI imports neither torch nor onnxruntime until a command needs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_cli_help_imports_no_heavy_dependency() -> None:
    code = (
        "import sys\n"
        "from attn_export.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = sorted(m for m in ('torch', 'onnxruntime', 'onnxscript', 'onnx') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "HEAVY []"
    assert "Commands:" in done.stdout and "verify" in done.stdout and "bench" in done.stdout


def test_check_imports_neither_torch_nor_onnxruntime(tmp_path: Path) -> None:
    """The pre-commit hook's command stays static: it parses graphs, it never runs one."""
    code = (
        "import sys\n"
        "from onnx import TensorProto, helper, save\n"
        "from attn_export.cli import main\n"
        "x = helper.make_tensor_value_info('x', TensorProto.FLOAT, ['batch', 4])\n"
        "y = helper.make_tensor_value_info('y', TensorProto.FLOAT, ['batch', 4])\n"
        "graph = helper.make_graph([helper.make_node('Relu', ['x'], ['y'])], 'g', [x], [y])\n"
        f"save(helper.make_model(graph, opset_imports=[helper.make_opsetid('', 18)]), {str(tmp_path / 'g.onnx')!r})\n"
        "try:\n"
        f"    main(['check', {str(tmp_path / 'g.onnx')!r}])\n"
        "except SystemExit as e:\n"
        "    print('EXIT', e.code)\n"
        "print('HEAVY', sorted(m for m in ('torch', 'onnxruntime', 'onnxscript') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.strip().splitlines()[-2:] == ["EXIT 0", "HEAVY []"], done.stdout + done.stderr

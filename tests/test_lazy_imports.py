"""--help stays fast: the CLI imports neither torch nor onnxruntime until a command needs them."""

from __future__ import annotations

import subprocess
import sys

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

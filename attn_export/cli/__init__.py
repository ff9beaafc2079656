"""The command line: a thin layer over the library. Commands parse, call one library
function, and render; one module per command, their shared options in ``options``, the
group and its error mapping in ``group``.

Every command turns the library's errors into one line on stderr and an exit code
(0 success, 1 a check failed, 2 bad usage or input); ``--debug`` shows the traceback.
"""

from __future__ import annotations

# Each command module registers its command on the group when imported.
from attn_export.cli import bench, build, check, inspect, list, localize, replay, report, verify  # noqa: F401
from attn_export.cli.group import cli, main
from attn_export.cli.options import MAX_SLOWDOWN

__all__ = ["MAX_SLOWDOWN", "cli", "main"]

"""Peak resident memory of one runner, measured in a fresh process so runners do not mix.

Run as ``python -m attn_export.pipelines.bench.memory SPEC_JSON`` by ``peak_rss_mb``; it
loads the runner (``torch`` or a runtime of the registry), runs it once on the given
sizes, and prints its peak RSS in MiB.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["peak_rss_mb"]


def peak_rss_mb(request: dict[str, Any], timeout_s: float = 300) -> float | None:
    """Peak RSS (MiB) of running ``request`` once in a child process; None if it failed."""
    done = subprocess.run(
        [sys.executable, "-m", "attn_export.pipelines.bench.memory", json.dumps(request)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        return None
    try:
        return float(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def _run(request: dict[str, Any]) -> None:
    from attn_export.model_spec import spec_from_dict
    from attn_export.model_spec.inputs import make_feeds

    spec = spec_from_dict(request["spec"], folder=Path(request["folder"]) if request["folder"] else None)
    feeds = make_feeds(spec, request["sizes"], 0)
    if request["runner"] == "torch":
        from attn_export.exporter.factory import instantiate
        from attn_export.runtimes.torch_eager import TorchRuntime

        runtime: Any = TorchRuntime(instantiate(spec), spec.inputs, spec.outputs, threads=request["threads"])
    else:
        from attn_export.runtimes import RUNTIMES

        kind = RUNTIMES[request["runner"]]
        (target,) = kind.targets([request["provider"]])
        unranged = dataclasses.replace(spec, dims={})  # bench may measure beyond the declared ranges
        runtime = kind.make(
            Path(request["file"]), unranged, target, request["threads"], request["budget"], request["timeout"]
        )
    with runtime:
        runtime.prepare(feeds)()
    print(_peak_rss_kib() / 1024)


def _peak_rss_kib() -> float:
    """VmHWM belongs to this process image alone; ru_maxrss can carry the parent's peak
    across fork and exec."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1])
    except OSError:
        pass
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


if __name__ == "__main__":
    _run(json.loads(sys.argv[1]))

"""Cells on a Ray cluster: ``$RAY_ADDRESS`` names one (``ray start --head`` prints it),
else a local cluster is started for the run and stopped after it.

Every node reads the build folder and the checkout's specs at the paths the driver gives
(a shared filesystem), and imports attn-export and the spec's modules from its own
installation, as a shard's machine does.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

from attn_export._deps import require
from attn_export.errors import UsageError, first_line

__all__ = ["RayExecutor"]

T = TypeVar("T")
#: A cluster's address: host:port, or a Ray Client's ray://host:port.
_ADDRESS = re.compile(r"(?:ray://)?(?P<host>[^:/]+|\[[^\]]+\]):(?P<port>\d+)/?")


#: An HTTP/2 client's connection preface and an empty SETTINGS frame: a gRPC server (a
#: Ray cluster's GCS, a Ray Client server) answers with its own SETTINGS frame.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4


def _answer(sock: socket.socket, size: int) -> bytes:
    """Up to ``size`` bytes the peer sends before it closes or the socket's timeout."""
    data = b""
    try:
        while len(data) < size and (chunk := sock.recv(size - len(data))):
            data += chunk
    except OSError:
        pass
    return data


def _check_reachable(address: str, wait_s: float = 10.0) -> None:
    """UsageError unless a gRPC server answers at ``address`` (``$RAY_ADDRESS``): ray.init
    waits minutes, printing its own retries, on an address where no cluster runs or where
    something else listens (a web server on the port)."""
    m = _ADDRESS.fullmatch(address)
    if m is None:
        return  # no address (a local cluster), or "auto": ray.init says what is wrong
    hint = "start one with `ray start --head` and give the address it prints, or unset RAY_ADDRESS for a local cluster"
    try:
        with socket.create_connection((m["host"].strip("[]"), int(m["port"])), timeout=wait_s) as sock:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return  # a TLS cluster answers a ClientHello, not cleartext HTTP/2: reached is all we learn
            sock.sendall(_HTTP2_HELLO)
            frame = _answer(sock, 9)
    except OSError as e:
        raise UsageError(
            f"--executor ray: no Ray cluster answers at $RAY_ADDRESS={address} ({e.strerror or e}); {hint}"
        ) from None
    if len(frame) < 9 or frame[3] != _SETTINGS:
        said = f"it answered {frame[:9]!r}" if frame else "it said nothing"
        raise UsageError(
            f"--executor ray: something listens at $RAY_ADDRESS={address}, but not a Ray cluster ({said}, where a "
            f"cluster's gRPC server answers HTTP/2); {hint}"
        )


def _in_driver_folder(folder: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` run from the driver's working directory, so that the paths
    the user typed (``verify build``) name on the node what they name on the driver; a
    worker starts in Ray's session folder."""
    try:
        os.chdir(folder)
    except OSError as e:
        raise UsageError(
            f"--executor ray: node {socket.gethostname()} has no folder {folder} (the working directory the run "
            f"started in: {e.strerror}); every node must see the build folder and specs at the driver's paths"
        ) from None
    return fn(*args, **kwargs)


class RayExecutor(Executor):
    """A ``concurrent.futures.Executor`` whose ``submit`` runs the function as a Ray task
    (one CPU each; ``jobs`` caps the cells in flight at once, default: as many as the
    cluster schedules). ``exclusive``: each task takes every CPU of one node, the nodes in
    turn, so that a timing never shares a machine with another cell."""

    def __init__(self, jobs: int | None = None, exclusive: bool = False) -> None:
        self._ray = require("ray", "--executor ray")
        self._started = not self._ray.is_initialized()
        if self._started:
            # ray.init reads $RAY_ADDRESS itself; without it, it starts a local cluster.
            address = os.environ.get("RAY_ADDRESS", "")
            _check_reachable(address)
            try:
                self._ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
            except Exception as e:  # noqa: BLE001 - Ray raises its own classes and ValueError alike
                where = f" at $RAY_ADDRESS={address}" if address else ""
                raise UsageError(f"--executor ray: cannot join the Ray cluster{where}: {first_line(e)}") from e
        self._jobs = jobs
        self._remote: Any = None
        self._in_flight: list[Future[Any]] = []
        self._refs: list[Any] = []
        self._nodes = self._whole_nodes() if exclusive else []
        self._submitted = 0

    def _whole_nodes(self) -> list[dict[str, Any]]:
        """Per alive node with CPUs, the task options that take all of it."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return [
            {
                "num_cpus": node["Resources"]["CPU"],
                "scheduling_strategy": NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
            }
            for node in self._ray.nodes()
            if node.get("Alive") and node.get("Resources", {}).get("CPU")
        ]

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if self._jobs:
            self._in_flight = [f for f in self._in_flight if not f.done()]
            while len(self._in_flight) >= self._jobs:
                self._in_flight.pop(0).exception()  # wait for the oldest
        if self._remote is None:
            self._remote = self._ray.remote(num_cpus=1, max_retries=0)(_in_driver_folder)
        remote = self._remote
        if self._nodes:
            remote = remote.options(**self._nodes[self._submitted % len(self._nodes)])
        self._submitted += 1
        ref = remote.remote(os.getcwd(), fn, *args, **kwargs)
        self._refs.append(ref)
        future: Future[T] = ref.future()
        self._in_flight.append(future)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        for ref in self._refs if cancel_futures else []:
            self._ray.cancel(ref)  # a task not started never starts; one running is stopped
        for future in self._in_flight if wait else []:
            future.exception()
        if self._started:
            self._ray.shutdown()

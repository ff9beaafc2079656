"""ONNX Runtime, on one execution provider, with a check that the session really uses it.

``load_session`` is the one place an InferenceSession is made: verify, build's smoke
check, variants, inspect and bench all go through it. Each session gets a CPU arena of its
own that cannot grow past the memory budget: a graph that asks for more fails in one line
instead of taking the machine's memory. A graph read from a file (a build folder from
elsewhere) is first loaded in a forked child: a graph that crashes ONNX Runtime itself fails
in one line instead of killing the process.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import os
import re
import signal
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from attn_export.errors import (
    ArtifactError,
    InputError,
    OptionError,
    ProviderError,
    RuntimeFailure,
    RunTimeout,
    first_line,
)
from attn_export.model_spec import DimRange, ModelSpec, TensorSpec
from attn_export.model_spec.memory import ENV, format_bytes, memory_budget
from attn_export.runtimes.base import RUN_TIMEOUT_S, Runtime, RuntimeKind, check_feeds
from attn_export.runtimes.static_cache import StaticCache, capacity_for
from attn_export.runtimes.target import PROVIDERS, Target

if TYPE_CHECKING:
    from attn_export.runtimes.decoders import Decoder, DecodeWindow
    from attn_export.runtimes.placement import Placement

__all__ = [
    "KIND",
    "MAX_TIMEOUT_S",
    "RUN_TIMEOUT_S",
    "OnnxRuntime",
    "available_providers",
    "check_timeout",
    "crash_on_load",
    "load_session",
    "require_provider",
    "run_bounded",
]

#: The longest limit taken: a day. Past it a limit is a typo, and a timer that far out
#: overflows.
MAX_TIMEOUT_S = 86400.0

_LEVELS = {"disabled": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED"}
#: What ONNX Runtime says when an allocation would take its arena past ``max_mem``.
#: GroupQueryAttention's refusal of several new tokens on a filled cache at batch > 1 (CPU),
#: and what to declare where a generator never feeds such a step.
_GQA_EXTEND = "batch_size must be 1 when sequence_length > 1 and past context is given"
_GQA_EXTEND_HINT = (
    " (a generator feeds such a graph a prompt on an empty cache, then one token a step: declare "
    "[cache] extend_batch = 1 in the spec to judge it on the steps it is fed)"
)
_ARENA_FULL = re.compile(
    r"running (?P<op>\w+) node.*Available memory of (?P<free>\d+) is smaller than requested bytes of (?P<asked>\d+)"
)


def available_providers() -> list[str]:
    """Short names of the providers this onnxruntime build offers."""
    import onnxruntime as ort

    by_ep = {p.execution_provider: name for name, p in PROVIDERS.items()}
    return [by_ep.get(p, p) for p in ort.get_available_providers()]


def require_provider(provider: str) -> str:
    """The ONNX Runtime name of ``provider``; ProviderError if this build lacks it."""
    import onnxruntime as ort

    if provider not in PROVIDERS:
        raise ProviderError(f"unknown provider '{provider}' (known: {', '.join(PROVIDERS)})")
    info = PROVIDERS[provider]
    if info.execution_provider not in ort.get_available_providers():
        hint = f" ({info.install_hint})" if info.install_hint else ""
        raise ProviderError(
            f"provider '{provider}' is not available in this onnxruntime; available: "
            f"{', '.join(available_providers())}{hint}"
        )
    return info.execution_provider


def _source(model: Path | bytes) -> str | bytes:
    """What InferenceSession gets: ONNX Runtime takes paths only as UTF-8, so a model in a
    folder named in another encoding is passed as bytes (unless it has external data,
    which ONNX Runtime finds only next to a path)."""
    if isinstance(model, bytes):
        return model
    path = str(model)
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        pass
    import onnx

    from attn_export.artifacts.files import read_regular
    from attn_export.artifacts.onnx_file import external_data_files

    data = read_regular(model)
    if external_data_files(onnx.load_from_string(data)):
        raise ArtifactError(f"{model}: ONNX Runtime cannot open a path that is not UTF-8 (rename the folder)")
    return data


def _register_arena(budget: int) -> None:
    """Make ``budget`` the cap of the CPU arena that the next session created with
    ``session.use_env_allocators`` takes. The environment holds one such arena at a time;
    a session keeps the one it took, and a new one replaces it in the environment."""
    import onnxruntime as ort

    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(info, ort.OrtArenaCfg({"max_mem": budget}))


def crash_on_load(
    model: Path | bytes, provider: str = "cpu", wait_s: float = 1800.0, level: str | None = None
) -> str | None:
    """How ONNX Runtime dies making a session of ``model`` (killed by a signal, or hung past
    ``wait_s``), tried in a forked child: a crash inside it (a segfault in a graph
    optimizer) then fails one graph, not the process and every graph after it. None where
    the child lives, also where the load fails with an error (the real load reports it),
    and where there is no fork."""
    if not hasattr(os, "fork"):
        return None
    with warnings.catch_warnings():  # the child only loads a session and exits at once
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            pid = os.fork()
        except OSError:  # no memory or processes left to try it: the real load is the test
            return None
    if pid == 0:
        try:
            faulthandler.disable()  # the crash is the parent's to report, once
            load_session(model, provider, level=level, probe=False)
        finally:
            os._exit(0)
    deadline, done = time.monotonic() + wait_s, (0, 0)
    try:
        while not (done := os.waitpid(pid, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                return f"hung for {wait_s:g} s"
            time.sleep(0.01)
    except ChildProcessError:  # SIGCHLD ignored: the child was reaped unseen, its end unknown
        return None
    finally:
        if not done[0]:  # hung, or the wait was interrupted: no child is left behind
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    status = done[1]
    return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status) else None


#: How ONNX Runtime fared making a session of each file (or bytes), provider and level in
#: a forked child (``crash_on_load``): each is tried once a process.
_PROBED: dict[tuple[object, ...], str | None] = {}


def _refuse_crash(model: Path | bytes, provider: str, level: str | None, label: str, what: str) -> None:
    """RuntimeFailure if making a session of ``model`` kills ONNX Runtime (``crash_on_load``)."""
    if isinstance(model, Path):
        try:
            st = model.stat()
        except OSError:
            return  # the real load says what is wrong with the path
        key: tuple[object, ...] = (os.path.realpath(model), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    else:
        key = (hashlib.sha256(model).hexdigest(),)
    key += (provider, level)
    if key not in _PROBED:
        _PROBED[key] = crash_on_load(model, provider, level=level)
    crash = _PROBED[key]
    if crash:
        raise RuntimeFailure(
            f"{label}: cannot load {what}: ONNX Runtime {crash} making a session of it (a crash inside ONNX "
            "Runtime, not an error it reports)"
        )


def load_session(
    model: Path | bytes,
    provider: str = "cpu",
    *,
    budget: int | None = None,
    threads: int | None = None,
    level: str | None = None,
    optimized_path: Path | None = None,
    no_fallback: bool = False,
    profile_prefix: Path | None = None,
    spinning: bool = True,
    probe: bool | None = None,
) -> Any:
    """An InferenceSession on ``provider`` alone; RuntimeFailure if it cannot load or
    silently runs elsewhere.

    ``budget`` caps the session's CPU arena, which holds the tensors its runs make (default:
    ``memory_budget()``, the caller's budget without a spec); ``threads`` pins intra-op
    threads (inter-op 1); ``level`` is disabled/basic/extended (ORT's default otherwise);
    ``optimized_path`` saves the optimized graph there;
    ``no_fallback`` makes a node without a kernel on the provider fail the load;
    ``profile_prefix`` turns on ONNX Runtime's per-node profiling; ``spinning=False``
    stops idle intra-op threads from spinning after a run, so they do not steal the cores
    from PyTorch timed in the same process; ``probe`` (default: for a file, on the CPU)
    first makes the session in a forked child, so that a graph crashing ONNX Runtime fails
    in one line (not on CUDA: a child forked after CUDA started cannot use it).
    """
    import onnxruntime as ort

    ep = require_provider(provider)
    options = ort.SessionOptions()
    options.log_severity_level = 4  # failures raise with their message; no log lines
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    if level is not None:
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _LEVELS[level])
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile_prefix)
    if no_fallback and provider != "cpu":
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    options.add_session_config_entry("session.use_env_allocators", "1")
    label = f"onnxruntime[{provider}]"
    what = model.name if isinstance(model, Path) else "the graph"
    if isinstance(model, Path) and provider == "cpu" if probe is None else probe:
        _refuse_crash(model, provider, level, label, what)
    cap = budget or memory_budget()
    _register_arena(cap)  # this session's arena...
    try:
        session = ort.InferenceSession(_source(model), sess_options=options, providers=[ep])
    except Exception as e:
        raise RuntimeFailure(f"{label}: cannot load {what}: {first_line(e)}") from e
    finally:
        _register_arena(cap)  # ...is the session's alone, and its memory goes with the session
    used = session.get_providers()
    if not used or used[0] != ep:
        raise RuntimeFailure(f"{label}: session fell back to {', '.join(used) or 'no provider'} instead of {ep}")
    return session


def check_timeout(timeout_s: Any, what: str = "timeout_s") -> float:
    """``timeout_s`` as seconds, or OptionError naming the option ``what`` (each face words it
    as it calls it): a limit that is no number, or not above 0 and at most ``MAX_TIMEOUT_S``,
    would stop every run at once or none."""
    number = isinstance(timeout_s, int | float) and not isinstance(timeout_s, bool)
    if not (number and 0 < timeout_s <= MAX_TIMEOUT_S):  # nan fails both comparisons
        refused = f"{{{what}}}: give seconds above 0 and at most {MAX_TIMEOUT_S:g}, not {{value!r}}"
        raise OptionError(refused, [what], value=timeout_s)
    return float(timeout_s)


def _has_loop(proto: Any) -> bool:
    """Whether a model's graph or functions (or a graph's, or a function's, nodes' subgraphs:
    an If's branches) hold a Loop."""
    parts = [proto.graph, *proto.functions] if hasattr(proto, "graph") else [proto]
    for part in parts:
        for node in part.node:
            subgraphs = [g for a in node.attribute for g in ([a.g] if a.HasField("g") else []) + list(a.graphs)]
            if node.op_type == "Loop" or any(_has_loop(g) for g in subgraphs):
                return True
    return False


_T = TypeVar("_T")


def run_bounded(
    session: Any, names: Sequence[str], feeds: Mapping[str, np.ndarray], timeout_s: float
) -> list[np.ndarray]:
    """``session.run``, stopped after ``timeout_s`` seconds (``bounded``)."""
    return list(bounded(lambda options: session.run(list(names), dict(feeds), options), timeout_s))


def bounded(run: Callable[[Any], _T], timeout_s: float) -> _T:
    """``run(options)``, a call of a session given these RunOptions, stopped after
    ``timeout_s`` seconds by ONNX Runtime's terminate flag (which a Loop checks at each
    iteration): RunTimeout, whose message says the limit; any other failure raises as ONNX
    Runtime raised it."""
    import onnxruntime as ort

    options = ort.RunOptions()
    options.log_severity_level = 4  # the failure raises with its message; no log line
    timer = threading.Timer(timeout_s, setattr, (options, "terminate", True))
    timer.start()
    try:
        return run(options)
    except Exception as e:
        if options.terminate:
            raise RunTimeout(f"ran past {timeout_s:g} s and was stopped (a Loop without end?)") from e
        raise
    finally:
        timer.cancel()


class OnnxRuntime(Runtime):
    """An InferenceSession pinned to one provider; a fallback to another provider fails.
    ``budget`` caps its CPU arena (``load_session``): a run that needs more is an InputError."""

    def __init__(
        self,
        model: Path | bytes,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        dims: Mapping[str, DimRange] | None = None,
        *,
        provider: str = "cpu",
        budget: int | None = None,
        threads: int | None = None,
        spinning: bool = True,
        capacity: int | None = None,
        timeout_s: float = RUN_TIMEOUT_S,
    ) -> None:
        super().__init__(inputs, outputs, dims)
        #: How long a run of a graph holding a Loop may take (``run_bounded``).
        self.timeout_s = timeout_s
        #: A cache updated in place (``runtimes.static_cache``): the buffer's positions.
        self.capacity = capacity
        self.static: StaticCache | None = None
        self.model = model
        self.provider = provider
        self.budget = budget or memory_budget()
        self.threads = threads
        self.spinning = spinning
        self.name = f"onnxruntime[{provider}]"
        self.session: Any = None
        #: Whether each present of a static cache is written into its past's buffer (``StaticCache.in_place``).
        self._in_place: bool | None = None
        #: A file's graph holding a Loop runs bounded (``run_bounded``), and once one run was
        #: stopped the next say so at once: a Loop without end would hold each case for the limit.
        self._loops = False

    def _activate(self) -> None:
        from attn_export.artifacts.onnx_file import load_model_file

        require_provider(self.provider)
        # a file is read first: that refuses corrupt files and external data outside its folder
        proto = load_model_file(self.model) if isinstance(self.model, Path) else None
        self.session = load_session(
            self.model, self.provider, budget=self.budget, threads=self.threads, spinning=self.spinning
        )
        self._loops = proto is not None and _has_loop(proto)
        self.static = StaticCache.from_metadata(self.session.get_modelmeta().custom_metadata_map)
        if self.static is not None:  # read from the graph once, not for each decoder
            import onnx

            if proto is None:
                assert isinstance(self.model, bytes)
                proto = onnx.load_from_string(self.model)
            self._in_place = self.static.in_place(proto)

    def _deactivate(self) -> None:
        self.session = None

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self.session is not None
        names = [t.name for t in self.outputs]
        static = self.static
        graph_feeds = self._graph_feeds(feeds, static)
        self._refuse_once_stopped()
        try:
            run = self._run_static if static is not None else self._plain_run
            values = run(names, graph_feeds)
        except RunTimeout as e:
            raise self._stopped_by(e) from e
        except RuntimeFailure:
            raise
        except Exception as e:
            full = _ARENA_FULL.search(first_line(e))
            if full:
                asked, free = format_bytes(int(full["asked"])), format_bytes(int(full["free"]))
                raise InputError(
                    f"{self.name}: {full['op']} asked for {asked}, over the {free} left of the memory budget of "
                    f"{format_bytes(self.budget)}; narrow the dims or raise --max-memory (or ${ENV}, or max_memory "
                    "in the spec)"
                ) from e
            hint = _GQA_EXTEND_HINT if _GQA_EXTEND in first_line(e) else ""
            raise RuntimeFailure(f"{self.name}: inference failed: {first_line(e)}{hint}") from e
        outputs = dict(zip(names, values, strict=True))
        if static is None:
            return outputs
        misfit = static.misfit(feeds, outputs, self.buffer_capacity)
        if misfit:
            raise RuntimeFailure(f"{self.name}: {misfit}")
        return static.filled((self.inputs, self.outputs, self.dims), feeds, outputs)

    def _plain_run(self, names: list[str], graph_feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """``session.run``; for a graph holding a Loop, stopped at the run limit."""
        assert self.session is not None
        if self._loops:
            return run_bounded(self.session, names, graph_feeds, self.timeout_s)
        return list(self.session.run(names, dict(graph_feeds)))

    def _run_static(self, names: list[str], graph_feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """A run in the shared-buffer mode; where it fails, a plain run (separate past and
        present) says why: a present that does not fit its buffer, or a graph that runs
        only with separate buffers (both failures)."""
        assert self.session is not None and self.static is not None
        try:
            return self._run_shared(names, graph_feeds)
        except RunTimeout:
            raise
        except Exception as shared:
            values = self._plain_run(names, graph_feeds)  # raises where the graph fails anyway
            misfit = self.static.misfit(graph_feeds, dict(zip(names, values, strict=True)), self.buffer_capacity)
            reason = misfit or f"it runs with separate past and present, not with one buffer: {first_line(shared)}"
            raise RuntimeFailure(f"{self.name}: {reason}") from shared

    def _run_shared(self, names: list[str], graph_feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """A run of a graph updating its cache in place as it is deployed: each past and its
        present bound to one buffer (ONNX Runtime's shared-buffer mode, where the attention
        appends in the past's memory), the other outputs ONNX Runtime's own."""
        import onnxruntime as ort

        assert self.session is not None and self.static is not None
        device = "cuda" if self.provider == "cuda" else "cpu"
        binding = self.session.io_binding()
        values = {
            n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), device, 0) for n, a in graph_feeds.items()
        }
        for name, value in values.items():
            binding.bind_ortvalue_input(name, value)
        buffers = {present: values[past] for past, present in self.static.pairs}
        for name in names:
            if name in buffers:
                binding.bind_ortvalue_output(name, buffers[name])
            else:
                binding.bind_output(name, device)
        session = self.session
        if self._loops:
            bounded(lambda options: session.run_with_iobinding(binding, options), self.timeout_s)
        else:
            session.run_with_iobinding(binding)
        return [v.numpy().copy() for v in binding.get_outputs()]

    @property
    def buffer_capacity(self) -> int:
        """Positions of a static cache's buffers (``static_cache.capacity_for``)."""
        assert self.static is not None
        return capacity_for(self.capacity, self.dims, self.outputs, self.static)

    def _graph_feeds(self, feeds: Mapping[str, np.ndarray], static: StaticCache | None) -> dict[str, np.ndarray]:
        """The graph's feeds for the spec's ``feeds``: the same, or for a cache updated in
        place (``static``, as the session's metadata records it), pasts in NaN-poisoned buffers."""
        if static is None:
            return dict(feeds)
        return static.feeds(feeds, capacity_for(self.capacity, self.dims, self.outputs, static))

    def prepare(self, feeds: Mapping[str, np.ndarray]) -> Callable[[], object]:
        """On CUDA, bind inputs and outputs on the device (IOBinding) so no copy is timed; a
        cache updated in place gets its buffers once, outside the timed call."""
        check_feeds(feeds, self.inputs, self.dims)
        assert self.session is not None
        session = self.session
        graph_feeds = self._graph_feeds(feeds, self.static)
        if self._loops:  # timed unbounded (a timer would be timed with each call): one bounded run first
            self._run(feeds)
        if self.provider != "cuda":
            plain = self.static is not None or self._loops
            return (lambda: session.run(None, graph_feeds)) if plain else super().prepare(feeds)
        import onnxruntime as ort

        binding = self.session.io_binding()
        for name, arr in graph_feeds.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr, "cuda", 0))
        for t in self.outputs:
            binding.bind_output(t.name, "cuda")

        def call() -> None:
            session.run_with_iobinding(binding)
            binding.synchronize_outputs()

        return call

    def placement(self, feeds: Mapping[str, np.ndarray]) -> Placement:
        """Where ONNX Runtime runs each node: one run of a session of its own with per-node
        profiling on (a profiled run is slower, so never one that is timed), read from the
        profile it writes into a temporary folder (``runtimes.placement``)."""
        from attn_export.artifacts.onnx_file import load_model_file
        from attn_export.runtimes import placement

        check_feeds(feeds, self.inputs, self.dims)
        ep = require_provider(self.provider)
        loops = isinstance(self.model, Path) and _has_loop(load_model_file(self.model))
        with tempfile.TemporaryDirectory(prefix="attn-export-profile-") as tmp:
            session = load_session(
                self.model,
                self.provider,
                budget=self.budget,
                threads=self.threads,
                profile_prefix=Path(tmp) / "profile",
                spinning=False,
            )
            static = StaticCache.from_metadata(session.get_modelmeta().custom_metadata_map)
            graph_feeds = self._graph_feeds(feeds, static)
            names = [o.name for o in session.get_outputs()]
            try:
                if loops:
                    run_bounded(session, names, graph_feeds, self.timeout_s)
                else:
                    session.run(names, graph_feeds)
            except Exception as e:
                raise RuntimeFailure(f"{self.name}: the profiled run failed: {first_line(e)}") from e
            path = Path(session.end_profiling())
            return placement.placement_from_profile(placement.read_profile(path), ep)

    def decoder(self, plan: DecodeWindow) -> Decoder:
        """Inputs and outputs bound (IOBinding): the presents stay ONNX Runtime's own. A graph
        holding a Loop takes its first step here through ``run``, bounded by the run limit; its
        timed steps are not (a timer would be timed with each), as ``prepare``'s runs."""
        from attn_export.runtimes.decoders import FeedbackDecoder, OrtDecoder

        if self._loops:
            FeedbackDecoder(self, plan).step()

        if self.static is not None:
            return OrtDecoder(
                self.session, self, plan, self.provider, self.static, self.buffer_capacity, self._in_place
            )
        return OrtDecoder(self.session, self, plan, self.provider)


def _make(
    model: Path | bytes,
    spec: ModelSpec,
    target: Target,
    threads: int | None,
    budget: int,
    timeout_s: float = RUN_TIMEOUT_S,
) -> Runtime:
    # Timed against PyTorch in one process: idle threads must not spin and steal its cores.
    provider = target.provider or "cpu"
    return OnnxRuntime(
        model,
        spec.inputs,
        spec.outputs,
        spec.dims,
        provider=provider,
        budget=budget,
        threads=threads,
        spinning=False,
        capacity=spec.cache_max_seq,
        timeout_s=timeout_s,
    )


KIND = RuntimeKind(
    name="onnxruntime",
    make=_make,
    providers=tuple(PROVIDERS),
    timed=True,
    help="ONNX Runtime on --provider (each provider its own target)",
    short="ort",
)

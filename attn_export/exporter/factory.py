"""Instantiate a spec's PyTorch module: import it, build its config object if it has one,
construct it, load its weights, eval mode, and call it as the spec says (``adapter``).

Used by build (to export) and verify (to rebuild the original with the same weights).
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

from attn_export._deps import OPTIONAL, missing, require
from attn_export.errors import SpecError, first_line
from attn_export.model_spec import ModelSpec

__all__ = ["adapt", "build_config", "instantiate", "resolve_object"]


def _forget_other_copy(module_name: str, search_path: str | None) -> None:
    """A module that lives in the spec's folder is imported afresh: another spec's folder
    may hold a module of the same name, and the file may have been edited since."""
    if search_path is None or module_name not in sys.modules:
        return
    base = Path(search_path).joinpath(*module_name.split("."))
    if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
        for name in [n for n in sys.modules if n == module_name or n.startswith(module_name + ".")]:
            del sys.modules[name]


def resolve_object(spec: ModelSpec, target: str) -> Any:
    """Import ``package.module:Attr`` (a class or a factory function), searching the spec's
    own folder first."""
    module_name, _, attr_path = target.partition(":")
    _forget_other_copy(module_name, spec.search_path)
    added = spec.search_path is not None and spec.search_path not in sys.path
    if added:
        sys.path.insert(0, spec.search_path)  # type: ignore[arg-type]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top in OPTIONAL:
            raise missing(top, f"{spec.name} ({target})") from e
        raise SpecError(f"{spec.name}: cannot import module '{module_name}': {e}") from e
    except (Exception, SystemExit) as e:  # a user module may raise anything at import, or exit
        raise SpecError(f"{spec.name}: importing '{module_name}' raised {type(e).__name__}: {e}") from e
    finally:
        if added:
            sys.path.remove(spec.search_path)  # type: ignore[arg-type]
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise SpecError(f"{spec.name}: module '{module_name}' has no attribute '{attr_path}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise SpecError(f"{spec.name}: '{target}' is not callable")
    return obj


def _construct(spec: ModelSpec, target: str, kwargs: dict[str, Any]) -> Any:
    factory = resolve_object(spec, target)
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise SpecError(f"{spec.name}: kwargs {kwargs} do not fit {target}: {e}") from e
    except (Exception, SystemExit) as e:  # sys.exit(0) would end the build with success and nothing built
        raise SpecError(f"{spec.name}: constructing {target} raised {type(e).__name__}: {e}") from e


def _unpickler_said(e: Exception) -> str:
    """What torch's weights-only unpickler found, without the advice around it (to load
    the file with weights_only=False, which would run the code a pickle carries)."""
    found = re.search(r"WeightsUnpickler error:\s*(.+)", str(e))
    return found[1].strip().splitlines()[0] if found else f"{type(e).__name__}: {first_line(e)}"


def _load_state_dict(spec: ModelSpec, module: Any) -> None:
    torch = require("torch", "loading weights")
    assert spec.weights.path is not None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about pickle protocols before refusing
            state = torch.load(spec.weights.path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise SpecError(
            f"{spec.name}: refused weights file {spec.weights.path}: not a plain state_dict, read with "
            f"weights_only=True, which runs no code in it ({_unpickler_said(e)}); give a file that "
            "torch.save(module.state_dict(), path) wrote"
        ) from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SpecError(f"{spec.name}: weights file {spec.weights.path} is not a state_dict of tensors")
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    wrong = sorted(
        f"{k} {tuple(state[k].shape)} != {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    )
    problems = [
        f"missing {_some(missing, ', ')}" if missing else "",
        f"unexpected {_some(extra, ', ')}" if extra else "",
        f"wrong shape {_some(wrong, '; ')}" if wrong else "",
    ]
    problems = [p for p in problems if p] + _prefixed(set(expected), set(state))
    if problems:
        raise SpecError(f"{spec.name}: weights do not fit {spec.module}: {'; '.join(problems)}")
    module.load_state_dict(state, strict=True)


def _some(names: list[str], sep: str, shown: int = 5) -> str:
    """The first ``shown`` of ``names``, and how many more: a real model's keys run to hundreds."""
    more = f"{sep}... ({len(names) - shown} more)" if len(names) > shown else ""
    return sep.join(names[:shown]) + more


def _prefixed(expected: set[str], given: set[str]) -> list[str]:
    """Where the file's keys are the module's with a prefix left off or added (a checkpoint's
    keys under ``CausalLMWithCache``, which holds the model as ``model``), what to do."""
    prefix = _common_prefix(expected)
    if prefix and {prefix + k for k in given} == expected:
        return [f"the file's keys are the module's without '{prefix}': add it before every key"]
    prefix = _common_prefix(given)
    if prefix and {prefix + k for k in expected} == given:
        return [f"the file's keys are the module's with '{prefix}' before each: strip it from every key"]
    return []


def _common_prefix(keys: set[str]) -> str:
    """The dotted prefix every key shares ('' where none)."""
    first = os.path.commonprefix(sorted(keys)) if keys else ""
    return first[: first.rfind(".") + 1]


def _vary_constant_parameters(module: Any, torch: Any) -> None:
    """Give every parameter that its init fills with one value (a bias of zeros, a norm's
    weight of ones) seeded values around it: a graph that drops or misplaces a zero bias
    computes the same as one that keeps it, so only a varied one can tell them apart."""
    with torch.no_grad():
        for param in module.parameters():
            if param.is_floating_point() and param.numel() > 1 and bool((param == param.flatten()[0]).all()):
                param.add_(0.1 * torch.randn_like(param))


def build_config(spec: ModelSpec) -> Any:
    """The config object the spec's ``config`` table describes (its class called with the
    rest as keywords), or None where it has none."""
    if spec.config is None:
        return None
    options = {k: v for k, v in spec.config.items() if k != "class"}
    config = _construct(spec, spec.config["class"], options)
    _refuse_misspelt(spec, config, options)
    return config


def _refuse_misspelt(spec: ModelSpec, config: Any, options: dict[str, Any]) -> None:
    """SpecError where a key of the config table is no field of its class but nearly one
    (``num_hidden_layer``): a transformers config keeps any keyword as an attribute of its
    own, so the model would be built with the field's default and fail far from the typo. A
    key near no field is the user's own (a custom module may read it) and is kept."""
    default = _default(type(config))
    if default is None:
        return
    fields = vars(default)
    public = [k for k in fields if not k.startswith("_")]
    for key in options:
        if key in fields or f"_{key}" in fields or _is_attribute(default, key):
            continue
        near = difflib.get_close_matches(key, public, n=1, cutoff=0.9)
        if near:
            raise SpecError(
                f"{spec.name}: config key '{key}' is no field of {type(config).__name__}; did you mean "
                f"'{near[0]}'? (it would keep '{key}' aside and build with {near[0]} = {fields[near[0]]!r})"
            )


#: Each config class made with its defaults (None: it needs arguments), by class.
_DEFAULTS: dict[type, Any] = {}


def _default(cls: type) -> Any:
    """``cls`` made with its defaults, once per class (a build reads its config many times,
    and some classes warn as they are made); None for a class that needs arguments."""
    if cls not in _DEFAULTS:
        try:
            _DEFAULTS[cls] = cls()
        except Exception:  # noqa: BLE001 - a class that needs arguments has no defaults to compare with
            _DEFAULTS[cls] = None
    return _DEFAULTS[cls]


def _is_attribute(config: Any, key: str) -> bool:
    """Whether ``config`` answers ``key`` (a property or an attribute map's alias); a property
    that raises (a per-layer value asked for globally) counts: it is the class's own."""
    try:
        getattr(config, key)
    except AttributeError:
        return False
    except Exception:  # noqa: BLE001 - any other refusal comes from a field the class defines
        return True
    return True


def instantiate(spec: ModelSpec) -> Any:
    """The spec's module with its weights, in eval mode (dropout off).

    Weights are a seeded random init unless the spec names a state_dict file, which is
    loaded with ``weights_only=True`` so a pickle carrying code is refused. In a seeded
    init, a parameter its init fills with one value gets values around it
    (``_vary_constant_parameters``).
    """
    torch = require("torch", "building the PyTorch module")
    from attn_export.exporter.adapter import wrap

    config = build_config(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.weights.seed)
        module = _construct(spec, spec.module, {**spec.kwargs, **({"config": config} if config is not None else {})})
        if isinstance(module, torch.nn.Module) and spec.weights.path is None:
            _vary_constant_parameters(module, torch)
    if not isinstance(module, torch.nn.Module):
        raise SpecError(f"{spec.name}: {spec.module} did not return a torch.nn.Module")
    if spec.weights.path is not None:
        _load_state_dict(spec, module)
    return wrap(module.eval(), spec, config, lambda target: resolve_object(spec, target))


def adapt(module: Any, spec: ModelSpec, config: Any = None) -> Any:
    """A module in hand, in eval mode, called as ``spec`` says (keywords, picks, ``[call]``);
    rotary modules in ``[call]`` are built from ``config``, as a spec's are from its own."""
    from attn_export.exporter.adapter import wrap

    return wrap(module.eval(), spec, config, lambda target: resolve_object(spec, target))

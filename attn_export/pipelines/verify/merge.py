"""``report merge``: the n shards of one verify run (``--shard i/n``) put back together as
the report one unsharded run would give, or a one-line refusal where they are not shards
of one run (another build, seed, option or version, a shard missing or given twice)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from attn_export.errors import UsageError
from attn_export.pipelines.verify.models import shard_names
from attn_export.pipelines.verify.results import Shard, VerifyReport, selection_sha256

__all__ = ["merge_shards"]


def _refuse(name: str, what: str, got: object, other: str, want: object) -> UsageError:
    return UsageError(f"{name}: {what} {got} differs from {other}'s {want}: shards of different runs do not merge")


def _same_run(shards: Sequence[tuple[str, VerifyReport]]) -> None:
    first_name, first = shards[0]
    for name, report in shards:
        if report.manifest_sha256 is None:
            raise UsageError(f"{name}: the report records no build (an older attn-export wrote it); verify again")
        checks = [
            ("build", report.manifest_sha256[:12], first.manifest_sha256 and first.manifest_sha256[:12]),
            ("build folder", report.artifacts, first.artifacts),
            ("seed", report.seed, first.seed),
        ]
        checks += [
            (f"option {key}", report.settings.get(key), first.settings.get(key))
            for key in sorted(set(report.settings) | set(first.settings))
        ]
        checks += [
            (f"{key} version", report.versions.get(key), first.versions.get(key))
            for key in sorted(set(report.versions) | set(first.versions))
        ]
        for what, got, want in checks:
            if got != want:
                raise _refuse(name, what, got, first_name, want)


def _shards(shards: Sequence[tuple[str, VerifyReport]]) -> list[Shard]:
    """Each report's shard (a whole run is shard 1/1 of its models), checked to be the n
    shards of one selection, each once."""
    found = [r.shard or Shard(1, 1, selection_sha256([c.model for c in r.checks])) for _, r in shards]
    first_name = shards[0][0]
    for (name, _), shard in zip(shards, found, strict=True):
        if shard.count != found[0].count:
            raise _refuse(name, "shard count", shard.count, first_name, found[0].count)
        if shard.selection != found[0].selection:
            raise UsageError(f"{name}: shard {shard.label} is of another selection of models than {first_name}'s")
    count = found[0].count
    seen: dict[int, str] = {}
    for (name, _), shard in zip(shards, found, strict=True):
        if shard.index in seen:
            raise UsageError(f"{name}: shard {shard.label} is given twice (also {seen[shard.index]})")
        seen[shard.index] = name
    if count > len(shards):  # said without counting up to a count read from a file
        missing = list(itertools.islice((f"{i}/{count}" for i in range(1, count + 1) if i not in seen), 3))
        more = f" and {count - len(shards) - len(missing)} more" if count - len(shards) > len(missing) else ""
        raise UsageError(
            f"shard{'s' if len(missing) > 1 else ''} {', '.join(missing)}{more} missing: give every shard's report"
        )
    return found


def merge_shards(shards: Sequence[tuple[str, VerifyReport]]) -> VerifyReport:
    """The report one unsharded run would give, from its shards' (name, report) pairs:
    models in sorted order, each with its checks, cases, decode trajectories, generations
    and placement as its shard found them; ``seconds`` the shards' sum. UsageError, in one line, where they are
    not the n shards of one run."""
    if not shards:
        raise UsageError("give the JSON report of every shard")
    _same_run(shards)
    found = _shards(shards)
    models = sorted(c.model for _, r in shards for c in r.checks)
    if selection_sha256(models) != found[0].selection:
        raise UsageError("the shards' models are not the selection they were sharded from")
    for (name, report), shard in zip(shards, found, strict=True):
        checked = [c.model for c in report.checks]
        if checked != shard_names(models, (shard.index, shard.count)):
            raise UsageError(f"{name}: shard {shard.label} holds other models than --shard {shard.label} gives")
        ran = {c.model for c in report.cases} | {d.model for d in report.decode}
        stray = sorted((ran | {g.model for g in report.generate} | {p.model for p in report.placement}) - set(checked))
        if stray:
            raise UsageError(f"{name}: holds results of model {stray[0]!r}, which none of its checks names")
    first = shards[0][1]
    order = {m: i for i, m in enumerate(models)}
    reports = [r for _, r in shards]
    return VerifyReport(
        first.artifacts,
        first.seed,
        dict(first.settings),
        checks=sorted((c for r in reports for c in r.checks), key=lambda c: order[c.model]),
        cases=sorted((c for r in reports for c in r.cases), key=lambda c: order[c.model]),
        decode=sorted((d for r in reports for d in r.decode), key=lambda d: order[d.model]),
        generate=sorted((g for r in reports for g in r.generate), key=lambda g: order[g.model]),
        placement=sorted((p for r in reports for p in r.placement), key=lambda p: order[p.model]),
        seconds=sum(r.seconds for r in reports),
        manifest_sha256=first.manifest_sha256,
        versions=dict(first.versions),
    )

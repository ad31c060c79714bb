"""Agreeing on a constructor's verdict before its first collective.

A rank that rejects its arguments and raises alone leaves its peers waiting in the next
collective (the symmetric heap's set-up) until a timeout, or for ever on some backends. So the
objects that own heap resources first gather every rank's verdict and raise on every rank alike.
"""
from __future__ import annotations

import torch.distributed as dist

from ditron_ep.runtime.errors import DitronConfigError


def raise_unless_all_agree(group: dist.ProcessGroup | None, what: str, problem: str | None,
                           same: dict[str, object] | None = None) -> None:
    """Collective (every rank of `group` must call it): raise DitronConfigError on every rank if
    any rank's `problem` is not None, naming the ranks when only some have one; or, when none
    has one, if the arguments in `same` (name -> value) differ between ranks, naming them."""
    world = dist.get_world_size(group)
    verdicts: list[tuple[str | None, dict | None]] = [(None, None)] * world
    dist.all_gather_object(verdicts, (problem, same), group=group)
    problems = [p for p, _ in verdicts]
    ranks = [r for r, p in enumerate(problems) if p]
    if not ranks:
        differ = [name for name in (same or {}) if any(v[name] != same[name] for _, v in verdicts)]
        if differ:
            detail = "; ".join(f"{name}: " + ", ".join(f"rank {r} {v[name]!r}" for r, (_, v) in enumerate(verdicts))
                               for name in differ)
            raise DitronConfigError(f"{what}: every rank must pass the same {', '.join(differ)} ({detail})")
        return
    distinct = sorted({problems[r] for r in ranks})
    detail = distinct[0] if len(distinct) == 1 else "; ".join(f"rank {r}: {problems[r]}" for r in ranks)
    where = "" if len(ranks) == world else f" (on rank(s) {', '.join(map(str, ranks))}; raised on every rank)"
    raise DitronConfigError(f"{what}: {detail}{where}")

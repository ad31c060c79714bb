"""Agreeing on a constructor's verdict before its first collective.

A rank that rejects its arguments and raises alone leaves its peers waiting in the next
collective (the symmetric heap's set-up) until a timeout, or for ever on some backends. So the
objects that own heap resources first gather every rank's verdict and raise on every rank alike.
"""
from __future__ import annotations

import torch.distributed as dist

from .errors import DitronConfigError


def raise_unless_all_agree(group: dist.ProcessGroup | None, what: str, problem: str | None) -> None:
    """Collective (every rank of `group` must call it): raise DitronConfigError on every rank if
    any rank's `problem` is not None, naming the ranks when only some have one."""
    world = dist.get_world_size(group)
    problems: list[str | None] = [None] * world
    dist.all_gather_object(problems, problem, group=group)
    ranks = [r for r, p in enumerate(problems) if p]
    if not ranks:
        return
    distinct = sorted({problems[r] for r in ranks})
    detail = distinct[0] if len(distinct) == 1 else "; ".join(f"rank {r}: {problems[r]}" for r in ranks)
    where = "" if len(ranks) == world else f" (on rank(s) {', '.join(map(str, ranks))}; raised on every rank)"
    raise DitronConfigError(f"{what}: {detail}{where}")

"""The planner: which algorithm family, built how, computes a problem.

Between the resolved `Problem` and the kernels sits one decision: the family of templates
(templates/<family>/) that computes it, and the schedule it is built with. The families are tried
in `RULES` order and the first whose rule accepts the problem is taken; `direct` accepts every
problem, so it is last. Adding an algorithm is a template folder, one rule here and its tests.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .problem import Problem
from .schedule import Schedule
from .spec import ConvSpec


@dataclasses.dataclass(frozen=True)
class Plan:
    """What computes one problem: the kernel module's spec (which names the family) and its schedule."""

    spec: ConvSpec
    schedule: Schedule

    @property
    def family(self) -> str:
        return self.spec.family


# (family, rule): the first rule that accepts a problem names its family.
RULES: tuple[tuple[str, Callable[[Problem], bool]], ...] = (
    ("direct", lambda problem: True),  # phase planes around a packed GEMM micro-kernel: any window
)


def family_for(problem: Problem) -> str:
    """The algorithm family that computes `problem`."""
    return next(family for family, accepts in RULES if accepts(problem))


def plan(problem: Problem, specialize: bool, schedule: Schedule) -> Plan:
    """The plan for `problem`: its family, specialized for its window or generic, under `schedule`."""
    spec = ConvSpec(problem.window if specialize else None, problem.dtype, problem.layout, family_for(problem))
    return Plan(spec, schedule)


__all__ = ["Plan", "RULES", "family_for", "plan"]

"""The local search: from the sampler's best layouts, climb by factor moves to a local optimum.

A space of today's stacks holds 1,000-30,000 layouts (degrees, micro-batch, schedule), too many
to score each in the 10 s budget; TPE finds the right region but, in the measurement of issue
10, missed the optimum by 0.25-1.8% in a third of the searches, and hill climbing from its best
layout reached the optimum in all of them in 1-3 steps. So after the sampled trials the search
climbs from the best sampled layouts (`climb_starts`): it scores every neighbour of the current
layout that no trial holds yet (each a whole trial: its group of strategies scanned, the
best kept, stored in the study), moves to the best neighbour while that is faster, and stops at a
layout no neighbour beats.

A neighbour differs by one move (`neighbours`):

- a factor moved between two mesh degrees: one degree times or over a prime p of the world size,
  or to the next value it takes in the space, the other the inverse (tp x2 and dp /2; pp 12 -> 8
  and dp x1.5), the micro-batch kept, or scaled by the same factor so the micro-batches per step
  stay; the schedule kept where the new pipeline has it, and 1F1B (else the interleaved schedule
  with the fewest virtual stages);
- a folded degree (ep) to any value it takes in the space, the micro-batch kept or scaled by
  the same factor (Qwen3-30B-A3B under torchtitan on 16 H100s: ep 1 with 8 sequences per
  micro-batch is a local optimum that ep x2 or /2 moves do not leave, 0.6% below ep 8 with 1);
- the micro-batch size one step up or down among those the degrees allow;
- the schedule: GPipe, 1F1B, or interleaved with the virtual stages one step, or a factor 2,
  away.

A degree move keeps the schedule or takes 1F1B, and the other schedule moves happen at fixed
degrees, so a neighbourhood holds 30-60 layouts, where moving
two pairs of degrees with every schedule (the measurement of issue 10) scored 387-1,060 layouts
per search.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

from autosearch.core import dimensions

STARTS = 3  # the best distinct layouts of the sampled trials a climb starts from
BASIN_STARTS = 3  # and the best layouts of that many other pipeline degrees
MAX_STEPS = 12  # moves per climb (a climb measured in issue 10 took 1-3)
INTERLEAVED = "interleaved_1f1b"
# the degrees a move trades a factor between (dp takes what the others leave), and the folded
# ones (ep) that move alone
MESH = dimensions.MESH_AXES
FOLDED = dimensions.FOLDED_LEVELS


def primes_of(n: int) -> tuple[int, ...]:
    """The prime factors of `n` (each once, increasing)."""
    out, p = [], 2
    while p * p <= n:
        if n % p == 0:
            out.append(p)
            while n % p == 0:
                n //= p
        p += 1
    if n > 1:
        out.append(n)
    return tuple(out)


class LayoutIndex:
    """Every layout of a space by its values, and by its degrees (what a move looks up).

    Args:
        layouts: the layouts of a `SearchSpace` (`SearchSpace.layouts()`).
        world_size: the devices (its primes are the factors a degree move trades).
    """

    def __init__(self, layouts, world_size: int):
        self.by_key: dict[tuple, Any] = {}
        self.by_degrees: dict[tuple, list] = defaultdict(list)
        for layout in layouts:
            self.by_key[self.key(layout)] = layout
            self.by_degrees[self.degrees(layout)].append(layout)
        self.primes = primes_of(world_size)
        # every value each degree takes in the space, increasing
        self.values = [sorted({d[i] for d in self.by_degrees}) for i in range(len(MESH + FOLDED))]

    @staticmethod
    def key(layout) -> tuple:
        return tuple(layout.values.items())

    @staticmethod
    def degrees(layout) -> tuple:
        return tuple(layout.values.get(n, 1) for n in MESH + FOLDED)

    def neighbours(self, layout) -> list:
        """The layouts one move away from `layout` (see the module), each once, in a fixed
        order."""
        seen: dict[tuple, Any] = {}
        for other in self._moves(layout):
            k = self.key(other)
            if k != self.key(layout) and k not in seen:
                seen[k] = other
        return list(seen.values())

    def _moves(self, layout) -> Iterator[Any]:
        v = layout.values
        names = MESH + FOLDED
        here = self.degrees(layout)
        for a, b in itertools.permutations(range(len(MESH)), 2):
            for new_a in self._steps(a, here[a]):
                if (here[b] * here[a]) % new_a:
                    continue
                moved = list(here)
                moved[a], moved[b] = new_a, here[b] * here[a] // new_a
                yield from self._near(v, tuple(moved), Fraction(new_a, here[a]))
        for i in range(len(MESH), len(names)):  # folded degrees move alone, to any value
            for moved_i in self.values[i]:  # they take (ep 1 -> 8 with the micro-batch / 8)
                if moved_i != here[i]:
                    moved = list(here)
                    moved[i] = moved_i
                    yield from self._near(v, tuple(moved), Fraction(moved_i, here[i]))
        same = self.by_degrees.get(here, [])
        mbs = sorted({o.micro_batch_size for o in same})
        i = mbs.index(v["micro_batch_size"])
        for mb in mbs[max(0, i - 1) : i + 2]:  # one step up or down, same schedule
            yield from (
                o for o in same if o.micro_batch_size == mb and _pipeline(o) == _pipeline(v)
            )
        if v["pp"] > 1:  # the schedules close to this one, same micro-batch
            close = _close_pipelines(v)
            mb = v["micro_batch_size"]
            yield from (o for o in same if o.micro_batch_size == mb and _pipeline(o) in close)

    def _steps(self, i: int, value: int) -> set[int]:
        """The values a degree moves to: times or over a prime of the world size, and the next
        value up and down that the degree takes in the space (GPT-3's 96 layers: pp 12 -> 8)."""
        out = {value * p for p in self.primes}
        out |= {value // p for p in self.primes if value % p == 0}
        taken = self.values[i]
        at = bisect.bisect_left(taken, value)
        out |= set(taken[max(0, at - 1) : at]) | set(taken[at + 1 : at + 2])
        out.discard(value)
        return out

    def _near(self, v: dict, degrees: tuple, ratio: Fraction) -> Iterator[Any]:
        """The layouts of `degrees` with this layout's micro-batch (or it scaled by the ratio of
        the moved degree) and its schedule where the new pipeline has it, else the schedules
        close to it."""
        there = self.by_degrees.get(degrees)
        if not there:
            return
        mb = v["micro_batch_size"]
        mbs = {mb} | {m.numerator for m in (mb * ratio, mb / ratio) if m.denominator == 1}
        pp = dict(zip(MESH + FOLDED, degrees))["pp"]
        here = [o for o in there if o.micro_batch_size in mbs]
        if pp == 1:
            yield from here
            return
        # the same schedule where the new pipeline has it, and 1F1B (a degree move that pays
        # only with another schedule: 405B on 16,384 GPUs, tp8 interleaved -> tp4 1F1B); else
        # the interleaved schedule with the fewest virtual stages (schedule moves go on there)
        wanted = {_pipeline(v), ("1f1b", 1)}
        # and the two shallowest interleaved schedules: the one that pays at the new degrees may
        # be the next if the first does not fit (405B on 16,384 GPUs: tp2-cp8 1F1B -> tp4-cp4
        # interleaved v3, v2 over the memory margin)
        inter = sorted({o.virtual_stages for o in here if o.pipeline_schedule == INTERLEAVED})
        wanted |= {(INTERLEAVED, vs) for vs in inter[:2]}
        yield from (o for o in here if _pipeline(o) in wanted)


def climb_starts(values: dict[tuple, float]) -> list[tuple]:
    """Where the climbs start, from {layout key: its best throughput} of the sampled trials:
    the `STARTS` best layouts, then the best layout of each pipeline degree (`BASIN_STARTS` of
    them, best first). Two basins that no single move joins are the rule at scale: ZeRO-3
    without a pipeline, and a deep interleaved pipeline with ZeRO-1 (GPT-3 175B on 384 A100s);
    sampled trials mostly find one of them, and a climb from the other side of it cannot cross
    the worse layouts between."""
    ranked = sorted(values, key=lambda k: values[k], reverse=True)
    starts = ranked[:STARTS]
    by_pp: dict[int, tuple] = {}
    for k in ranked:
        by_pp.setdefault(dict(k)["pp"], k)
    starts += [k for k in by_pp.values() if k not in starts][:BASIN_STARTS]
    return starts


def layout_key(strategy) -> tuple:
    """The key of the layout of `strategy` in a `LayoutIndex`."""
    from search_spaces import LAYOUT_FIELDS

    return tuple((name, getattr(strategy, name)) for name in LAYOUT_FIELDS)


def _pipeline(values) -> tuple[str, int]:
    if isinstance(values, dict):
        return values["pipeline_schedule"], values["virtual_stages"]
    return values.pipeline_schedule, values.virtual_stages


def _close_pipelines(v: dict) -> set[tuple[str, int]]:
    """GPipe, 1F1B and interleaved with the virtual stages one step or a factor 2 away."""
    vs = v["virtual_stages"]
    steps = {vs - 1, vs + 1, vs * 2, vs // 2, 2} if v["pipeline_schedule"] == INTERLEAVED else {2}
    return {("gpipe", 1), ("1f1b", 1)} | {(INTERLEAVED, s) for s in steps if s >= 2}

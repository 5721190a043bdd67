"""Running many programs: in this process, or spread over worker processes.

A program's cost is its compile (Dynamo, AOTAutograd, Inductor walking its
nodes, C++ for the code around the blocks), single-threaded Python for the
most part: on a 2-core machine two worker processes run close to twice the
programs in the same time.  Each worker is a fresh interpreter (``spawn``)
that inherits the environment (``TRITON_INTERPRET`` included), leaves
Inductor's broken CPU int8 lowering unregistered as the test process does,
and returns its programs' counts as a :class:`~.stats.Stats`.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Iterable, Sequence

from .build import build
from .check import run
from .spec import ProgramSpec
from .stats import Stats


def run_one(spec: ProgramSpec) -> Stats:
    stats = Stats()
    stats.add(run(build(spec)))
    return stats


def _init() -> None:
    from .. import without_inductor_cpu_int8_woq

    without_inductor_cpu_int8_woq()


def run_specs(specs: Sequence[ProgramSpec] | Iterable[ProgramSpec], workers: int = 1) -> Stats:
    """Every program built, compiled and checked; their counts summed (in the order given)."""
    stats = Stats()
    if workers <= 1:
        for spec in specs:
            stats.merge(run_one(spec))
        return stats
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init) as pool:
        for one in pool.map(run_one, list(specs), chunksize=1):
            stats.merge(one)
    return stats

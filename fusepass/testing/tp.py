"""Tensor parallelism on one machine: ranks spawned on the loopback, a model per rank.

    results = spawn(check, world_size=2, timeout=150, args=(...))   # check(rank, world_size, *args) -> picklable

Each rank is a fresh process (``spawn``) with a gloo process group over
127.0.0.1 (an NCCL one where every rank has a CUDA device: pass
``backend="nccl"``).  The whole run is bounded: past ``timeout`` seconds the
ranks are killed and ``spawn`` raises; a collective that waits on a rank
that died gives up after the process group's own timeout.  A rank's
exception comes back with its traceback.

:func:`load` builds a random-weight ``transformers`` model once (rank 0
saves it to a folder the ranks share) and loads it on every rank with the
model's own tensor-parallel plan (``tp_plan="auto"``): the path users take.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable, Sequence

import torch


def single_rank_group() -> None:
    """Make sure the process has a default process group, for rules whose forms
    hold collectives (``all_reduce_rms_norm``): the one it has, else a
    single-rank gloo group over an in-process store (no network), whose
    all-reduce is the identity."""
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world_size: int, port: int, backend: str, pg_timeout: float, fn: Callable[..., Any],
          args: Sequence[Any], out: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        result = fn(rank, world_size, *args)
        out.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - the parent reports it with the rank's traceback
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int = 2, timeout: float = 150.0, args: Sequence[Any] = (),
          backend: str = "gloo", threads: int = 1) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` ranks; their results, by rank.

    ``fn`` must be importable by name (a module-level function).  Each rank
    runs ``threads`` intra-op threads (the ranks share the machine's cores).
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        procs = [ctx.Process(target=_rank, args=(r, world_size, port, backend, timeout, fn, args, out), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
    finally:
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        while len(results) + len(failures) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{world_size} ranks did not finish in {timeout:.0f} s "
                                   f"(done: {sorted(results)}); killed")
            try:
                rank, ok, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and not failures:
                    failures.append(f"rank(s) {dead} exited with {[procs[r].exitcode for r in dead]} "
                                    "without a result")
                    break
                continue
            if ok:
                results[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
                break  # the others may wait on it in a collective: no point waiting for them
    finally:
        for p in procs:
            p.join(timeout=0 if failures or len(results) < world_size else 10)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise RuntimeError("tensor-parallel run failed on " + "\n".join(failures))
    return [results[r] for r in range(world_size)]


def save(name: str, folder: str, dtype: torch.dtype = torch.float32, **config: Any) -> None:
    """A random-weight ``fusepass.models`` model saved to ``folder`` (call on one rank)."""
    from fusepass import models

    models.build(name, dtype=dtype, **config).save_pretrained(folder)


def load(name: str, folder: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The ``fusepass.models`` model ``name`` saved in ``folder``, sharded over
    the default process group by its own plan (``tp_plan="auto"``)."""
    from fusepass import models

    cls, _ = models._config(name, "tiny")
    try:
        from transformers import DistributedConfig
    except ImportError:  # transformers before DistributedConfig: the argument itself
        return cls.from_pretrained(folder, tp_plan="auto", dtype=dtype).eval()
    return cls.from_pretrained(folder, distributed_config=DistributedConfig(tp_plan="auto"), dtype=dtype).eval()

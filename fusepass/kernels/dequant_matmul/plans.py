"""Plans: the heuristic, and measured plans kept per key in JSON files."""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from dataclasses import asdict
from pathlib import Path

import torch

from fusepass.kernels._common import cdiv
from fusepass.kernels.dequant_matmul.config import _GEMV_MAX_M, CUBLAS, Config, _pow2, m_bucket

log = logging.getLogger("fusepass")


def _auto_split(programs: int, K: int, BK: int, n_sm: int) -> int:
    """K slices that bring ``programs`` to about four per SM (one slice when N alone does)."""
    want = max(1, (4 * n_sm) // max(1, programs))
    return max(1, min(want, K // BK, 16))


def _heuristic(M: int, N: int, K: int, fmt: str, G: int, dtype: torch.dtype, n_sm: int) -> Config:
    """The plan when there is no measured one (no table entry, tuning off, CUDA-graph capture, the interpreter)."""
    if M > (2 if fmt == "int4" else 1) and N >= 2048 and (fmt != "int4" or G % 32 == 0) and dtype != torch.float32:
        # A few rows on a large weight: the transposed kernel (rows padded to 16)
        # ran 0.67-0.90x the GEMV's time, cold, at int4 M = 4-8 and int8 / fp8
        # M = 2-8 on Llama-3-8B's 4096- and 14336-row shapes (H100, 33abe0c and
        # 0e2b217); the GEMV kept int4 M = 2 and the 1024-row shape.
        bk = min(128, G) if fmt == "int4" else 128
        return Config("mmt", BM=16, BN=64, BK=bk, warps=4, stages=3, split=_auto_split(cdiv(N, 64), K, bk, n_sm))
    if M <= _GEMV_MAX_M:
        bk = 1024 if fmt == "int4" else 512
        bk = max(bk, G) if fmt == "int4" else bk
        bn = 8 if fmt == "int4" or M == 1 else max(1, 8 // _pow2(M))
        return Config("gemv", BN=bn, BK=bk, split=_auto_split(cdiv(N, bn), K, bk, n_sm), warps=4)
    if dtype == torch.float32 or M > 256:
        return CUBLAS
    bm = min(64 if M <= 64 else 128, max(16, _pow2(M)))
    if fmt != "int4" or G % 32 == 0:
        # The transposed kernel won 26 of the 27 keys of int4, int8 and fp8 at
        # M = 16-64 swept on the H100 on cold weights (Llama-3-8B shapes) and 16
        # of 18 at M = 128-256, mostly with these tiles; the split is half the
        # one that brings the grid to four programs per SM.
        bk = min(128, G) if fmt == "int4" else 128
        return Config("mmt", BM=bm, BN=64, BK=bk, warps=4, stages=3,
                      split=max(1, _auto_split(cdiv(N, 64) * cdiv(M, bm), K, bk, n_sm) // 2))
    bk = min(64, G) if fmt == "int4" else 64
    bn = 64 if M <= 64 else 128
    progs = cdiv(M, bm) * cdiv(N, bn)
    return Config("mm", BM=bm, BN=bn, BK=bk, split=_auto_split(progs, K, bk, n_sm), warps=4, stages=3)


# -- plans: measured once per key, cached in memory and in a JSON file ----------
#
# The key is (GPU name, format, group, M bucket, N, K); fp16 and bf16 share
# it (same bytes, same instructions), fp32 has its own.  A default table
# measured on an H100 ships beside this file; plans measured on the user's
# machine go to FUSEPASS_DEQUANT_MATMUL_CACHE (default
# ~/.cache/fusepass/dequant_matmul.json, "" to keep them in memory only) and
# win over the shipped ones.  FUSEPASS_DEQUANT_MATMUL_TUNE=0 turns tuning off.

_SHIPPED = Path(__file__).parent.parent / "dequant_matmul_plans.json"
_plans: dict[str, dict] | None = None
_plans_lock = threading.Lock()


def _cache_path() -> Path | None:
    env = os.environ.get("FUSEPASS_DEQUANT_MATMUL_CACHE")
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusepass" / "dequant_matmul.json"


def _read(path: Path | None) -> dict[str, dict]:
    if path is None or not path.is_file():
        return {}
    try:
        return dict(json.loads(path.read_text()).get("plans", {}))
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("fusepass: ignoring unreadable plan file %s (%s)", path, exc)
        return {}


def _load_plans() -> dict[str, dict]:
    global _plans
    with _plans_lock:
        if _plans is None:
            _plans = {**_read(_SHIPPED), **_read(_cache_path())}
        return _plans


def _save_plan(key: str, cfg: Config, us: float) -> None:
    entry = {**asdict(cfg), "us": round(us, 2)}
    with _plans_lock:
        assert _plans is not None
        _plans[key] = entry
        path = _cache_path()
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            data = _read(path)
            data[key] = entry
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"plans": dict(sorted(data.items()))}, indent=0))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("fusepass: could not save the dequant_matmul plan to %s (%s)", path, exc)


@functools.cache
def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def plan_key(M: int, N: int, K: int, fmt: str, group_size: int, dtype: torch.dtype, device: torch.device) -> str:
    prec = "fp32" if dtype == torch.float32 else "16bit"
    g = f"g{group_size}" if fmt == "int4" else "gc"
    return f"{_gpu_name(device)}|{fmt}-{g}|{prec}|M{m_bucket(M)}|N{N}|K{K}"

def _from_entry(entry: dict) -> Config:
    return Config(**{k: v for k, v in entry.items() if k in Config.__dataclass_fields__})

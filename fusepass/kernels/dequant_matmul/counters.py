"""Split-K arrival counters: zeroed int32 regions a launch can count in."""

from __future__ import annotations

import logging
import threading

import torch
from torch import Tensor

log = logging.getLogger("fusepass")

# -- split-K counters -------------------------------------------------------------
#
# With K split over several programs per output tile, the tile's last program
# to arrive sums the slices (_finish), counting arrivals in an int32 per tile
# that must read zero when the launch starts and that the last program sets
# back to zero.  A launch gets counters no other launch can be using at the
# same time: eager launches one region per CUDA stream (launches on a stream
# run one after another); launches captured into a CUDA graph a region of
# their own for the graph's whole life, taken from a pool zeroed before any
# capture (a capture cannot zero memory without putting the zeroing into
# every replay).  Where none can be had (a capture before any eager launch on
# the device, the pool used up, more tiles than a region), the slices are
# summed by a second kernel as before: same result, one launch more.
#
# The counters live as long as the process, so they must not come from a
# CUDA-graph memory pool: torch.compile's CUDA graphs run their warm-up calls
# eagerly with every allocation of the calling thread sent to the graphs' pool,
# and a tensor that outlives the call there fails their check ("tensor(s) in
# the cudagraph pool not tracked as outputs"; Llama-3-8B at batch 8 through
# generate, H100, 9ec0c5a).  So they are allocated and zeroed on a thread of
# their own, whose allocations go to the ordinary pool, which is waited for.

_STREAM_COUNTERS = 1 << 14  # per stream, for eager launches
_CAPTURE_COUNTERS = 1 << 20  # per device, for captured launches (4 MB)
_counters_lock = threading.Lock()
_stream_counters: dict[tuple[int, int], Tensor] = {}
_capture_pools: dict[int, list] = {}  # device index -> [pool, next free counter]


def _zeros_outside_graph_pools(n: int, device: torch.device) -> Tensor:
    """``n`` zeroed int32 on ``device``, allocated outside any CUDA-graph memory pool."""
    box: list = []

    def alloc() -> None:
        try:
            with torch.cuda.device(device):
                t = torch.zeros(n, dtype=torch.int32, device=device)
                torch.cuda.current_stream(device).synchronize()
            box.append(t)
        except BaseException as exc:  # noqa: BLE001 - raised again on the calling thread
            box.append(exc)

    thread = threading.Thread(target=alloc, name="fusepass-split-counters")
    thread.start()
    thread.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _split_counters(device: torch.device, tiles: int) -> Tensor | None:
    """``tiles`` zeroed counters for one split-K launch on the current stream, or None."""
    if device.type != "cuda":  # the interpreter runs programs one after another
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _counters_lock:
        if torch.cuda.is_current_stream_capturing():
            pool = _capture_pools.get(index)
            if pool is None or pool[1] + tiles > pool[0].numel():
                log.info("fusepass: dequant_matmul split-K in a CUDA graph without free counters; "
                         "its slices are summed by a second kernel")
                return None
            start = pool[1]
            pool[1] += tiles
            return pool[0][start:start + tiles]
        if tiles > _STREAM_COUNTERS:
            return None
        dev = torch.device("cuda", index)
        if index not in _capture_pools:
            _capture_pools[index] = [_zeros_outside_graph_pools(_CAPTURE_COUNTERS, dev), 0]
        key = (index, torch.cuda.current_stream(dev).cuda_stream)
        ctr = _stream_counters.get(key)
        if ctr is None:
            ctr = _stream_counters[key] = _zeros_outside_graph_pools(_STREAM_COUNTERS, dev)
        return ctr[:tiles]

"""All-reduce (sum) of a tensor-parallel partial result, the residual add, and RMSNorm.

    h = all_reduce_sum(x, group)            over the ranks of ``group_name``
    h = h + residual                        when a residual is given (in x's dtype)
    y = rms_norm(h, w, eps)                 as ``fusepass::rms_norm`` (weight_offset, cast_before_weight)
    returns (y, h)

The boundary of every tensor-parallel decoder layer: the attention output
and MLP down projections are row-parallel, each rank holds a partial sum,
and the all-reduce that joins them feeds the residual add and the next
norm.  ``h`` is both the norm's input and the next residual.

Paths:

- CPU (gloo) and every non-CUDA device: the functional collective
  (``_c10d_functional.all_reduce`` + ``wait_tensor``, what Dynamo makes of
  ``dist.all_reduce``), then the plain-torch ``add_rms_norm`` reference;
- CUDA, inputs per rank up to :func:`one_shot_limit` (32 MB at 2 ranks, a
  prefill of 2048 tokens of 8192 bf16 features; 512 KB at 3-4, decode
  sizes; rows of at most 16384): one launch, no NCCL.  Every rank's
  buffer is mapped into every other's (``torch.distributed._symmetric_memory``,
  one workspace per group, set up at the first such call).  Each program
  copies its rows of x into its own rank's buffer, meets the same program of
  every peer at a barrier of flags in the peers' signal pads, loads its
  rows from every rank's buffer, sums them in fp32 in rank order (every
  rank gets the same bits; for two ranks the bits NCCL gives), adds the
  residual, normalises, stores y and h, and meets the peers again so that
  no rank overwrites its buffer while one still reads it;
- CUDA otherwise: the collective (NCCL), then ``fusepass::add_rms_norm``'s
  Triton kernel (or ``rms_norm``'s without a residual).

Correct for any world size; the paths are chosen from shapes alone, so every
rank takes the same one.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from torch.fx.experimental.symbolic_shapes import statically_known_true

from fusepass.kernels._common import (
    call,
    eps_args,
    is_ptr,
    op_eps,
    register_inline,
    rows,
    run_kernel,
    scalar_arg,
    scalar_fp32,
)
from fusepass.kernels.rms_norm import (
    _add_rms_norm_ref_out,
    _check_residual,
    _inline_ok,
    _kernel_handles,
    _traced,
    add_rms_norm_fwd,
    rms_norm_fwd,
    rms_norm_reference,
)

_c10d = torch.ops._c10d_functional


def all_reduce_sum(x: Tensor, group_name: str) -> Tensor:
    """``x`` summed over the ranks of ``group_name``, waited for; x is left as it was."""
    return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), "sum", group_name))


# ------------------------------------------------------- one-shot path ----

# Inputs up to this many bytes per rank take the one-shot kernel at two
# ranks (the workspace's size), 512 KB at three or four.  On H200s (8192
# bf16 columns, CUDA-graph time), against NCCL + add_rms_norm: two ranks,
# faster at every token count run, 1 to 2048 (10.4 vs 18.1 us at 1, 17.4 vs
# 40.9 at 128, 73.6 vs 108.8 at 1024, 135.4 vs 194.7 at 2048, a prefill's
# boundary); four ranks, faster up to 32 tokens (19.4 vs 33.5 us at 1, 28.0
# vs 45.0 at 32) and slower from 128 (56.6 vs 45.8): each program meets its
# peers one after another and reads every rank's rows, so the kernel grows
# with the world size.  Not run beyond four ranks: NCCL there.  A benchmark
# may raise the limit to the workspace's size, or set 0 for the collective
# path.
ONE_SHOT_MAX_BYTES = 32 << 20
_WORKSPACE_BYTES = 32 << 20
_ONE_SHOT_MAX_N = 16384  # a row held in registers
_ONE_SHOT_MAX_WORLD = 4
_ONE_SHOT_MAX_BYTES_4 = 512 << 10  # three or four ranks


def one_shot_limit(world: int) -> int:
    """Bytes per rank up to which ``world`` ranks take the one-shot kernel (0: never)."""
    if not 2 <= world <= _ONE_SHOT_MAX_WORLD:
        return 0
    limit = ONE_SHOT_MAX_BYTES if world == 2 else min(ONE_SHOT_MAX_BYTES, _ONE_SHOT_MAX_BYTES_4)
    return min(limit, _WORKSPACE_BYTES)


# Programs per launch (rows dealt round-robin), fewer where a signal pad
# cannot hold WORLD 4-byte flags for each.
_ONE_SHOT_PROGRAMS = 128


@triton.jit
def _meet_peers(pads, block, RANK: tl.constexpr, WORLD: tl.constexpr):
    # Program ``block`` of this rank meets program ``block`` of every other.
    # It raises its flag (slot [block, RANK]) in every peer's pad with release
    # semantics (its threads' stores before it, made visible system-wide),
    # then takes the peers' flags from its own pad with acquire semantics.
    # A flag goes 0 -> 1 by its sender and 1 -> 0 by its receiver: a sender
    # whose previous flag the peer has not taken yet waits, so one meeting
    # cannot overtake the last.  Scalar atomics run once per program.
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer = tl.load(pads + r).to(tl.pointer_type(tl.int32))
            while tl.atomic_cas(peer + block * WORLD + RANK, 0, 1, sem="release", scope="sys") != 0:
                pass
    own = tl.load(pads + RANK).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        if r != RANK:
            while tl.atomic_cas(own + block * WORLD + r, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()


@triton.jit
def _one_shot_kernel(
    x,
    res,
    w,
    y,
    h,
    bufs,
    pads,
    stride_x,
    stride_r,
    M,
    N,
    eps,
    weight_offset,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    BN: tl.constexpr,
    EPS_PTR: tl.constexpr,
):
    # bufs / pads: int64 addresses of every rank's buffer and signal pad.
    # y, h: fresh contiguous [M, N]; the buffers hold x's rows contiguously.
    eps = scalar_fp32(eps, EPS_PTR)
    weight_offset = tl.cast(weight_offset, tl.float32)
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    DT = x.dtype.element_ty
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    own = tl.load(bufs + RANK).to(tl.pointer_type(DT))
    for m in range(pid, M, step):
        b_x = tl.load(x + tl.cast(m, tl.int64) * stride_x + o_n, mask=m_n)
        tl.store(own + m * N + o_n, b_x, mask=m_n)
    _meet_peers(pads, pid, RANK, WORLD)
    b_w = tl.load(w + o_n, mask=m_n, other=0.0).to(tl.float32) + weight_offset
    for m in range(pid, M, step):
        b_s = tl.zeros([BN], dtype=tl.float32)
        for r in tl.static_range(WORLD):  # rank order: the same sum on every rank
            peer = tl.load(bufs + r).to(tl.pointer_type(DT))
            b_s += tl.load(peer + m * N + o_n, mask=m_n, other=0.0).to(tl.float32)
        # The all-reduce's result in x's dtype, as the collective returns it,
        # then torch's x + res: an fp32 add, one rounding.
        b_h = b_s.to(DT)
        if HAS_RESIDUAL:
            b_r = tl.load(res + tl.cast(m, tl.int64) * stride_r + o_n, mask=m_n, other=0.0).to(tl.float32)
            b_h = (b_h.to(tl.float32) + b_r).to(DT)
        tl.store(h + m * N + o_n, b_h, mask=m_n)
        b_x = b_h.to(tl.float32)
        b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=0) / N + eps)
        b_n = b_x * b_rstd
        if CAST_BEFORE_WEIGHT:
            b_n = b_n.to(DT).to(tl.float32)
        tl.store(y + m * N + o_n, (b_n * b_w).to(y.dtype.element_ty), mask=m_n)
    # Peers read this rank's buffer until here; the next call overwrites it.
    _meet_peers(pads, pid, RANK, WORLD)


@dataclass
class Workspace:
    """One group's symmetric buffers on one device: ``bufs`` and ``pads`` hold
    every rank's buffer and signal pad address (int64, on the device)."""

    buffer: Tensor
    handle: object
    bufs: Tensor
    pads: Tensor
    rank: int
    world: int
    programs: int


_workspaces: dict[tuple[str, int], Workspace | None] = {}
_workspace_lock = threading.Lock()


def _group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _group_size(group_name: str) -> int:
    return _group(group_name).size()


def _all_ranks(ok: bool, group_name: str, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank of the group (a MIN all-reduce): the
    ranks take the one-shot path together or not at all, since a rank that
    spins on flags its peers never raise would wait for ever."""
    import torch.distributed as dist

    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=_group(group_name))
    return bool(flag.item())


def _allocate(group_name: str, device: torch.device) -> Tensor:
    import torch.distributed._symmetric_memory as symm_mem

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated where it is no longer needed
        symm_mem.enable_symm_mem_for_group(group_name)
    return symm_mem.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def _rendezvous(buffer: Tensor, group_name: str, device: torch.device) -> Workspace:
    import torch.distributed._symmetric_memory as symm_mem

    handle = symm_mem.rendezvous(buffer, group_name)
    pad_bytes = handle.get_signal_pad(handle.rank).numel() * 4
    return Workspace(
        buffer, handle,
        torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device),
        torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device),
        handle.rank, handle.world_size,
        min(_ONE_SHOT_PROGRAMS, pad_bytes // (4 * handle.world_size)))


def workspace(group_name: str, device: torch.device) -> Workspace | None:
    """The group's workspace on ``device``: made at the first call (collectives:
    every rank of the group calls it at the same point), None on every rank
    where one rank could not make it (then NCCL serves every call)."""
    key = (group_name, device.index)
    if key in _workspaces:  # every call after the first: no lock
        return _workspaces[key]
    with _workspace_lock:
        if key in _workspaces:
            return _workspaces[key]
        # No allocation in a capture: NCCL this time (every rank captures at the same point).
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        ws, buffer, why = None, None, None
        try:
            buffer = _allocate(group_name, device)
        except Exception as exc:  # noqa: BLE001 - no peer memory here: the collective path
            why = f"{type(exc).__name__}: {exc}"
        # Every rank allocated, or none goes on to the rendezvous (a collective).
        if _all_ranks(buffer is not None, group_name, device):
            try:
                ws = _rendezvous(buffer, group_name, device)
            except Exception as exc:  # noqa: BLE001
                why = f"{type(exc).__name__}: {exc}"
            if not _all_ranks(ws is not None, group_name, device):
                ws, why = None, why or "another rank's rendezvous failed"
        else:
            why = why or "another rank could not allocate symmetric memory"
        if ws is None:
            warnings.warn(f"fusepass: no symmetric memory for group {group_name} ({why}); "
                          "all_reduce_rms_norm uses NCCL", stacklevel=2)
        _workspaces[key] = ws
        return ws


def one_shot_applies(x: Tensor, residual: Tensor | None, weight: Tensor, out_dtype: torch.dtype,
                     group_name: str) -> bool:
    """Whether the CUDA op takes the one-shot kernel for these inputs: decided
    from shapes and dtypes, the same on every rank."""
    N = x.shape[-1] if x.dim() else 0
    return (x.is_cuda and _kernel_handles(x, weight, out_dtype, residual)
            and 0 < x.numel() and N <= _ONE_SHOT_MAX_N
            and x.numel() * x.element_size() <= one_shot_limit(_group_size(group_name)))


def one_shot_fwd(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype, ws: Workspace):
    """(y, h) by the one-shot kernel; x's rows are summed over ``ws``'s group."""
    N = x.shape[-1]
    x2 = rows(x, N)
    r2 = None if residual is None else rows(residual, N)
    M = x2.shape[0]
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    eps = scalar_arg(eps, x)
    BN = triton.next_power_of_2(N)
    _one_shot_kernel[(min(M, ws.programs),)](
        x2, r2 if r2 is not None else x2, weight, y, h, ws.bufs, ws.pads,
        x2.stride(0), r2.stride(0) if r2 is not None else 0, M, N, eps, weight_offset,
        RANK=ws.rank, WORLD=ws.world, HAS_RESIDUAL=r2 is not None, CAST_BEFORE_WEIGHT=cast_before_weight,
        BN=BN, EPS_PTR=is_ptr(eps), num_warps=max(1, min(16, BN // 256)))
    return y, h


# ------------------------------------------------------------------- ops ----


def _reference(h, residual, weight, eps, weight_offset, cast_before_weight, out_dtype):
    """The op after its collective, in plain torch."""
    if residual is None:
        return rms_norm_reference(h, weight, eps, weight_offset, cast_before_weight, out_dtype).contiguous(), h
    return _add_rms_norm_ref_out(h, residual, weight, eps, weight_offset, cast_before_weight, out_dtype)


@torch.library.custom_op("fusepass::all_reduce_rms_norm", mutates_args=())
def all_reduce_rms_norm(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    out_dtype: torch.dtype,
    group_name: str,
    eps_tensor: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(rms_norm(h), h) with h = all_reduce_sum(x) (+ residual), contiguous,
    x's shape; ``eps_tensor`` as for ``fusepass::rms_norm``.  This body serves
    CPU and every non-CUDA device."""
    eps = op_eps(eps, eps_tensor)
    h = all_reduce_sum(x, group_name)
    return _reference(h, residual, weight, eps, weight_offset, cast_before_weight, out_dtype)


@all_reduce_rms_norm.register_fake
def _all_reduce_rms_norm_fake(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype, group_name,
                              eps_tensor=None):
    if residual is not None:
        _check_residual(x, residual)
    op_eps(eps, eps_tensor)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape)


@all_reduce_rms_norm.register_kernel("cuda")
def _all_reduce_rms_norm_cuda(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype, group_name,
                              eps_tensor=None):
    eps = op_eps(eps, eps_tensor)
    if one_shot_applies(x, residual, weight, out_dtype, group_name):
        ws = workspace(group_name, x.device)
        if ws is not None:
            # A launch that fails fails on every rank alike (same shapes):
            # each then runs the collective path.
            return run_kernel(
                "all_reduce_rms_norm",
                lambda: one_shot_fwd(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype, ws),
                lambda: _nccl_path(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype,
                                   group_name))
    return _nccl_path(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype, group_name)


def _nccl_path(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype, group_name):
    h = all_reduce_sum(x, group_name)
    args = (h, residual, weight, eps, weight_offset, cast_before_weight, out_dtype)
    if not _kernel_handles(h, weight, out_dtype, residual):
        return _reference(*args)

    def launch():
        if residual is None:
            # h is the collective's own fresh buffer: the op's second output as it is.
            return rms_norm_fwd(h, weight, eps, weight_offset, cast_before_weight, out_dtype), h
        return add_rms_norm_fwd(h, residual, weight, eps, weight_offset, cast_before_weight, out_dtype)

    # The collective has run: a failing kernel falls back to the reference on its result.
    return run_kernel("all_reduce_rms_norm", launch, lambda: _reference(*args))


# ------------------------------------------------------- calls in graphs ----
#
# Inlined, the op is the functional collective (which Inductor schedules as
# its own, as it would the model's all-reduce) followed by the norm kernel's
# launch: no dispatcher trip for the norm, the same kernel as the op's CUDA body.


def _op_inline_ok(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype, group_name,
                  eps_tensor=None):
    # Inputs that may take the one-shot kernel stay the op (it picks its path
    # when it runs); a token count the graph does not fix may.
    limit = one_shot_limit(_group_size(group_name))
    small = limit > 0 and not statically_known_true(x.numel() * x.element_size() > limit)
    return (eps_tensor is None and _inline_ok(x, weight, eps, out_dtype, residual)
            and not (small and x.shape[-1] <= _ONE_SHOT_MAX_N))


def _op_inline(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype, group_name, eps_tensor=None):
    h = all_reduce_sum(x, group_name)
    out = _traced(h, residual, weight, eps, weight_offset, cast_before_weight, out_dtype)
    return out if residual is not None else (out, h)


register_inline(torch.ops.fusepass.all_reduce_rms_norm.default, _op_inline_ok, _op_inline)


def all_reduce_rms_norm_call(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype, group_name):
    """What the rule puts in a graph: the collective and the norm kernel's launch
    when the engine inlines kernels for a CUDA graph, else the op.  ``eps`` is a
    number or a 0-dim tensor (see :func:`fusepass.match.scalar_input`)."""
    eps, eps_tensor = eps_args(eps)
    return call(torch.ops.fusepass.all_reduce_rms_norm.default, x, residual, weight, eps, weight_offset,
                cast_before_weight, out_dtype, group_name, eps_tensor)

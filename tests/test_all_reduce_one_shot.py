"""The one-shot all-reduce + add + RMSNorm kernel of ``fusepass::all_reduce_rms_norm``.

CPU: each rank is a process running the kernel under the Triton
interpreter; the ranks' buffers and signal pads are files every process
maps (what symmetric memory does with device memory), so the kernel's
copy-in, its two meetings of flags and the rank-ordered sum run as on the
GPU, at 2 and 3 ranks, several calls in a row with new data each (a
meeting that let a rank overtake another, or a stale buffer, shows as a
wrong sum).  GPU (two devices): the op itself over NCCL ranks, against
the collective path on the same inputs, plain calls and CUDA-graph
replays.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

CALLS = 3
# (M, N, dtype, residual, weight_offset, cast_before_weight): odd sizes, more
# rows than programs (rows dealt round-robin), no residual, (1 + w).
CASES = [
    (5, 100, torch.float32, True, 0.0, False),
    (9, 64, torch.float16, True, 1.0, True),
    (3, 33, torch.float32, False, 0.0, False),
    (14, 40, torch.float32, True, 0.0, False),
]
PROGRAMS = 4  # < 5 and 9 rows: some programs take two or three rows


def _inputs(rank: int, call: int, case, world: int):
    M, N, dtype, residual, *_ = case
    g = torch.Generator().manual_seed(1000 * call + 10 * rank + world)
    x = torch.randn(M, N, generator=g).to(dtype)
    g = torch.Generator().manual_seed(1000 * call + 7)  # the same residual and weight on every rank
    res = torch.randn(M, N, generator=g).to(dtype) if residual else None
    w = torch.randn(N, generator=g).to(dtype)
    return x, res, w


def _mapped_rank(rank: int, world: int, folder: str) -> list:
    from fusepass.kernels.all_reduce_rms_norm import Workspace, one_shot_fwd

    size = 1 << 16

    def mapped(kind, r, dtype, n):
        return torch.from_file(os.path.join(folder, f"{kind}{r}"), shared=True, size=n, dtype=dtype)

    bufs = [mapped("buf", r, torch.uint8, size) for r in range(world)]
    pads = [mapped("pad", r, torch.int32, PROGRAMS * world) for r in range(world)]
    ws = Workspace(bufs[rank], None, torch.tensor([b.data_ptr() for b in bufs]),
                   torch.tensor([p.data_ptr() for p in pads]), rank, world, PROGRAMS)
    out = []
    for call in range(CALLS):
        for case in CASES:
            x, res, w = _inputs(rank, call, case, world)
            y, h = one_shot_fwd(x, res, w, 1e-5, case[4], case[5], x.dtype, ws)
            out.append((y.numpy().copy(), h.numpy().copy()))  # by value: the rank exits after
    return out


def test_ranks_sum_and_normalise_through_mapped_buffers():
    from fusepass.kernels.rms_norm import add_rms_norm_reference, rms_norm_reference
    from fusepass.testing import assert_close, tp

    for world in (2, 3):
        with tempfile.TemporaryDirectory() as folder:
            for r in range(world):  # zeroed pads: no flag raised yet; buffers poisoned
                torch.full((1 << 16,), 0xFF, dtype=torch.uint8).numpy().tofile(os.path.join(folder, f"buf{r}"))
                torch.zeros(PROGRAMS * world, dtype=torch.int32).numpy().tofile(os.path.join(folder, f"pad{r}"))
            results = tp.spawn(_mapped_rank, world_size=world, timeout=240, args=(folder,))
            # Every flag raised was taken: once all ranks are done the pads are back to zero.
            for r in range(world):
                pad = torch.from_file(os.path.join(folder, f"pad{r}"), size=PROGRAMS * world, dtype=torch.int32)
                assert not pad.any(), (world, r, pad.tolist())
        for rank, outs in enumerate(results):
            i = 0
            for call in range(CALLS):
                for case in CASES:
                    xs = [_inputs(r, call, case, world)[0] for r in range(world)]
                    _, res, w = _inputs(rank, call, case, world)
                    s = sum(x.float() for x in xs).to(xs[0].dtype)  # fp32 sum in rank order, one rounding
                    if res is None:
                        ey, eh = rms_norm_reference(s, w, 1e-5, case[4], case[5], s.dtype), s
                    else:
                        ey, eh = add_rms_norm_reference(s, res, w, 1e-5, case[4], case[5], s.dtype)
                    y, h = (torch.from_numpy(a) for a in outs[i])
                    i += 1
                    assert torch.equal(h, eh), (world, rank, call, case[:3])
                    assert_close(y, ey, dtype=y.dtype)
            # Every rank holds the same h and y.
            for a, b in zip(outs, results[0]):
                assert (a[0] == b[0]).all() and (a[1] == b[1]).all()


def _agreement_rank(rank: int, world: int) -> list:
    import warnings

    import torch.distributed as dist

    from fusepass.kernels import all_reduce_rms_norm as ar

    def allocate(group, device, fails):
        if rank in fails:
            raise RuntimeError("no peer memory here")
        return torch.empty(8, dtype=torch.uint8)

    def rendezvous(buffer, group, device, fails):
        if rank in fails:
            raise RuntimeError("rendezvous failed here")
        return f"workspace of rank {rank}"

    out = []
    # (ranks whose allocation fails, ranks whose rendezvous fails): one group each.
    for alloc_fails, rdv_fails in (((1,), ()), ((), (0,)), ((), ())):
        group = dist.new_group(list(range(world))).group_name
        ar._allocate = lambda g, d, f=alloc_fails: allocate(g, d, f)
        ar._rendezvous = lambda b, g, d, f=rdv_fails: rendezvous(b, g, d, f)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ws = ar.workspace(group, torch.device("cpu"))
        again = ar.workspace(group, torch.device("cpu"))  # decided once per group
        out.append((ws, again, [str(w.message) for w in caught]))
    return out


def test_ranks_take_the_one_shot_path_together_or_not_at_all():
    from fusepass.testing import tp

    results = tp.spawn(_agreement_rank, world_size=2, timeout=120)
    for rank, cases in enumerate(results):
        (ws1, again1, warn1), (ws2, again2, warn2), (ws3, again3, warn3) = cases
        # One rank could not allocate: no rank goes on (the other would wait in the rendezvous).
        assert ws1 is None and again1 is None, rank
        assert any("could not allocate" in w or "no peer memory" in w for w in warn1), warn1
        # One rank's rendezvous failed: the other's workspace is not used either.
        assert ws2 is None and again2 is None, rank
        assert any("rendezvous failed" in w for w in warn2), warn2
        # Every rank made it: each uses its own.
        assert ws3 == again3 == f"workspace of rank {rank}" and not warn3, (rank, ws3, warn3)


# -- two GPUs: the op over NCCL ranks ---------------------------------------------------------

GPU_CASES = [  # (tokens, hidden, dtype, residual)
    (1, 8192, torch.bfloat16, True),
    (3, 4096, torch.float16, True),
    (16, 8192, torch.bfloat16, True),
    (5, 5000, torch.float32, False),
    (128, 8192, torch.bfloat16, True),
    (160, 8192, torch.bfloat16, True),  # 2.5 MiB: above the limit at 4 ranks, the collective path
    (32, 8192, torch.bfloat16, True),  # 512 KiB: the limit at 4 ranks
    (2048, 8192, torch.bfloat16, True),  # 32 MiB: the limit at 2 ranks
    (2049, 8192, torch.bfloat16, True),  # above it: the collective path
]


def _gpu_rank(rank: int, world: int) -> list:
    import torch.distributed as dist

    from fusepass.kernels import all_reduce_rms_norm as ar
    from fusepass.bench.timing import captured

    group = dist.group.WORLD.group_name
    dev = torch.device("cuda", rank)
    out = []
    for tokens, hidden, dtype, residual in GPU_CASES:
        # Every rank's x, made on every rank: the exact reference is their fp32 sum in rank
        # order, rounded once (the kernel's; NCCL rounds each partial sum beyond two ranks).
        xs = []
        for r in range(world):
            g = torch.Generator(device=dev).manual_seed(r)
            xs.append(torch.randn(tokens, hidden, device=dev, dtype=dtype, generator=g) * (r + 1))
        x = xs[rank]
        g = torch.Generator(device=dev).manual_seed(99)
        res = torch.randn(tokens, hidden, device=dev, dtype=dtype, generator=g) if residual else None
        w = torch.randn(hidden, device=dev, dtype=dtype, generator=g)
        args = (res, w, 1e-5, 0.0, True, dtype, group)

        def exact(scale):
            s = sum((xr * scale).float() for xr in xs).to(dtype)
            # The sum's rounding bound where NCCL rounds each partial sum (beyond two ranks).
            bound = world * 2.0 ** -8 * (sum((xr * scale).float().abs() for xr in xs)
                                         + (res.float().abs() if residual else 0))
            return (*ar._reference(s, *args[:-1]), bound)

        def norm_of(out):  # the op's norm of the h it returned
            return ar._reference(out[1], None, *args[1:-1])[0]

        one_shot = ar.one_shot_applies(x, res, w, dtype, group)
        checks = []
        for _ in range(3):
            got = torch.ops.fusepass.all_reduce_rms_norm(x, *args)
            checks.append(((*got, norm_of(got)), exact(1)))
        # CUDA-graph replays with new data written into the captured input.
        static, held = x.clone(), {}

        def fn():
            held["out"] = torch.ops.fusepass.all_reduce_rms_norm(static, *args)

        # A capture allocates from the caching allocator (off under compute-sanitizer runs).
        capture = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1"
        replay = captured(fn) if capture else None  # held["out"]: the captured outputs, rewritten by each replay
        for k in range(3 if capture else 0):
            static.copy_(x * (k + 2))
            replay()
            got = tuple(t.clone() for t in held["out"])
            checks.append(((*got, norm_of(got)), exact(k + 2)))
        torch.cuda.synchronize()
        out.append(dict(one_shot=one_shot, checks=[(_np(a), _np(b)) for a, b in checks]))
    return out


def _np(ts):
    # By value (the rank exits before the parent reads), exactly: fp32 holds every bf16 and fp16.
    return [t.float().cpu().numpy() for t in ts]


def _tensors(arrays):
    return [torch.from_numpy(a) for a in arrays]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_one_shot_op_on_gpus(world):
    from fusepass.kernels.all_reduce_rms_norm import one_shot_limit
    from fusepass.testing import assert_close, tp

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    results = tp.spawn(_gpu_rank, world_size=world, timeout=300, backend="nccl")
    for case, *per_rank in zip(GPU_CASES, *results):
        tokens, hidden, dtype, _ = case
        one_shot = tokens * hidden * dtype.itemsize <= one_shot_limit(world)
        assert per_rank[0]["one_shot"] == one_shot, case
        for rank, r in enumerate(per_rank):
            for got, expected in r["checks"]:
                (y, h, y_of_h), (ey, eh, bound) = _tensors(got), _tensors(expected)
                if one_shot or world == 2:  # the kernel's sum, and NCCL's of two ranks: the same bits
                    assert torch.equal(h, eh), (case, rank)
                    assert_close(y, ey, dtype=dtype)
                else:  # NCCL rounds each partial sum: within that rounding, and y the norm of that h
                    assert ((h - eh).abs() <= bound).all(), (case, rank, (h - eh).abs().max().item())
                    assert_close(y, y_of_h, dtype=dtype)
            assert (r["checks"][0][0][1] == per_rank[0]["checks"][0][0][1]).all(), (case, rank, "ranks differ")


def test_one_shot_limit_keys_the_compile_cache():
    # The limit decides whether a boundary is inlined into a compiled graph:
    # a compile under another limit must not be served from the cache.
    from fusepass import kernels
    from fusepass.kernels import all_reduce_rms_norm as ar

    shipped = ar.ONE_SHOT_MAX_BYTES
    before = kernels.fingerprint()
    try:
        ar.ONE_SHOT_MAX_BYTES = 0
        assert kernels.fingerprint() != before
    finally:
        ar.ONE_SHOT_MAX_BYTES = shipped
    assert kernels.fingerprint() == before

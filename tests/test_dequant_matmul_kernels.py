"""dequant_matmul kernels (fusepass/kernels/dequant_matmul/) against the fp32
dequantize-then-matmul reference.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors, so
shapes stay tiny: N = 24 is not a multiple of the row blocks, K = 128 spans
several tiles and groups.  Every path is forced with an explicit config
(GEMV, GEMV split-K, tensor-core, tensor-core split-K and permuted-K,
dequant + mm); outputs are poisoned with NaN first so unwritten elements show.
Output magnitudes are kept near 1: the dtype table is an absolute plus a
relative bound, and the tensor-core path rounds the dequantised int4 weight
to x's dtype (2**-9 relative in bf16) as the model's own dequant form does.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from fusepass.formats import dequantize_int4
from fusepass.kernels import dequant_matmul as dm
from fusepass.kernels.dequant_matmul import counters, launch, op, plans, tuner
from fusepass.kernels.dequant_matmul.config import Problem, m_bucket, valid
from fusepass.kernels._common import TOLERANCES, cdiv, interpreting
from fusepass.testing.library_layouts import library_inputs
from fusepass.testing import differential

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# id -> (fmt, group, asymmetric)
WEIGHT_CASES = {
    "int8": ("int8", 0, False),
    "int4-g32": ("int4", 32, True),
    "int4-g64-sym": ("int4", 64, False),
    "int4-g128": ("int4", 128, True),
    "fp8": ("fp8", 0, False),
}
PATHS = {
    "gemv": dm.Config("gemv", BN=8, BK=128, split=1),
    "gemv-splitk": dm.Config("gemv", BN=16, BK=128, split=3),  # 3 slices of K = 384: the last one masked
    "mm": dm.Config("mm", BM=16, BN=16, BK=32, split=1),
    "mm-splitk": dm.Config("mm", BM=16, BN=16, BK=32, split=2),
    "mm-perm": dm.Config("mm", BM=16, BN=16, BK=32, split=2, perm=1),
    "mmt": dm.Config("mmt", BM=16, BN=16, BK=32, split=1),
    "mmt-splitk": dm.Config("mmt", BM=16, BN=16, BK=32, split=2),
    "mmt-bm128": dm.Config("mmt", BM=128, BN=16, BK=32, split=2, warps=8),
    # int4's scales loaded one and two tiles ahead, across slices of four tiles
    "mmt-ahead1": dm.Config("mmt", BM=16, BN=16, BK=32, split=1, ahead=1),
    "mmt-ahead2-splitk": dm.Config("mmt", BM=16, BN=16, BK=32, split=3, ahead=2),
    # x copied into the int4 tile's K order first, read as stored
    "mmt-xperm-splitk": dm.Config("mmt", BM=16, BN=16, BK=32, split=3, ahead=1, xperm=1),
    "cublas": dm.CUBLAS,
}


def _problem(M, N, K, fmt, group, dtype, gpu="test", sms=132):
    return Problem(m_bucket(max(1, M)), N, K, fmt, group if fmt in ("int4", "nf4", "fp4", "hqq4") else 0, dtype, gpu, sms)


def _valid(cfg, M, K, fmt, group, dtype):
    return valid(cfg, _problem(M, 1, K, fmt, group, dtype))


def _inputs(M, N, K, fmt, group, asym, dtype, bias=True, seed=0, lead=()):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=gen).to(dtype)
    if fmt == "int4":
        w = torch.randint(0, 256, (N, K // 2), generator=gen, dtype=torch.uint8)
        s = (torch.rand(N, K // group, generator=gen) + 0.5) / (4 * K ** 0.5)
        z = (torch.rand(N, K // group, generator=gen) * 15).to(dtype) if asym else None
    elif fmt == "int8":
        w = torch.randint(-128, 128, (N, K), generator=gen, dtype=torch.int8)
        s = (torch.rand(N, generator=gen) + 0.5) / (64 * K ** 0.5)
        z = None
    else:
        w = (torch.randn(N, K, generator=gen) * 64).to(torch.float8_e4m3fn)
        s = (torch.rand(N, generator=gen) + 0.5) / (64 * K ** 0.5)
        z = None
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    return x, w, s.to(dtype), z, b


def _assert_close(out, x, w, s, z, b, fmt, group):
    ref = dm.dequant_matmul_reference(x, w, s, z, b, fmt, group)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    tol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out, ref, atol=tol.atol, rtol=tol.rtol)


def _run(x, w, s, z, b, fmt, group, cfg):
    """The launcher into a NaN-poisoned output (and workspace, see _poisoned_workspace)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    out = torch.full((x2.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    launch._launch(x2, w, s, z, b, out, fmt, group if fmt == "int4" else 0, cfg)
    return out.view(*x.shape[:-1], w.shape[0])


@pytest.fixture(autouse=True)
def _poisoned_workspace(monkeypatch):
    real = launch._workspace
    monkeypatch.setattr(launch, "_workspace", lambda *a: real(*a).fill_(float("nan")))


def _cases():
    for path, cfg in PATHS.items():
        for fid, (fmt, group, asym) in WEIGHT_CASES.items():
            for did, dtype in DTYPES.items():
                if cfg.kind in ("mm", "mmt") and dtype == torch.float32:
                    continue  # fp32 takes the GEMV or the cuBLAS path (see _valid)
                if cfg.perm and fmt != "int4":
                    continue
                ms = (1, 3, 8) if cfg.kind == "gemv" else (3, 17)
                for M in ms:
                    if dtype == torch.float16 and M == 8:
                        continue  # one BM = 8 case per dtype pair is enough
                    bias = (M + len(fid)) % 2 == 0
                    yield pytest.param(cfg, fmt, group, asym, dtype, M, bias,
                                       id=f"{path}-{fid}-{did}-M{M}-{'bias' if bias else 'nobias'}")


@pytest.mark.parametrize("cfg,fmt,group,asym,dtype,M,bias", list(_cases()))
def test_path_matches_reference(cfg, fmt, group, asym, dtype, M, bias):
    K = 384 if cfg.split == 3 else 128
    x, w, s, z, b = _inputs(M, 24, K, fmt, group, asym, dtype, bias)
    out = _run(x, w, s, z, b, fmt, group, cfg)
    _assert_close(out, x, w, s, z, b, fmt, group)


@pytest.mark.parametrize("fid", ["int8", "int4-g32", "int4-g64-sym", "fp8"])
def test_gemv_non_finite_activation_like_the_dequantised_matmul(fid):
    """An infinite activation gives +-inf where the dequantised matmul does, and
    NaN where it does (0 * inf): a zero point folded out of the sum (sum v x -
    z sum x) once turned every +-inf into inf - inf = NaN."""
    fmt, group, asym = WEIGHT_CASES[fid]
    x, w, s, z, b = _inputs(2, 16, 256, fmt, group, asym, torch.float32, bias=False)
    x[0, 5] = float("inf")
    x[1, 100] = float("-inf")
    out = _run(x, w, s, z, b, fmt, group, PATHS["gemv"])
    ref = dm.dequant_matmul_reference(x, w, s, z, b, fmt, group)
    assert torch.isinf(ref).any()
    torch.testing.assert_close(out, ref, equal_nan=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("path", ["gemv", "gemv-splitk"])
@pytest.mark.parametrize("asym", [True, False])
def test_int4_gemv_folded_non_finite_like_the_dequantised_matmul(device, path, asym):
    """One row of x (the GEMV that takes the zero point off each chunk's sum):
    an infinite activation, and sums that overflow only in the folded form
    (sum (128 + q) x), give what the dequantised matmul gives: the kernel sees
    the non-finite sums and re-does the slice value by value.  On the GPU at
    a real size, with the inline-PTX conversion."""
    if device == "cpu":
        cfg, N, K, G = PATHS[path], 24, (384 if path == "gemv-splitk" else 128), 32
    else:
        cfg = dm.Config("gemv", BN=4, BK=2048, warps=2, split=3 if path == "gemv-splitk" else 1)
        N, K, G = 4096, 6144, 128
    x, w, s, z, _ = (t.to(device) if t is not None else None
                     for t in _inputs(1, N, K, "int4", G, asym, torch.float32, bias=False))
    for case in ("inf", "overflow"):
        xc = x.clone()
        if case == "inf":
            xc[0, 5], xc[0, K - 3] = float("inf"), float("-inf")  # (split-K: the first and last slices)
        else:
            xc[0, 40:72] = 1e36  # finite sums of (q - z) x; a folded sum of (128 + q) x is not (> 3.4e38)
        out = _run(xc, w, s, z, None, "int4", G, cfg)
        ref = dm.dequant_matmul_reference(xc, w, s, z, None, "int4", G)
        if case == "inf":
            assert torch.isinf(ref).any()
        else:
            assert torch.isfinite(ref).all()
        fin = ref[torch.isfinite(ref)]
        big = fin.abs().max().item() if fin.numel() else 1.0
        torch.testing.assert_close(out, ref, equal_nan=True, rtol=1e-5, atol=1e-5 * big)


# Every group with every zero-point dtype, the activation dtype cycling through
# them (a Latin square: each pair of the three axes meets; 12 of the 36 products,
# 34 s instead of 102 under the interpreter).
_FOLDED = [(g, z, ("bf16", "fp16", "fp32")[(i + j) % 3]) for i, g in enumerate((8, 16, 32, 128))
           for j, z in enumerate((torch.float32, torch.bfloat16, None))]


@pytest.mark.parametrize("group,zdtype,did", _FOLDED)
def test_int4_gemv_folded_matches_per_value(group, zdtype, did):
    """The folded GEMV (fold=1, M = 1: one tile a slice, and a loop of 2-8
    tiles) and the per-value one (fold=0) all within the dtype table of the
    reference, chunks of 4-16 bytes, fp32 and 16-bit zero points, no zero
    point (8 subtracted)."""
    dtype = DTYPES[did]
    K = 256
    x, w, s, _, b = _inputs(1, 24, K, "int4", group, False, dtype)
    gen = torch.Generator().manual_seed(5)
    z = None if zdtype is None else (torch.rand(24, K // group, generator=gen) * 15).to(zdtype)
    cfgs = [dm.Config("gemv", BN=4, BK=128, split=2, fold=fold) for fold in (1, 0)]
    cfgs.append(dm.Config("gemv", BN=2, BK=max(32, group), fold=1))
    for cfg in cfgs:
        _assert_close(_run(x, w, s, z, b, "int4", group, cfg), x, w, s, z, b, "int4", group)


@pytest.mark.parametrize("K", [32, 256])
@pytest.mark.parametrize("asym", [False, True])
def test_int4_gemv_fp32_x_not_folded(K, asym):
    """fp32 x at M = 1 is summed value by value whatever the plan's fold: the
    folded sum s (sum (128 + q) x - (128 + z) sum x) rounds products of ~136 |x|
    and cancels them, 2.2e-4 off the fp64 product where eager's fp32 matmul was
    3.1e-6 off (a long differential run: x one value 0.7104 broadcast over K =
    32, s 0.598, y up to 27, sum_k |x_k W_nk| up to 70.5).  Held against fp64
    to the fp32 table, atol at least the differential checker's summation
    floor, four units of roundoff of sum_k |x_k W_nk| (1.7e-5 there): per
    value the kernel is within one unit, folded it was 52 (13 floors)."""
    gen = torch.Generator().manual_seed(3)
    N, group = 24, 32
    x = torch.full((1, K), 0.7104)  # one value over K (an expanded scalar): its sum does not cancel
    w = torch.randint(0, 256, (N, K // 2), generator=gen, dtype=torch.uint8)
    s = torch.full((N, K // group), 0.5982)
    z = (torch.rand(N, K // group, generator=gen) * 15).round() if asym else None
    b = torch.randn(N, generator=gen)
    out = _run(x, w, s, z, b, "int4", group, dm.Config("gemv", BN=4, BK=32, split=1, fold=1))
    ref = dm.dequant_matmul_reference(x.double(), w, s.double(), None if z is None else z.double(), b.double(),
                                      "int4", group)
    W = dm.dequant_matmul_reference(torch.eye(K, dtype=torch.float64), w, s.double(),
                                    None if z is None else z.double(), None, "int4", group)
    floor = 4 * 2.0**-24 * (x.double().abs() @ W.abs()).max().item()
    tol = TOLERANCES[torch.float32]
    torch.testing.assert_close(out.double(), ref, atol=max(tol.atol, floor), rtol=tol.rtol)


@pytest.mark.parametrize("path", ["gemv", "mmt", "mm-splitk", "cublas"])
@pytest.mark.parametrize("zdtype", [torch.float32, torch.bfloat16])
def test_int4_fractional_zero_points(path, zdtype):
    """Zero points that are not integers (HQQ-style float zeros), fp32 or 16-bit
    beside bf16 x: each path subtracts them as the reference does, q - z in fp32
    rounded once, however it builds q."""
    x, w, s, _, b = _inputs(5, 24, 128, "int4", 32, False, torch.bfloat16)
    z = (torch.rand(24, 4, generator=torch.Generator().manual_seed(3)) * 15 + 1 / 3).to(zdtype)
    cfg = PATHS[path]
    if cfg.kind == "gemv":
        x = x[:3]
    _assert_close(_run(x, w, s, z, b, "int4", 32, cfg), x, w, s, z, b, "int4", 32)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_k_not_a_multiple_of_the_tile(fmt):
    # K = 96: int8 tiles of 64 leave a masked half tile; int4 g32 has 3 groups.
    group = 32 if fmt == "int4" else 0
    for cfg in (dm.Config("gemv", BN=8, BK=64, split=1), dm.Config("gemv", BN=8, BK=64, split=2),
                dm.Config("mm", BM=16, BN=16, BK=32, split=2), dm.Config("mmt", BM=16, BN=16, BK=64, split=2)):
        if not _valid(cfg, 5, 96, fmt, group, torch.bfloat16):
            assert cfg.kind == "mmt" and fmt == "int4"  # BK 64 spans two groups of 32
            continue
        x, w, s, z, b = _inputs(5, 24, 96, fmt, group, True, torch.bfloat16)
        _assert_close(_run(x, w, s, z, b, fmt, group, cfg), x, w, s, z, b, fmt, group)



# -- int4 mmt: the tile computed in x's dtype ----------------------------------------------

# The interpreter runs Triton on CPU tensors; the GPU runs the inline-PTX conversion (tiles._int4_pairs).
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(not interpreting(), reason="needs the Triton interpreter")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The plans' int4 mmt tiles for M = 16 and M = 64 on the Llama-3-8B shapes (plans.heuristic)
MMT_M16 = dm.Config("mmt", BM=16, BN=128, BK=128, split=8, stages=3)
MMT_M64 = dm.Config("mmt", BM=64, BN=128, BK=128, split=2, stages=3)


def _int4_weight(N, K, group, dtype, zero, seed=0, device="cpu"):
    """Codes, scales of both signs over four decades (fp16 products down to its
    subnormals), and zero points: "fractional" (any value in [-1, 16), a few below
    2**-5), "integer" (some weights exactly 0) or "none" (8)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (N, K // 2), generator=gen, dtype=torch.uint8)
    shape = (N, K // group)
    s = (torch.rand(shape, generator=gen) + 0.1) * 10 ** (-4 * torch.rand(shape, generator=gen))
    s = torch.where(torch.rand(shape, generator=gen) < 0.3, -s, s).to(dtype)
    z = None
    if zero == "fractional":
        z = torch.rand(shape, generator=gen) * 17 - 1
        z = torch.where(torch.rand(shape, generator=gen) < 0.1, z * 2e-3, z).to(dtype)
    elif zero == "integer":
        z = torch.randint(0, 16, shape, generator=gen).to(dtype)
    return tuple(t.to(device) if t is not None else None for t in (w, s, z))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("zero", ["fractional", "integer", "none"])
@pytest.mark.parametrize("did", list(HALF))
def test_int4_mmt_tile_is_the_models_weight(device, zero, did):
    """The tile the mmt kernel dequantises is, bit for bit, the model's own form
    (formats.dequantize_int4 in x's dtype: q - z rounded, then times s rounded),
    not the fp32 form rounded once.  x = I makes out = W^T: each sum is one
    product by 1, exact in fp32; N is not a multiple of the tile's rows."""
    dtype = HALF[did]
    if device == "cpu":
        N, K, group, cfgs = 40, 128, 64, [dm.Config("mmt", BM=16, BN=32, BK=64, split=2)]
    else:
        N, K, group, cfgs = 300, 1024, 128, [MMT_M16, MMT_M64]
    w, s, z = _int4_weight(N, K, group, dtype, zero, seed=len(zero), device=device)
    model = dequantize_int4(w, s, z, dtype)
    once = dm.dequant_matmul_reference(torch.eye(K, device=device, dtype=dtype), w, s, z, None, "int4", group).t()
    if zero == "fractional":
        assert not torch.equal(model, once)  # q - z is rounded: the two roundings are seen
    if dtype == torch.float16:
        assert ((model != 0) & (model.abs() < 2 ** -14)).any()  # subnormal products
    for cfg in cfgs:
        out = torch.full((K, N), float("nan"), dtype=dtype, device=device)
        launch._launch(torch.eye(K, device=device, dtype=dtype), w, s, z, None, out, "int4", group, cfg)
        mismatch = (out.t() != model).sum().item()
        assert mismatch == 0, f"{cfg.label()}: {mismatch} values differ from the model's weight"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("did", list(HALF))
def test_int4_mmt_non_finite_activation_like_the_dequantised_matmul(device, did):
    """Infinite activations give +-inf where the matmul on the model's weight
    does, and NaN where it does: inf * 0 for the weights with q = z, inf - inf."""
    dtype = HALF[did]
    N, K, group = (24, 128, 32) if device == "cpu" else (4160, 2048, 128)
    w, s, z = _int4_weight(N, K, group, dtype, "integer", seed=3, device=device)
    cfgs = [PATHS["mmt-splitk"]] if device == "cpu" else [MMT_M16, MMT_M64]
    for cfg in cfgs:
        M = cfg.BM - 3
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype).to(device)
        x[0, 5] = float("inf")
        x[1, 100] = float("-inf")
        x[2, 7], x[2, 9] = float("inf"), float("-inf")
        out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
        launch._launch(x, w, s, z, None, out, "int4", group, cfg)
        ref = (x.float() @ dequantize_int4(w, s, z, dtype).float().t()).to(dtype)
        assert torch.isinf(ref).any() and torch.isnan(ref).any()
        tol = TOLERANCES[dtype]
        torch.testing.assert_close(out, ref, equal_nan=True, atol=tol.atol, rtol=tol.rtol)


SPLIT_PATHS = {k: v for k, v in PATHS.items() if v.split > 1}


@pytest.fixture
def launched(monkeypatch):
    """The kernels the launcher runs, in order."""
    kernels = []
    real_run = launch._run

    def run(built, warmup):
        kernels.append(built.kernel)
        return real_run(built, warmup)

    monkeypatch.setattr(launch, "_run", run)
    return kernels


@pytest.mark.parametrize("sum_here", [True, False], ids=["last-program-sums", "second-kernel"])
@pytest.mark.parametrize("path", list(SPLIT_PATHS))
def test_split_k_sums_in_the_kernel_or_a_second_one(monkeypatch, launched, path, sum_here):
    """Split K: the tile's last program sums the slices, counting arrivals in
    counters it leaves at zero for the next launch (two launches in a row on
    the same counters here, the second on other inputs), and no second kernel
    runs; without counters the second kernel sums them, to the same result."""
    cfg = SPLIT_PATHS[path]
    counters = torch.zeros(64, dtype=torch.int32)
    handed = []

    def fake_counters(device, tiles):
        handed.append(tiles)
        return counters[:tiles]

    monkeypatch.setattr(launch, "_split_counters", fake_counters)
    fmt, group, asym = WEIGHT_CASES["int4-g32"] if cfg.kind != "mmt" else WEIGHT_CASES["int8"]
    K = 384 if cfg.split == 3 else 128
    for seed in (0, 1):
        x, w, s, z, b = _inputs(3 if cfg.kind == "gemv" else 17, 24, K, fmt, group, asym, torch.bfloat16, seed=seed)
        out = torch.full((x.shape[0], 24), float("nan"), dtype=x.dtype)
        launch._launch(x, w, s, z, b, out, fmt, group, cfg, sum_here=sum_here)
        _assert_close(out, x, w, s, z, b, fmt, group)
        assert not counters.any(), "the last program leaves its tile's counter at zero"
    assert (launch._splitk_reduce_kernel in launched) != sum_here
    assert bool(handed) == sum_here
    tiles = -(-24 // cfg.BN) * (1 if cfg.kind == "gemv" else -(-17 // cfg.BM))
    assert not handed or handed[0] == tiles


def test_split_k_without_counters_falls_back_to_the_second_kernel(monkeypatch, launched):
    monkeypatch.setattr(launch, "_split_counters", lambda device, tiles: None)
    x, w, s, z, b = _inputs(3, 24, 384, "int8", 0, False, torch.float16)
    _assert_close(_run(x, w, s, z, b, "int8", 0, PATHS["gemv-splitk"]), x, w, s, z, b, "int8", 0)
    assert launched[-1] is launch._splitk_reduce_kernel


# -- the op: layouts, dtypes and sizes the launcher sees through dequant_matmul_fwd --------


def _op(*args):
    with differential.triton_on_cpu(["dequant_matmul"]):
        return torch.ops.fusepass.dequant_matmul(*args)


@pytest.mark.parametrize("M", [0, 1, 5, 17])
def test_op_leading_dims_and_heuristic_plan(M):
    # The plan on a non-CUDA device is the heuristic: GEMV at M <= 2 (int4; M <= 8 otherwise), tensor cores above.
    x, w, s, z, b = _inputs(M, 24, 128, "int4", 32, True, torch.bfloat16, lead=(2,))
    out = _op(x, w, s, z, b, "int4", 32)
    assert out.shape == (2, M, 24)
    if M:
        _assert_close(out, x, w, s, z, b, "int4", 32)


def test_op_non_contiguous_x_and_weight():
    x, w, s, _, b = _inputs(6, 24, 64, "int8", 0, False, torch.float16)
    xt = x.t().contiguous().t()  # column-major: stride along K is not 1 -> copied
    assert xt.stride(-1) != 1
    wide = torch.zeros(24, 80, dtype=torch.int8)
    wide[:, :64] = w
    ws = wide[:, :64]  # rows with a stride: read in place
    out = _op(xt, ws, s, None, b, "int8", 0)
    _assert_close(out, x, w, s, None, b, "int8", 0)
    wt = w.t().contiguous().t()  # column-major weight: copied
    _assert_close(_op(x, wt, s, None, b, "int8", 0), x, w, s, None, b, "int8", 0)
    xb = x[:1].expand(6, 64)  # broadcast rows (stride 0 along M)
    _assert_close(_op(xb, w, s, None, None, "int8", 0), xb.contiguous(), w, s, None, None, "int8", 0)


def test_op_fp64_is_the_reference():
    x, w, s, _, b = _inputs(3, 24, 64, "fp8", 0, False, torch.float64)
    out = _op(x, w, s, None, b, "fp8", 0)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, dm.dequant_matmul_reference(x, w, s, None, b, "fp8", 0))


def test_op_runs_the_kernel_not_the_fallback():
    from fusepass.kernels._common import clear_kernel_fallbacks, kernel_fallbacks

    clear_kernel_fallbacks()
    x, w, s, z, b = _inputs(4, 24, 64, "int4", 64, False, torch.bfloat16)
    _op(x, w, s, z, b, "int4", 64)
    assert "dequant_matmul" not in kernel_fallbacks()


# -- plans ---------------------------------------------------------------------------------


def test_buckets_and_keys():
    assert [dm.m_bucket(m) for m in (1, 2, 3, 8, 9, 1024, 1025, 4096)] == [1, 2, 4, 8, 16, 1024, 1025, 4096]
    k1 = Problem.of(3, 4096, 4096, "int4", 128, torch.bfloat16, "cpu").key
    k2 = Problem.of(4, 4096, 4096, "int4", 128, torch.float16, "cpu").key
    k3 = Problem.of(4, 4096, 4096, "int4", 128, torch.float32, "cpu").key
    assert k1 == k2 != k3
    assert k1 == "cpu|int4-g128|16bit|M4|N4096|K4096"
    assert Problem.of(5, 8, 64, "int8", 64, torch.bfloat16, "cpu").key == "cpu|int8-gc|16bit|M8|N8|K64"


@pytest.mark.parametrize("fmt,group", [("int8", 0), ("int4", 32), ("int4", 128), ("fp8", 0)])
def test_every_candidate_and_default_is_runnable(fmt, group):
    for M in (1, 2, 3, 8, 9, 64, 300, 5000):
        for dtype in DTYPES.values():
            for K in (4096, 14336):
                p = _problem(M, 4096, K, fmt, group, dtype)
                cands = tuner.candidates(p)
                assert cands and all(valid(c, p) for c in cands)
                assert valid(plans.heuristic(p), p)


def _int4_gemv_whole(cfg, p) -> bool:
    """An int4 GEMV tile gives every thread chunks of its own: BK a multiple of the
    values one chunk per thread covers (a shallower tile leaves threads loading
    and converting copies of other threads' chunks: correct, and slower)."""
    return cfg.kind != "gemv" or p.fmt != "int4" or cfg.BK % plans.int4_gemv_bk(p.K, p.group, cfg.warps) == 0


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_gemv_tiles_give_each_thread_its_own_chunks(group):
    for M in (1, 2, 3, 8):
        for N, K in ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (18944, 3584), (3584, 18944),
                     (512, 1024)):
            p = _problem(M, N, K, "int4", group, torch.bfloat16)
            for cfg in [plans.heuristic(p), *tuner.candidates(p)]:
                assert _int4_gemv_whole(cfg, p), (cfg.label(), N, K)
    # Where eight rows a program make few programs (the k/v projection at M = 1), the heuristic
    # takes four rows a program over the whole of K, not K slices (split-K: 1.4x the time, H200).
    p = _problem(1, 1024, 4096, "int4", 128, torch.bfloat16, sms=132)
    cfg = plans.heuristic(p)
    assert cfg.kind == "gemv" and cfg.BN == 4 and launch.splits(cfg, 4096) == 1 and cfg.BK == 4096
    assert 1024 // cfg.BN >= 132
    for N, K in ((4096, 4096), (14336, 4096), (4096, 14336)):  # enough programs already: unchanged
        assert plans.heuristic(_problem(1, N, K, "int4", 128, torch.bfloat16, sms=132)).BN == 8


def test_int4_small_m_split_keeps_the_sms_evenly_busy():
    """The int4 tensor-core heuristic's K split (plans._balanced_split): two measured
    traps avoided (H200): 288 programs of 13 steps where 256 of 14 fit (33.0 against
    26.7 µs), and one slice for 148 tiles on 132 SMs (66 against 32 µs)."""
    sms = 132
    for N, K, M in ((4096, 14336, 16), (4096, 14336, 64), (18944, 3584, 16), (14336, 4096, 16),
                    (3584, 18944, 16), (5120, 13824, 64)):
        cfg = plans.heuristic(_problem(M, N, K, "int4", 128, torch.bfloat16, sms=sms))
        assert cfg.kind == "mmt" and cfg.ahead in (1, 2)
        split = launch.splits(cfg, K)
        programs = cdiv(N, cfg.BN) * cdiv(M, cfg.BM) * split
        assert programs >= 1.5 * sms, (N, K, M, cfg.label())
        # the busiest SM does no more K steps than with the split one below or above
        steps = cdiv(K // cfg.BK, split)
        busiest = cdiv(programs, sms) * (steps + 2 * (split > 1))
        for other in (split - 1, split + 1):
            o_steps = cdiv(K // cfg.BK, other)
            o_n = cdiv(K // cfg.BK, o_steps)
            o_programs = cdiv(N, cfg.BN) * cdiv(M, cfg.BM) * o_n
            if other >= 1 and o_programs >= 1.5 * sms:
                assert busiest <= cdiv(o_programs, sms) * (o_steps + 2 * (o_n > 1)), (N, K, M, other)
    cfg = plans.heuristic(_problem(16, 4096, 14336, "int4", 128, torch.bfloat16, sms=sms))
    assert launch.splits(cfg, 14336) == 8  # not 9


def test_shipped_plans_are_valid():
    files = sorted(plans.PLANS_DIR.glob("*.json"))
    assert files, "no shipped plans"
    for path in files:
        shipped = plans.read(path)
        assert shipped, path
        for key, entry in shipped.items():
            gpu, fmt_g, prec, m, n, k = key.split("|")
            assert plans.shipped_path(gpu) == path, (key, path)  # each GPU's plans in its own file
            fmt, g = fmt_g.split("-")
            group = int(g[1:]) if g[1:].isdigit() else 0  # (int4's and the library layouts' groups; "gc": per channel)
            dtype = torch.float32 if prec == "fp32" else torch.bfloat16
            p = Problem(int(m[1:]), int(n[1:]), int(k[1:]), fmt, group, dtype, gpu)
            assert p.key == key
            assert valid(plans.from_entry(entry), p), key
            assert _int4_gemv_whole(plans.from_entry(entry), p), key


@pytest.fixture
def plan_files(tmp_path, monkeypatch):
    """An empty user cache in tmp_path, and a GPU named "NVIDIA H100 80GB HBM3"
    (132 SMs) for CUDA problems; the plan store read afresh before and after."""
    path = tmp_path / "plans.json"
    monkeypatch.setenv("FUSEPASS_DEQUANT_MATMUL_CACHE", str(path))
    from fusepass.kernels.dequant_matmul import config

    monkeypatch.setattr(config, "gpu_name", lambda d: "NVIDIA H100 80GB HBM3" if d.type == "cuda" else d.type)
    monkeypatch.setattr(config, "sm_count", lambda d: 132 if d.type == "cuda" else 1)
    plans.reset()
    yield path
    plans.reset()


def test_plan_file_round_trip(plan_files):
    cfg = dm.Config("mm", BM=16, BN=64, BK=64, split=4, stages=3, perm=1)
    p = Problem(16, 8, 64, "int4", 128, torch.bfloat16, "GPU")
    plans.save(p, cfg, 12.5)
    saved = json.loads(plan_files.read_text())["plans"]["GPU|int4-g128|16bit|M16|N8|K64"]
    assert plans.from_entry(saved) == cfg and saved["us"] == 12.5
    plans.reset()
    assert plans.lookup(p) == cfg


def test_plans_are_looked_up_never_tuned(plan_files, monkeypatch):
    """A plan comes from the user cache, else the GPU's shipped file, else the
    heuristic; nothing is compiled or timed (the tuner runs only when asked:
    ``fusepass tune``), and the compile cache's key follows the plans."""
    def no_tuning(*a, **k):
        raise AssertionError("tuned during a lookup")

    monkeypatch.setattr(tuner, "tune", no_tuning)
    monkeypatch.setattr(tuner, "_time_us", no_tuning)
    # The H100 file has fp8 at M = 1024 on this shape as dequantise + cuBLAS.
    shipped = Problem.of(1000, 14336, 4096, "fp8", 0, torch.bfloat16, "cuda")
    assert shipped.M == 1024 and shipped.gpu == "NVIDIA H100 80GB HBM3" and shipped.sms == 132
    assert plans.measured(shipped) is not None
    assert dm.dequant_matmul_plan(1000, 14336, 4096, "fp8", 0, torch.bfloat16, "cuda") == "dequant+cublas"
    # A GPU without a shipped file: the heuristic, with that GPU's SM count.
    other = Problem(1024, 14336, 4096, "fp8", 0, torch.bfloat16, "Some GPU", 100)
    assert plans.measured(other) is None and plans.lookup(other) == plans.heuristic(other)
    # A plan measured here wins over the shipped one, and changes the fingerprint.
    before = plans.fingerprint()
    mine = dm.Config("mmt", BM=128, BN=64, BK=128, split=2, stages=3)
    plans.save(shipped, mine, 99.0)
    assert plans.lookup(shipped) == mine
    assert dm.dequant_matmul_plan(1000, 14336, 4096, "fp8", 0, torch.bfloat16, "cuda") == "tensor-core"
    assert plans.fingerprint() != before
    # An entry a kernel cannot run (a GEMV at M = 1024) is not used.
    plans.save(shipped, dm.Config("gemv", BN=8, BK=512), 1.0)
    assert plans.lookup(shipped) == plans.heuristic(shipped)
    # Nor one with a scale distance or x order the kernel does not have (a hand-edited file).
    int4 = Problem.of(16, 4096, 14336, "int4", 128, torch.bfloat16, "cuda")
    for bad in (dm.Config("mmt", BM=16, BN=128, BK=128, split=8, stages=3, ahead=3),
                dm.Config("mmt", BM=16, BN=128, BK=128, split=8, stages=3, xperm=2)):
        plans.save(int4, bad, 1.0)
        plans.reset()
        assert plans.lookup(int4) == plans.heuristic(int4)


def test_plan_query_off_cuda():
    assert dm.dequant_matmul_plan(1, 64, 64, "int8", 0, torch.bfloat16, "cpu") == "reference"
    assert dm.dequant_matmul_plan(1, 64, 64, "int8", 0, torch.float64, "cuda") == "reference"


# -- GPU, real sizes -----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,group,asym", [("int8", 0, False), ("int4", 128, True), ("int4", 32, False),
                                            ("fp8", 0, False)])
def test_gpu_real_sizes_every_path(fmt, group, asym):
    N, K = 4096, 4096
    # int4 GEMV tiles: 1024 values per warp (a 16-byte chunk per thread and row)
    paths = [dm.Config("gemv", BN=8, BK=4096 if fmt == "int4" else 512, split=1),
             dm.Config("gemv", BN=16, BK=1024 if fmt == "int4" else 512, split=4, warps=1 if fmt == "int4" else 8),
             dm.Config("mm", BM=16, BN=64, BK=min(64, group or 64), split=1, stages=3),
             dm.Config("mm", BM=64, BN=128, BK=min(64, group or 64), split=3, stages=3),
             dm.Config("mm", BM=16, BN=64, BK=min(64, group or 64), split=2, stages=3, perm=1),
             dm.Config("mmt", BM=16, BN=64, BK=min(128, group or 128), split=1, stages=3),
             dm.Config("mmt", BM=64, BN=128, BK=min(128, group or 256), split=3, stages=3),
             dm.Config("mmt", BM=128, BN=128, BK=min(64, group or 64), split=2, warps=8, stages=3),
             dm.CUBLAS]
    for cfg in paths:
        for M, dtype in ((1, torch.bfloat16), (5, torch.float16), (77, torch.bfloat16), (3, torch.float32)):
            if not _valid(cfg, M, K, fmt, group, dtype):
                continue
            x, w, s, z, b = (t.cuda() if t is not None else None
                             for t in _inputs(M, N, K, fmt, group, asym, dtype))
            out = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
            launch._launch(x, w, s, z, b, out, fmt, group, cfg)
            _assert_close(out, x, w, s, z, b, fmt, group)
    # and through the op with its measured plan, inside a CUDA graph
    x, w, s, z, b = (t.cuda() if t is not None else None for t in _inputs(16, N, K, fmt, group, asym, torch.bfloat16))
    expected = torch.ops.fusepass.dequant_matmul(x, w, s, z, b, fmt, group)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.fusepass.dequant_matmul(x, w, s, z, b, fmt, group)
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(out, x, w, s, z, b, fmt, group)
    torch.testing.assert_close(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dm.Config("gemv", BN=4, BK=1024, split=4, warps=4),
                                 dm.Config("mmt", BM=16, BN=64, BK=128, split=8, stages=3)], ids=lambda c: c.kind)
def test_gpu_split_k_summed_in_the_kernel_eager_graphs_and_streams(launched, cfg):
    """Split K summed by each tile's last program: right on every launch (the
    counters reset themselves), in CUDA graphs replayed again and again (the
    captured launches keep counters of their own; two graphs replayed on two
    streams at once), and on two streams launching at the same time, each
    with its own counters; the second kernel never runs."""
    N, K, M = 4096, 4096, (1 if cfg.kind == "gemv" else 16)
    fmt = "int8"
    ins = [tuple(t.cuda() if t is not None else None for t in _inputs(M, N, K, fmt, 0, False, torch.bfloat16,
                                                                      seed=i)) for i in range(4)]

    def run(i, out):
        launch._launch(ins[i][0], ins[i][1], ins[i][2], None, ins[i][4], out, fmt, 0, cfg)
        return out

    for _ in range(3):  # eager, one after another on the same counters
        for i in range(4):
            _assert_close(run(i, torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")),
                          *ins[i], fmt, 0)
    outs = [torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    graphs = []
    for i in range(2):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(3):
                run(i, outs[i])
        graphs.append(g)
    streams = [torch.cuda.Stream() for _ in range(2)]
    torch.cuda.synchronize()
    for rep in range(20):
        for i, (g, st) in enumerate(zip(graphs, streams)):
            outs[i].fill_(float("nan"))
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                g.replay()
        for st in streams:
            torch.cuda.current_stream().wait_stream(st)
        torch.cuda.synchronize()
        for i in range(2):
            _assert_close(outs[i], *ins[i], fmt, 0)
    for rep in range(20):  # eager launches on two streams at once
        for i, st in enumerate(streams):
            outs[2 + i].fill_(float("nan"))
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                for _ in range(3):
                    run(2 + i, outs[2 + i])
        for st in streams:
            torch.cuda.current_stream().wait_stream(st)
        torch.cuda.synchronize()
        for i in (2, 3):
            _assert_close(outs[i], *ins[i], fmt, 0)
    assert launch._splitk_reduce_kernel not in launched
    for ctr in counters._stream_counters.values():
        assert not ctr.any()
    pool, used = counters._capture_pools[torch.cuda.current_device()]
    assert used > 0 and not pool[:used].any()


@pytest.mark.gpu
def test_gpu_split_k_in_torch_compile_cuda_graphs(monkeypatch):
    """torch.compile's CUDA graphs (mode="reduce-overhead") run their warm-up
    calls with every allocation of the thread sent to the graphs' memory pool,
    and refuse a tensor left alive there.  The split-K counters outlive the
    call, so they are allocated elsewhere: here for the first time inside such
    a warm-up.  (Before, Llama-3-8B at batch 8 failed in generate with "tensor(s)
    in the cudagraph pool not tracked as outputs".)"""
    cfg = dm.Config("mmt", BM=16, BN=64, BK=128, split=8, stages=3)
    monkeypatch.setattr(op, "_plan", lambda *a, **k: cfg)
    monkeypatch.setattr(counters, "_stream_counters", {})
    monkeypatch.setattr(counters, "_capture_pools", {})
    torch._dynamo.reset()
    _, w, s, _, b = (t.cuda() if t is not None else None
                     for t in _inputs(8, 4096, 4096, "int8", 0, False, torch.bfloat16, seed=7))
    fn = torch.compile(lambda x: torch.ops.fusepass.dequant_matmul(x, w, s, None, b, "int8", 0) * 2,
                       mode="reduce-overhead")
    for seed in range(4):
        x = _inputs(8, 4096, 4096, "int8", 0, False, torch.bfloat16, seed=seed)[0].cuda()
        out = fn(x).clone()
        _assert_close(out / 2, x, w, s, None, b, "int8", 0)
    assert counters._capture_pools and counters._stream_counters  # the counters were in use
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("fid", ["int4-g32", "int4-g64-sym", "int4-g128"])
def test_gpu_int4_gemv_non_finite_and_odd_row_stride(fid):
    """The GPU's int4 GEMV builds its floats with inline PTX (the interpreter
    never runs it): infinities as the dequantised matmul gives them, and an x
    whose rows start at odd element offsets (copied before the pairwise view)."""
    fmt, group, asym = WEIGHT_CASES[fid]
    cfg = dm.Config("gemv", BN=8, BK=1024, split=2)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x, w, s, z, b = (t.cuda() if t is not None else None
                         for t in _inputs(3, 512, 2048, fmt, group, asym, dtype, bias=False))
        x[0, 5] = float("inf")
        x[2, 1001] = float("-inf")
        out = torch.full((3, 512), float("nan"), dtype=dtype, device="cuda")
        launch._launch(x, w, s, z, b, out, fmt, group, cfg)
        ref = dm.dequant_matmul_reference(x, w, s, z, b, fmt, group)
        assert torch.isinf(ref).any()
        torch.testing.assert_close(out, ref, equal_nan=True, atol=TOLERANCES[dtype].atol, rtol=TOLERANCES[dtype].rtol)
        wide = torch.randn(3, 2049, device="cuda").to(dtype)
        xo = wide[:, 1:]  # row stride 2049, offset 1: odd in elements
        out = torch.full((3, 512), float("nan"), dtype=dtype, device="cuda")
        launch._launch(xo, w, s, z, b, out, fmt, group, cfg)
        _assert_close(out, xo, w, s, z, b, fmt, group)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [MMT_M16, MMT_M64], ids=["M16", "M64"])
def test_gpu_int4_mmt_real_sizes(cfg):
    """The plans' int4 mmt tiles at M = 16 and 64 on a 4160-row weight (half a
    tile past 4096), split K summed in the kernel: against the matmul on the
    model's own weight, bf16 and fp16, fractional and no zero points, M a whole
    and a partial row block."""
    N, K, group = 4160, 4096, 128
    for dtype in (torch.bfloat16, torch.float16):
        for zero in ("fractional", "none"):
            w, s, z = _int4_weight(N, K, group, dtype, zero, device="cuda")
            s = s.abs() / 32  # outputs near 1 (the dtype table is absolute plus relative)
            wm = dequantize_int4(w, s, z, dtype).float()
            for M in (cfg.BM, cfg.BM - 3):
                x = torch.randn(M, K, device="cuda").to(dtype)
                out = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
                launch._launch(x, w, s, z, None, out, "int4", group, cfg)
                assert torch.isfinite(out).all()
                tol = TOLERANCES[dtype]
                torch.testing.assert_close(out, (x.float() @ wm.t()).to(dtype), atol=tol.atol, rtol=tol.rtol)


def test_int4_gemv_x_rows_at_odd_offsets():
    # The int4 GEMV reads x as pairs of values: rows at odd element offsets are copied first.
    x, w, s, z, b = _inputs(3, 24, 128, "int4", 32, True, torch.bfloat16)
    wide = torch.randn(3, 129).to(torch.bfloat16)
    xo = wide[:, 1:]
    assert xo.stride(0) % 2 and xo.storage_offset() % 2
    _assert_close(_run(xo, w, s, z, b, "int4", 32, PATHS["gemv"]), xo, w, s, z, b, "int4", 32)


def test_tuner_timer_waits_for_the_host(monkeypatch):
    """The tuner's timer lengthens its sleep kernel until the host has queued all
    the timed calls before it ends: a sleep that ended first let host overhead
    into the GPU time and misranked split-K configs (H100, 98cc3cf)."""
    state = {"sleeps": [], "order": []}

    class Event:
        def __init__(self, enable_timing=True):
            self.name = None

        def record(self):
            state["order"].append(self)

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            order = state["order"][-3:]  # pre, start, end of the last round
            if self is order[0]:
                return state["sleeps"][-1] / 1e6  # the sleep's GPU time: 1M cycles per ms here
            return 10 * 0.005  # ten calls of 5 µs

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: state["sleeps"].append(cycles))
    host_per_call_s = 0.0003  # 3 ms for ten calls: longer than the first 1 ms sleep
    us = tuner._time_us(lambda: time.sleep(host_per_call_s))
    assert us == pytest.approx(5.0)
    assert state["sleeps"][0] == 1_000_000 and max(state["sleeps"]) >= 4_000_000
    assert len(state["sleeps"]) >= 5  # at least two rounds thrown away, then three kept


@pytest.mark.parametrize("l2_mb,free_mb,expect", [(50, 10_000, 16), (1, 10_000, 6), (50, 1, 1), (0.001, 10_000, 1)])
def test_tuner_times_a_ring_of_weight_copies_larger_than_the_l2(monkeypatch, l2_mb, free_mb, expect):
    """The tuner times each config over copies of the weight read in turn, so a
    weight that fits the L2 is timed as a model reads it, from memory: three
    L2s' worth of copies, at most 16 and a quarter of the free memory."""
    class Props:
        L2_cache_size = int(l2_mb * 2**20)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(free_mb * 2**20), 0))
    w = torch.randint(0, 256, (1024, 512), dtype=torch.uint8)  # 0.5 MiB
    s = torch.rand(1024, 8, dtype=torch.bfloat16)
    z = torch.rand(1024, 8, dtype=torch.bfloat16)
    ring = tuner._cold_ring(w, s, z)
    assert len(ring) == expect
    assert ring[0][0] is w and ring[0][1] is s and ring[0][2] is z
    for wc, sc, zc in ring[1:]:  # copies: equal values, their own memory
        assert torch.equal(wc, w) and wc.data_ptr() != w.data_ptr()
        assert torch.equal(sc, s) and torch.equal(zc, z) and zc.data_ptr() != z.data_ptr()
    assert tuner._cold_ring(w, s, None)[-1][2] is None


def test_tune_command_lists_a_models_problems_and_needs_a_gpu_to_time(plan_files, capsys):
    """``fusepass tune``: the problems of a quantized model (the prefill's M and
    the decode batch, every converted layer's N x K) with the plan each gets
    now; timing them needs a GPU."""
    from fusepass.cli import main

    assert main(["tune", "--model", "llama", "--size", "tiny", "--quantize", "int8", "--batch", "2", "--seq", "4",
                 "--list"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("int8")]
    assert rows and {int(r[1]) for r in rows} == {2, 8}  # M buckets of 2 (decode) and 2 x 4 (prefill)
    assert all("(heuristic)" in line for line in out.splitlines() if line.startswith("int8"))
    assert main(["tune", "--shapes", "64x32,48x32", "--fmt", "int4", "--group-size", "32", "--m", "1,3",
                 "--list"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("int4-g32")]
    assert sorted((int(r[1]), int(r[2]), int(r[3])) for r in rows) == [(1, 48, 32), (1, 64, 32), (4, 48, 32),
                                                                        (4, 64, 32)]
    if not torch.cuda.is_available():
        assert main(["tune", "--shapes", "64x32"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().out


def test_tune_step_keeps_what_the_step_times_faster(plan_files):
    """``fusepass tune --step``'s search: each plan the step looked up is pinned to
    each candidate and the step timed; the fastest is kept where it gains more
    than min_gain, one key at a time with the choices made before it; a
    candidate that fails is skipped; the plans in place stay where nothing
    gains enough.  The step here is a sum of made-up times of the plans that
    ``plans.lookup`` returns (what the ops' calls see), so pin's effect on
    lookups is what is tested."""
    from fusepass.bench.e2e.tune_step import search

    a = Problem.of(1, 6144, 4096, "int4", 128, torch.bfloat16, "cuda")
    b = Problem.of(1, 4096, 14336, "int4", 128, torch.bfloat16, "cuda")
    c = Problem.of(1, 4096, 4096, "int4", 128, torch.bfloat16, "cuda")
    keys = [(p, plans.lookup(p)) for p in (b, a, c)]
    start = dict(keys)
    # four other candidates of each key: 10, 11, 12, 13 µs; the plans in place 12
    others = {p: [cfg for cfg in tuner.candidates(p) if cfg.kind == "gemv" and cfg != start[p]][:4] for p in start}
    cost = {(p, cfg): 10.0 + i for p in start for i, cfg in enumerate(others[p])}
    cost.update({(p, cfg): 12.0 for p, cfg in keys})
    bad = others[a][0]
    cost[(b, others[b][1])] = 11.0 - 1.0  # b: 10 and 10 (the first of equal times kept)
    for cfg in others[a][1:]:
        cost[(a, cfg)] = 11.99             # a: 0.01 µs better than in place, under min_gain
    cost[(a, bad)] = 5.0                   # fastest, but it fails
    cost[(c, others[c][3])] = 9.0          # c: 3 µs better

    def measure():
        now = {p: plans.lookup(p) for p in start}
        if now[a] == bad:
            raise RuntimeError("out of resources")
        return sum(cost[(p, cfg)] for p, cfg in now.items())

    lines = []
    cands = {p: [start[p]] + others[p] for p in start}  # (the plan in place among them is not timed twice)
    choices, trials = search(keys, lambda p: cands[p], measure, plans.pin, min_gain=0.005, say=lines.append)
    got = {ch.key: ch.after for ch in choices}
    assert got[b] == others[b][0] and got[a] == start[a] and got[c] == others[c][3]
    assert any("failed (RuntimeError" in line for line in lines)
    assert sum(t.cfg == start[b] for t in trials) == 0 and len(trials) == 3 + 4 + 3 + 4
    # each key is first timed with its plan in place, after the earlier keys' choices
    assert [t.us for t in trials if t.cfg is None] == [36.0, 34.0, 34.0]
    assert plans.lookup(b) == others[b][0] and plans.lookup(c) == others[c][3]  # left pinned
    plans.pin(b, None)
    assert plans.lookup(b) == start[b]  # unpinned: the files (or the heuristic) again
    # out of budget before the first key: nothing timed, the plans in place kept
    choices, trials = search(keys, lambda p: cands[p], measure, plans.pin, budget_s=-1.0, say=lines.append)
    assert not trials and all(ch.after == ch.before for ch in choices)
    # a plan kept by the step is saved as the step's, apart from kernel timings
    plans.save(c, others[c][3], 830.5, where="step")
    saved = json.loads(plan_files.read_text())["plans"][c.key]
    assert saved["where"] == "step" and saved["us"] == 830.5 and plans.from_entry(saved) == others[c][3]


def test_tune_step_needs_a_gpu(capsys):
    from fusepass.cli import main

    if torch.cuda.is_available():
        pytest.skip("on a GPU the command times a model")
    assert main(["tune", "--step", "tiny-llama", "--quantize", "int4"]) == 2
    assert "CUDA GPU" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="is for --step"):  # a library's layers: only in a model's step
        main(["tune", "--shapes", "64x32", "--quantize", "bnb-nf4", "--list"])


# -- other libraries' layouts (fusepass.formats.LIBRARY_FORMATS) ------------------------------

LIB_PATHS = {
    "gemv": dm.Config("gemv", BN=8, BK=64, split=1),
    "gemv-splitk": dm.Config("gemv", BN=16, BK=64, split=3),  # 3 slices of K = 192, each 64 deep
    "mm": dm.Config("mm", BM=16, BN=16, BK=32, split=1),
    "mm-splitk": dm.Config("mm", BM=16, BN=16, BK=64, split=2),  # a slice ends inside a tile: masked
    "cublas": dm.CUBLAS,
}


def _library_cases():
    for path, cfg in LIB_PATHS.items():
        for fmt in ("nf4", "fp4", "gptq4", "gptq4_v1", "hqq4"):
            for did, dtype in DTYPES.items():
                if cfg.kind == "mm" and dtype == torch.float32:
                    continue
                if fmt == "fp4" and did == "fp16":
                    continue
                # one M per case, alternating (the GEMV's 1 and 3, the tiles' 3 and 17): every
                # M meets every path and format (120 cases took 112 s under the interpreter)
                ms = (1, 3) if cfg.kind == "gemv" else (3, 17)
                M = ms[(len(path) + len(fmt) + len(did)) % 2]
                yield pytest.param(cfg, fmt, dtype, M, id=f"{path}-{fmt}-{did}-M{M}")


@pytest.mark.parametrize("cfg,fmt,dtype,M", list(_library_cases()))
def test_library_layout_path_matches_reference(cfg, fmt, dtype, M):
    """Each path reads the bitsandbytes and GPTQ layouts as stored: N = 40 (not
    whole blocks of rows or of GPTQ's eight zero points per word), K = 192."""
    N, K = 40, 192
    x, w, s, z, g, group = library_inputs(fmt, M, N, K, dtype, seed=M)
    b = torch.randn(N).to(dtype) if M % 2 else None
    out = torch.full((M, N), float("nan"), dtype=dtype)
    launch._launch(x, w, s, z, b, out, fmt, group if fmt in ("nf4", "fp4", "hqq4") else 0, cfg, g_idx=g)
    ref = dm.dequant_matmul_reference(x, w, s, z, b, fmt, group, g_idx=g)
    assert torch.isfinite(out).all(), "unwritten (NaN) outputs"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref, atol=tol.atol, rtol=tol.rtol)


def test_library_reference_is_the_libraries_dequantization():
    """formats.dequantize_library against bitsandbytes' own dequantize_4bit (its CPU
    path) on weights it quantized itself, NF4 and FP4."""
    bnb = pytest.importorskip("bitsandbytes")
    from fusepass.formats import dequantize_library

    w = torch.randn(24, 128)
    for fmt in ("nf4", "fp4"):
        packed, state = bnb.functional.quantize_4bit(w, blocksize=64, quant_type=fmt)
        theirs = bnb.functional.dequantize_4bit(packed, state).float()
        ours = dequantize_library(packed.view(24, 64), state.absmax.view(24, 2), None, None, fmt, 64)
        assert torch.equal(ours, theirs), fmt


# id -> (fmt, N, K, group, config, M, dtype): the code books (int4's words) and HQQ (int8's words, rows
# paired) on the transposed kernel
LIB_MMT_CASES = {
    "nf4-g64-BK32-M3-bf16": ("nf4", 40, 192, 64, dm.Config("mmt", BM=16, BN=16, BK=32), 3, torch.bfloat16),
    # BK 128 over blocks of 64, split in two, the absmax a tile ahead, x in the tile's K order
    "nf4-g64-BK128-M17-fp16-ahead-xperm": ("nf4", 40, 256, 64, dm.Config("mmt", BM=32, BN=16, BK=128, split=2,
                                                                          ahead=2, xperm=1), 17, torch.float16),
    "fp4-g32-BK64-M5-bf16-splitk": ("fp4", 24, 256, 32, dm.Config("mmt", BM=16, BN=32, BK=64, split=3, ahead=1), 5,
                                    torch.bfloat16),
    "fp4-g128-BK32-M16-fp16": ("fp4", 40, 256, 128, dm.Config("mmt", BM=16, BN=16, BK=32, ahead=1), 16,
                               torch.float16),
    # HQQ: N = 40 (a tile of 16 rows straddles the halves at 20), N = 22 (odd halves)
    "hqq4-g64-BK32-M3-bf16": ("hqq4", 40, 192, 64, dm.Config("mmt", BM=16, BN=16, BK=32), 3, torch.bfloat16),
    "hqq4-g64-BK128-M17-fp16-ahead-xperm": ("hqq4", 40, 256, 64, dm.Config("mmt", BM=32, BN=16, BK=128, split=2,
                                                                            ahead=2, xperm=1), 17, torch.float16),
    "hqq4-g32-BK64-M5-bf16-splitk": ("hqq4", 22, 256, 32, dm.Config("mmt", BM=16, BN=32, BK=64, split=3, ahead=1),
                                     5, torch.bfloat16),
    "hqq4-g16-BK64-M16-fp16": ("hqq4", 40, 256, 16, dm.Config("mmt", BM=16, BN=16, BK=64, ahead=2, xperm=1), 16,
                               torch.float16),
}


@pytest.mark.parametrize("case", list(LIB_MMT_CASES))
def test_library_mmt_matches_reference(case):
    """NF4 / FP4 and HQQ read as words by the transposed kernel: N = 40, 24 and 22
    (not whole tiles of rows), blocks inside a tile and tiles inside a block,
    split K, scales loaded ahead, x copied into the tile's K order; unwritten
    outputs NaN."""
    fmt, N, K, group, cfg, M, dtype = LIB_MMT_CASES[case]
    p = _problem(M, N, K, fmt, group, dtype)
    assert valid(cfg, p)
    x, w, s, z, g, _ = library_inputs(fmt, M, N, K, dtype, seed=M, group=group)
    b = torch.randn(N).to(dtype) if M % 2 else None
    out = torch.full((M, N), float("nan"), dtype=dtype)
    launch._launch(x, w, s, z, b, out, fmt, group, cfg)
    ref = dm.dequant_matmul_reference(x, w, s, z, b, fmt, group)
    assert torch.isfinite(out).all(), "unwritten (NaN) outputs"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("case", ["nf4-g64-BK128-M17-fp16-ahead-xperm", "hqq4-g32-BK64-M5-bf16-splitk"])
def test_library_mmt_non_finite_activation_like_the_dequantised_matmul(case):
    """An infinite activation gives what the dequantised matmul gives (NaN where a
    weight is 0, as NF4's code 7 is), not a finite number."""
    fmt, N, K, group, cfg, M, dtype = LIB_MMT_CASES[case]
    x, w, s, z, g, _ = library_inputs(fmt, M, N, K, dtype, seed=3, group=group)
    x[0, 5] = float("inf")
    x[M - 1, 100] = float("-inf")
    out = torch.full((M, N), float("nan"), dtype=dtype)
    launch._launch(x, w, s, z, None, out, fmt, group, cfg)
    ref = dm.dequant_matmul_reference(x, w, s, z, None, fmt, group)
    assert torch.isinf(ref).any()
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref, equal_nan=True, atol=tol.atol, rtol=tol.rtol)


def test_library_mmt_valid():
    """The libraries' transposed kernel needs 16-bit x, blocks of a multiple of
    32 (code books) or 16 (HQQ, N even) that tiles of BK lie in or cover whole,
    and K in whole tiles; not GPTQ's."""
    cfg = dm.Config("mmt", BM=16, BN=64, BK=128)
    assert valid(cfg, _problem(16, 4096, 4096, "nf4", 64, torch.bfloat16))
    assert valid(cfg, _problem(16, 4096, 4096, "fp4", 256, torch.float16))
    assert not valid(cfg, _problem(16, 4096, 4096, "nf4", 64, torch.float32))
    assert not valid(cfg, _problem(16, 4096, 4032, "nf4", 48, torch.bfloat16))  # blocks of 48
    assert not valid(cfg, _problem(16, 4096, 4160, "nf4", 64, torch.bfloat16))  # K not whole tiles of 128
    assert valid(cfg, _problem(16, 4096, 4096, "hqq4", 64, torch.bfloat16))
    assert valid(cfg, _problem(16, 4096, 4096, "hqq4", 16, torch.bfloat16))
    assert not valid(cfg, _problem(16, 4097, 4096, "hqq4", 64, torch.bfloat16))  # rows do not pair
    assert not valid(cfg, _problem(16, 4096, 4104, "hqq4", 8, torch.bfloat16))
    assert not valid(cfg, _problem(16, 4096, 4096, "gptq4", 0, torch.bfloat16))


@pytest.mark.parametrize("fmt", ["nf4", "gptq4", "hqq4"])
def test_library_op_cuda_body_under_interpreter(fmt):
    """The op's CUDA body (plan, launch) on CPU tensors with the Triton interpreter."""
    x, w, s, z, g, group = library_inputs(fmt, 5, 24, 128, torch.bfloat16)
    with differential.triton_on_cpu(["dequant_matmul"]):
        out = torch.ops.fusepass.dequant_matmul(x.view(1, 5, 128), w, s, z, None, fmt, group, g)
    ref = dm.dequant_matmul_reference(x, w, s, z, None, fmt, group, g_idx=g)
    torch.testing.assert_close(out.view(5, 24), ref, atol=1.6e-2, rtol=1.6e-2)


# -- the GEMV loops of HQQ's and GPTQ's layouts (gemv._hqq_gemv, _gptq_gemv) ----------------

GPTQ_SHIFTS = torch.tensor([4, 0, 12, 8, 20, 16, 28, 24], dtype=torch.int32)  # not GPTQ's own table: the general loop
# id -> (fmt, N, K, group, act_order, shifts, config, M, dtype)
LIB_GEMV_CASES = {
    # HQQ, N even: rows n and n + N / 2 share bytes.  N = 22: 11 pairs, not whole blocks of BN.
    "hqq4-g32-M1-bf16": ("hqq4", 22, 128, 32, False, None, dm.Config("gemv", BN=8, BK=64), 1, torch.bfloat16),
    "hqq4-g32-M3-fp16-splitk": ("hqq4", 22, 128, 32, False, None, dm.Config("gemv", BN=4, BK=32, split=2), 3,
                                torch.float16),
    "hqq4-g64-M2-fp32-splitk": ("hqq4", 22, 256, 64, False, None, dm.Config("gemv", BN=2, BK=128, split=2), 2,
                                torch.float32),
    "hqq4-g8-M4-bf16": ("hqq4", 22, 64, 8, False, None, dm.Config("gemv", BN=4, BK=32), 4, torch.bfloat16),
    "hqq4-g32-N21-M2-bf16": ("hqq4", 21, 128, 32, False, None, dm.Config("gemv", BN=8, BK=64), 2,  # value by value
                             torch.bfloat16),
    # GPTQ: N = 20, not whole zero-point words; K = 96, not whole tiles of 64.
    "gptq4-g32-M1-bf16-splitk": ("gptq4", 20, 96, 32, False, None, dm.Config("gemv", BN=16, BK=32, split=2), 1,
                                 torch.bfloat16),
    "gptq4-g32-M3-fp16": ("gptq4", 20, 96, 32, False, None, dm.Config("gemv", BN=8, BK=64), 3, torch.float16),
    "gptq4-g8-M2-fp32": ("gptq4", 20, 64, 8, False, None, dm.Config("gemv", BN=32, BK=32), 2, torch.float32),
    "gptq4-act-M1-fp16": ("gptq4", 20, 96, 32, True, None, dm.Config("gemv", BN=16, BK=64), 1, torch.float16),
    "gptq4-act-M4-bf16-splitk": ("gptq4", 20, 128, 32, True, None, dm.Config("gemv", BN=16, BK=64, split=2), 4,
                                 torch.bfloat16),
    "gptq4-shifts-M2-fp32": ("gptq4", 20, 64, 32, False, GPTQ_SHIFTS, dm.Config("gemv", BN=16, BK=32), 2,
                             torch.float32),
    "gptq4_v1-g32-M2-bf16": ("gptq4_v1", 20, 96, 32, False, None, dm.Config("gemv", BN=16, BK=32, split=2), 2,
                             torch.bfloat16),
    "gptq4_v1-act-M3-fp32": ("gptq4_v1", 20, 64, 32, True, None, dm.Config("gemv", BN=8, BK=32), 3, torch.float32),
    # The code books' loop (bitsandbytes' NF4 / FP4): N = 13, not whole blocks of BN; a 16-byte chunk per
    # block of 32 or more, half a smaller block; K = 192 with BK = 128: the last tile half past K (masked).
    "nf4-g64-M1-bf16": ("nf4", 13, 256, 64, False, None, dm.Config("gemv", BN=8, BK=64), 1, torch.bfloat16),
    "nf4-g64-M3-fp16-splitk": ("nf4", 13, 256, 64, False, None, dm.Config("gemv", BN=4, BK=64, split=2), 3,
                               torch.float16),
    "nf4-g32-M2-fp32-masked": ("nf4", 13, 192, 32, False, None, dm.Config("gemv", BN=4, BK=128), 2, torch.float32),
    "fp4-g128-M5-bf16-splitk": ("fp4", 13, 512, 128, False, None, dm.Config("gemv", BN=2, BK=128, split=3), 5,
                                torch.bfloat16),
    "fp4-g16-M1-fp32": ("fp4", 13, 96, 16, False, None, dm.Config("gemv", BN=8, BK=32), 1, torch.float32),
    "nf4-g48-M2-bf16": ("nf4", 13, 192, 48, False, None, dm.Config("gemv", BN=8, BK=64), 2,  # value by value
                        torch.bfloat16),
}


def _lib_gemv(case, seed=0, inf=False):
    fmt, N, K, group, act_order, shifts, cfg, M, dtype = LIB_GEMV_CASES[case]
    x, w, s, z, g, group = library_inputs(fmt, M, N, K, dtype, seed=seed, group=group, act_order=act_order)
    if inf:
        x[0, 5] = float("inf")
        x[M - 1, K - 3] = float("-inf")
    b = torch.randn(N).to(dtype) if M % 2 else None
    out = torch.full((M, N), float("nan"), dtype=dtype)
    launch._launch(x, w, s, z, b, out, fmt, group if fmt in ("hqq4", "nf4", "fp4") else 0, cfg, g_idx=g,
                   shifts=shifts)
    ref = dm.dequant_matmul_reference(x, w, s, z, b, fmt, group, g_idx=g, shifts=shifts)
    return out, ref


@pytest.mark.parametrize("case", list(LIB_GEMV_CASES))
def test_library_gemv_loops_match_reference(case):
    """HQQ's pairs of rows and GPTQ's word loops (grouped words and per-code
    groups: act-order, or a shift table that is not GPTQ's) against the fp32
    reference, NaN-poisoned outputs and split-K workspace."""
    out, ref = _lib_gemv(case, seed=len(case))
    assert torch.isfinite(out).all(), "unwritten (NaN) outputs"
    tol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out, ref, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("case", ["hqq4-g32-M3-fp16-splitk", "gptq4-g32-M3-fp16", "gptq4_v1-act-M3-fp32",
                                  "nf4-g64-M3-fp16-splitk"])
def test_library_gemv_non_finite_activation_like_the_dequantised_matmul(case):
    # The zero point is subtracted from each code, not folded out of the sum (inf - inf = NaN).
    out, ref = _lib_gemv(case, inf=True)
    assert torch.isinf(ref).any()
    tol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out, ref, equal_nan=True, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("path", ["gemv-words", "gemv-codes", "mm", "cublas"])
def test_gptq_negative_g_idx_counts_from_the_end(path, device):
    """GPTQ's forms index the scales and zero points with g_idx as torch does, a negative index
    counted from the end: every path reads the same rows (it read before the tensors: 1e4 off)."""
    fmt, N, K = "gptq4", 20, 96
    dtype = torch.float32 if path.startswith("gemv") else torch.bfloat16
    x, w, s, z, g, group = library_inputs(fmt, 3, N, K, dtype, seed=5, act_order=path == "gemv-codes")
    groups = s.shape[0]
    g = torch.where(torch.arange(K) % 3 == 0, g - groups, g).to(torch.int32)  # a third of them negative
    x, w, s, z, g = (t.to(device) for t in (x, w, s, z, g))
    cfg = {"gemv-words": dm.Config("gemv", BN=16, BK=32), "gemv-codes": dm.Config("gemv", BN=16, BK=32),
           "mm": dm.Config("mm", BM=16, BN=16, BK=32), "cublas": dm.CUBLAS}[path]
    out = torch.full((3, N), float("nan"), dtype=dtype, device=device)
    launch._launch(x, w, s, z, None, out, fmt, 0, cfg, g_idx=g)
    ref = dm.dequant_matmul_reference(x, w, s, z, None, fmt, group, g_idx=g)
    assert (g < 0).any() and torch.isfinite(out).all()
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.skipif(not interpreting(), reason="counts helper calls of the interpreted kernel")
def test_gptq_gemv_takes_the_word_loop_where_each_word_has_one_group(monkeypatch):
    """The word loop (one scale row per word row, codes by _word_128) runs where
    g_idx gives each word's eight codes one group and the shifts are GPTQ's own;
    act-order and another shift table take the per-code loop."""
    from fusepass.kernels.dequant_matmul import gemv

    calls = []
    real = gemv._word_128
    monkeypatch.setattr(gemv, "_word_128", lambda *a: calls.append(1) or real(*a))
    for case, words in (("gptq4-g32-M3-fp16", True), ("gptq4-g8-M2-fp32", True), ("gptq4-act-M1-fp16", False),
                        ("gptq4-shifts-M2-fp32", False)):
        calls.clear()
        _lib_gemv(case)
        assert bool(calls) == words, case


def test_gptq_gemv_checks_every_word_of_its_slice(monkeypatch):
    """Groups k // 32, but two codes beyond the check's first block of 2048 trade
    groups: their words have two groups each, and the program takes the
    per-code loop (the word loop would give them one)."""
    from fusepass.kernels.dequant_matmul import gemv

    calls = []
    real = gemv._word_128
    monkeypatch.setattr(gemv, "_word_128", lambda *a: calls.append(1) or real(*a))
    x, w, s, z, g, _ = library_inputs("gptq4", 1, 8, 2112, torch.float32, act_order=False)
    g[2060], g[2100] = g[2100].item(), g[2060].item()
    out = torch.full((1, 8), float("nan"))
    launch._launch(x, w, s, z, None, out, "gptq4", 0, dm.Config("gemv", BN=8, BK=64), g_idx=g)
    ref = dm.dequant_matmul_reference(x, w, s, z, None, "gptq4", 32, g_idx=g)
    torch.testing.assert_close(out, ref, atol=TOLERANCES[torch.float32].atol, rtol=TOLERANCES[torch.float32].rtol)
    assert not calls or not interpreting()


@pytest.mark.skipif(not interpreting(), reason="counts helper calls of the interpreted kernel")
def test_codebook_gemv_takes_its_loop_on_whole_chunks(monkeypatch):
    """The code books run the int4 loop (one lookup per value, tiles._codebook_pair)
    where a block is whole 16-byte chunks (or half a block under 32) and the tile
    whole chunks; a block of 48 reads value by value."""
    from fusepass.kernels.dequant_matmul import gemv

    calls = []
    real = gemv._codebook_pair
    monkeypatch.setattr(gemv, "_codebook_pair", lambda *a: calls.append(1) or real(*a))
    for case, loop in (("nf4-g64-M1-bf16", True), ("fp4-g16-M1-fp32", True), ("nf4-g48-M2-bf16", False)):
        calls.clear()
        _lib_gemv(case)
        assert bool(calls) == loop, case
    assert not launch.own_loop("nf4", 64, 64, dm.Config("gemv", BN=8, BK=48))  # a tile of 1.5 chunks


def test_library_gemv_plans():
    """The GEMV range of HQQ (even N) and GPTQ
    plans their own loops: HQQ a 16-byte chunk per thread and pair, GPTQ 128
    columns; odd N and more rows of GPTQ take the paths that read value by value."""
    for M in (1, 2, 5, 8):
        for N, K in ((4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096), (22, 128)):
            p = _problem(M, N, K, "hqq4", 64, torch.bfloat16)
            cfg = plans.heuristic(p)
            assert valid(cfg, p) and cfg.kind == "gemv" and cfg.BK == 512 * cfg.warps, (M, N, K, cfg)
            assert launch.gemv_asm("hqq4", 64, N, cfg)
            for fmt in ("gptq4", "gptq4_v1"):
                p = _problem(M, N, K, fmt, 0, torch.float16)
                cfg = plans.heuristic(p)
                assert valid(cfg, p) and cfg.kind == "gemv" and cfg.BN == 128, (M, N, K, cfg)
    for M in (16, 64, 256):  # beyond the GEMV, the transposed kernel on a large weight
        p = _problem(M, 4096, 4096, "hqq4", 64, torch.bfloat16)
        assert plans.heuristic(p).kind == "mmt" and valid(plans.heuristic(p), p)
    p = _problem(1, 4097, 4096, "hqq4", 64, torch.bfloat16)
    assert plans.heuristic(p).BK == 256 and not launch.hqq_pairs("hqq4", 4097)
    assert not launch.gemv_asm("hqq4", 64, 4096, dm.Config("gemv", BN=8, BK=256))  # a thread's chunk is not whole
    assert plans.heuristic(_problem(9, 4096, 4096, "gptq4", 0, torch.bfloat16)).kind == "mm"
    # The code books: to four rows (and fp32 x to eight) the int4 GEMV's tiles where
    # blocks are whole chunks, each thread a whole chunk (the shuffles convert four bytes at a time); from
    # five rows to 256 the transposed kernel on words; blocks of 48 value by value.
    for M in (1, 2, 4, 8, 16, 64, 256):
        for N, K in ((4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)):
            for fmt, G in (("nf4", 64), ("fp4", 64), ("nf4", 128), ("nf4", 32)):
                for dtype in (torch.bfloat16, torch.float32):
                    p = _problem(M, N, K, fmt, G, dtype)
                    cfg = plans.heuristic(p)
                    assert valid(cfg, p), (M, N, K, fmt, G, dtype, cfg)
                    if M > 4 and dtype != torch.float32:
                        assert cfg.kind == "mmt" and cfg.BK == (128 if M <= 16 else 64), (M, N, K, fmt, G, dtype, cfg)
                    elif M <= 8:
                        assert cfg.kind == "gemv" and launch.own_loop(fmt, N, G, cfg) \
                            and launch.gemv_asm(fmt, G, N, cfg), (M, N, K, fmt, G, dtype, cfg)
    p = _problem(16, 4096, 4160, "nf4", 64, torch.bfloat16)  # K not whole tiles of 128: tiles of 64
    assert plans.heuristic(p).BK == 64
    p = _problem(1, 4096, 4032, "nf4", 48, torch.bfloat16)
    assert not launch.own_loop("nf4", 4096, 48, plans.heuristic(p))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,group,act_order", [("nf4", 64, False), ("fp4", 64, False), ("nf4", 128, False),
                                                 ("hqq4", 64, False), ("hqq4", 32, False), ("gptq4", 128, False),
                                                 ("gptq4", 128, True), ("gptq4_v1", 32, False)])
def test_gpu_library_gemv_loops(fmt, group, act_order):
    """The code books', HQQ's and GPTQ's GEMV loops on the GPU, with the inline-PTX
    conversions and shuffles the interpreter never runs: the op's plan at M = 1-8
    against the reference, with infinite activations, and the op at M = 1 in a CUDA graph."""
    N, K = 4096, 4096
    G = group if fmt in ("hqq4", "nf4", "fp4") else 0
    # (16-bit x from five rows takes the code books to the transposed kernel: three rows there)
    m_odd = 3 if fmt in ("nf4", "fp4") else 5
    for M, dtype in ((1, torch.bfloat16), (2, torch.float16), (m_odd, torch.bfloat16), (8, torch.float32)):
        x, w, s, z, g, _ = (t.cuda() if isinstance(t, torch.Tensor) else t
                            for t in library_inputs(fmt, M, N, K, dtype, seed=M, group=group, act_order=act_order))
        x[0, 5] = float("inf")
        x[M - 1, 1001] = float("-inf")
        cfg = plans.lookup(Problem.of(M, N, K, fmt, G, dtype, x.device))
        assert cfg.kind == "gemv", cfg
        out = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
        launch._launch(x, w, s, z, None, out, fmt, G, cfg, g_idx=g)
        ref = dm.dequant_matmul_reference(x, w, s, z, None, fmt, group, g_idx=g)
        assert torch.isinf(ref).any()
        tol = TOLERANCES[dtype]
        torch.testing.assert_close(out, ref, equal_nan=True, atol=tol.atol, rtol=tol.rtol,
                                   msg=lambda m: f"{cfg.label()} M{M}: {m}")
    x, w, s, z, g, _ = (t.cuda() if isinstance(t, torch.Tensor) else t
                        for t in library_inputs(fmt, 1, N, K, torch.bfloat16, group=group, act_order=act_order))
    expected = torch.ops.fusepass.dequant_matmul(x, w, s, z, None, fmt, group, g)
    ref = dm.dequant_matmul_reference(x, w, s, z, None, fmt, group, g_idx=g)
    tol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(expected, ref, atol=tol.atol, rtol=tol.rtol)
    _assert_graph_replays(lambda: torch.ops.fusepass.dequant_matmul(x, w, s, z, None, fmt, group, g), expected)


def _assert_graph_replays(call, expected):
    """``call`` captured in a CUDA graph and replayed gives ``expected``."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nf4", "fp4", "gptq4", "gptq4_v1", "hqq4"])
def test_gpu_library_layouts_real_sizes(fmt):
    """The libraries' layouts on a GPU at a real layer's size, every path and the op's plan in a CUDA graph."""
    N, K = 4096, 4096
    paths = [dm.Config("gemv", BN=8, BK=256, split=1), dm.Config("gemv", BN=16, BK=256, split=4),
             dm.Config("mm", BM=16, BN=64, BK=32, split=1, stages=3), dm.Config("mm", BM=64, BN=128, BK=32, split=2),
             # (the code books' transposed kernel: its shuffles run only here)
             dm.Config("mmt", BM=16, BN=128, BK=128, split=8, stages=3, ahead=1),
             dm.Config("mmt", BM=64, BN=128, BK=128, split=2, warps=8, stages=3, ahead=2, xperm=1),
             dm.CUBLAS]
    for cfg in paths:
        for M, dtype in ((1, torch.bfloat16), (5, torch.float16), (77, torch.bfloat16)):
            if cfg.kind == "gemv" and M > 8 or (fmt == "fp4" and dtype == torch.float16):
                continue
            if cfg.kind == "mmt" and M == 1:  # (a compile each: the plans take it from five rows)
                continue
            if not _valid(cfg, M, K, fmt, 64 if fmt in ("nf4", "fp4") else 32, dtype):
                continue
            x, w, s, z, g, group = (t.cuda() if isinstance(t, torch.Tensor) else t
                                    for t in library_inputs(fmt, M, N, K, dtype, seed=M))
            out = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
            launch._launch(x, w, s, z, None, out, fmt, group if fmt in ("nf4", "fp4", "hqq4") else 0, cfg, g_idx=g)
            ref = dm.dequant_matmul_reference(x, w, s, z, None, fmt, group, g_idx=g)
            assert torch.isfinite(out).all(), (cfg, M)
            tol = TOLERANCES[dtype]
            torch.testing.assert_close(out, ref, atol=tol.atol, rtol=tol.rtol, msg=lambda m: f"{cfg} M{M}: {m}")
    x, w, s, z, g, group = (t.cuda() if isinstance(t, torch.Tensor) else t
                            for t in library_inputs(fmt, 16, N, K, torch.bfloat16))
    expected = torch.ops.fusepass.dequant_matmul(x, w, s, z, None, fmt, group, g)
    _assert_graph_replays(lambda: torch.ops.fusepass.dequant_matmul(x, w, s, z, None, fmt, group, g), expected)


@pytest.mark.skipif(not interpreting(), reason="the ops' kernels on CPU tensors under the interpreter")
def test_tune_step_pins_plans_the_steps_launches_take(plan_files, monkeypatch):
    """``fusepass tune --step`` on a tiny Llama's int4 decode step, its ops' Triton
    kernels interpreted on the CPU: the step's plans are found from its lookups
    (q / k / v, gate / up as one gated call, o, down), a candidate pinned for the
    largest (the gated pair's) is what that call's launch then takes, and a plan
    kept (where the interpreted step ran faster) lands in the user cache marked
    as the step's."""
    import dataclasses

    from fusepass.bench.e2e.tune_step import tune_step
    from fusepass.kernels.dequant_matmul import gated as gm
    from fusepass.testing import differential

    launched = []
    real = gm.gated_launch
    monkeypatch.setattr(gm, "gated_launch", lambda *a, **k: launched.append(a[8].BN) or real(*a, **k))
    tried = []

    def candidates(p):  # one other tile for the first (largest) plan, none for the rest
        tried.append(p)
        return [dataclasses.replace(plans.lookup(p), BN=4)] if len(tried) == 1 else []

    with differential.triton_on_cpu():
        choices, before, after = tune_step("tiny-llama", "1", "int4", 32, 1, 4, min_gain=0.0,
                                           candidates=candidates, say=lambda line: None)
    keys = [(c.key.N, c.key.K) for c in choices]
    assert keys == [(256, 64), (128, 64), (64, 128), (64, 64)]  # gate + up, q + k + v, down, o
    assert 8 in launched and 4 in launched  # the heuristic's eight rows, then the pinned four
    assert choices[0].after.BN in (4, 8) and all(c.after == c.before for c in choices[1:])
    # (the interpreter's timings decide whether the four rows were faster: saved only then)
    saved = json.loads(plan_files.read_text())["plans"] if plan_files.exists() else {}
    if choices[0].after.BN == 4:
        assert list(saved) == [choices[0].key.key] and saved[choices[0].key.key]["where"] == "step"
    else:
        assert not saved
    assert before > 0 and after > 0


def test_tune_step_without_rules_compiles_that_variant(monkeypatch):
    """``fusepass tune --step --without RULE`` tunes the step of fusepass without
    that rule (the plans of that variant's lookups): the model is compiled with
    the backend name ``fusepass bench e2e`` uses for the A/B."""
    from fusepass.bench.e2e import run
    from fusepass.bench.e2e.tune_step import tune_step
    from fusepass.testing import differential

    asked = []

    class Stop(Exception):
        pass

    def fresh(model, backend, **kwargs):
        asked.append((backend, run.compile_args(backend)))
        raise Stop

    monkeypatch.setattr(run, "_fresh", fresh)
    with differential.triton_on_cpu(), pytest.raises(Stop):
        tune_step("tiny-llama", "1", "int4", 32, without=["dequant_matmul_gated", "swiglu"], say=lambda line: None)
    backend, args = asked[0]
    assert backend == "fusepass-no:dequant_matmul_gated+swiglu"
    assert args["options"]["disable_rules"] == ["dequant_matmul_gated", "swiglu"]

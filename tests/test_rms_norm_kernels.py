"""fusepass::rms_norm and fusepass::add_rms_norm: kernels against an fp64 reference.

Without CUDA the launchers run under Triton's interpreter (conftest sets
TRITON_INTERPRET=1) on CPU tensors at small shapes, each variant forced.
Every launch writes into outputs filled with NaN, so an element the kernel
skips fails the comparison.

Triton 3.9's interpreter truncates fp32 -> bf16 (``_convert_float`` with no
rounding mode) where the GPU rounds to nearest even; the kernels round their
bf16 results to nearest themselves under the interpreter (``round_to``), so
the interpreted kernels compute what the GPU computes.
"""

from __future__ import annotations

import pytest
import torch
import triton

from fusepass.kernels import rms_norm as K
from fusepass.kernels._common import (
    TOLERANCES,
    Tol,
    clear_kernel_fallbacks,
    inject_failure,
    kernel_fallbacks,
)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
NAMES = {v: k for k, v in DTYPES.items()}
EPS = 1e-6


def forced(variant: str, N: int) -> dict:
    """Overrides that make each variant do its interesting thing at small shapes."""
    if variant == "tile":
        return {"variant": "tile", "block_m": 4}  # M = 5, 7: a partial last tile
    if variant == "looped":
        # Two or more chunks per row when N > 16, the last one partial when N
        # is odd; two programs, so programs loop over several rows.
        return {"variant": "looped", "block_n": max(16, triton.next_power_of_2(N) // 2), "num_programs": 2}
    return {"variant": variant}


def make(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    res = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, res, w


def reference64(x, w, weight_offset, cast_before_weight, out_dtype, res=None):
    """The op in fp64 with the op's own roundings (h and the cast before the weight)."""
    h = None
    if res is not None:
        h = (x.double() + res.double()).to(x.dtype)
        x = h
    xd = x.double()
    n = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)
    if cast_before_weight:
        n = n.to(x.dtype).double()
    return (n * (w.double() + weight_offset)).to(out_dtype), h


def tol_for(x_dtype, out_dtype, cast_before_weight) -> Tol:
    # The op rounds to x's dtype before the weight when cast_before_weight:
    # an fp32 output then carries x's rounding error.
    tols = [TOLERANCES[out_dtype]] + ([TOLERANCES[x_dtype]] if cast_before_weight else [])
    return Tol(max(t.atol for t in tols), max(t.rtol for t in tols))


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def run_and_check(op, x, res, w, weight_offset, cast_before_weight, out_dtype, **overrides):
    out = poisoned(x.shape, out_dtype)
    if op == "rms_norm":
        y = K.rms_norm_fwd(x, w, EPS, weight_offset, cast_before_weight, out_dtype, out=out, **overrides)
        h, h_ref = None, None
        y_ref, _ = reference64(x, w, weight_offset, cast_before_weight, out_dtype)
    else:
        h_out = poisoned(x.shape, x.dtype)
        y, h = K.add_rms_norm_fwd(x, res, w, EPS, weight_offset, cast_before_weight, out_dtype,
                                  out=out, h_out=h_out, **overrides)
        assert h is h_out
        _, h_ref = reference64(x, w, weight_offset, cast_before_weight, out_dtype, res=res)
        # The norm of the kernel's own h: under the interpreter h may be one
        # bf16 ulp off (see the module docstring), and an fp32 output would
        # carry that difference.  h itself is checked against h_ref below.
        y_ref, _ = reference64(h, w, weight_offset, cast_before_weight, out_dtype)
    assert y is out
    t = tol_for(x.dtype, out_dtype, cast_before_weight)
    torch.testing.assert_close(y.double(), y_ref.double(), atol=t.atol, rtol=t.rtol)
    if h is not None:
        th = TOLERANCES[x.dtype]
        torch.testing.assert_close(h.double(), h_ref.double(), atol=th.atol, rtol=th.rtol)


OPS = ["rms_norm", "add_rms_norm"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("variant", K.VARIANTS)
def test_bf16_roundings_are_to_nearest(op, variant):
    """bf16 in and out, cast before the weight: h, the normalised value and the output each
    rounded to nearest, under the interpreter too (its own conversion truncates: a
    differential program's add+RMSNorm came out one bf16 ulp low at magnitudes 8-16, 0.0625
    off).  Nearly every element is the fp64 reference's bf16 value, and none is low on average."""
    x, res, w = make((5, 257), torch.bfloat16, seed=4)
    kw = forced(variant, 257)
    if op == "rms_norm":
        y = K.rms_norm_fwd(x, w, EPS, 0.0, True, torch.bfloat16, **kw)
        h, y_ref = None, reference64(x, w, 0.0, True, torch.float64)[0]
    else:
        y, h = K.add_rms_norm_fwd(x, res, w, EPS, 0.0, True, torch.bfloat16, **kw)
        assert torch.equal(h, (x.double() + res.double()).to(torch.bfloat16))
        y_ref = reference64(h, w, 0.0, True, torch.float64)[0]
    y = y.double()
    same = (y == y_ref.to(torch.bfloat16).double()).double().mean().item()
    ulps = ((y - y_ref) / y_ref.abs().clamp_min(1e-30) * 128).mean().item()  # signed, in bf16's 2^-7
    assert same > 0.95 and abs(ulps) < 0.05, (same, ulps)


# ------------------------------------------------------------- semantics ----

SEMANTICS = [
    pytest.param(op, v, dt, off, cast, out,
                 id=f"{op}-{v}-{dt}-off{off:g}-{'cast' if cast else 'nocast'}-out_{out}")
    for op in OPS
    for v in K.VARIANTS
    for dt in DTYPES
    for off in (0.0, 1.0)
    for cast in (False, True)
    for out in ([dt, "fp32"] if dt != "fp32" else ["fp32", "bf16"])
]


@pytest.mark.parametrize("op,variant,dtype,weight_offset,cast,out", SEMANTICS)
def test_semantics(op, variant, dtype, weight_offset, cast, out):
    """Every argument combination, each variant: M5-N33."""
    x, res, w = make((5, 33), DTYPES[dtype])
    run_and_check(op, x, res, w, weight_offset, cast, DTYPES[out], **forced(variant, 33))


# The launch options that change the code, not the math: the weight loaded
# before the reduction (row, tile), the looped variant with one program per row.
OPTIONS = [
    pytest.param(op, dt, M, N, kw, id=f"{op}-{dt}-M{M}-N{N}-" + "-".join(f"{k}{v}" for k, v in kw.items()))
    for op in OPS
    for dt in ("bf16", "fp32")
    for M, N, kw in [
        (5, 33, {"variant": "row", "w_first": True}),
        (5, 33, {"variant": "row", "w_first": False}),
        (5, 33, {"variant": "tile", "block_m": 4, "w_first": True}),
        (5, 33, {"variant": "tile", "block_m": 4, "w_first": False}),
        (7, 130, {"variant": "looped"}),  # one program per row, the heuristic's chunks
    ]
]


@pytest.mark.parametrize("op,dtype,M,N,kw", OPTIONS)
def test_launch_options(op, dtype, M, N, kw):
    x, res, w = make((M, N), DTYPES[dtype], seed=N)
    run_and_check(op, x, res, w, 1.0, True, DTYPES[dtype], **kw)


# ---------------------------------------------------------------- shapes ----

# The interpreter's cost grows with M x N (bf16 casts are bit-twiddled in
# numpy): M = 64 only at short rows.
SHAPES = [
    pytest.param(op, v, M, N, id=f"{op}-{v}-M{M}-N{N}")
    for op in OPS
    for v in K.VARIANTS
    for M, N in [(1, 1), (1, 7), (1, 2048), (7, 7), (7, 33), (7, 130), (7, 2048), (64, 1), (64, 33)]
]


@pytest.mark.parametrize("op,variant,M,N", SHAPES)
def test_shapes(op, variant, M, N):
    x, res, w = make((M, N), torch.bfloat16, seed=M * 10007 + N)
    run_and_check(op, x, res, w, 0.0, True, torch.bfloat16, **forced(variant, N))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("M,N", [(64, 130), (64, 2048), (3, 4096)], ids=lambda v: str(v))
def test_default_config(op, M, N):
    """No overrides: whatever the heuristic picks on this device."""
    x, res, w = make((M, N), torch.float16)
    run_and_check(op, x, res, w, 1.0, False, torch.float16)


@pytest.mark.parametrize("op", OPS)
def test_looped_long_row(op):
    """N = 262151 (2**18 + 7): 65 chunks of the default 4096, the last one 7 wide."""
    x, res, w = make((3, 262151), torch.bfloat16)
    assert K.rms_norm_config(3, 262151, 2, K.sm_count(x.device)).variant == "looped"
    run_and_check(op, x, res, w, 0.0, True, torch.bfloat16)


# --------------------------------------------------------------- layouts ----


def _layouts(N):
    g = torch.Generator().manual_seed(N)
    wide = torch.randn(6, 2 * N, generator=g).to(torch.bfloat16)
    tall = torch.randn(N, 6, generator=g).to(torch.bfloat16)
    return {
        "leading-2x3": torch.randn(2, 3, N, generator=g).to(torch.bfloat16),
        "column-slice": wide[:, 3:3 + N],  # row stride 2N, a view
        "every-other-row": wide[::2, :N],
        "transposed": tall.t(),  # column stride 6: copied
        "broadcast-rows": torch.randn(N, generator=g).to(torch.bfloat16).expand(6, N),  # row stride 0
        "strided-3d": torch.randn(2, 6, N, generator=g).to(torch.bfloat16)[:, ::2],
    }


LAYOUTS = [
    pytest.param(op, v, name, id=f"{op}-{v}-{name}-N33")
    for op in OPS
    for v in K.VARIANTS
    for name in _layouts(33)
]


@pytest.mark.parametrize("op,variant,layout", LAYOUTS)
def test_layouts(op, variant, layout):
    x = _layouts(33)[layout]
    _, _, w = make((1, 33), torch.bfloat16)
    res = torch.randn(x.shape).to(torch.bfloat16).transpose(-1, -2).contiguous().transpose(-1, -2)
    run_and_check(op, x, res, w, 1.0, True, torch.bfloat16, **forced(variant, 33))


def test_rows_view_without_copy():
    wide = torch.randn(6, 64)
    assert K._rows(wide[:, 8:40], 32).data_ptr() == wide[:, 8:].data_ptr()
    assert K._rows(wide[::2, :32], 32).stride() == (128, 1)
    assert K._rows(torch.randn(32).expand(5, 32), 32).stride() == (0, 1)
    assert K._rows(torch.randn(32, 5).t(), 32).stride() == (32, 1)  # the one copy


# ------------------------------------------------------------- zero size ----

ZERO = [(0, 8), (4, 0), (2, 0, 8), (0,)]


@pytest.mark.parametrize("shape", ZERO, ids=lambda s: "x".join(map(str, s)))
def test_zero_size(shape):
    x = torch.empty(shape, dtype=torch.bfloat16)
    w = torch.ones(shape[-1], dtype=torch.bfloat16)
    for variant in K.VARIANTS:
        y = K.rms_norm_fwd(x, w, EPS, 0.0, True, torch.float32, variant=variant)
        assert y.shape == x.shape and y.dtype == torch.float32
        y, h = K.add_rms_norm_fwd(x, x, w, EPS, 0.0, True, torch.float32, variant=variant)
        assert y.shape == h.shape == x.shape and h.dtype == x.dtype
    for fn in (torch.ops.fusepass.rms_norm, K._rms_norm_cuda):
        assert fn(x, w, EPS, 0.0, True, torch.float16).shape == x.shape
    for fn in (torch.ops.fusepass.add_rms_norm, K._add_rms_norm_cuda):
        y, h = fn(x, x, w, EPS, 0.0, True, torch.float16)
        assert y.shape == h.shape == x.shape and y.dtype == torch.float16


def test_bad_out_is_refused():
    x, _, w = make((4, 8), torch.float32)
    with pytest.raises(ValueError, match="out is"):
        K.rms_norm_fwd(x, w, EPS, out=torch.empty(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="holds a whole row"):
        K.rms_norm_fwd(x, w, EPS, variant="row", block_n=4)


# ------------------------------------------------------------ heuristics ----

# What an H100 (132 SMs) gets at the benchmark shapes, bf16.
H100 = [
    # residual, M, N, variant, BM, BN, num_warps, programs, w_first
    (False, 4096, 4096, "row", 1, 4096, 8, 4096, False),
    (False, 16384, 4096, "row", 1, 4096, 8, 16384, False),
    (False, 8192, 8192, "row", 1, 8192, 16, 8192, False),
    (False, 4096, 16384, "row", 1, 16384, 32, 4096, False),
    (False, 2048, 65536, "looped", 1, 8192, 16, 264, False),  # 264 rows x 128 KB in flight: 34 MB of L2
    (False, 8, 262144, "looped", 1, 16384, 32, 8, False),
    (False, 2048, 32768, "looped", 1, 4096, 8, 528, False),
    (False, 1, 4096, "row", 1, 4096, 8, 1, True),  # one wave: the weight's load overlaps x's
    (False, 32, 4096, "row", 1, 4096, 8, 32, True),
    (False, 32, 16384, "row", 1, 16384, 32, 32, False),  # w_first would spill
    (False, 131072, 128, "tile", 32, 128, 8, 4096, False),  # Qwen3 q/k norm: 4096 tokens x 32 heads
    (False, 2048, 128, "tile", 2, 128, 1, 1024, False),  # 64 tokens x 32 heads: tiles shrink to fill 132 SMs
    (False, 64, 128, "tile", 1, 128, 1, 64, True),  # 2 tokens x 32 heads
    # add+RMSNorm: the two-pass loop, one program per row, at 4096..8192 with many rows...
    (True, 4096, 4096, "looped", 1, 2048, 8, 4096, False),
    (True, 8192, 8192, "looped", 1, 2048, 8, 8192, False),
    (True, 4096, 16384, "row", 1, 16384, 32, 4096, False),
    (True, 32, 4096, "row", 1, 4096, 8, 32, True),  # ...not at decode sizes
    (True, 2048, 65536, "looped", 1, 16384, 32, 132, False),  # x, res and h: 256 KB a row in flight
]


@pytest.mark.parametrize("residual,M,N,variant,BM,BN,warps,programs,w_first", H100, ids=lambda v: str(v))
def test_heuristics_h100(residual, M, N, variant, BM, BN, warps, programs, w_first):
    assert K.rms_norm_config(M, N, 2, 132, residual=residual) == K.RmsNormConfig(
        variant, BM, BN, warps, programs, w_first=w_first)


# ------------------------------------------------------------ custom ops ----


def _opcheck_samples(op):
    x, res, w = make((2, 3, 16), torch.bfloat16)
    xt = torch.randn(16, 6).t()  # non-contiguous fp32
    wt = torch.randn(16)
    x64 = torch.randn(4, 16, dtype=torch.float64)
    eps64 = torch.tensor(0.5, dtype=torch.float64)  # dynamic=True's unspecialised float
    if op == "rms_norm":
        return [
            (x, w, EPS, 0.0, True, torch.bfloat16),
            (xt, wt, 1e-5, 1.0, False, torch.float32),
            (x, wt, EPS, 0.0, True, torch.float32),
            (x64, x64[0], EPS, 0.0, False, torch.float64),
            (x, w, 0.0, 0.0, True, torch.bfloat16, eps64),
        ]
    return [
        (x, res, w, EPS, 0.0, True, torch.bfloat16),
        (xt, torch.randn(6, 16), wt, 1e-5, 1.0, False, torch.float32),
        (x64, x64, x64[0], EPS, 1.0, True, torch.float64),
        (x, res, w, 0.0, 1.0, False, torch.bfloat16, eps64),
    ]


@pytest.mark.parametrize("op", OPS)
def test_opcheck(op, device):
    for args in _opcheck_samples(op):
        args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(getattr(torch.ops.fusepass, op).default, args)


@pytest.mark.parametrize("op", OPS)
def test_under_torch_compile(op):
    """The fake impl under Dynamo + AOTAutograd, fullgraph, with dynamic M."""
    x, res, w = make((2, 5, 16), torch.bfloat16)
    if op == "rms_norm":
        def fn(x, res, w):
            return torch.ops.fusepass.rms_norm(x, w, EPS, 1.0, True, torch.float32)
    else:
        def fn(x, res, w):
            return torch.ops.fusepass.add_rms_norm(x, res, w, EPS, 1.0, True, torch.float32)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    for m in (5, 9):
        xm, rm = x[:, :1].expand(2, m, 16).contiguous(), res[:, :1].expand(2, m, 16).contiguous()
        for got, want in zip(torch.utils._pytree.tree_leaves(compiled(xm, rm, w)),
                             torch.utils._pytree.tree_leaves(fn(xm, rm, w))):
            assert got.shape == want.shape and got.is_contiguous()
            torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.fixture
def fallbacks():
    clear_kernel_fallbacks()
    yield kernel_fallbacks
    clear_kernel_fallbacks()


def _cuda_impl(op):
    return K._rms_norm_cuda if op == "rms_norm" else K._add_rms_norm_cuda


def _op_args(op, x, res, w):
    return (x, w) if op == "rms_norm" else (x, res, w)


@pytest.mark.parametrize("op", OPS)
def test_fallback_on_kernel_failure(op, fallbacks):
    """An injected failure in the CUDA impl returns the reference and is recorded."""
    x, res, w = make((4, 33), torch.bfloat16)
    args = (*_op_args(op, x, res, w), EPS, 1.0, True, torch.bfloat16)
    want = getattr(K, f"{op}_reference")(*args)
    with inject_failure(op):
        got = _cuda_impl(op)(*args)
    for g, r in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert torch.equal(g, r)
    assert "injected failure" in fallbacks()[op]


@pytest.mark.parametrize("op", OPS)
def test_cuda_impl_runs_the_kernel(op, fallbacks, monkeypatch):
    """The CUDA impl launches Triton (here: the interpreter) for fp32/fp16/bf16,
    and sends fp64 to the reference without a launch."""
    x, res, w = make((4, 33), torch.float16)
    args = (*_op_args(op, x, res, w), EPS, 0.0, False, torch.float16)
    got = _cuda_impl(op)(*args)
    want = reference64(x, w, 0.0, False, torch.float16, res=None if op == "rms_norm" else res)
    for g, r in zip(torch.utils._pytree.tree_leaves(got), [t for t in want if t is not None]):
        torch.testing.assert_close(g, r, atol=TOLERANCES[torch.float16].atol, rtol=TOLERANCES[torch.float16].rtol)
    assert fallbacks() == {}

    def no_launch(*a, **k):
        raise AssertionError("fp64 reached the Triton launcher")

    monkeypatch.setattr(K, f"{op}_fwd", no_launch)
    x64, r64, w64 = (t.double() for t in (x, res, w))
    args64 = (*_op_args(op, x64, r64, w64), EPS, 1.0, True, torch.float64)
    got = _cuda_impl(op)(*args64)
    want = getattr(K, f"{op}_reference")(*args64)
    for g, r in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert g.dtype == torch.float64 and torch.equal(g, r)
    assert fallbacks() == {}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("variant", K.VARIANTS)
def test_eps_tensor_is_read_when_the_kernel_runs(op, variant, fallbacks):
    """eps as a 0-dim tensor (dynamic=True's unspecialised float) gives the
    float eps's result exactly: on x's device the kernel loads it, a CPU one
    (on a GPU) goes as its value.  eps = 0.5 moves the output by ~20%."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, res, w = (t.to(device) for t in make((5, 33), torch.bfloat16))
    launch = K.rms_norm_fwd if op == "rms_norm" else K.add_rms_norm_fwd
    args, flags = _op_args(op, x, res, w), (0.0, True, torch.bfloat16)
    want = launch(*args, 0.5, *flags, **forced(variant, 33))
    for eps in (torch.tensor(0.5, dtype=torch.float64, device=device), torch.tensor(0.5)):
        got = launch(*args, eps, *flags, **forced(variant, 33))
        for g, r in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            assert torch.equal(g, r), f"eps on {eps.device}"
    # The op, through its CUDA implementation: eps_tensor wins over eps.
    got = _cuda_impl(op)(*args, 1e-6, *flags, eps_tensor=torch.tensor(0.5))
    for g, r in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        torch.testing.assert_close(g, r, atol=TOLERANCES[torch.bfloat16].atol, rtol=TOLERANCES[torch.bfloat16].rtol)
    assert fallbacks() == {}


# ------------------------------------------------------------------- GPU ----

GPU_SHAPES = [(4096, 4096), (16384, 4096), (8192, 8192), (4096, 16384), (2048, 65536), (1, 4096), (32, 4096),
              (131072, 128), (4, 262144)]


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("M,N", GPU_SHAPES, ids=lambda v: str(v))
def test_gpu_real_sizes(op, M, N, fallbacks):
    """bf16 at model sizes against an fp32 reference, through the op; no fallback allowed."""
    torch.manual_seed(0)
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
    t = TOLERANCES[torch.bfloat16]
    if op == "rms_norm":
        y = torch.ops.fusepass.rms_norm(x, w, EPS, 0.0, True, torch.bfloat16)
        y_ref = K.rms_norm_reference(x, w, EPS, 0.0, True, torch.float32)
    else:
        y, h = torch.ops.fusepass.add_rms_norm(x, res, w, EPS, 0.0, True, torch.bfloat16)
        y_ref, h_ref = K.add_rms_norm_reference(x, res, w, EPS, 0.0, True, torch.float32)
        assert torch.equal(h, h_ref)  # one fp32 add rounded to bf16, as torch does
    torch.cuda.synchronize()
    assert fallbacks() == {}, fallbacks()
    torch.testing.assert_close(y.float(), y_ref, atol=t.atol, rtol=t.rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("variant", K.VARIANTS)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_gpu_variants(op, variant, dtype):
    """Each variant compiled for the GPU, poisoned outputs, at a size with partial blocks."""
    M, N = 1000, 3000 if variant != "tile" else 130
    x, res, w = (t.cuda() for t in make((M, N), DTYPES[dtype]))
    overrides = {"variant": variant, **({"block_m": 8} if variant == "tile" else {}),
                 **({"block_n": 1024} if variant == "looped" else {})}
    out = torch.full((M, N), float("nan"), device="cuda", dtype=DTYPES[dtype])
    if op == "rms_norm":
        y = K.rms_norm_fwd(x, w, EPS, 1.0, True, DTYPES[dtype], out=out, **overrides)
        y_ref, _ = reference64(x, w, 1.0, True, DTYPES[dtype])
    else:
        h_out = torch.full_like(out, float("nan"))
        y, h = K.add_rms_norm_fwd(x, res, w, EPS, 1.0, True, DTYPES[dtype], out=out, h_out=h_out, **overrides)
        _, h_ref = reference64(x, w, 1.0, True, DTYPES[dtype], res=res)
        assert torch.equal(h, h_ref)  # the GPU rounds to nearest even, as torch does
        y_ref, _ = reference64(h, w, 1.0, True, DTYPES[dtype])
    t = TOLERANCES[DTYPES[dtype]]
    torch.testing.assert_close(y.double(), y_ref.double(), atol=t.atol, rtol=t.rtol)

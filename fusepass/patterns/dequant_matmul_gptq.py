"""GPTQ's 4-bit linear as its torch kernel dequantizes it -> ``fusepass::dequant_matmul`` (fmt "gptq4").

    q[k, n]  = (qweight[k // 8, n] >> wf[k % 8]) & 15          qweight int32 [K / 8, N]
    z[g, n]  = (qzeros[g, n // 8] >> wf[n % 8]) & 15 (+ 1)     qzeros int32 [groups, N / 8]
    W[k, n]  = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])
    y = x @ W                                                   W stored [K, N]

as GPTQ's plain-torch layer writes it (gptqmodel's ``TorchQuantLinear``;
AutoGPTQ's older kernels add 1 to the zero points, form ``v1``): the codes
unpacked with shifts by the layer's ``wf`` buffer (its bit offsets, read by
the op when it runs: the graph holds them as an input), truncated to int8
and masked, the scales and zero points gathered by ``g_idx`` (any order:
act-order included), and ``x @ W`` on a weight stored ``[K, N]``.  The op
reads the packed words as they are (fusepass.formats: gptq4), so nothing is
repacked and nothing of the weight is computed at compile time.  Leading
dims of x are flattened around the matmul as usual; a bias added after
stays an add beside the op.

Refused with the reason: scales not in x's dtype (the model's own matmul
would fail), shapes that are not GPTQ's 4-bit layout (8 codes per word, a
g_idx of K entries), a shift table that is not eight offsets.
"""

from __future__ import annotations

import torch
import torch.fx

from fusepass.match import MatchInfo, same, shape_str
from fusepass.patterns import dequant_matmul as dm
from fusepass.rule import Form, NearMiss, Rule

aten = torch.ops.aten
N_EX, K_EX, G_EX = 24, 64, 32


def _unpacked(qweight, qzeros, wf):
    z = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, 8), wf.unsqueeze(0)).to(torch.int8)
    z = torch.bitwise_and(z, 15).reshape(qzeros.shape[0], -1)
    q = torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, 8, -1), wf.unsqueeze(-1)).to(torch.int8)
    q = torch.bitwise_and(q, 15).reshape(-1, qweight.shape[1])
    return q, z


def search(x, qweight, qzeros, scales, g_idx, wf):
    q, z = _unpacked(qweight, qzeros, wf)
    g = g_idx.long()
    return torch.matmul(x, scales[g] * (q - z[g]))


def search_v1(x, qweight, qzeros, scales, g_idx, wf):
    q, z = _unpacked(qweight, qzeros, wf)
    z = z + 1
    g = g_idx.long()
    return torch.matmul(x, scales[g] * (q - z[g]))


def _replace(fmt):
    def replace(x, qweight, qzeros, scales, g_idx, wf):
        return dm._op()(x, qweight, scales, qzeros, None, fmt, 0, g_idx, wf.reshape(-1).to(torch.int32))
    return replace


def _int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq_weights(n, k, group, dtype, act_order=True, gen=None):
    """Random GPTQ tensors: qweight, qzeros, scales, g_idx (act-order: a permutation's groups), wf."""
    qweight = _int32(torch.randint(0, 2**32, (k // 8, n), generator=gen, dtype=torch.int64))
    qzeros = _int32(torch.randint(0, 2**32, (k // group, n // 8), generator=gen, dtype=torch.int64))
    # (q - z) has rms ~6: columns of norm O(1) (see dequant_matmul.channel_scale)
    scales = ((0.5 + torch.rand(k // group, n, generator=gen)) / (6 * k ** 0.5)).to(dtype)
    g_idx = torch.arange(k, dtype=torch.int32) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    wf = torch.arange(0, 32, 4, dtype=torch.int32).unsqueeze(0)
    return qweight, qzeros, scales, g_idx, wf


def example_inputs(dtype):
    return [torch.randn(4, K_EX, dtype=dtype), *gptq_weights(N_EX, K_EX, G_EX, dtype)]


def sized_inputs(dtype, shape):
    """x of ``shape`` with K rounded up to a multiple of 32 (whole words and groups)."""
    k = max(32, -(-(shape[-1] if shape else 1) // 32) * 32)
    qweight, qzeros, scales, g_idx, wf = gptq_weights(N_EX, k, 32, dtype)
    return dict(x=torch.randn(*shape[:-1], k, dtype=dtype), qweight=qweight, qzeros=qzeros, scales=scales,
                g_idx=g_idx, wf=wf)


def _reshaped(m: MatchInfo, dtype: torch.dtype) -> list[torch.Tensor]:
    return [n.meta["val"] for n in m.nodes if n.target == aten.reshape.default
            and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype == dtype]


def check(m: MatchInfo) -> str | None:
    x, qweight, qzeros, scales = m.val("x"), m.val("qweight"), m.val("qzeros"), m.val("scales")
    g_idx, wf = m.val("g_idx"), m.val("wf")
    reason = dm.check_activation(x)
    if reason:
        return reason
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        return f"qweight/qzeros are {qweight.dtype}/{qzeros.dtype}, not int32 words"
    if wf.numel() != 8 or wf.dtype != torch.int32:
        return f"the shift table {wf.dtype}{shape_str(wf)} is not eight int32 offsets (4-bit codes)"
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if not (dm.rows_contiguous(qweight) and dm.rows_contiguous(qzeros)):
        return "qweight/qzeros are not stored row after row"
    if scales.dim() != 2 or not same(scales.shape[1], n) or not same(qzeros.shape[0], scales.shape[0]) \
            or not same(qzeros.shape[1] * 8, n):
        return (f"scales {shape_str(scales)} and qzeros {shape_str(qzeros)} are not [groups, {n}] and "
                f"[groups, {n} / 8]")
    if g_idx.dim() != 1 or not same(g_idx.shape[0], k) or g_idx.dtype.is_floating_point:
        return f"g_idx {g_idx.dtype}{shape_str(g_idx)} is not {k} integers"
    if scales.dtype != x.dtype:
        return f"scales are {scales.dtype}, the activation {x.dtype}"
    # any_reshape: the unpacking reshapes must be [K, N] codes and [groups, N] zero points.
    int8 = _reshaped(m, torch.int8)
    want = {(k, n), (scales.shape[0], n)}
    got = {tuple(t.shape) for t in int8}
    if not all(any(same(a, b[0]) and same(c, b[1]) for (a, c) in got) for b in want) or len(int8) != 2:
        return f"the unpacked codes {sorted(got)} are not [K, N] = [{k}, {n}] and [groups, N]"
    return dm.check_output(m, x, n) or dm.check_library_device(x, "gptq4")


def _nm_codes_reshaped(x, qweight, qzeros, scales, g_idx, wf):
    # the words unpacked as [8, K / 8, N] (codes of one word K / 8 apart): not GPTQ's order
    q = torch.bitwise_and(torch.bitwise_right_shift(qweight.unsqueeze(0).expand(8, -1, -1),
                                                    wf.reshape(8, 1, 1)).to(torch.int8), 15)
    q = q.reshape(-1, qweight.shape[1])
    _, z = _unpacked(qweight, qzeros, wf)
    g = g_idx.long()
    return torch.matmul(x, scales[g] * (q - z[g]))


RULE = Rule(
    name="dequant_matmul_gptq",
    forms=[Form("gptq", search, _replace("gptq4")), Form("v1", search_v1, _replace("gptq4_v1"))],
    example_inputs=example_inputs,
    sized_inputs=sized_inputs,
    check=check,
    anchor=(aten.mm.default,),
    any_reshape=True,
    near_misses=[
        NearMiss("codes in another order", _nm_codes_reshaped, example_inputs, ""),
    ],
    doc=__doc__,
)

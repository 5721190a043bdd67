"""Matrix-vector products on quantized weights under coordinate-descent tuning.

With ``torch._inductor.config.coordinate_descent_tuning`` on (torchao's
``quantize_`` turns it on, and gpt-fast), Inductor decomposes an mm with
M = 1 or N = 1 into a multiply and a sum while tracing, before any post-grad
pass runs: a decode step's dequantize -> matmul would reach the rules in a
form none of them matches.  While fusepass compiles, such an mm stays an mm
when one operand is computed from an int8 / uint8 / fp8 tensor (a dequantized
weight); every other mm decomposes as Inductor would.  After the rules ran,
an mm kept so that no rule took is decomposed as Inductor would have
(Inductor's fused multiply-and-sum, not a dequantized copy and cuBLAS).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .formats import WEIGHT_DTYPES
from .regions import region_match
from .rule import Region

aten = torch.ops.aten
_STORED_DTYPES = tuple(WEIGHT_DTYPES.values())  # the op's stored weights: int8, int4 packed in uint8, fp8
_DEPTH = 12  # ops between the stored weight and the mm operand (int4's unpack is the longest chain)


def from_stored(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value is computed from an int8 / uint8 / fp8 tensor within _DEPTH ops."""
    todo, seen = [(node, 0)], {node}
    while todo:
        n, d = todo.pop()
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype in _STORED_DTYPES:
            return True
        if d < _DEPTH and n.op == "call_function":
            for a in n.all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    todo.append((a, d + 1))
    return False


def _traced_from_stored(t: Any) -> bool:
    """from_stored for a tensor being traced; False whenever that cannot be told."""
    try:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

        mode = get_proxy_mode()
        slot = get_proxy_slot(t, mode.tracer, None) if mode is not None else None
        return slot is not None and from_stored(slot.proxy.node)
    except Exception:  # noqa: BLE001 - tracing internals: when in doubt, Inductor's own decomposition
        return False


def _decomposes(a: Any, b: Any) -> bool:
    """Whether Inductor's decomposition turns mm(a, b) into a multiply and a sum (a, b values)."""
    return bool(torch._inductor.config.coordinate_descent_tuning and a.device.type not in ("cpu", "mps")
                and (statically_known_true(a.shape[0] == 1) or statically_known_true(b.shape[1] == 1)))


def _mm_keeping_quantized(inductor_mm: Any, a: Any, b: Any, *args: Any, **kwargs: Any) -> Any:
    if _decomposes(a, b) and (_traced_from_stored(b) or _traced_from_stored(a)):
        return NotImplemented  # traced as aten.mm
    return inductor_mm(a, b, *args, **kwargs)


def _inductor_mm() -> Any:
    from torch._inductor import decomposition as inductor_decomp

    return getattr(inductor_decomp, "mm", None)


@contextlib.contextmanager
def quantized_matvec_stays_mm() -> Iterator[None]:
    """Inductor's decompositions for the duration, except for a matrix-vector mm on a dequantized weight.

    The table is patched in place and restored, not passed to ``compile_fx``: a
    table passed there is part of the FX graph cache's key, which cannot hash
    it, and both Inductor's and AOTAutograd's caches would be bypassed.
    """
    from torch._inductor import decomposition as inductor_decomp

    tables = {id(t): t for t in (inductor_decomp.decompositions, inductor_decomp.select_decomp_table())}
    saved = [(t, t.get(aten.mm.default)) for t in tables.values()]
    try:
        for t, inductor_mm in saved:
            if inductor_mm is not None:
                t[aten.mm.default] = functools.partial(_mm_keeping_quantized, inductor_mm)
        yield
    finally:
        for t, inductor_mm in saved:
            if inductor_mm is not None:
                t[aten.mm.default] = inductor_mm


def decompose_kept_matvecs(gm: torch.fx.GraphModule) -> int:
    """After the rules: the mms quantized_matvec_stays_mm kept and no rule took, decomposed
    as Inductor would have.  Returns how many."""
    inductor_mm = _inductor_mm()
    if inductor_mm is None or not torch._inductor.config.coordinate_descent_tuning:
        return 0
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != aten.mm.default or len(node.args) != 2:
            continue
        a, b = node.args
        va, vb = (x.meta.get("val") if isinstance(x, torch.fx.Node) else None for x in (a, b))
        if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and _decomposes(va, vb)
                and (from_stored(b) or from_stored(a))):
            continue
        region = Region(form="inductor_mm", anchor=node, nodes=[node], outputs=[node], args=[a, b])
        # (a, b) only: traced, inductor_mm's optional out_dtype would count as a third input
        region_match(gm.graph, region).replace_by_example(lambda a, b: inductor_mm(a, b), [a, b])
        done += 1
    return done

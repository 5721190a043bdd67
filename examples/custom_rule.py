"""Writing a fusepass rule from scratch: logit soft-capping.

Gemma-2-style models cap their logits with ``cap * tanh(logits / cap)``.
Inductor fuses that into one pointwise kernel already, so this rule is here to
show the API, not for speed.  The steps are the same for any rule:

1. an op that computes the whole subgraph (a ``torch.library`` custom op with
   a fake implementation; a real rule gives it a Triton kernel for CUDA);
2. a ``search`` function in plain torch -- it is the reference semantics;
3. a ``replace`` function with the same arguments that calls the op;
4. a ``check`` that refuses, with a reason, what the op cannot do;
5. near-misses that must not match;
6. ``check_rule`` to test it, ``register_rule`` to use it.

Run:  python examples/custom_rule.py
"""

import torch

import fusepass
from fusepass import Form, NearMiss, Rule
from fusepass.testing import check_rule


# 1. The op.
@torch.library.custom_op("example::softcap", mutates_args=())
def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return (torch.tanh(x.float() / cap) * cap).to(x.dtype)


@softcap.register_fake
def _(x, cap):
    return torch.empty_like(x)


# 2. What to look for, in plain torch (``cap`` is a scalar: any value matches).
def search(x, cap):
    return torch.tanh(x / cap) * cap


# 3. What to put there instead.
def replace(x, cap):
    return torch.ops.example.softcap(x, cap)


# 4. When to say no.
def check(m: fusepass.MatchInfo):
    if m.is_node("cap"):
        return "cap is a tensor, not a Python number"
    if m.val("cap") <= 0:
        return f"cap {m.val('cap')} is not positive"
    return None


# 5. Something close that is not a soft-cap: the scale differs from the divisor.
def not_a_softcap(x):
    return torch.tanh(x / 30.0) * 20.0


RULE = Rule(
    name="softcap",
    forms=[Form("gemma2", search, replace)],
    example_inputs=lambda dtype: [torch.randn(4, 32, dtype=dtype)],
    scalars={"cap": 30.0},
    check=check,
    near_misses=[NearMiss("scale differs", not_a_softcap, lambda dt: [torch.randn(4, 32, dtype=dt)], "")],
)


def main() -> None:
    # 6. Test it the way the built-in rules are tested, then use it.
    for result in check_rule(RULE, dtypes=[torch.float32]):
        print(f"{result.case}: rewrites={result.rewrites} max error={result.max_error:.2g}")

    fusepass.register_rule(RULE, replace=True)
    try:
        def head(h, w):
            return search(h @ w, 30.0)

        h, w = torch.randn(8, 64), torch.randn(64, 128)
        fusepass.reset_reports()
        out = torch.compile(head, backend="fusepass")(h, w)
        torch.testing.assert_close(out, head(h, w))
        print(fusepass.last_report())
        assert fusepass.last_report().count("softcap") == 1
    finally:
        fusepass.unregister_rule("softcap")


if __name__ == "__main__":
    main()

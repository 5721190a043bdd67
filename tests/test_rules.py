"""Every registered rule, checked end to end from its own declaration.

A rule added later joins these checks by declaring its forms, example inputs
and near-misses: each form must be rewritten and match its search function
run eagerly (per dtype), each near-miss must be refused with its reason.
"""

import pytest
import torch

import fusepass
from fusepass.testing import check_rule

RULES = [r.name for r in fusepass.rules()]


@pytest.mark.parametrize("name", RULES)
def test_rule(name):
    results = check_rule(fusepass.get_rule(name))
    rewritten = [r for r in results if "/near-miss/" not in r.case]
    assert len(rewritten) == len(fusepass.get_rule(name).forms) * len(fusepass.get_rule(name).dtypes)
    assert all(r.rewrites >= 1 for r in rewritten)


def test_builtin_rules_are_registered():
    assert {"rms_norm", "add_rms_norm"} <= set(RULES)
    # The residual fusion must see the add before the plain norm takes the norm alone.
    assert RULES.index("add_rms_norm") < RULES.index("rms_norm")


def test_register_rule_rejects_duplicates_and_non_rules():
    rule = fusepass.get_rule("rms_norm")
    with pytest.raises(ValueError, match="already registered"):
        fusepass.register_rule(fusepass.Rule(name="rms_norm", forms=rule.forms, example_inputs=rule.example_inputs))
    with pytest.raises(TypeError):
        fusepass.register_rule(object())


def test_patterns_cover_every_dtype_and_swapped_operands():
    from fusepass.engine import compile_rule

    forms = compile_rule(fusepass.get_rule("rms_norm"))
    assert {cf.dtype for cf in forms} == {torch.float32, torch.float16, torch.bfloat16}
    assert any(cf.variant == "swapped" for cf in forms)

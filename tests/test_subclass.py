"""Tensor-subclass parameters taken apart at compile time (fusepass/subclass.py)."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import fusepass
import fusepass.backend
import fusepass.subclass
from fusepass.testing import assert_close


def _linear(requires_grad=False):
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    w = TwoTensor(torch.randn(8, 16), torch.randn(8, 16))
    lin.weight = torch.nn.Parameter(w, requires_grad=requires_grad)
    return lin


def _compile(model, **kwargs):
    torch._dynamo.reset()
    fusepass.reset_reports()
    return torch.compile(model, backend="fusepass", **kwargs)


def _notes():
    return [n for g in fusepass.last_report().graphs for n in g.notes]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_subclass_weight_matches_eager_and_follows_updates(dynamic):
    lin = _linear()
    x = torch.randn(3, 16)
    with torch.no_grad():
        compiled = _compile(lin, dynamic=dynamic)
        assert_close(compiled(x), lin(x), "first call")
        assert any("1 tensor-subclass parameter(s) taken apart" in n for n in _notes()), _notes()
        # The inner tensors are read on every call: an in-place update and a
        # replaced inner tensor both show, as they do eagerly.
        lin.weight.a.copy_(torch.randn(8, 16))
        assert_close(compiled(x), lin(x), "after an in-place update")
        lin.weight.b = torch.randn(8, 16)
        assert_close(compiled(x), lin(x), "after replacing an inner tensor")


def test_aotautograd_gets_plain_inputs_and_calls_stay_cheap(monkeypatch):
    """The graph AOTAutograd compiles takes the inner tensors.  Up to torch 2.12
    AOTAutograd's wrapper called __tensor_flatten__ on every subclass input at
    every call (2.13 generates straight-line code instead); Dynamo's guards
    call it too, and that is all that is left."""
    seen = []
    compile_ = fusepass.backend._compile
    monkeypatch.setattr(fusepass.backend, "_compile",
                        lambda gm, inputs, *a: seen.append(list(inputs)) or compile_(gm, inputs, *a))
    calls = []
    flatten = TwoTensor.__tensor_flatten__
    monkeypatch.setattr(TwoTensor, "__tensor_flatten__", lambda self: calls.append(1) or flatten(self))
    lin = _linear()
    x = torch.randn(3, 16)

    def per_call():
        compiled = _compile(lin)
        compiled(x)
        calls.clear()
        for _ in range(4):
            assert_close(compiled(x), lin(x), "warm call")
        return len(calls) / 4

    with torch.no_grad():
        taken_apart = per_call()
        assert seen and not any(isinstance(t, TwoTensor) for t in seen[-1]), [type(t) for t in seen[-1]]
        monkeypatch.setattr(fusepass.backend, "flatten_subclass_inputs", lambda gm, inputs: None)
        as_before = per_call()
        assert any(isinstance(t, TwoTensor) for t in seen[-1])
    generated = importlib.util.find_spec("torch._functorch._aot_autograd.subclass_codegen") is not None
    assert taken_apart < as_before or (generated and taken_apart == as_before), (taken_apart, as_before)


def test_subclass_that_needs_grad_is_left_to_aotautograd():
    lin = _linear(requires_grad=True)
    x = torch.randn(3, 16)
    compiled = _compile(lin)
    assert_close(compiled(x), lin(x), "requires_grad")
    assert not any("tensor-subclass" in n for n in _notes()), _notes()


def test_failed_compile_goes_back_to_dynamos_graph(monkeypatch):
    def broken(self, leaves):
        raise RuntimeError("cannot rebuild")

    monkeypatch.setattr(fusepass.subclass.Layout, "build", broken)
    lin = _linear()
    x = torch.randn(3, 16)
    with torch.no_grad():
        out = _compile(lin)(x)
        assert_close(out, lin(x), "after falling back")
    assert any("as Dynamo gave it" in n and "cannot rebuild" in n for n in _notes()), _notes()


WARM = textwrap.dedent("""
    import json, torch, fusepass
    from torch.testing._internal.two_tensor import TwoTensor
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.SiLU(), torch.nn.Linear(64, 8))
    for m in (model[0], model[2]):
        w = TwoTensor(torch.randn_like(m.weight), torch.randn_like(m.weight))
        m.weight = torch.nn.Parameter(w, requires_grad=False)
    x = torch.randn(3, 64)
    with torch.no_grad():
        err = (torch.compile(model, backend="fusepass")(x) - model(x)).abs().max().item()
    report = fusepass.last_report()
    print(json.dumps({"err": err, "cache": [g.cache for g in report.graphs],
                      "notes": [n for g in report.graphs for n in g.notes]}))
""")


def test_warm_start_from_the_caches(tmp_path):
    """A second process is served from the compile caches (the graph's code names
    fusepass.subclass.rebuild and a layout key that is the same in every process)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", WARM], capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["err"] < 1e-4 and warm["err"] < 1e-4, runs
    assert warm["cache"] == ["hit"], runs
    assert any("2 tensor-subclass parameter(s)" in n for n in warm["notes"]), runs

"""Real model code from ``transformers`` (small random-weight configs), compiled
with fusepass: logits match eager, and the report counts what the model has.

Each model is compiled once per module and shared by the tests below (an
Inductor compile of one of these takes 10-45 s on a 2-core machine).
"""

import functools
import re

import pytest
import torch

import fusepass
from fusepass import models
from fusepass.testing import assert_close

pytest.importorskip("transformers")


@functools.cache
def compiled(name, dtype=torch.float32):
    model = models.build(name, dtype=dtype, size="tiny")
    ids = models.input_ids(model)
    torch._dynamo.reset()
    fusepass.reset_reports()
    with torch.no_grad():
        expected = model(ids).logits
        actual = torch.compile(model, backend="fusepass")(ids).logits
    return model, expected, actual, fusepass.last_report()


def layers(model):
    return model.config.num_hidden_layers


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_where_is_a_module_of_the_model_printed_whole(name):
    """transformers 5 passes ``self`` through a decorator (Dynamo's source is ``L['args'][0].model...``):
    every hit's "where" is a path of named_modules(), and the table prints each path it shows unbroken."""
    model, _, _, report = compiled(name)
    names = {n for n, _ in model.named_modules()}
    wheres = {h.where for h in report.hits}
    assert wheres and wheres <= names, wheres - names
    shown = set(re.findall(r"model\.[\w.]*\w", str(report)))
    assert shown and shown <= names, shown - names


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma", "qwen3_next"])
def test_logits_match_eager(name):
    _, expected, actual, _ = compiled(name)
    assert_close(actual, expected, name)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma", "qwen3_next"])
def test_every_norm_is_rewritten(name):
    model, _, _, report = compiled(name)
    # Qwen3-Next's gated norms (after each GDN layer) go to rms_norm_gated.
    assert (report.count("rms_norm") + report.count("add_rms_norm") + report.count("rms_norm_gated")
            == models.count_norms(model))
    assert not report.reasons("rms_norm"), report.reasons("rms_norm")


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma", "qwen3_next"])
def test_residual_add_fuses_before_every_norm_that_follows_one(name):
    # Every decoder layer adds the residual before its post-attention norm and
    # before the next layer's (or the final) norm: 2 per layer.
    model, _, _, report = compiled(name)
    assert report.count("add_rms_norm") == 2 * layers(model)


def test_qwen3_head_norms_are_counted():
    model, _, _, report = compiled("qwen3")
    where = [h.where for h in report.hits if h.rule == "rms_norm"]
    assert sum("q_norm" in w for w in where) == layers(model)
    assert sum("k_norm" in w for w in where) == layers(model)


@pytest.mark.parametrize("name", ["gemma", "qwen3_next"])
def test_zero_centred_weights_use_the_zero_centred_form(name):
    _, _, _, report = compiled(name)
    forms = {h.form.split(" ")[0] for h in report.hits if h.rule == "add_rms_norm"}
    assert forms == {"zero_centred"}


def test_bf16_llama_matches_eager():
    _, expected, actual, report = compiled("llama", torch.bfloat16)
    assert report.count("add_rms_norm") == 2 * 2
    assert_close(actual, expected, "llama bf16")


@pytest.mark.parametrize("name,rule", [("llama", "swiglu"), ("qwen3", "swiglu"), ("gemma", "geglu"),
                                       ("phi3", "swiglu")])
def test_one_activation_rewrite_per_decoder_layer(name, rule):
    model, expected, actual, report = compiled(name)
    assert report.count(rule) == layers(model), str(report)
    assert_close(actual, expected, name)


def test_phi3_fused_projection_halves_feed_the_op():
    model, _, _, report = compiled("phi3")
    # Phi-3 computes up * act(gate) from one gate_up_proj: the swapped operand
    # order, and no norm or activation left behind.
    assert all("swapped" in h.form for h in report.hits if h.rule == "swiglu")
    assert report.count("add_rms_norm") == 2 * layers(model)


def test_qwen3_next_gdn_layer_is_pretraced():
    # One GDN layer in the tiny model: its chunk function reaches the graph as the op.
    _, _, _, report = compiled("qwen3_next")
    assert [h.form for h in report.hits if h.rule == "gdn_chunk"] == ["pretrace"]

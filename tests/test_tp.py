"""Tensor-parallel models compiled with fusepass: two gloo ranks on the loopback.

Tiny Llama, Qwen3-MoE and Qwen3.5 models loaded with their own plans
(``tp_plan="auto"``), each rank's model compiled with ``backend="fusepass"``
(``fullgraph=True``, under ``no_grad``), and the same Llama quantized to
int8 and int4 on the sharded model.  Checked per rank: the rewrites are the
unsharded model's (the norms at the all-reduce boundaries taken by
``all_reduce_rms_norm`` instead of ``add_rms_norm``/``rms_norm``), the
all-reduce rule fused every boundary that ends in an all-reduce, and the
logits equal the same sharded model run eagerly within the dtype table.

One spawn runs every check (each rank compiles ~8 small graphs; the two
ranks share the machine's cores) and returns plain results that the tests
below read; the whole run is bounded in time.
"""

from __future__ import annotations

import collections
import tempfile

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it to load with a tp_plan
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORLD = 2
TIMEOUT = 300  # seconds for the whole spawn (measured ~150 s on 2 CPU cores)
MODELS = ("llama", "qwen3_moe", "qwen3_5")
QUANTIZED = (("int8", 32), ("int4", 32))  # (fmt, group_size): K shards of 32 and 64 are whole groups of 32
NORM_RULES = ("rms_norm", "add_rms_norm", "all_reduce_rms_norm")


# -- what each rank runs ----------------------------------------------------------------------

def _summary(report) -> dict:
    return {
        "hits": dict(collections.Counter(h.rule for h in report.hits)),
        "where": sorted((h.rule, h.where) for h in report.hits),
        "refusals": [(r.rule, r.reason) for r in report.refusals],
    }


def _compile(model, ids):
    import fusepass
    from fusepass.backend import interpreting_after_pass

    torch._dynamo.reset()
    fusepass.reset_reports()
    # The graph after the pass run by the FX interpreter on CPU (the rewrites are the same;
    # Inductor's C++ build of ~8 graphs a rank: the spawn took 112 s with it, the file 59 s without).
    on_cpu = ids.device.type == "cpu"
    with torch.no_grad(), interpreting_after_pass(on_cpu):
        eager = model(ids).logits
        compiled = torch.compile(model, backend="fusepass", fullgraph=True)(ids).logits
    return eager, compiled, _summary(fusepass.last_report())


def _error(actual, expected) -> str | None:
    from fusepass.testing import assert_close

    try:
        assert_close(actual, expected)
    except AssertionError as exc:
        return str(exc)[:500]
    return None


def _boundaries(model) -> int:
    """All-reduce boundaries a rank's graph has: the vocabulary-parallel
    embedding's (where the plan shards it: transformers 5.24 does, 5.17 does
    not), then the end of every attention and MLP block, less the GDN blocks
    (their output projection gathers: colwise_gather_output)."""
    config = model.config
    gdn = sum(t == "linear_attention" for t in getattr(config, "layer_types", None) or [])
    weight = model.get_input_embeddings().weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return int(local.shape[0] < config.vocab_size) + 2 * config.num_hidden_layers - gdn


def _torch_plan(model) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(model.config.num_hidden_layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return plan


def _check(rank: int, world: int, folder: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import fusepass
    from fusepass import models
    from fusepass.testing import tp

    torch.manual_seed(0)
    if rank == 0:
        for name in MODELS:
            tp.save(name, f"{folder}/{name}")
    dist.barrier()
    out: dict = {"unsharded": {}, "tp": {}, "quantized": {}}
    # The unsharded references, split over the ranks (they compile at the same time).
    for name in MODELS[rank::world]:
        model = models._config(name, "tiny")[0].from_pretrained(f"{folder}/{name}").eval()
        _, _, out["unsharded"][name] = _compile(model, models.input_ids(model))
    for name in MODELS:
        model = tp.load(name, f"{folder}/{name}")
        eager, compiled, summary = _compile(model, models.input_ids(model))
        out["tp"][name] = dict(summary, error=_error(compiled, eager), boundaries=_boundaries(model))
    for fmt, group in QUANTIZED:
        model = tp.load("llama", f"{folder}/llama")
        ids = models.input_ids(model)
        quantized = fusepass.quantize(model, fmt=fmt, group_size=group)
        eager, compiled, summary = _compile(model, ids)
        row = dict(summary, error=_error(compiled, eager), converted=len(quantized.converted),
                   skipped=quantized.skipped, boundaries=_boundaries(model))
        if fmt == "int4":
            # Whole groups per shard: each rank's codes are the unsharded model's, so the
            # sharded model computes what the unsharded quantized one does (to summation order).
            whole = models._config("llama", "tiny")[0].from_pretrained(f"{folder}/llama").eval()
            fusepass.quantize(whole, fmt=fmt, group_size=group)
            with torch.no_grad():
                row["vs_unsharded"] = _error(eager, whole(ids).logits)
        out["quantized"][fmt] = row
    # torch's own API: parallelize_module with Colwise/RowwiseParallel, then int8.
    model = models.build("llama", size="tiny")  # the same seed, the same weights on every rank
    ids = models.input_ids(model)
    parallelize_module(model, init_device_mesh("cpu", (world,)), _torch_plan(model))
    quantized = fusepass.quantize(model, fmt="int8")
    eager, compiled, summary = _compile(model, ids)
    out["torch_int8"] = dict(summary, error=_error(compiled, eager), converted=len(quantized.converted),
                             boundaries=_boundaries(model))  # 4: the embedding is not sharded here
    # int4 groups of 64 straddle o_proj's K shards (64 = 2 x 32): refused with the reason.
    model = tp.load("llama", f"{folder}/llama")
    out["straddle"] = fusepass.quantize(model, fmt="int4", group_size=64).skipped
    # Quantized first, then sharded (fusepass.parallelize_module with torch's styles).
    mesh = init_device_mesh("cpu", (world,))
    out["quantized_first"] = {}
    for fmt, group in QUANTIZED:
        model = models.build("llama", size="tiny")
        ids = models.input_ids(model)
        fusepass.quantize(model, fmt=fmt, group_size=group)
        with torch.no_grad():
            whole = model(ids).logits
        fusepass.parallelize_module(model, mesh, _torch_plan(model))
        eager, compiled, summary = _compile(model, ids)
        out["quantized_first"][fmt] = dict(summary, error=_error(compiled, eager), vs_unsharded=_error(eager, whole),
                                           boundaries=_boundaries(model))
    model = models.build("llama", size="tiny")
    fusepass.quantize(model, fmt="int4", group_size=64)
    try:
        fusepass.parallelize_module(model, mesh, _torch_plan(model))
        out["quantized_first_straddle"] = None
    except ValueError as exc:
        out["quantized_first_straddle"] = str(exc)
    return out


@pytest.fixture(scope="module")
def ranks():
    from fusepass.testing import tp

    with tempfile.TemporaryDirectory() as folder:
        return tp.spawn(_check, world_size=WORLD, timeout=TIMEOUT, args=(folder,))


# -- the checks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_logits_match_eager_tp(ranks, name):
    for rank, r in enumerate(ranks):
        assert r["tp"][name]["error"] is None, f"rank {rank}: {r['tp'][name]['error']}"


@pytest.mark.parametrize("name", MODELS)
def test_all_reduce_fused_at_every_boundary(ranks, name):
    for rank, r in enumerate(ranks):
        row = r["tp"][name]
        assert row["hits"].get("all_reduce_rms_norm") == row["boundaries"], (rank, row["hits"])
        assert not [x for x in row["refusals"] if x[0] == "all_reduce_rms_norm"], row["refusals"]


@pytest.mark.parametrize("name", MODELS)
def test_same_rewrites_as_unsharded(ranks, name):
    """Every rule rewrites on a rank what it rewrites unsharded, the norms at the
    all-reduce boundaries by all_reduce_rms_norm, in the same places."""
    ref = next(r["unsharded"][name] for r in ranks if name in r["unsharded"])
    assert "all_reduce_rms_norm" not in ref["hits"]
    for rank, r in enumerate(ranks):
        row = r["tp"][name]
        others = {k: v for k, v in row["hits"].items() if k not in NORM_RULES}
        assert others == {k: v for k, v in ref["hits"].items() if k not in NORM_RULES}, (rank, row["hits"])
        norms = sorted(w for rule, w in row["where"] if rule in NORM_RULES)
        assert norms == sorted(w for rule, w in ref["where"] if rule in NORM_RULES), rank
        assert not row["refusals"], (rank, row["refusals"])
    # The ranks agree with each other too (one plan, one graph per rank).
    assert ranks[0]["tp"][name]["where"] == ranks[1]["tp"][name]["where"]


@pytest.mark.parametrize("fmt", [f for f, _ in QUANTIZED])
def test_quantized_tp_model(ranks, fmt):
    fp = ranks[0]["tp"]["llama"]["hits"]
    for rank, r in enumerate(ranks):
        row = r["quantized"][fmt]
        assert row["error"] is None, f"rank {rank}: {row['error']}"
        assert row["converted"] == 14 and not row["skipped"], row  # 7 linears x 2 layers, lm_head left
        rule = "dequant_matmul" if fmt == "int8" else "dequant_matmul_int4"
        assert row["hits"].get(rule) == row["converted"], (rank, row["hits"], row["refusals"])
        assert {k: v for k, v in row["hits"].items() if k != rule} == fp, (rank, row["hits"])
        assert row["hits"].get("all_reduce_rms_norm") == row["boundaries"]
        assert not row["refusals"], row["refusals"]


def test_int4_shards_quantize_as_the_unsharded_model(ranks):
    for rank, r in enumerate(ranks):
        assert r["quantized"]["int4"]["vs_unsharded"] is None, f"rank {rank}: {r['quantized']['int4']['vs_unsharded']}"


def test_int4_groups_straddling_a_shard_are_refused(ranks):
    for r in ranks:
        skipped = dict(r["straddle"])
        assert set(skipped) == {"model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"}, skipped
        assert all("straddle a shard" in why for why in skipped.values()), skipped


def test_torch_parallelize_module_int8(ranks):
    for rank, r in enumerate(ranks):
        row = r["torch_int8"]
        assert row["error"] is None, f"rank {rank}: {row['error']}"
        assert row["hits"].get("dequant_matmul") == row["converted"] == 14, (rank, row["hits"], row["refusals"])
        assert row["hits"].get("all_reduce_rms_norm") == row["boundaries"], (rank, row["hits"])
        assert not row["refusals"], row["refusals"]


@pytest.mark.parametrize("fmt", [f for f, _ in QUANTIZED])
def test_model_quantized_first_then_sharded(ranks, fmt):
    for rank, r in enumerate(ranks):
        row = r["quantized_first"][fmt]
        assert row["error"] is None, f"rank {rank}: {row['error']}"
        assert row["vs_unsharded"] is None, f"rank {rank}: {row['vs_unsharded']}"
        rule = "dequant_matmul" if fmt == "int8" else "dequant_matmul_int4"
        assert row["hits"].get(rule) == 14, (rank, row["hits"], row["refusals"])
        assert row["hits"].get("all_reduce_rms_norm") == row["boundaries"], (rank, row["hits"])
        assert not row["refusals"], row["refusals"]
        why = r["quantized_first_straddle"]
        assert why and "o_proj" in why and "straddle a shard" in why, why


# -- one rank, in this process (conftest's single-rank gloo group) --------------------------------

class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _mesh(*shape):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantize_keeps_parallelize_module_hooks(fmt):
    """A Colwise/Rowwise pair on one rank: the sharded layers quantized, their
    DTensor hooks kept, the result the unsharded quantized model's."""
    import fusepass
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model, ref = _MLP(), _MLP()
    ref.load_state_dict(model.state_dict())
    parallelize_module(model, _mesh(1), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    everything = {"filter": lambda name, m: True, "group_size": 32}
    assert len(fusepass.quantize(model, fmt=fmt, **everything).converted) == 2
    fusepass.quantize(ref, fmt=fmt, **everything)
    assert type(model.up).__name__.startswith("Sharded") and model.up._forward_pre_hooks
    x = torch.randn(4, 64)
    with torch.no_grad():
        y = model(x)
        assert not isinstance(y, torch.distributed.tensor.DTensor)
        torch.testing.assert_close(y, ref(x))


def test_quantize_refuses_other_layouts():
    import fusepass
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    flat, square = _mesh(1), _mesh(1, 1)
    for mesh, placements, reason in ((square, [Shard(0), Shard(0)], "2-D device mesh"),
                                     (flat, [_StridedShard(0, split_factor=2)], "packed or strided")):
        model = _MLP()
        model.up.weight = torch.nn.Parameter(distribute_tensor(model.up.weight.detach(), mesh, placements))
        skipped = dict(fusepass.quantize(model, filter=lambda name, m: True).skipped)
        assert list(skipped) == ["up"] and reason in skipped["up"], skipped


def test_quantized_model_cannot_be_sharded_by_torch_alone():
    """torch's parallel styles take nn.Linear only: a quantized layer (its
    weight a buffer the style would not shard) is refused, not half-sharded."""
    import fusepass
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = _MLP()
    fusepass.quantize(model, filter=lambda name, m: True)
    with pytest.raises(NotImplementedError, match="nn.Linear"):
        parallelize_module(model, _mesh(1), {"up": ColwiseParallel()})


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_quantized_model_sharded_after_by_fusepass(fmt):
    """fusepass.parallelize_module on a model quantized first (one rank): the
    layers keep their codes, take the styles' hooks, and compute what the
    unsharded quantized model does; the plan's patterns are read as torch reads them."""
    import fusepass
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    model = _MLP()
    everything = {"filter": lambda name, m: True, "group_size": 32}
    fusepass.quantize(model, fmt=fmt, **everything)
    ref = _MLP()
    fusepass.quantize(ref, fmt=fmt, **everything)
    ref.load_state_dict(model.state_dict())
    fusepass.parallelize_module(model, _mesh(1), {"u*": ColwiseParallel(), "down": RowwiseParallel()})
    for layer in (model.up, model.down):
        assert type(layer).__name__.startswith("Sharded") and layer._forward_pre_hooks
    torch.testing.assert_close(model.up.weight, ref.up.weight, rtol=0, atol=0)
    x = torch.randn(4, 64)
    with torch.no_grad():
        y = model(x)
        assert not isinstance(y, torch.distributed.tensor.DTensor)
        torch.testing.assert_close(y, ref(x))
    with pytest.raises(ValueError, match="already sharded"):
        fusepass.parallelize_module(model, _mesh(1), {"up": ColwiseParallel()})


def test_parallelize_module_refuses_before_changing_anything():
    import fusepass
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    model = _MLP()
    fusepass.quantize(model, fmt="int8", filter=lambda name, m: True)
    with pytest.raises(ValueError, match="SequenceParallel"):
        fusepass.parallelize_module(model, _mesh(1), {"up": ColwiseParallel(), "down": SequenceParallel()})
    assert not type(model.up).__name__.startswith("Sharded") and not model.up._forward_pre_hooks
    with pytest.raises(ValueError, match="2-D device mesh"):
        fusepass.parallelize_module(model, _mesh(1, 1), {"up": ColwiseParallel()})


# -- several GPUs: NCCL ranks, bf16, the CUDA paths (kernels inlined into Inductor's code) -------------

def _check_cuda(rank: int, world: int, folder: str) -> dict:
    import torch.distributed as dist

    import fusepass
    from fusepass import models
    from fusepass.testing import tp

    if rank == 0:
        tp.save("llama", f"{folder}/llama", dtype=torch.bfloat16)
    dist.barrier()
    out = {}
    for fmt in (None, "int8", "int4"):
        model = tp.load("llama", f"{folder}/llama", dtype=torch.bfloat16)
        if fmt:
            fusepass.quantize(model, fmt=fmt, group_size=32)
        eager, compiled, summary = _compile(model, models.input_ids(model).cuda())
        out[fmt or "bf16"] = dict(summary, error=_error(compiled, eager), boundaries=_boundaries(model))
    # int4 quantized first, then sharded by torch's plan (fusepass.parallelize_module)
    from torch.distributed.device_mesh import init_device_mesh

    model = models.build("llama", size="tiny").to(device="cuda", dtype=torch.bfloat16)
    fusepass.quantize(model, fmt="int4", group_size=32)
    fusepass.parallelize_module(model, init_device_mesh("cuda", (world,)), _torch_plan(model))
    eager, compiled, summary = _compile(model, models.input_ids(model).cuda())
    out["int4, quantized first"] = dict(summary, error=_error(compiled, eager), boundaries=_boundaries(model))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp_on_gpus():
    from fusepass.testing import tp

    with tempfile.TemporaryDirectory() as folder:
        results = tp.spawn(_check_cuda, world_size=2, timeout=600, args=(folder,), backend="nccl")
    for rank, r in enumerate(results):
        for case, row in r.items():
            assert row["error"] is None, f"rank {rank} {case}: {row['error']}"
            assert row["hits"].get("all_reduce_rms_norm") == row["boundaries"], (rank, case, row["hits"])
            assert not row["refusals"], (rank, case, row["refusals"])

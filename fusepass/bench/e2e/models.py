"""The models ``fusepass bench e2e`` builds: configs of real checkpoints (no
download), random weights made on the device, optional weight-only
quantization, and the bytes a decode step reads."""

from __future__ import annotations

import sys
from typing import Any

import torch

# Configs of real checkpoints (config.json's fields that shape the compute).
MODELS: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "class": "LlamaForCausalLM", "config": "LlamaConfig", "norm_offset": 1.0,
        "fields": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                       max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                       bos_token_id=128000, eos_token_id=128001),
    },
    "qwen3-8b": {
        "class": "Qwen3ForCausalLM", "config": "Qwen3Config", "norm_offset": 1.0,
        "fields": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                       max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                       bos_token_id=151643, eos_token_id=151645),
    },
    # Qwen3.5-9B's text model: 8 x (3 Gated DeltaNet layers, 1 gated attention
    # layer); the layer types follow from the depth (every 4th is attention),
    # so --layers 4 keeps the 3:1 pattern.  Norms are zero-centred (1 + w).
    "qwen3.5-9b": {
        "class": "Qwen3_5ForCausalLM", "config": "Qwen3_5TextConfig", "norm_offset": 0.0,
        "fields": dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=256, hidden_act="silu",
                       linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_num_key_heads=16, linear_num_value_heads=32, max_position_embeddings=262144,
                       rms_norm_eps=1e-6, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                        "partial_rotary_factor": 0.25},
                       eos_token_id=248044),
    },
    # Qwen3-30B-A3B: 48 sparse layers of 128 experts (top-8, intermediate 768).
    "qwen3-30b-a3b": {
        "class": "Qwen3MoeForCausalLM", "config": "Qwen3MoeConfig", "norm_offset": 1.0,
        "fields": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                       num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                       num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                       mlp_only_layers=[], hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                       bos_token_id=151643, eos_token_id=151645),
    },
    # gpt-oss-20b: 24 layers (sliding and full attention alternating), 32 experts, top-4, biased
    # transposed experts with the clamped activation, a top-k-then-softmax router.
    "gpt-oss-20b": {
        "class": "GptOssForCausalLM", "config": "GptOssConfig", "norm_offset": 1.0,
        "fields": dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                       num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                       num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
                       rms_norm_eps=1e-5, swiglu_limit=7.0, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                        "original_max_position_embeddings": 4096},
                       eos_token_id=200002, pad_token_id=199999),
    },
    # Qwen3.5-35B-A3B's text model: 10 x (3 Gated DeltaNet layers, 1 gated attention layer), each
    # with a sparse block of 256 experts (top-8, intermediate 512) and a gated shared expert.
    "qwen3.5-35b-a3b": {
        "class": "Qwen3_5MoeForCausalLM", "config": "Qwen3_5MoeTextConfig", "norm_offset": 0.0,
        "fields": dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                       num_key_value_heads=2, head_dim=256, hidden_act="silu", linear_conv_kernel_dim=4,
                       linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                       linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                       num_experts=256, num_experts_per_tok=8, max_position_embeddings=262144, rms_norm_eps=1e-6,
                       tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                        "partial_rotary_factor": 0.25},
                       eos_token_id=248044),
    },
    # --quick: fusepass.models' tiny Llama, on the CPU, for CI.
    "tiny-llama": {
        "class": "LlamaForCausalLM", "config": "LlamaConfig", "norm_offset": 1.0,
        "fields": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096),
    },
    # The hybrid at tiny size (CPU smoke test of the Gated DeltaNet path: --quick --model tiny-qwen3.5).
    "tiny-qwen3.5": {
        "class": "Qwen3_5ForCausalLM", "config": "Qwen3_5TextConfig", "norm_offset": 0.0,
        "fields": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                       linear_num_value_heads=4, max_position_embeddings=4096,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                        "partial_rotary_factor": 0.25}),
    },
    # The MoE models at tiny size (CPU smoke tests: --quick --model tiny-qwen3-moe / tiny-qwen3.5-moe).
    "tiny-qwen3-moe": {
        "class": "Qwen3MoeForCausalLM", "config": "Qwen3MoeConfig", "norm_offset": 1.0,
        "fields": dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                       mlp_only_layers=[], max_position_embeddings=4096),
    },
    "tiny-qwen3.5-moe": {
        "class": "Qwen3_5MoeForCausalLM", "config": "Qwen3_5MoeTextConfig", "norm_offset": 0.0,
        "fields": dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=2, max_position_embeddings=4096,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                        "partial_rotary_factor": 0.25}),
    },
}


# -- the model ---------------------------------------------------------------------

def _layers(spec: dict[str, Any], layers: str | int) -> int:
    full = spec["fields"]["num_hidden_layers"]
    return full if str(layers) == "full" else min(int(layers), full)


def build(name: str, layers: str | int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.nn.Module:
    """The model from its config, random weights made on ``device`` (norm weights drawn too, not ones)."""
    import transformers as tf

    from fusepass.models import transformers_class

    spec = MODELS[name]
    fields = {**spec["fields"], "num_hidden_layers": _layers(spec, layers)}
    try:
        config = transformers_class(spec["config"])(**fields)
        cls = transformers_class(spec["class"])
    except AttributeError as exc:
        raise SystemExit(f"fusepass bench e2e: transformers {tf.__version__} has no {exc.name}: "
                         f"{name} needs a newer transformers") from exc
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls._from_config(config, dtype=dtype)
    with torch.no_grad():
        for module in model.modules():
            if "Norm" in type(module).__name__ and getattr(module, "weight", None) is not None:
                module.weight.normal_(0.0, 0.1).add_(spec["norm_offset"] if "Gated" not in type(module).__name__
                                                      else 1.0)
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.generation_config.pad_token_id = 0
    return model.eval()


# --quantize's names: fusepass.quantize's int8 / int4, torchao's int8, bitsandbytes' 4-bit (-dq: with
# double quantization), GPTQ's and HQQ's layouts (through fusepass.load_quantized)
QUANTIZE = ("int8", "int4", "torchao-int8", "bnb-nf4", "bnb-nf4-dq", "bnb-fp4", "gptq", "gptq-act-order", "hqq")


def quantize(model: torch.nn.Module, fmt: str | None, group_size: int) -> torch.nn.Module:
    if not fmt:
        return model
    if fmt.startswith("bnb-"):
        return _bitsandbytes_4bit(model, fmt[4:7], nested=fmt.endswith("-dq"))
    if fmt in ("gptq", "gptq-act-order", "hqq"):
        return _checkpoint_loaded(model, fmt, group_size)
    if fmt == "torchao-int8":  # torchao's int8 weight-only tensor subclass, lm_head kept in bf16 as below
        try:
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
        except ImportError as exc:
            raise SystemExit("fusepass bench e2e: --quantize torchao-int8 needs torchao (pip install torchao)") from exc
        quantize_(model, Int8WeightOnlyConfig(),
                  filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and not fqn.endswith("lm_head"))
        return model
    import fusepass

    if not hasattr(fusepass, "quantize"):
        raise SystemExit("fusepass bench e2e: --quantize needs fusepass.quantize, which this version lacks")
    print(fusepass.quantize(model, fmt=fmt, group_size=group_size), file=sys.stderr)  # in place; a summary
    return model


def _checkpoint_loaded(model: torch.nn.Module, fmt: str, group: int) -> torch.nn.Module:
    """Every linear but lm_head written in a library's stored layout and read back through
    ``fusepass.load_quantized``, as such a checkpoint is loaded: GPTQ's (v1, asymmetric: the
    model's own weights rounded to 4 bits; ``gptq-act-order``: each column's group following a
    random order of K) or HQQ's (4-bit, axis 1, float zero points)."""
    import fusepass
    from fusepass.testing.library_layouts import gptq_tensors, hqq_tensors

    state = {}
    for name, lin in model.named_modules():
        if type(lin) is not torch.nn.Linear or name.endswith("lm_head"):
            continue
        if fmt == "hqq":
            tensors, _ = hqq_tensors(lin.weight.detach(), group)
        else:
            tensors, _ = gptq_tensors(lin.weight.detach(), group, act_order=fmt == "gptq-act-order")
        state.update({f"{name}.{key}": value for key, value in tensors.items()})
        if lin.bias is not None:
            state[f"{name}.bias"] = lin.bias.detach()
    print(fusepass.load_quantized(model, state, "hqq" if fmt == "hqq" else "gptq"), file=sys.stderr)  # in place
    return model


def _bitsandbytes_4bit(model: torch.nn.Module, quant_type: str, nested: bool = False) -> torch.nn.Module:
    """Every linear but lm_head as bitsandbytes' Linear4bit (``quant_type`` nf4 or fp4, blocks of 64,
    no double quantization: BitsAndBytesConfig's defaults; ``nested``: double quantization, as QLoRA's
    recipes set it), quantized by bitsandbytes on the model's device."""
    try:
        import bitsandbytes as bnb
    except ImportError as exc:
        raise SystemExit("fusepass bench e2e: --quantize bnb-* needs bitsandbytes (pip install bitsandbytes)") from exc
    for name, parent in list(model.named_modules()):
        for child_name, lin in list(parent.named_children()):
            if type(lin) is not torch.nn.Linear or f"{name}.{child_name}".endswith("lm_head"):
                continue
            w = lin.weight
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None, compute_dtype=w.dtype,
                                  compress_statistics=nested, quant_type=quant_type, device="meta")
            q.weight = bnb.nn.Params4bit(w.data, requires_grad=False, compress_statistics=nested,
                                         quant_type=quant_type)
            if lin.bias is not None:
                q.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
            setattr(parent, child_name, q.to(w.device).eval())
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """What one decode step reads at the least: every parameter and buffer once, the input embedding
    excluded (B rows of it are read) unless the output layer shares it, and of a sparse MoE layer's
    expert stacks only k of the E experts (every token routed to the same k: the batch-1 step's bytes;
    counting all E put a 48-layer Qwen3-30B-A3B step at 6x its "floor")."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    sparse = _expert_share(model)
    # bitsandbytes keeps a 4-bit weight's absmax (and nested absmax) on the weight's quant_state
    states = [getattr(t, "quant_state", None) for t in tensors.values()]
    for st in filter(None, states):
        for part in (st, getattr(st, "state2", None)):
            if part is not None and isinstance(getattr(part, "absmax", None), torch.Tensor):
                tensors[id(part.absmax)] = part.absmax
    total = sum(_nbytes(t) * sparse.get(id(t), 1.0) for t in tensors.values())
    embed = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    if out is None or out.weight is not embed:
        total -= _nbytes(embed)
    return round(total)


def _expert_share(model: torch.nn.Module) -> dict[int, float]:
    """id -> k / E for the tensors of the model's ``experts`` modules whose first dim is the expert
    count E (transformers' stacked experts, plain or quantized in place); k = num_experts_per_tok."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    E = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    k = getattr(config, "num_experts_per_tok", None)
    if not (isinstance(E, int) and isinstance(k, int) and 0 < k < E):
        return {}
    share = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "experts":
            continue
        for t in list(module.parameters()) + list(module.buffers()):
            if t.dim() >= 1 and t.shape[0] == E:
                share[id(t)] = k / E
    return share


def _nbytes(t: torch.Tensor) -> int:
    """Storage bytes; a tensor subclass (torchao's quantized weights) counts the tensors it holds."""
    if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()

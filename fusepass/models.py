"""Small random-weight ``transformers`` models for the demo and the tests.

Built from configs, never downloaded.  The weights of the norms are drawn at
random too (their real initialisation is all ones or all zeros, which would
hide a kernel that ignores the weight).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

MODELS = ("llama", "qwen3", "gemma", "phi3", "qwen3_next", "qwen3_5", "qwen3_moe", "qwen3_5_moe")

# What importing and running transformers' models prints around fusepass:
# torchao (imported by transformers for its quantizer) trying C++ extensions
# built for another Python or CUDA (its Python paths work without them);
# torch deprecating the pytree registration torchao makes of two enums; and
# transformers advising flash-linear-attention / causal-conv1d for its eager
# GDN code (under fusepass that call is fusepass's op).  Dropped by their
# exact text, while fusepass builds a model or runs a command, and only then.
_PEER_NOISE = {
    "torchao": ("Failed to load ", ".so"),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
    "transformers.integrations.hub_kernels": ("is falling back to its reference PyTorch implementation",),
}


class _Drop(logging.Filter):
    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not all(f in message for f in self.fragments)


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """``transformers`` (and through it torchao) imported and run without the known noise above."""
    filters = [(logging.getLogger(name), _Drop(*fragments)) for name, fragments in _PEER_NOISE.items()]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)


def transformers_class(name: str) -> Any:
    """``transformers.<name>``, imported quietly (transformers imports its model modules lazily, on access)."""
    with quiet_imports():
        import transformers

        return getattr(transformers, name)


def _config(name: str, size: str, **overrides: Any) -> Any:
    with quiet_imports():
        import transformers as tf

        return _config_with(tf, name, size, **overrides)


def _config_with(tf: Any, name: str, size: str, **overrides: Any) -> Any:

    # tiny: tests; small: the demo; medium: GPU timing (a 4-layer slice of a
    # 1B-class model: hidden 2048, 16 heads of 128).
    hidden, layers, inter, heads, kv, vocab = {
        "tiny": (64, 2, 128, 4, 2, 256),
        "small": (256, 4, 704, 4, 2, 256),
        "medium": (2048, 4, 5632, 16, 4, 32000),
    }[size]
    common = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                  max_position_embeddings=4096)
    cls, config = _base_config(tf, name, hidden, heads, layers, common)
    for key, value in overrides.items():
        setattr(config, key, value)
    return cls, config


def _base_config(tf: Any, name: str, hidden: int, heads: int, layers: int, common: dict[str, Any]) -> Any:
    if name == "llama":
        return tf.LlamaForCausalLM, tf.LlamaConfig(**common, head_dim=hidden // heads)
    if name == "qwen3":
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(**common, head_dim=hidden // heads)
    if name == "gemma":
        return tf.GemmaForCausalLM, tf.GemmaConfig(**common, head_dim=hidden // heads,
                                                    hidden_activation="gelu_pytorch_tanh")
    if name == "phi3":
        return tf.Phi3ForCausalLM, tf.Phi3Config(**common, pad_token_id=0)
    if name == "qwen3_next":
        return tf.Qwen3NextForCausalLM, tf.Qwen3NextConfig(
            **common, head_dim=hidden // heads, linear_num_value_heads=2, linear_num_key_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32,
            layer_types=["linear_attention", "full_attention"] * (layers // 2))
    if name == "qwen3_5":
        # One GDN layer then one full-attention layer (3:1 in the real model);
        # 2 key heads serving 4 value heads, as the real 16:32.
        return tf.Qwen3_5ForCausalLM, tf.Qwen3_5TextConfig(
            **common, head_dim=hidden // heads, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16,
            layer_types=["linear_attention", "full_attention"] * (layers // 2))
    if name == "qwen3_moe":
        # Every layer sparse: 4 experts of 32, 2 per token, as Qwen3-30B-A3B's 128 of 768, 8 per token.
        return tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            **common, head_dim=hidden // heads, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if name == "qwen3_5_moe":
        # Qwen3.5's GDN + attention layers with Qwen3-MoE's sparse blocks (and a sigmoid-gated shared expert).
        return tf.Qwen3_5MoeForCausalLM, tf.Qwen3_5MoeTextConfig(
            **common, head_dim=hidden // heads, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32,
            layer_types=["linear_attention", "full_attention"] * (layers // 2))
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def build(name: str = "llama", dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
          size: str = "tiny", seed: int = 0, **config: Any) -> torch.nn.Module:
    """A random-weight model; ``config`` overrides fields of its config (``mlp_only_layers=[0, 1]``)."""
    cls, config = _config(name, size, **config)
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        for module in model.modules():
            if "Norm" in type(module).__name__ and getattr(module, "weight", None) is not None:
                module.weight.normal_(0.0, 0.5).add_(0.0 if name in ("gemma", "qwen3_next", "qwen3_5", "qwen3_5_moe") else 1.0)
    return model.to(device=device, dtype=dtype).eval()


def count_norms(model: torch.nn.Module) -> int:
    return sum(1 for m in model.modules() if type(m).__name__.endswith("RMSNorm")
               or type(m).__name__.endswith("RMSNormGated"))


def input_ids(model: torch.nn.Module, batch: int = 2, seq: int = 8, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    return ids.to(next(model.parameters()).device)

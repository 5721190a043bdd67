"""The host's share of a compiled decode step whose weights are tensor subclasses.

A Llama-3-8B-shaped model (random weights, bf16; on the CPU a narrow one),
quantized with torchao's int8 weight-only config or with ``fusepass.quantize``
(plain int8 tensors, same kernels), compiled with ``--backend`` (CUDA graphs
on a GPU) and called one decode step at a time in a loop, each call
synchronized: the step as the host sees it.  Then the step's kernels and host
functions (torch.profiler on a GPU) and a cProfile of ten calls.

    python benchmarks/sweep_subclass_step.py --quantize torchao --backend fusepass --device cuda
    python benchmarks/sweep_subclass_step.py --quantize torchao --backend fusepass --keep-subclasses

``--keep-subclasses`` compiles without fusepass taking the subclass weights
apart (fusepass/subclass.py), as before ef50cea.  An experiment, not a
registry entry (names starting with ``sweep`` are skipped by ``fusepass bench``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch


def build(device: str, layers: int, quantize: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if device == "cuda":
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                          num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                          max_position_embeddings=256, rope_theta=500000.0)
    else:
        cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    if quantize == "torchao":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(model, Int8WeightOnlyConfig(),
                  filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and "lm_head" not in fqn)
    elif quantize == "fusepass":
        import fusepass

        fusepass.quantize(model, fmt="int8")
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quantize", choices=["torchao", "fusepass", "none"], default="torchao")
    p.add_argument("--backend", default="fusepass")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--keep-subclasses", action="store_true")
    args = p.parse_args()
    if args.keep_subclasses:
        import fusepass.backend

        fusepass.backend.flatten_subclass_inputs = lambda gm, inputs: None
    from transformers import StaticCache

    cuda = args.device == "cuda"
    model = build(args.device, args.layers, args.quantize)
    fn = torch.compile(model, backend=args.backend, fullgraph=True, dynamic=False,
                       mode="reduce-overhead" if cuda else None)
    cache = StaticCache(config=model.config, max_cache_len=64)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 1000, (1, 8), device=args.device), past_key_values=cache, use_cache=True)
        ids = torch.randint(0, 1000, (1, 1), device=args.device)
        pos = torch.tensor([8], device=args.device)

        def step() -> torch.Tensor:
            return fn(input_ids=ids, past_key_values=cache, position_ids=pos[None], cache_position=pos,
                      use_cache=True).logits

        t0 = time.perf_counter()
        step()
        print(f"first call (compile) {time.perf_counter() - t0:.1f} s")
        for _ in range(5):
            step()
        sync()
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        print(f"{args.quantize} {args.backend} {args.device}: {statistics.median(times) * 1e3:.2f} ms/step")
        from torch._dynamo.utils import counters

        print("inductor counters:", dict(counters["inductor"]))
        if cuda:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step()
                sync()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(10):
            step()
        sync()
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue())


if __name__ == "__main__":
    main()

"""Generation and evaluation throughput: our KV-cache generation (static decode steps, CUDA-graph captured on
CUDA; and the growing-cache path it replaced) vs recomputing the prefix (--recompute) vs Hugging Face
GPT2LMHeadModel.generate on the same weights, greedy, one process; and evaluation forward tokens/s.

    python tools/bench/bench_generate.py            # CPU, L4 h256 V8192, prompt 16, 128 new tokens, batch 1, 8, 32
    python tools/bench/bench_generate.py --lengths 64 512 --batches 4 --repeats 5 --recompute-up-to 512
    python tools/bench/bench_generate.py --device cuda --dtype bfloat16 --layers 12 --hidden 768 --heads 12 \
        --vocab 50257 --recompute-up-to 0        # GPT-2 124M on one GPU (issue 54's cells)

The implementations alternate within each repeat (this machine is shared and noisy); tokens/s = batch x new
tokens / seconds, the median over --repeats. The ratios are the median (min-max) of the per-repeat ratios, each
from the same repeat, so a slow phase of the machine cancels and one noisy repeat cannot flip the verdict.
--recompute is measured up to --recompute-up-to new tokens (its cost grows as n^2: O(n^2) tokens of forward for n
new tokens, the cache O(n)); its speedup should grow with the length.
Targets: on the CPU ours (static) >= 1.2x HF generate at every length and batch, the cache's speedup over
--recompute growing with length; on CUDA (issue 54, GPT-2 124M bf16, 128 new tokens) >= 3x HF at batch 1, >= 2x at
batch 8 and 32.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mpu  # noqa: E402
from bench_common import init_single_process, median_and_spread, precision_header, write_json_rows  # noqa: E402
from megatron.model import GPT2Model, GPT2ModelConfig  # noqa: E402
from megatron.model.hf_interchange import to_hf_state_dict  # noqa: E402
from megatron.text_generation import generate  # noqa: E402


def build(layers, hidden, heads, vocab, positions, device, dtype):
    torch.manual_seed(1234)
    mpu.model_parallel_cuda_manual_seed(1234)
    config = GPT2ModelConfig(num_layers=layers, vocab_size=vocab, hidden_size=hidden, num_attention_heads=heads,
                             max_sequence_length=positions, real_vocab_size=vocab)
    ours = GPT2Model(config, parallel_output=False).eval()
    from transformers import GPT2Config, GPT2LMHeadModel
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=hidden, n_layer=layers,
                                    n_head=heads, activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                    attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)).eval()
    model_config = {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
                    "max_sequence_length": positions, "vocab_size": vocab, "layernorm_epsilon": 1e-5}
    hf.load_state_dict(to_hf_state_dict(dict(ours.state_dict()), model_config), strict=False)
    hf.tie_weights()
    return ours.to(device=device, dtype=dtype), hf.to(device=device, dtype=dtype)


def timed(fn):
    """Seconds of fn(), the device's queued work included."""
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_generation(ours, hf, prompt, new_tokens, repeats, recompute, cuda_graph):
    """{way: [tokens/s of each repeat]}; the ways alternate order from repeat to repeat."""
    def ways(count):
        out = {"static": lambda: generate(ours, prompt.tolist(), count, greedy=True, cuda_graph=cuda_graph),
               "growing": lambda: generate(ours, prompt.tolist(), count, greedy=True, static_cache=False),
               "hf": lambda: hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                         max_new_tokens=count, min_new_tokens=count, pad_token_id=0)}
        if recompute:
            out["recompute"] = lambda: generate(ours, prompt.tolist(), count, greedy=True, use_cache=False)
        return out
    rates = {name: [] for name in ways(new_tokens)}
    with torch.no_grad():
        for fn in ways(8).values():
            fn()                                   # warm-up
        measured = ways(new_tokens)
        for repeat in range(repeats):
            for name in (list(measured) if repeat % 2 == 0 else list(reversed(measured))):
                rates[name].append(prompt.size(0) * new_tokens / timed(measured[name]))
    return rates


def ratio_cell(numerators, denominators):
    """'median (min-max)' of the per-repeat ratios, or '-' when one side was not measured."""
    if not numerators or not denominators:
        return "-"
    ratio, low, high = median_and_spread([a / b for a, b in zip(numerators, denominators)])
    return f"{ratio:.2f}x ({low:.2f}-{high:.2f})"


def rate_cell(values):
    return f"{statistics.median(values):,.0f}" if values else "-"


def bench_evaluation(ours, hf, tokens, repeats):
    """Forward-only tokens/s on full windows (what tasks/main.py does per batch)."""
    ways = {"ours": lambda: ours(tokens), "HF": lambda: hf(tokens).logits}
    times = {name: [] for name in ways}
    with torch.no_grad():
        for fn in ways.values():
            fn()
        for repeat in range(repeats):
            for name in (list(ways) if repeat % 2 == 0 else list(reversed(ways))):
                times[name].append(timed(ways[name]))
    return {name: tokens.numel() / statistics.median(values) for name, values in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128], help="new tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="prompts per generate call")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="both models' parameters and activations")
    parser.add_argument("--no-cuda-graph", action="store_true",
                        help="CUDA: run the static decode steps eagerly (generate(..., cuda_graph=False))")
    parser.add_argument("--recompute-up-to", type=int, default=128,
                        help="measure --recompute up to this many new tokens (its time grows as the square)")
    parser.add_argument("--eval-seq", type=int, default=1024)
    parser.add_argument("--eval-batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads (0: torch's default); 1 is steadier on a shared, loaded machine")
    parser.add_argument("--json", default=None,
                        help="also write the generation rows here (batch, new tokens, tokens/s, static / HF ratio: "
                             "the median of the per-repeat ratios), rewritten after every row")
    parser.add_argument("--no-eval", action="store_true", help="skip the evaluation-forward table")
    options = parser.parse_args()
    if options.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device")
    device, dtype = torch.device(options.device), getattr(torch, options.dtype)
    init_single_process()
    if options.threads:
        torch.set_num_threads(options.threads)
    ours, hf = build(options.layers, options.hidden, options.heads, options.vocab, options.positions, device, dtype)
    graph = options.device == "cuda" and not options.no_cuda_graph
    print(precision_header() + f"; {options.dtype} on {options.device} here")
    print(f"# GPT-2 L={options.layers} h={options.hidden} heads={options.heads} V={options.vocab}, prompt "
          f"{options.prompt} tokens, greedy, {torch.get_num_threads()} threads, {options.repeats} repeats: tok/s "
          "medians; ratios: median (min-max) of the per-repeat ratios; ours static: the static decode steps"
          f"{', CUDA-graph captured' if graph else ', eager'}; ours growing: the cache read as a growing prefix")
    print("| batch | new tokens | ours static tok/s | ours growing tok/s | ours --recompute tok/s | HF generate tok/s | "
          "static / growing | static / HF |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for batch in options.batches:
        prompt = torch.randint(0, options.vocab, (batch, options.prompt), generator=torch.Generator().manual_seed(7))
        prompt = prompt.to(device)
        for length in options.lengths:
            rates = bench_generation(ours, hf, prompt, length, options.repeats, length <= options.recompute_up_to,
                                     None if graph else False)
            static, growing, recompute, theirs = rates["static"], rates["growing"], rates.get("recompute", []), \
                rates["hf"]
            print(f"| {batch} | {length} | {rate_cell(static)} | {rate_cell(growing)} | {rate_cell(recompute)} | "
                  f"{rate_cell(theirs)} | {ratio_cell(static, growing)} | {ratio_cell(static, theirs)} |", flush=True)
            rows.append({"batch": batch, "new_tokens": length, "device": options.device, "dtype": options.dtype,
                         "ours_tokens_per_s": statistics.median(static), "hf_tokens_per_s": statistics.median(theirs),
                         "ours_over_hf": median_and_spread([a / b for a, b in zip(static, theirs)])[0]})
            if options.json:
                write_json_rows(options.json, rows)
    if options.no_eval:
        dist.destroy_process_group()
        return
    tokens = torch.randint(0, options.vocab, (options.eval_batch, options.eval_seq),
                           generator=torch.Generator().manual_seed(8)).to(device)
    rate = bench_evaluation(ours, hf, tokens, options.repeats)
    print()
    print(f"| evaluation forward ({options.eval_batch} x {options.eval_seq}) | ours tok/s | HF tok/s | ours / HF |")
    print("|---|---:|---:|---:|")
    print(f"| full windows | {rate['ours']:,.0f} | {rate['HF']:,.0f} | {rate['ours'] / rate['HF']:.2f}x |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

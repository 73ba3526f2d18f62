"""Generation and evaluation throughput: our KV-cache generation vs recomputing the prefix (--recompute) vs Hugging
Face GPT2LMHeadModel.generate on the same weights, greedy, one process; and evaluation forward tokens/s.

    python tools/bench/bench_generate.py                       # L4 h256 V8192, prompt 16, new tokens 32/128/256
    python tools/bench/bench_generate.py --lengths 64 512 --batch 4 --repeats 5

Each cell is the median of --repeats runs, the three implementations alternating within each repeat (this
machine is shared and noisy). tokens/s = batch x new tokens / seconds. The cache's speedup over recomputing should
grow with the length (recomputing costs O(n^2) tokens of forward for n new tokens, the cache O(n)).
Targets: ours (cache) >= HF generate; the cache's speedup growing with length.
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
from bench_common import init_single_process, precision_header  # noqa: E402
from megatron.model import GPT2Model, GPT2ModelConfig  # noqa: E402
from megatron.model.hf_interchange import to_hf_state_dict  # noqa: E402
from megatron.text_generation import generate  # noqa: E402


def build(layers, hidden, heads, vocab, positions):
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
    return ours, hf


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_generation(ours, hf, prompt, new_tokens, repeats):
    ways = {
        "ours (KV cache)": lambda: generate(ours, prompt.tolist(), new_tokens, greedy=True, use_cache=True),
        "ours (--recompute)": lambda: generate(ours, prompt.tolist(), new_tokens, greedy=True, use_cache=False),
        "HF generate": lambda: hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                           max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                           pad_token_id=0),
    }
    times = {name: [] for name in ways}
    with torch.no_grad():
        for fn in ways.values():
            fn()                                   # warm-up
        for repeat in range(repeats):
            order = list(ways) if repeat % 2 == 0 else list(reversed(ways))
            for name in order:
                times[name].append(timed(ways[name]))
    return {name: prompt.size(0) * new_tokens / statistics.median(values) for name, values in times.items()}


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
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 256], help="new tokens")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--eval-seq", type=int, default=1024)
    parser.add_argument("--eval-batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    init_single_process()
    ours, hf = build(options.layers, options.hidden, options.heads, options.vocab, options.positions)
    print(precision_header() + "; fp32 here")
    print(f"# GPT-2 L={options.layers} h={options.hidden} heads={options.heads} V={options.vocab}, prompt "
          f"{options.prompt} tokens, batch {options.batch}, greedy, {torch.get_num_threads()} threads, "
          f"median of {options.repeats}")
    print("| new tokens | ours KV cache tok/s | ours --recompute tok/s | HF generate tok/s | cache / recompute | "
          "ours / HF |")
    print("|---:|---:|---:|---:|---:|---:|")
    prompt = torch.randint(0, options.vocab, (options.batch, options.prompt),
                           generator=torch.Generator().manual_seed(7))
    for length in options.lengths:
        rate = bench_generation(ours, hf, prompt, length, options.repeats)
        cache, recompute, theirs = rate["ours (KV cache)"], rate["ours (--recompute)"], rate["HF generate"]
        print(f"| {length} | {cache:,.0f} | {recompute:,.0f} | {theirs:,.0f} | {cache / recompute:.2f}x | "
              f"{cache / theirs:.2f}x |", flush=True)
    tokens = torch.randint(0, options.vocab, (options.eval_batch, options.eval_seq),
                           generator=torch.Generator().manual_seed(8))
    rate = bench_evaluation(ours, hf, tokens, options.repeats)
    print()
    print(f"| evaluation forward ({options.eval_batch} x {options.eval_seq}) | ours tok/s | HF tok/s | ours / HF |")
    print("|---|---:|---:|---:|")
    print(f"| full windows | {rate['ours']:,.0f} | {rate['HF']:,.0f} | {rate['ours'] / rate['HF']:.2f}x |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

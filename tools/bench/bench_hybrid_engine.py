"""Generation from the training engine under ZeRO-3 (the Hybrid Engine: megatron.text_generation.hybrid) against
the naive way and Hugging Face, at data-parallel 2 on this machine's CPU.

    python tools/bench/bench_hybrid_engine.py [--new-tokens 32] [--repeats 3]

Rows: batch 1 and 8 of 16-token prompts, greedy, fp32, GPT-2 L4 h256 heads 4 V8192 (positions 128), one thread per
process. Columns (new tokens per second per rank, medians over repeats, each way timed right after the other):
    hybrid      generate_from_training_model(engine, ...): every parameter gathered once per call, the KV-cache
                decode, released after
    naive       the same KV-cache decode on the engine's module as it is: stage 3 gathers and releases every unit
                at every token's forward (what a generate without the Hybrid Engine costs)
    HF          transformers' GPT2LMHeadModel.generate on the exported weights, alone on rank 0 (rank 1 waits)
The tokens of all three are checked equal.
"""
import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

SHAPE = dict(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=8192, max_sequence_length=128)
PROMPT = 16


def _worker(batches, new_tokens, repeats):
    import torch
    import torch.distributed as dist
    import mpu
    from megatron import zero
    from megatron.model.gpt2_model import GPT2Model, GPT2ModelConfig
    from megatron.model.hf_interchange import to_hf_state_dict
    from megatron.text_generation.generation import generate
    from megatron.text_generation.hybrid import generate_from_training_model, generation_mode
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2ModelConfig(**SHAPE)
    with zero.Init(data_parallel_group=mpu.get_data_parallel_group()):
        model = GPT2Model(config)
    zero.register_external_parameter(model.lm_head, model.word_embeddings.weight)
    engine = zero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), mpu=mpu,
                             config={"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10 ** 6,
                                     "zero_optimization": {"stage": 3,
                                                           "stage3_param_persistence_threshold": 0}})[0]
    hf = None
    params = list(engine.module.named_parameters())
    with zero.GatheredParameters([p for _, p in params]):      # every rank takes part; rank 0 keeps a copy
        weights = {name: p.detach().clone() for name, p in params} if dist.get_rank() == 0 else None
    if dist.get_rank() == 0:
        from transformers import GPT2Config, GPT2LMHeadModel
        model_config = dict(SHAPE, vocab_size=SHAPE["vocab_size"], layernorm_epsilon=1e-5)
        hf = GPT2LMHeadModel(GPT2Config(n_layer=SHAPE["num_layers"], n_embd=SHAPE["hidden_size"],
                                        n_head=SHAPE["num_attention_heads"], n_positions=SHAPE["max_sequence_length"],
                                        vocab_size=SHAPE["vocab_size"], activation_function="gelu_new")).eval()
        hf.load_state_dict(to_hf_state_dict(weights, model_config), strict=False)
    rows = []
    for batch in batches:
        prompts = torch.randint(0, SHAPE["vocab_size"], (batch, PROMPT),
                                generator=torch.Generator().manual_seed(batch)).tolist()
        times = {"hybrid": [], "naive": [], "HF": []}
        outputs = {}
        for _ in range(repeats):
            start = time.perf_counter()
            outputs["hybrid"] = generate_from_training_model(engine, prompts, new_tokens, greedy=True)
            times["hybrid"].append(time.perf_counter() - start)
            start = time.perf_counter()
            with generation_mode(engine.module):
                outputs["naive"] = generate(engine.module, prompts, new_tokens, greedy=True)
            times["naive"].append(time.perf_counter() - start)
            dist.barrier()
            if hf is not None:
                start = time.perf_counter()
                with torch.no_grad():
                    out = hf.generate(torch.tensor(prompts), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      do_sample=False, pad_token_id=0)
                times["HF"].append(time.perf_counter() - start)
                outputs["HF"] = out[:, PROMPT:].tolist()
            dist.barrier()
        same = outputs["hybrid"] == outputs["naive"] and (hf is None or outputs["hybrid"] == outputs["HF"])
        rows.append({"batch": batch, "same": same,
                     **{key: batch * new_tokens / statistics.median(values) for key, values in times.items()
                        if values}})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    from megatron.spawn import run_distributed
    results = run_distributed(_worker, 2, args=([1, 8], options.new_tokens, options.repeats), model_parallel_size=1,
                              timeout=3600)
    print(f"# GPT-2 L4 h256 V8192, ZeRO-3 dp 2, prompt {PROMPT} tokens, {options.new_tokens} new, greedy, 1 thread "
          f"per process, {options.repeats} repeats: new tokens/s per rank (medians)")
    columns = ["batch", "hybrid tok/s", "naive tok/s", "HF tok/s", "hybrid / naive", "hybrid / HF", "same tokens"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("-" * (len(column) + 2) for column in columns) + "|")
    for row, other in zip(results[0], results[1]):
        cells = [str(row["batch"]), f"{row['hybrid']:.0f}", f"{row['naive']:.0f}", f"{row['HF']:.0f}",
                 f"{row['hybrid'] / row['naive']:.2f}x", f"{row['hybrid'] / row['HF']:.2f}x",
                 str(row["same"] and other["same"])]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

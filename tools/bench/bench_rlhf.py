"""RLHF step 3 (train_rlhf.py) on this machine: time per iteration split into generation, scoring and training,
for PPO and GRPO, and the generation's tokens/s against Hugging Face generate on the same weights.

    python tools/bench/bench_rlhf.py [--iters 6] [--new-tokens 32] [--layers 4] [--hidden 256]
    python tools/bench/bench_rlhf.py --device cuda --dtype bfloat16 --layers 12 --hidden 768   # one GPU

Setting: one process, fp32 on the CPU by default (--device, --dtype: the same run on one GPU, CUDA hidden for
--device cpu), the embedded chat data's prompts (data/sft/, built on first use; the last 48 prompt
tokens), a random GPT-2 (L4 h256 heads 4 by default, the default data's vocabulary, positions 128) as the actor (and
reference) and a random reward model (critic and scorer for PPO), rollouts of 32 completions (GRPO: 8 prompts x 4)
of up to --new-tokens sampled tokens, micro-batches of 16, one PPO epoch, Megatron path (no --deepspeed). Columns
(ms per iteration, mean over the iterations after the first): generation (the training model's KV-cache decode,
generate_from_training_model), scoring (reward model or function, old/reference log-probs, values), training (the
optimizer steps of actor and critic); then generation tokens/s of the first rollout (completion tokens / its
generation time) and of HF GPT2LMHeadModel.generate on the same starting weights and prompts (one left-padded batch
with its attention mask, sampling, the same new tokens at most), timed right after in the same process.
"""
import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))

WEBTEXT = os.path.join(REPO, "data", "webtext")
PROMPT = 48


def _models(root, layers, hidden):
    """(HF actor directory, our actor checkpoint, our reward checkpoint) of random models."""
    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel
    from megatron.checkpoint.full_checkpoint import write_full_checkpoint
    from megatron.model.hf_interchange import from_hf_state_dict
    vocab = len(json.load(open(os.path.join(WEBTEXT, "vocab.json"))))
    shape = dict(n_layer=layers, n_embd=hidden, n_head=4, n_positions=128, vocab_size=vocab,
                 activation_function="gelu_new", bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    actor = GPT2LMHeadModel(GPT2Config(**shape))
    reward = GPT2ForSequenceClassification(GPT2Config(**shape, num_labels=1, pad_token_id=0))
    actor.save_pretrained(os.path.join(root, "hf_actor"), safe_serialization=True)
    weights, config = from_hf_state_dict(actor.state_dict(), actor.config.to_dict())
    write_full_checkpoint(os.path.join(root, "actor"), weights, config, 1)
    state = reward.state_dict()
    score = state.pop("score.weight")
    weights, config = from_hf_state_dict(state, reward.config.to_dict())
    weights["score.weight"] = score
    write_full_checkpoint(os.path.join(root, "reward"), weights, config, 1)
    return os.path.join(root, "hf_actor"), os.path.join(root, "actor"), os.path.join(root, "reward")


def _run(argv):
    import mpu
    import train_rlhf
    history = train_rlhf.main(argv)
    mpu.destroy_model_parallel()
    return history["first_rollout"]


def _hf_tokens_per_second(hf_dir, prompts, new_tokens, device="cpu", dtype_name="float32"):
    import torch
    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel.from_pretrained(hf_dir).to(device=device, dtype=getattr(torch, dtype_name)).eval()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)
    torch.manual_seed(0)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=True, top_k=0,
                             eos_token_id=0, pad_token_id=0)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    new = out[:, width:]
    ended = (new == 0).int().cumsum(1)
    tokens = int(((ended == 0) | ((ended == 1) & (new == 0))).sum())     # up to and including the first eos
    return tokens / seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu hides CUDA from the run (train_rlhf.py follows mpu's device choice)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="bfloat16: train_rlhf.py --bf16 and HF in bf16")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""      # before torch is imported here or in the workers
    import prepare_sft_data
    from megatron.spawn import run_distributed
    sft = os.path.join(REPO, "data", "sft")
    manifest = prepare_sft_data.prepare(sft, vocab_dir=WEBTEXT)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        hf_dir, actor, reward = _models(root, args.layers, args.hidden)
        common = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads", "4",
                  "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-file",
                  os.path.join(WEBTEXT, "vocab.json"), "--merge-file", os.path.join(WEBTEXT, "merges.txt"),
                  "--data-path", os.path.join(sft, manifest["data_prefix"]), "--split", manifest["split"],
                  "--load", actor, "--batch-size", "16", "--global-batch-size", "32", "--max-prompt-length",
                  str(PROMPT), "--max-completion-length", str(args.new_tokens), "--train-iters", str(args.iters),
                  "--lr", "1e-5", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
                  "--log-interval", "1"] + (["--bf16"] if args.dtype == "bfloat16" else [])
        for algorithm, flags in (("ppo", ["--critic-load", reward, "--reward-model", reward]),
                                 ("grpo", ["--num-generations", "4", "--reward-fn",
                                           "megatron.posttrain.rlhf_rewards:answer_length"])):
            log = os.path.join(root, f"{algorithm}.jsonl")
            rollout = run_distributed(_run, 1, args=(common + ["--algorithm", algorithm, "--log-jsonl", log] + flags,),
                                      timeout=3600)[0]
            records = [json.loads(line) for line in open(log)]
            phases = [r["rlhf_ms"] for r in records if r.get("type") == "train"][1:]    # after the first
            mean = {key: sum(p[key] for p in phases) / len(phases) for key in phases[0]}
            tokens = sum(len(c) for c in rollout["completions"])
            ours = tokens / rollout["seconds"]["generation"]
            theirs = _hf_tokens_per_second(hf_dir, rollout["prompts"], args.new_tokens, args.device, args.dtype)
            rows.append((algorithm, mean, ours, theirs))
    import torch
    print(f"# bench_rlhf: L{args.layers} h{args.hidden}, rollouts of 32, {args.new_tokens} new tokens at most, "
          f"{args.iters} iterations, {args.dtype} on {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("| algorithm | iteration ms | generation ms | scoring ms | training ms | ours tokens/s | HF tokens/s | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for algorithm, mean, ours, theirs in rows:
        total = sum(mean.values())
        print(f"| {algorithm} | {total:.0f} | {mean['generation']:.0f} | {mean['scoring']:.0f} | "
              f"{mean['training']:.0f} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

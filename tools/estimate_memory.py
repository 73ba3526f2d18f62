"""Model-state and activation memory per rank of a GPT-2 shape, without hardware (megatron/memory.py).

    python tools/estimate_memory.py --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 \
        --vocab-size 50257 --model-parallel-size 2 --data-parallel-size 8 --zero-stage 2 --bf16 --micro-batch-size 4

Prints the parameters per model-parallel rank (our GPT2Model's shapes, vocabulary padded like the training script),
the model-state bytes by kind (the same numbers `pretrain_gpt.py` prints at start-up for the same settings) and an
activation estimate (Korthikanti et al. 2022; see memory.activation_bytes_per_layer).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron import memory  # noqa: E402


def _vocab_size_with_padding(vocab_size, divisible_by, model_parallel_size):
    multiple = divisible_by * model_parallel_size
    return -(-vocab_size // multiple) * multiple


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--num-layers", type=int, required=True)
    parser.add_argument("--hidden-size", type=int, required=True)
    parser.add_argument("--num-attention-heads", type=int, required=True)
    parser.add_argument("--seq-length", type=int, required=True)
    parser.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    parser.add_argument("--vocab-size", type=int, required=True, help="the tokenizer's vocabulary (before padding)")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    parser.add_argument("--model-parallel-size", type=int, default=1)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=None,
                        help="ZeRO stage (the --deepspeed path); omitted: the Megatron path (no partitioning)")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true")
    precision.add_argument("--bf16", action="store_true")
    parser.add_argument("--reduce-bucket-size", type=int, default=None,
                        help="stage 2: zero_optimization.reduce_bucket_size, for the bucket bound")
    parser.add_argument("--overlap-comm", action="store_true")
    parser.add_argument("--offload", action="store_true", help="master weights and moments in host memory")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--checkpoint-activations", action="store_true")
    return parser


def estimate(args):
    """(parameters per mp rank, per-group counts, model-state bytes, activation bytes)."""
    padded_vocab = _vocab_size_with_padding(args.vocab_size, args.make_vocab_size_divisible_by,
                                            args.model_parallel_size)
    counts = memory.gpt2_param_groups(args.num_layers, args.hidden_size, padded_vocab,
                                      args.max_position_embeddings or args.seq_length, args.model_parallel_size)
    dtype = "float16" if args.fp16 else ("bfloat16" if args.bf16 else "float32")
    if args.zero_stage is None:
        states = memory.model_state_bytes(counts, 1, 0, dtype, offload=args.offload, alignment=1,
                                          master_grads=args.fp16 or args.bf16)
    else:
        states = memory.model_state_bytes(counts, args.data_parallel_size, args.zero_stage, dtype,
                                          offload=args.offload, reduce_bucket_size=args.reduce_bucket_size,
                                          overlap_comm=args.overlap_comm)
    activations = memory.activation_bytes(args.num_layers, args.seq_length, args.micro_batch_size, args.hidden_size,
                                          args.num_attention_heads, args.model_parallel_size,
                                          args.checkpoint_activations,
                                          bytes_per_element=4 if dtype == "float32" else 2)
    return sum(counts), counts, states, activations, padded_vocab, dtype


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.hidden_size % args.num_attention_heads or args.num_attention_heads % args.model_parallel_size:
        sys.exit("error: --hidden-size must divide by --num-attention-heads, and the heads by --model-parallel-size")
    total, counts, states, activations, padded_vocab, dtype = estimate(args)
    setting = (f"mp {args.model_parallel_size}, dp {args.data_parallel_size}, "
               f"{'Megatron optimizer' if args.zero_stage is None else f'ZeRO stage {args.zero_stage}'}, {dtype}")
    print(f"parameters per model-parallel rank: {total} (weight decay {counts[0]}, no decay {counts[1]}; "
          f"padded vocabulary {padded_vocab})")
    print(f"model-state memory estimate per rank (bytes, {setting}): {memory.format_bytes(states)}")
    print(f"activations per rank (bytes, micro batch {args.micro_batch_size}, "
          f"{'checkpointed' if args.checkpoint_activations else 'no recomputation'}): {activations} "
          f"({activations / 2 ** 20:.2f} MiB)")
    return states


if __name__ == "__main__":
    main()

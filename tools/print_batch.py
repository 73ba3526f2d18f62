"""Print the samples each data-parallel rank trained on at one iteration: token ids and text, through
pretrain_gpt.py's own dataset provider (megatron/data/pretraining.py) and loader
(megatron.data.samplers.pretraining_loader; raw shards: megatron.data.stream, re-read up to the iteration). One
process, no torch.distributed: give the training run's flags and its number of processes.

    python tools/print_batch.py --iteration 1200 --world-size 8 <the training run's flags: model parallel size,
        --batch-size, --global-batch-size, --train-iters, --seed, --seq-length, --data-path / --train-data,
        --split, --vocab-file, --merge-file, --data-cache-path, [--deepspeed --deepspeed_config ds.json]>

Prints one JSON object per sample: {"iteration", "data_parallel_rank", "micro_batch", "sample_index", "ids",
"text"}: `ids` is the [seq_length + 1] row the rank read at that iteration (the model's input is ids[:-1], its
labels ids[1:]); "text" is its detokenization (null with --mock-data). Iteration N (1-based) consumed the global
batches after (N - 1) x global-batch-size samples, as a run resumed there would (a constant global batch size).
"""
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron import cli  # noqa: E402


class PrintBatchError(cli.UserError, ValueError):
    """Bad input: one line, exit status 1."""


def add_print_batch_args(parser):
    group = parser.add_argument_group("print batch")
    group.add_argument("--iteration", type=int, required=True, help="the training iteration (1-based)")
    group.add_argument("--world-size", type=int, default=1, help="processes of the training run (sets the "
                       "data-parallel size with --model-parallel-size)")
    return parser


def parse_args(argv):
    """Megatron's parser at the training run's world size (read from the environment by validate_args)."""
    from megatron.arguments import parse_args as megatron_parse_args
    world_parser = cli.ArgumentParser(add_help=False)       # --world-size alone: --help and errors come below
    world_parser.add_argument("--world-size", type=int, default=1)
    world = world_parser.parse_known_args(argv)[0].world_size
    if world < 1:
        raise PrintBatchError(f"--world-size must be at least 1, got {world}")
    os.environ["WORLD_SIZE"] = str(world)
    args = megatron_parse_args(add_print_batch_args, argv)
    if not 1 <= args.iteration <= args.train_iters:
        raise PrintBatchError(f"--iteration {args.iteration} is outside the run's 1..--train-iters "
                              f"({args.train_iters})")
    return args


def batches_at(args, train_dataset):
    """[(data-parallel rank, micro-batch index, [sample index], ids tensor [b, s + 1])] of iteration
    args.iteration, in the order the ranks consumed them."""
    from megatron.data.samplers import pretraining_loader
    consumed = (args.iteration - 1) * args.global_batch_size
    if hasattr(train_dataset, "loader"):
        return _stream_batches_at(args, train_dataset, consumed)
    out = []
    for rank in range(args.data_parallel_size):
        loader = pretraining_loader(train_dataset, consumed, args.batch_size, rank, args.data_parallel_size)
        sampler, batches = loader.batch_sampler, iter(loader)
        indices = iter(sampler)
        for micro in range(args.num_micro_batches):
            out.append((rank, micro, next(indices), next(batches)["text"]))
    return out


def _stream_batches_at(args, source, consumed):
    """batches_at for raw shards (megatron.data.stream): the global stream re-read from its start up to the
    iteration (its order is a function of the seed alone), each global micro batch cut as the ranks cut it."""
    micro_batch, ranks = args.batch_size, args.data_parallel_size
    stream = source.loader(micro_batch * ranks, 0, 1, consumed_samples=consumed,
                           log=lambda line: print(line, file=sys.stderr))
    global_batches = [next(stream)["text"] for _ in range(args.num_micro_batches)]
    out = []
    for rank in range(ranks):
        for micro, batch in enumerate(global_batches):
            first = consumed + micro * micro_batch * ranks + rank * micro_batch
            out.append((rank, micro, list(range(first, first + micro_batch)),
                        batch[rank * micro_batch:(rank + 1) * micro_batch]))
    return out


def main(argv=None):
    """Returns the printed records."""
    from megatron.data.samplers import train_valid_test_num_samples
    from megatron.data.pretraining import pretraining_datasets
    from megatron.global_vars import get_tokenizer, set_global_variables
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with contextlib.redirect_stdout(sys.stderr):   # progress lines of the shared code: stdout stays JSON
        set_global_variables(args)
        train_dataset = pretraining_datasets(args, train_valid_test_num_samples(     # pretrain_gpt.py's data
            args.train_iters, args.global_batch_size, args.eval_interval, args.eval_iters))[0]
    tokenizer = get_tokenizer()
    records = []
    for rank, micro, indices, ids in batches_at(args, train_dataset):
        for sample_index, row in zip(indices, ids.tolist()):
            records.append({"iteration": args.iteration, "data_parallel_rank": rank, "micro_batch": micro,
                            "sample_index": sample_index, "ids": row,
                            "text": None if tokenizer is None else tokenizer.detokenize(row)})
            print(json.dumps(records[-1], ensure_ascii=False), flush=True)
    return records


if __name__ == "__main__":
    from megatron.initialize import run_main
    run_main(main)

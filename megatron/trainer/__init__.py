"""The parts of megatron/training.py that stand on their own (each name re-exported there, where callers and
tests find them; the loop, the step recipes and every --deepspeed branch stay in training.py):

    builders.py         Megatron-LM's weight-decay groups and the --lr schedule (AnnealingLR)
    log_line.py         the training log line (rank 0, TensorBoard, the --log-jsonl record's core) with tokens/s
                        and TFLOP/s, and flops_per_token, the count behind them
    data_iterators.py   the train/valid/test iterators, starting where the consumed samples say
    downstream_eval.py  --eval-tasks: lm-eval tasks scored by the model being trained (DownstreamEval)

This file imports nothing.
"""

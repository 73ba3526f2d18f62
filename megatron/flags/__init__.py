"""The pieces of Megatron's command line that megatron/arguments.py (parse_args, validate_args) puts together:

    groups.py          the argparse groups (_add_*_args: model shape, training, checkpointing, distributed, data,
                       logging, LoRA; the MoE group is megatron/model/moe_args.py's) that build_parser adds
    deepspeed_json.py  under --deepspeed, the --deepspeed_config JSON parsed once and the flags it shares with the
                       command line reconciled with it (the JSON wins; a disagreeing flag is an error)

This file imports nothing.
"""

"""A checkpoint resumed with a model or optimizer flag other than its own stops in one line naming the flag, on both
paths, before anything is loaded: an MoE checkpoint without --num-experts (the model shape is compared before the
ZeRO engine's load_state_dict, which would list every missing and unexpected key), a Muon checkpoint under AdamW
and an AdamW one under --optimizer muon (the optimizer kind is compared before the param groups are)."""
import os

from megatron.spawn import run_distributed
from tests.helpers import TINY, train, write_config

MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
MUON = ["--optimizer", "muon"]


def _resume_messages(root):
    """{case: the CheckpointError's message, or None when the resumed run trained}."""
    import mpu
    from megatron.checkpoint import CheckpointError

    def run(argv):
        try:
            train(TINY + argv)
        except CheckpointError as error:
            return str(error)
        finally:
            mpu.destroy_model_parallel()
        return None

    zero = ["--deepspeed", "--deepspeed_config", write_config(root)]
    messages = {}
    for case, saved, resumed in (("moe_zero", MOE + zero, zero), ("muon_megatron", MUON, []),
                                 ("adamw_zero", zero, MUON + zero)):
        save = os.path.join(root, case)
        assert run(saved + ["--train-iters", "2", "--save", save, "--save-interval", "2"]) is None
        messages[case] = run(resumed + ["--train-iters", "3", "--load", save])
    messages["the fix"] = run(["--train-iters", "3", "--load", os.path.join(root, "muon_megatron"),
                               "--no-load-optim"])
    return messages


def test_resuming_with_other_model_or_optimizer_flags_is_one_line(tmp_path):
    root = str(tmp_path)
    messages = run_distributed(_resume_messages, 1, args=(root,))[0]
    switch = ("the checkpoint's optimizer state is {}'s, this run's optimizer is {}: resume with --optimizer {}, or "
              "pass --no-load-optim (or --finetune) to start {} fresh from the saved weights")
    assert messages == {
        "moe_zero": f"{root}/moe_zero/iter_0000002 was saved by another model shape: num_experts 4 (checkpoint) != "
                    "None (this run); moe_router_topk 2 (checkpoint) != None (this run)",
        "muon_megatron": f"{root}/muon_megatron/iter_0000002/mp_rank_00/model_optim_rng.pt: "
                         + switch.format("Muon", "AdamW", "muon", "AdamW"),
        "adamw_zero": f"{root}/adamw_zero/iter_0000002: " + switch.format("AdamW", "Muon", "adam", "Muon"),
        "the fix": None}

"""Part (c) of the GPU check: a DeepSpeed-style client on our engine, as a DeepSpeed-Chat user writes one.

    python tools/ds_client_check.py               # on the GPU when torch sees one, else on the CPU (the tests do)
    python tools/ds_client_check.py --stages 3 --steps 5

A Hugging Face GPT-2 (GPT2LMHeadModel, a small GPT2Config) is built on the CPU, then `deepspeed.initialize` through
our alias (`megatron.zero.as_deepspeed.install()`, then `import deepspeed`), with `deepspeed.ops.adam.FusedAdam`,
bf16 and the Hybrid Engine enabled, at ZeRO-2 and then ZeRO-3, one process (rank 0 of 1: no port). Each stage
trains a few steps on one fixed batch (engine(...).loss, engine.backward, engine.step) and then generates greedily
with `engine.generate` and with `engine.module.generate` (DeepSpeed-Chat's call). It checks, and prints one JSON
line per stage (`RESULT {...}`):
- the model went to the accelerator (engine.device, every parameter or its ZeRO-3 partition there);
- at ZeRO-3 the parameters are partitioned between steps (empty outside a forward) where the data-parallel size is
  above 1; at 1 (this one process) they are resident instead: whole, AVAILABLE, and views of their partition (no
  copy: nothing to shard, megatron/zero/stage3.py);
- every loss is finite and the last is below the first (one batch, memorized);
- both generate calls return the prompt followed by the same new tokens, on the device;
- ZeRO-2's and ZeRO-3's losses agree within 0.02 (the same model, batch and steps; bf16 rounding apart).
Exits 1 naming the first failed check, 0 when every stage passes.
"""
import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

VOCAB, POSITIONS, PROMPT, NEW_TOKENS = 128, 64, 8, 8


class CheckFailed(Exception):
    pass


def check(condition, message):
    if not condition:
        raise CheckFailed(message)


def run_stage(deepspeed, stage, steps):
    """Build, train `steps` steps and generate at ZeRO `stage`; returns the stage's record."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=POSITIONS,
                                       bos_token_id=None, eos_token_id=None))
    check(all(p.device.type == "cpu" for p in model.parameters()), "the model was not built on the CPU")
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
              "bf16": {"enabled": True}, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "hybrid_engine": {"enabled": True}}
    optimizer = deepspeed.ops.adam.FusedAdam(model.parameters(), lr=3e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    device = torch.device(deepspeed.get_accelerator().current_device_name())
    check(engine.device == device, f"engine.device is {engine.device}, the accelerator's device {device}")
    placed = [p.ds_tensor if stage == 3 and hasattr(p, "ds_tensor") else p for p in engine.module.parameters()]
    check(all(t.device == device for t in placed), f"a parameter is not on {device} after deepspeed.initialize")

    tokens = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1)).to(device)
    losses = []
    engine.train()
    for _ in range(steps):
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if stage == 3:
        check_stage3_between_steps(engine)
    check(all(math.isfinite(x) for x in losses), f"a loss is not finite: {losses}")
    check(losses[-1] < losses[0], f"the loss did not fall over {steps} steps on one batch: {losses}")

    engine.eval()
    prompt = tokens[:2, :PROMPT]
    mask = torch.ones_like(prompt)
    by_engine = engine.generate(prompt, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                pad_token_id=0)
    by_module = engine.module.generate(prompt, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                       pad_token_id=0)
    check(by_engine.device == device, f"generated tokens are on {by_engine.device}, not {device}")
    check(tuple(by_engine.shape) == (2, PROMPT + NEW_TOKENS), f"generated shape {tuple(by_engine.shape)}")
    check(torch.equal(by_engine[:, :PROMPT], prompt), "the generated sequences do not start with the prompt")
    check(torch.equal(by_engine, by_module), "engine.generate and engine.module.generate disagree")
    return {"stage": stage, "device": str(device), "losses": [round(x, 4) for x in losses],
            "generated": by_engine[:, PROMPT:].tolist()}


def check_stage3_between_steps(engine):
    """Partitioned (empty) at data-parallel size > 1; resident at 1: whole, AVAILABLE, views of the partition."""
    from megatron.zero import ZeroParamStatus
    params = list(engine.module.parameters())
    if engine.ctx.data_parallel_size > 1:
        check(all(p.numel() == 0 for p in params), "ZeRO-3 parameters are whole between steps (not partitioned)")
        return
    check(all(tuple(p.shape) == tuple(p.ds_shape) and p.ds_status == ZeroParamStatus.AVAILABLE for p in params),
          "ZeRO-3 at data-parallel size 1: a parameter is not whole and AVAILABLE between steps (not resident)")
    spans = [(g.partition.data_ptr(), g.partition.data_ptr() + g.partition.numel() * g.partition.element_size())
             for g in engine.stage3.groups]
    check(all(any(lo <= p.data_ptr() < hi for lo, hi in spans) for p in params),
          "ZeRO-3 at data-parallel size 1: a parameter is a copy, not a view of its partition")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="2,3", help="ZeRO stages, comma-separated (default 2,3)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per stage (default 4)")
    args = parser.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    if args.steps < 2 or any(s not in (0, 1, 2, 3) for s in stages):
        parser.error("--steps must be at least 2 and --stages among 0, 1, 2, 3")
    from megatron.zero import as_deepspeed
    as_deepspeed.install()
    import deepspeed
    deepspeed.init_distributed()
    losses = {}
    for stage in stages:
        start = time.perf_counter()
        try:
            record = run_stage(deepspeed, stage, args.steps)
            losses[stage] = record["losses"]
            if 2 in losses and 3 in losses:
                apart = max(abs(a - b) for a, b in zip(losses[2], losses[3]))
                check(apart <= 0.02, f"ZeRO-2's and ZeRO-3's losses differ by {apart}: {losses[2]} {losses[3]}")
        except CheckFailed as e:
            print(f"ds_client_check: ZeRO-{stage}: {e}", file=sys.stderr)
            return 1
        record["seconds"] = round(time.perf_counter() - start, 1)
        print("RESULT " + json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""MoE through pretrain_gpt.py: the --deepspeed path at expert-parallel size 2 trains the same losses as at 1 (the
same data-parallel size), prints the aux loss and the tokens per expert every log interval, and its model-state
estimate equals what the engine holds after step 1 (experts partitioned over the expert-data-parallel group);
pipeline parallelism with EP equals the run without; the FLOP count counts the active parameters; bad flag
combinations stop with one line."""
import contextlib
import io
import re
import types

import pytest

from megatron.spawn import run_distributed
from megatron.initialize import layout_line
from megatron.model.moe_args import StarvingExpertWatch
from tests.helpers import NO_DROPOUT, parser_error, TINY, train, write_config

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
       "--log-interval", "5"]
LOG = re.compile(r"moe aux loss: ([0-9.E+-]+) \| tokens per expert min/max: (\d+)/(\d+)")


def _train_capturing(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        history = train(argv)
    return history, out.getvalue()


def test_deepspeed_path_at_expert_parallel_2_equals_1(tmp_path):
    config = write_config(str(tmp_path))       # ZeRO-2, micro batch 2
    common = TINY + NO_DROPOUT + MOE + ["--deepspeed", "--deepspeed_config", config]
    (ep1, _), _ = run_distributed(_train_capturing, 2, args=(common,))
    (ep2, stdout), _ = run_distributed(_train_capturing, 2, args=(common + ["--expert-model-parallel-size", "2"],))
    assert len(ep2["lm loss"]) == 10
    assert max(abs(a - b) for a, b in zip(ep1["lm loss"], ep2["lm loss"])) <= 1e-5, (ep1["lm loss"], ep2["lm loss"])
    logged = LOG.findall(stdout)
    assert len(logged) == 2, stdout
    assert ("data-parallel 2, expert-parallel 2 (expert-data-parallel 1); optimizer: AdamW (lr 0.001, betas "
            "0.9/0.999, eps 1e-08, weight decay 0.01); ZeRO stage 2") in stdout, stdout[:2000]
    tokens = 2 * 16                             # rank 0's micro-batch: 2 sequences of 16
    for aux, low, high in logged:
        assert float(aux) > 0 and 0 <= int(low) <= int(high) <= tokens
        assert int(high) >= tokens * 2 // 4     # some expert takes at least the average share
    assert ep2["model_state_estimate"]["total"] == ep2["model_state_measured"]["total"]
    assert ep2["model_state_measured"]["total"] < ep1["model_state_measured"]["total"]   # half the experts here


def test_pipeline_2_with_expert_parallel_2_equals_one_stage(tmp_path):
    """4 ranks: 2 stages x data-parallel 2 at EP 2 (ZeRO-1, 2 micro-batches a step, aux and z losses on) train the
    losses of 2 ranks without the pipeline: each stage's MoE layer gets its aux-loss gradient with the right scale."""
    config = write_config(str(tmp_path), zero_optimization={"stage": 1}, gradient_accumulation_steps=2)
    common = TINY + NO_DROPOUT + MOE + ["--expert-model-parallel-size", "2", "--deepspeed", "--deepspeed_config",
                                        config]
    one_stage = run_distributed(train, 2, args=(common,))[0]["lm loss"]
    two_stages = run_distributed(train, 4, args=(common + ["--pipeline-model-parallel-size", "2"],))[-1]["lm loss"]
    assert len(two_stages) == 10
    assert max(abs(a - b) for a, b in zip(one_stage, two_stages)) <= 1e-6, (one_stage, two_stages)


def test_resume_at_expert_parallel_2_and_weights_at_1(tmp_path):
    """pretrain_gpt.py --deepspeed at EP 2 stopped at iteration 5 (saved) and resumed equals the straight run; the
    checkpoint loads at EP 1 with --no-load-optim (every expert is in it), its optimizer state is refused there."""
    config = write_config(str(tmp_path))
    save = str(tmp_path / "ckpt")
    common = TINY + NO_DROPOUT + MOE + ["--deepspeed", "--deepspeed_config", config]
    ep2 = common + ["--expert-model-parallel-size", "2"]
    straight = run_distributed(train, 2, args=(ep2,))[0]["lm loss"]
    run_distributed(train, 2, args=(ep2 + ["--save", save, "--exit-interval", "5"],))
    resumed = run_distributed(train, 2, args=(ep2 + ["--load", save],))[0]["lm loss"]
    assert len(resumed) == 5 and max(abs(a - b) for a, b in zip(resumed, straight[5:])) <= 1e-6, (resumed, straight)
    weights = run_distributed(train, 2, args=(common + ["--load", save, "--no-load-optim"],))[0]["lm loss"]
    assert len(weights) == 5 and abs(weights[0] - resumed[0]) <= 1e-6   # the first loss is the saved weights'
    with pytest.raises(RuntimeError, match="saved at expert-model-parallel size 2, this run uses 1"):
        run_distributed(train, 2, args=(common + ["--load", save],))


def test_flops_count_active_parameters():
    import mpu
    from megatron.training import flops_per_token
    L, h, s, V, f = 2, 32, 16, 64, 48
    plain = flops_per_token(L, h, s, V, ffn_hidden_size=f)
    moe = mpu.MoEConfig(num_experts=4, topk=2, layer_freq=2)       # layer 0 only
    # layer 0 runs 2 expert MLPs (4hf each) and its router (2hE): one more MLP and the router, 3 passes
    assert flops_per_token(L, h, s, V, ffn_hidden_size=f, moe=moe) == plain + 3 * (4 * h * f + 2 * h * 4)
    swiglu = flops_per_token(L, h, s, V, ffn_hidden_size=f, swiglu=True, moe=mpu.MoEConfig(num_experts=4, topk=1))
    assert swiglu == flops_per_token(L, h, s, V, ffn_hidden_size=f, swiglu=True) + 3 * L * 2 * h * 4


@pytest.mark.parametrize("flags,message", [
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 needs --num-experts"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk (5) must be between 1 and --num-experts"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2"], "must divide the data-parallel size (1)"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "0"], "--moe-expert-capacity-factor (0.0) must be > 0"),
    (["--num-experts", "4", "--lora-rank", "4"], "--num-experts cannot be combined with --lora-rank"),
])
def test_bad_moe_flags_stop_with_one_line(flags, message, capsys):
    from megatron.arguments import parse_args
    line = parser_error(lambda argv: parse_args(args_list=["--mock-data"] + argv), flags, capsys)
    assert message in line, line


def test_expert_parallel_needs_the_engine(capsys, monkeypatch):
    from megatron.arguments import parse_args
    monkeypatch.setenv("WORLD_SIZE", "2")
    line = parser_error(lambda argv: parse_args(args_list=["--mock-data"] + argv),
                        ["--num-experts", "4", "--expert-model-parallel-size", "2"], capsys)
    assert "--expert-model-parallel-size 2 needs --deepspeed" in line, line


def test_starving_expert_warning_after_three_intervals_in_a_row_once_and_rearmed():
    """The watch's rule by hand: min 0 at intervals 1-3 warns at the third only; a fed interval re-arms it."""
    watch = StarvingExpertWatch(aux_loss_coeff=0.0)
    fed, starving = {"tokens per expert min": 1}, {"tokens per expert min": 0}
    lines = [watch.observe(fields, 10 * i) for i, fields in
             enumerate([starving, starving, fed, starving, starving, starving, starving, fed, {}], start=1)]
    assert [i for i, line in enumerate(lines, start=1) if line] == [6]
    assert lines[5] == ("WARNING: an expert was routed no tokens at each of the last 3 log intervals (iteration 60): "
                        "--moe-aux-loss-coeff is 0; set it (Megatron-LM's usual 1e-2) to balance the experts' load")
    assert "--moe-aux-loss-coeff is 0.01; raise it" in StarvingExpertWatch(0.01, intervals=1).observe(starving, 5)


def test_training_warns_when_an_expert_starves():
    """64 experts, top-1, 32 tokens a micro-batch: at least 32 experts get none at every interval, so the third
    log interval (iteration 3) warns once; the layout line names the expert-parallel degree and the optimizer."""
    flags = ["--num-experts", "64", "--moe-router-topk", "1", "--train-iters", "4", "--log-interval", "1",
             "--batch-size", "2"]
    ((_, stdout),) = run_distributed(_train_capturing, 1, args=(TINY + NO_DROPOUT + flags,))   # own process
    warnings = [line for line in stdout.splitlines() if "routed no tokens" in line]
    assert warnings == ["WARNING: an expert was routed no tokens at each of the last 3 log intervals (iteration 3): "
                        "--moe-aux-loss-coeff is 0; set it (Megatron-LM's usual 1e-2) to balance the experts' load"]
    assert [int(low) for _, low, _ in LOG.findall(stdout)] == [0, 0, 0, 0]
    assert ("> layout: tensor-parallel 1, pipeline-parallel 1, context-parallel 1, data-parallel 1, expert-parallel 1 "
            "(expert-data-parallel 1); optimizer: AdamW (lr 0.001, betas 0.9/0.999, eps 1e-08, weight decay 0.01); "
            "Megatron's optimizer (no --deepspeed)") in stdout.splitlines()


def test_layout_line_names_every_degree_and_muons_two_halves():
    args = types.SimpleNamespace(
        model_parallel_size=2, pipeline_model_parallel_size=3, context_parallel_size=2, data_parallel_size=4,
        num_experts=8, expert_model_parallel_size=2, optimizer="muon", muon_lr=0.05, muon_momentum=0.9, lr=3e-4,
        adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6, weight_decay=0.1, zero_config=object(), zero_stage=1)
    assert layout_line(args) == (
        "> layout: tensor-parallel 2, pipeline-parallel 3, context-parallel 2, data-parallel 4, expert-parallel 2 "
        "(expert-data-parallel 2); optimizer: Muon (muon-lr 0.05, momentum 0.9) for the hidden matrices, AdamW (lr "
        "0.0003, betas 0.8/0.95, eps 1e-06, weight decay 0.1) for the rest; ZeRO stage 1")
    args.num_experts, args.optimizer = None, "adam"      # no experts: expert-parallel 1 whatever the flag says
    assert ", data-parallel 4, expert-parallel 1; optimizer: AdamW (lr 0.0003," in layout_line(args)

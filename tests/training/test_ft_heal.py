"""A replica group SIGKILLed at a fixed step heals from the live group (issue 72, item 2): two groups of
pretrain_gpt.py (ZeRO-2, one rank each, each under its own torchrun) and torchft's lighthouse on loopback. Group 1
dies in the optimizer step of iteration KILL_AT; its torchrun restarts it (no --load: nothing is read from a file)
and it receives weights, optimizer state, scheduler, counters and data position from group 0, which never
restarts. The whole trajectory is checked against a single-process plain-PyTorch reference that trains, at each
iteration, on the samples of the groups in the logged quorum."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron.data.samplers import MegatronPretrainingSampler
from megatron.spawn import free_port, run_distributed
from tests.helpers import assert_bitwise, FIXTURES, MOCK_VOCAB, NO_DROPOUT, REPO, TINY_SHAPE

ITERS, KILL_AT, WAIT_AT = 8, 3, 5
MICRO, ACCUMULATION, GROUPS = 2, 2, 2
GLOBAL = MICRO * ACCUMULATION * GROUPS
CLIP = 0.05
MODEL = MOCK_VOCAB + TINY_SHAPE + NO_DROPOUT + [
    "--batch-size", str(MICRO), "--train-iters", str(ITERS), "--log-interval", "1", "--eval-iters", "0",
    "--lr", "1e-3", "--warmup", "0", "--lr-decay-style", "constant", "--seed", "7", "--clip-grad", str(CLIP),
    "--global-batch-size", str(MICRO * ACCUMULATION)]


def _launch(group, directory, lighthouse, env_extra, restarts):
    config = os.path.join(directory, "ds.json")
    with open(config, "w") as handle:   # the JSON's fault_tolerance block sets --ft-replica-groups and the timeout
        json.dump({"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
                   "gradient_clipping": CLIP, "zero_optimization": {"stage": 2, "reduce_bucket_size": 4000},
                   "fault_tolerance": {"replica_groups": GROUPS, "timeout": 30}}, handle)
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(env_extra)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--max-restarts",
               str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
               os.path.join(FIXTURES, "ft_group.py"), *MODEL, "--deepspeed", "--deepspeed_config", config,
               "--ft-group-id", str(group), "--ft-lighthouse", lighthouse, "--save", os.path.join(directory, "save"),
               "--log-jsonl", os.path.join(directory, "log.jsonl")]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _losses(directory):
    with open(os.path.join(directory, "log.jsonl")) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return {r["iteration"]: r["losses"]["lm loss"] for r in records if "losses" in r}


def _ft_records(directory, event):
    """{iteration: the group's --log-jsonl 'ft' record of `event`} ('step': its quorum; 'heal')."""
    with open(os.path.join(directory, "log.jsonl")) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return {r["iteration"]: r for r in records if r.get("type") == "ft" and r["event"] == event}


def _final(directory):
    tag = os.path.join(directory, "save", f"iter_{ITERS:07d}")
    return {name: torch.load(os.path.join(tag, name), map_location="cpu", weights_only=False)
            for name in sorted(os.listdir(tag)) if name.endswith(".pt")}


@pytest.fixture(scope="module")
def healed_run(tmp_path_factory):
    from torchft._torchft import LighthouseServer
    root = tmp_path_factory.mktemp("ft_heal")
    directories = [str(root / f"group{g}") for g in range(GROUPS)]
    for directory in directories:
        os.makedirs(directory)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=20000, quorum_tick_ms=20,
                                  heartbeat_timeout_ms=1000)
    rejoined, ready = str(root / "rejoined"), {"FT_READY": str(root)}
    try:
        survivor = _launch(0, directories[0], lighthouse.address(),
                           {"FT_WAIT_AT": str(WAIT_AT), "FT_REJOINED": rejoined, **ready}, restarts=0)
        killed = _launch(1, directories[1], lighthouse.address(),
                         {"FT_KILL_AT": str(KILL_AT), "KILL_RANK": "0", "KILL_MARKER": str(root / "killed"),
                          "FT_REJOINED": rejoined, **ready}, restarts=1)
        outputs = [process.communicate(timeout=400) for process in (survivor, killed)]
    finally:
        lighthouse.shutdown()
    for process, (stdout, stderr) in zip((survivor, killed), outputs):
        assert process.returncode == 0, stdout[-3000:] + stderr[-5000:]
    return directories, [stdout for stdout, _ in outputs]


def _logged_quorums(stdout):
    """{iteration: (groups in the quorum, dropped sample indices)} from the survivor's lines for incomplete steps."""
    found = {}
    for iteration, quorum, indices in re.findall(
            r"iteration (\d+): quorum \[([\d, ]*)\] of \d+ groups, committed; dropped group 1's samples \[([\d, ]*)\]",
            stdout):
        found[int(iteration)] = ([int(g) for g in quorum.split(",")], [int(i) for i in indices.split(",")])
    return found


def _reference(argv, quorums):
    """Single process, plain torch AdamW and clip_grad_norm_ on the same GPT2Model: each iteration trains on the
    samples (MockGPTDataset, by global index) of the groups in that iteration's quorum. Returns ({iteration:
    {group: that group's mean loss}}, the final parameters)."""
    import pretrain_gpt
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.initialize import initialize_megatron
    from megatron.trainer.builders import param_groups_for_weight_decay
    args = initialize_megatron(None, argv)
    model = pretrain_gpt.model_provider()
    optimizer = torch.optim.AdamW(param_groups_for_weight_decay(model), lr=args.lr, weight_decay=args.weight_decay,
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
    data = MockGPTDataset(ITERS * GLOBAL, args.seq_length, args.vocab_size, args.seed)
    losses = {}
    for iteration in range(1, ITERS + 1):
        consumed, losses[iteration] = (iteration - 1) * GLOBAL, {}
        optimizer.zero_grad()
        for group in quorums[iteration]:
            sampler = MegatronPretrainingSampler(ITERS * GLOBAL, consumed, MICRO, group, GROUPS)
            batches = list(sampler)[:ACCUMULATION]     # this group's micro batches of the iteration
            group_losses = []
            for indices in batches:
                text = torch.tensor(np.stack([data[i]["text"] for i in indices]))
                tokens, labels = text[:, :-1], text[:, 1:]
                positions = torch.arange(tokens.shape[1]).expand_as(tokens)
                loss = model(tokens, positions, None, labels=labels).float().mean()
                (loss / (len(quorums[iteration]) * ACCUMULATION)).backward()
                group_losses.append(loss.item())
            losses[iteration][group] = sum(group_losses) / ACCUMULATION
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_the_killed_group_heals_from_the_live_one_and_the_survivor_never_restarts(healed_run):
    directories, (survivor_out, healed_out) = healed_run
    assert survivor_out.count("building GPT2 model") == 1          # the survivor was never restarted
    assert healed_out.count("building GPT2 model") == 2            # the killed group was, by its torchrun
    heal = re.search(r"healed from a live group at iteration (\d+)", healed_out)
    assert heal, healed_out[-3000:]
    logged = _logged_quorums(survivor_out)
    assert set(logged) == set(range(KILL_AT + 1, int(heal.group(1)) + 1))   # alone from the kill to the heal
    for iteration, (quorum, dropped) in logged.items():
        assert quorum == [0]
        # exactly group 1's share of that step: what its sampler (data-parallel rank 1 of 2) would have read
        share = list(MegatronPretrainingSampler(ITERS * GLOBAL, (iteration - 1) * GLOBAL, MICRO, 1, GROUPS))
        assert dropped == [i for batch in share[:ACCUMULATION] for i in batch]
    _assert_the_log_and_plot_show_quorums_and_the_heal(directories, logged, int(heal.group(1)))
    # after the heal both groups hold the same weights and optimizer state, bitwise, to the end
    assert_bitwise(_final(directories[0]), _final(directories[1]))

    quorums = {i: logged[i][0] if i in logged else [0, 1] for i in range(1, ITERS + 1)}
    reference_losses, reference_weights = run_distributed(_reference, 1, args=(MODEL, quorums),
                                                          init_process_group=False)[0]
    survivor, healed = _losses(directories[0]), _losses(directories[1])
    for iteration in range(1, ITERS + 1):
        assert survivor[iteration] == pytest.approx(reference_losses[iteration][0], rel=1e-6)
        if iteration > int(heal.group(1)):
            assert healed[iteration] == pytest.approx(reference_losses[iteration][1], rel=1e-6)
    module = _final(directories[0])["mp_rank_00_model_states.pt"]["module"]
    for name, weight in reference_weights.items():
        assert torch.allclose(module[name].float(), weight, rtol=0, atol=1e-6), name


def _assert_the_log_and_plot_show_quorums_and_the_heal(directories, logged, healed_at):
    """Every step's quorum size in the survivor's --log-jsonl (1 while alone, with the dropped indices the log line
    names; 2 otherwise), the heal in the healed group's, and tools/plot_run.py draws both panels."""
    from plot_run import present_panels, read_run
    steps = _ft_records(directories[0], "step")
    assert {i: r["quorum"] for i, r in steps.items()} == {i: 1 if i in logged else 2 for i in range(1, ITERS + 1)}
    assert {i: r["dropped"] for i, r in steps.items()} == {
        i: {"1": logged[i][1]} if i in logged else {} for i in range(1, ITERS + 1)}
    heals = _ft_records(directories[1], "heal")
    assert list(heals) == [healed_at] and 0 < heals[healed_at]["heal_seconds"] < 30, heals
    assert [r["quorum"] for i, r in _ft_records(directories[1], "step").items() if i > healed_at] == [2] * (
        ITERS - healed_at)
    runs = [read_run(os.path.join(d, "log.jsonl"), f"group {g}") for g, d in enumerate(directories)]
    titles = [panel.title for panel in present_panels(runs)[0]]
    assert "replica groups in the quorum" in titles and "heals" in titles, titles

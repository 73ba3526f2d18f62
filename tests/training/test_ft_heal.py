"""Faults injected at fixed iterations into one of two replica groups (issue 72): two groups of pretrain_gpt.py
(ZeRO-2, one rank each, each under its own torchrun) and torchft's lighthouse on loopback, in ONE run. Group 1 gets,
in order: a Python exception in the forward (its torchrun restarts it), a NaN gradient (it contributes nothing and
heals at its next step), a SIGKILL in the optimizer step, a SIGKILL during the gradient exchange, a SIGSTOP past
--ft-timeout (then SIGCONT: its exchange fails and it heals). Group 0 never restarts and loses no step: a failed
exchange is redone with a new quorum. After every heal group 1's whole training state is group 0's bitwise, and
both trajectories equal a single-process plain-PyTorch reference that trains, at each iteration, on the samples of
the groups in group 0's logged quorum."""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron.spawn import run_distributed
from tests.helpers import assert_bitwise, FIXTURES, REPO
from tests.training.ft_reference import ACCUMULATION, CLIP, GROUPS, ITERS, MICRO, MODEL, reference, replayed_shares

FAULTS = {"exception": 3, "nan": 8, "kill_step": 10, "kill_exchange": 15, "stop": 20}   # group 1 gets them
WAIT_AT = (5, 12, 17, 22)       # group 0 waits there until group 1 is back from the 1st, 2nd, ... removing fault
TIMEOUT, STOP_SECONDS = 4, 7    # --ft-timeout; the SIGSTOP outlasts it (and the lighthouse's heartbeat timeout)


def _launch(group, directory, root, lighthouse, env_extra, restarts):
    config = os.path.join(directory, "ds.json")
    with open(config, "w") as handle:   # the JSON's fault_tolerance block sets --ft-replica-groups and the timeout
        json.dump({"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
                   "gradient_clipping": CLIP, "zero_optimization": {"stage": 2, "reduce_bucket_size": 4000},
                   "fault_tolerance": {"replica_groups": GROUPS, "timeout": TIMEOUT, "replay_dropped": True}}, handle)
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update({"FT_DIR": root, "FT_READY": root, "FT_DIGESTS": os.path.join(directory, "digests.jsonl"),
                **env_extra})
    # Fresh interpreters here, torchrun's agents and workers both (subprocess, and PYTHON_EXEC, not the warm ones of
    # tests/warm_python.py): the faults' heal steps (FAULTS, WAIT_AT) assume a restart takes an interpreter's start-up
    # (a warm worker rejoins steps sooner), and with warm agents group 1 once made step 1's quorum alone (group 0's
    # manager not yet heartbeating) in a loaded clean-clone run
    env["PYTHON_EXEC"] = sys.executable
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               "--max-restarts", str(restarts),        # --standalone: its own rendezvous port, no race for one
               os.path.join(FIXTURES, "ft_group.py"), *MODEL, "--deepspeed", "--deepspeed_config", config,
               "--ft-group-id", str(group), "--ft-lighthouse", lighthouse, "--save", os.path.join(directory, "save"),
               "--log-jsonl", os.path.join(directory, "log.jsonl")]
    with open(os.path.join(directory, "output.txt"), "w") as output:   # read after the run (or a hang)
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)


def _records(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _by_iteration(directory, keep):
    """{iteration: the last record of the group's log that `keep` selects} (a restarted attempt logs again)."""
    return {r["iteration"]: r for r in _records(os.path.join(directory, "log.jsonl")) if keep(r)}


def _final(directory):
    tag = os.path.join(directory, "save", f"iter_{ITERS:07d}")
    return {name: torch.load(os.path.join(tag, name), map_location="cpu", weights_only=False)
            for name in sorted(os.listdir(tag)) if name.endswith(".pt")}


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    from torchft._torchft import LighthouseServer
    root = tmp_path_factory.mktemp("ft_heal")
    directories = [str(root / f"group{g}") for g in range(GROUPS)]
    for directory in directories:
        os.makedirs(directory)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=20000, quorum_tick_ms=20,
                                  heartbeat_timeout_ms=1000)
    try:
        survivor = _launch(0, directories[0], str(root), lighthouse.address(),
                           {"FT_WAIT_AT": ",".join(map(str, WAIT_AT))}, restarts=0)
        faulty = _launch(1, directories[1], str(root), lighthouse.address(),
                         {"FT_FAULTS": ",".join(f"{kind}:{k}" for kind, k in FAULTS.items()),
                          "FT_STOP_SECONDS": str(STOP_SECONDS)}, restarts=3)
        for process in (survivor, faulty):
            process.wait(timeout=400)
    finally:
        lighthouse.shutdown()
    outputs = []
    for process, directory in zip((survivor, faulty), directories):
        with open(os.path.join(directory, "output.txt")) as handle:
            outputs.append(handle.read())
        assert process.returncode == 0, outputs[-1][-8000:]
    steps = _by_iteration(directories[0], lambda r: r.get("type") == "ft" and r["event"] == "step")
    heals = _by_iteration(directories[1], lambda r: r.get("type") == "ft" and r["event"] == "heal")
    return directories, outputs, steps, heals


def _alone(heals):
    """The iterations group 0 must have trained without group 1: from each fault (the one after a SIGKILL in the
    optimizer step, whose exchange went through) to group 1's next heal (logged at the iteration it resumes after)."""
    alone = set()
    for kind, k in FAULTS.items():
        first = k + 1 if kind == "kill_step" else k
        alone |= set(range(first, min(h for h in heals if h >= k) + 1))
    return alone


def _quorums_and_shares(heals):
    alone = _alone(heals)
    quorums = {i: [0] if i in alone else [0, 1] for i in range(1, ITERS + 1)}
    return (quorums, *replayed_shares(quorums))


def test_the_survivor_never_restarts_and_commits_every_step(faulty_run):
    directories, (survivor_out, faulty_out), steps, heals = faulty_run
    assert survivor_out.count("building GPT2 model") == 1               # group 0 was never restarted
    assert faulty_out.count("building GPT2 model") == 4                 # group 1 three times, by its torchrun
    assert "groups, discarded;" not in survivor_out                     # (a slow-step stack dump may name it)
    assert sorted(steps) == list(range(1, ITERS + 1))
    assert all(record["committed"] for record in steps.values())
    # the exchanges that failed against a dead or stopped group 1 were redone with a new quorum, once
    redone = {i for i, record in steps.items() if record["exchanges"] > 1}
    assert {FAULTS["exception"], FAULTS["kill_exchange"], FAULTS["stop"]} <= redone, redone
    assert all(steps[i]["exchanges"] == 2 for i in redone) and steps[FAULTS["nan"]]["exchanges"] == 1


def test_group_1_heals_after_each_fault(faulty_run):
    directories, _, steps, heals = faulty_run
    after = sorted(min(h for h in heals if h >= k) for k in FAULTS.values())
    assert sorted(heals) == after, (heals, FAULTS)      # one heal per fault, none elsewhere
    assert FAULTS["nan"] in heals     # right at the next step
    assert all(0 < record["heal_seconds"] < 30 for record in heals.values()), heals
    # the faulty group's own record of the NaN step: committed nowhere, its samples dropped there
    faulty_steps = _by_iteration(directories[1], lambda r: r.get("type") == "ft" and r["event"] == "step")
    assert not faulty_steps[FAULTS["nan"]]["committed"]


def test_after_each_heal_the_state_is_the_survivors_bitwise(faulty_run):
    directories, _, _, heals = faulty_run
    digests = [{r["iteration"]: r["digest"] for r in _records(os.path.join(d, "digests.jsonl"))}
               for d in directories]
    for healed_at in heals:
        assert digests[1][healed_at + 1] == digests[0][healed_at + 1], healed_at
    assert_bitwise(_final(directories[0]), _final(directories[1]))     # and to the end


def test_the_quorums_and_dropped_samples_are_the_failed_groups_share(faulty_run):
    directories, _, steps, heals = faulty_run
    alone = _alone(heals)
    assert {i for i, r in steps.items() if r["quorum"] == 1} == alone
    assert {i for i, r in steps.items() if r["quorum"] == 2} == set(range(1, ITERS + 1)) - alone
    _, shares, replayed, _ = _quorums_and_shares(heals)
    for iteration, record in steps.items():
        # exactly group 1's share of that step (a replayed one, or what its sampler would have read)
        assert record["dropped"] == ({"1": shares[iteration][1]} if iteration in alone else {}), iteration
        assert record["replayed"] == shares[iteration][:replayed[iteration]], iteration
    from plot_run import present_panels, read_run
    runs = [read_run(os.path.join(d, "log.jsonl"), f"group {g}") for g, d in enumerate(directories)]
    titles = [panel.title for panel in present_panels(runs)[0]]
    assert "replica groups in the quorum" in titles and "heals" in titles, titles


def test_with_replay_every_sample_is_trained_on_once(faulty_run):
    """--ft-replay-dropped: the shares of the steps group 1 missed were trained on later (by whichever group held
    them then), and what the run consumed was trained on exactly once."""
    directories, _, steps, heals = faulty_run
    quorums, shares, replayed, left = _quorums_and_shares(heals)
    assert sum(replayed.values()) >= len(_alone(heals)) > 0 and left == []   # a share dropped again is queued again
    trained = [i for iteration, quorum in quorums.items() for g in quorum for i in shares[iteration][g]]
    consumed = _by_iteration(directories[0], lambda r: "consumed_samples" in r)[ITERS]["consumed_samples"]
    assert sorted(trained) == list(range(consumed))


def test_the_trajectory_equals_a_reference_applying_the_logged_quorums(faulty_run):
    directories, _, steps, heals = faulty_run
    quorums, shares, _, _ = _quorums_and_shares(heals)
    alone = _alone(heals)
    reference_losses, norms, reference_weights = run_distributed(reference, 1, args=(MODEL, quorums, shares),
                                                                 init_process_group=False)[0]
    survivor, faulty = (_by_iteration(d, lambda r: "losses" in r) for d in directories)
    for iteration in range(1, ITERS + 1):
        assert survivor[iteration]["losses"]["lm loss"] == pytest.approx(reference_losses[iteration][0], rel=1e-6)
        assert survivor[iteration]["grad_norm"] == pytest.approx(norms[iteration], rel=1e-6), iteration
        if iteration not in alone and iteration != FAULTS["kill_step"]:   # group 1 trained it (and logged it)
            assert faulty[iteration]["losses"]["lm loss"] == pytest.approx(reference_losses[iteration][1], rel=1e-6)
    module = _final(directories[0])["mp_rank_00_model_states.pt"]["module"]
    for name, weight in reference_weights.items():
        assert torch.allclose(module[name].float(), weight, rtol=0, atol=1e-6), name

"""zero.checkpointing: bitwise-equal gradients for every option, saved-activation bytes, configuration errors.

The model-parallel checks run once on 2 processes (mp=2) and return everything the tests assert on. Every tensor
lives on mpu's device (the CPU, or the rank's GPU under `pytest --device cuda`); workers return CPU copies, so the
parent compares ranks on one device.
"""
import json
import warnings

import pytest
import torch
from torch import nn

import mpu
from megatron.zero import checkpointing
from megatron.zero.config import ConfigError
from megatron.spawn import run_distributed

NUM_LAYERS, HIDDEN, HEADS, SEQ, BATCH, STEPS = 3, 32, 4, 16, 2, 2
ACTIVATION_BYTES = BATCH * SEQ * HIDDEN * 4  # one fp32 [b, s, h] tensor
# (partition_activations, checkpoint_in_cpu, contiguous_checkpointing)
ZERO_OPTIONS = [(p, c, g) for p in (False, True) for c in (False, True) for g in (False, True)]


# ----------------------------------------------------------------------------------------------------------------
# Model-parallel checks (2 processes, mp=2)

def _configure(options, **extra):
    partition, cpu, contiguous = options
    checkpointing.configure(mpu, partition_activations=partition, checkpoint_in_cpu=cpu,
                            contiguous_checkpointing=contiguous,
                            num_checkpoints=NUM_LAYERS if contiguous else None, **extra)


def _set_mode(model, checkpoint_activations):
    """Checkpointing on or off, with the pair the model builder would hand a model built now (zero.checkpointing's
    once configured, else mpu's): one model runs every mode."""
    from megatron.model.gpt2_model import activation_checkpointing_pair
    model.checkpoint_activations = checkpoint_activations
    model.set_activation_checkpointing(*activation_checkpointing_pair())


def _device_rng_state():
    """The state of the generator dropout draws from on mpu's device (CUDA's under --device cuda)."""
    device = mpu.get_device()
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _on_cpu(value):
    """`value` with every tensor in it (nested in dicts, lists, tuples) copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {key: _on_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(item) for item in value)
    return value


def _train_steps(model, x, target, mask=None, input_requires_grad=True):
    """STEPS forward/backward passes from a fixed RNG state: (grads, losses, RNG states afterwards)."""
    mpu.model_parallel_cuda_manual_seed(99)
    model.zero_grad(set_to_none=True)
    losses, input_grads = [], []
    for _ in range(STEPS):
        leaf = x.clone().requires_grad_(input_requires_grad)
        loss = (model(leaf, mask) * target).sum()
        loss.backward()
        losses.append(loss.detach())
        input_grads.append(leaf.grad)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    grads["input"] = input_grads
    rng = (torch.get_rng_state(), _device_rng_state(), mpu.get_cuda_rng_tracker().get_states())
    return grads, losses, rng


def _saved_tensors(run):
    """{(data_ptr, bytes): (storage data_ptr, storage bytes)} of the distinct tensors autograd saves while
    `run()` builds the graph, and run()'s result."""
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        seen[(tensor.data_ptr(), tensor.numel() * tensor.element_size())] = (storage.data_ptr(), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return seen, out


def _saved_bytes(run):
    seen, _ = _saved_tensors(run)
    return sum(nbytes for _, nbytes in seen)


def _mp2_worker():
    mpu.model_parallel_cuda_manual_seed(1234)
    model = mpu.ParallelTransformer(NUM_LAYERS, HIDDEN, HEADS, attention_dropout_prob=0.2, output_dropout_prob=0.2)
    device = mpu.get_device()
    generator = torch.Generator().manual_seed(7)                    # a CPU generator: the same draws on any device
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=generator).to(device)       # the same on both ranks
    target = torch.randn(BATCH, SEQ, HIDDEN, generator=generator).to(device)
    results = {"runs": {}, "bytes": {}}

    def run(name, checkpoint_activations, **kwargs):
        _set_mode(model, checkpoint_activations)
        results["runs"][name] = _train_steps(model, x, target, **kwargs)

    checkpointing.unconfigure()
    run("none", False)
    run("mpu", True)
    for options in ZERO_OPTIONS:
        _configure(options)
        run(f"zero{options}", True)
    _configure((True, True, True), synchronize=True, profile=True)
    run("zero all+synchronize+profile", True)
    results["profile"] = checkpointing.profile_summary()

    # Inputs that do not require grad, and a tensor mask next to the checkpointed hidden states.
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool, device=device).triu(1).view(1, 1, SEQ, SEQ)  # True = masked out
    for name, kwargs in (("no input grad", dict(input_requires_grad=False)), ("mask", dict(mask=mask))):
        checkpointing.unconfigure()
        run(f"{name} none", False, **kwargs)
        _configure((True, False, True))
        run(f"{name} zero", True, **kwargs)

    # Saved-activation bytes of one forward (no backward needed to count them).
    leaf = x.clone().requires_grad_()
    for name, options in (("none", None), ("plain", (False, False, False)), ("partition", (True, False, False)),
                          ("partition+contiguous", (True, False, True))):
        checkpointing.unconfigure()
        if options is not None:
            _configure(options)
        _set_mode(model, options is not None)
        results["bytes"][name] = _saved_bytes(lambda: model(leaf))
        checkpointing.reset()  # forwards without backward: free the contiguous slots
    results["bytes"]["final layernorm"] = _saved_bytes(
        lambda: model.final_layernorm(torch.randn(BATCH, SEQ, HIDDEN, device=device, requires_grad=True)))

    # Contiguous: the partitioned chunk inputs of every step live in one buffer, allocated once.
    _configure((True, False, True))
    _set_mode(model, True)
    results["contiguous storages"] = []
    for _ in range(STEPS):
        seen, out = _saved_tensors(lambda: model(leaf))
        out.sum().backward()
        results["contiguous storages"].append(
            {storage for (_, nbytes), storage in seen.items() if nbytes == ACTIVATION_BYTES // 2})
    checkpointing.unconfigure()
    return _on_cpu(results)


@pytest.fixture(scope="module")
def mp2_results():
    return run_distributed(_mp2_worker, world_size=2, model_parallel_size=2)


def _assert_bitwise_equal(name, got, want):
    grads, losses, rng = got
    ref_grads, ref_losses, ref_rng = want
    assert grads.keys() == ref_grads.keys()
    for key in ref_grads:
        pairs = zip(grads[key], ref_grads[key]) if key == "input" else [(grads[key], ref_grads[key])]
        for g, ref in pairs:
            assert (g is None) == (ref is None), f"{name}: gradient of {key}"
            if g is not None:
                assert torch.equal(g, ref), f"{name}: gradient of {key} differs by {(g - ref).abs().max()}"
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), f"{name}: losses {losses} != {ref_losses}"
    assert torch.equal(rng[0], ref_rng[0]), f"{name}: the CPU's default RNG stream moved differently"
    assert torch.equal(rng[1], ref_rng[1]), f"{name}: the device's default RNG stream moved differently"
    assert rng[2].keys() == ref_rng[2].keys() and all(torch.equal(rng[2][k], ref_rng[2][k]) for k in rng[2]), \
        f"{name}: the tracker's RNG stream moved differently"


@pytest.mark.parametrize("name", ["mpu"] + [f"zero{o}" for o in ZERO_OPTIONS] + ["zero all+synchronize+profile"])
def test_gradients_bitwise_equal_with_dropout(mp2_results, name):
    for rank, results in enumerate(mp2_results):
        _assert_bitwise_equal(f"rank {rank} {name}", results["runs"][name], results["runs"]["none"])


@pytest.mark.parametrize("case", ["no input grad", "mask"])
def test_inputs_without_grad_and_masks(mp2_results, case):
    for rank, results in enumerate(mp2_results):
        runs = results["runs"]
        _assert_bitwise_equal(f"rank {rank} {case}", runs[f"{case} zero"], runs[f"{case} none"])
    if case == "no input grad":
        grads = mp2_results[0]["runs"]["no input grad zero"][0]
        assert all(g is not None and g.abs().sum() > 0 for k, g in grads.items() if k != "input")


def test_dropout_is_active(mp2_results):
    """Guards the equality tests against passing because dropout did nothing."""
    runs = mp2_results[0]["runs"]
    losses = runs["none"][1]
    assert not torch.equal(losses[0], losses[1]), "two steps on the same input gave the same loss: no dropout?"


def test_saved_bytes_fall_to_checkpointed_inputs_and_partition_divides_them(mp2_results):
    for results in mp2_results:
        saved = results["bytes"]
        layernorm = saved["final layernorm"]  # the only saver outside the checkpointed chunks
        assert saved["plain"] == NUM_LAYERS * ACTIVATION_BYTES + layernorm
        assert saved["partition"] == NUM_LAYERS * ACTIVATION_BYTES // 2 + layernorm
        assert saved["partition+contiguous"] == saved["partition"]
        assert saved["none"] > 5 * saved["plain"], saved


def test_contiguous_checkpoints_share_one_buffer_across_steps(mp2_results):
    for results in mp2_results:
        storages = results["contiguous storages"]
        assert len(storages[0]) == 1 and all(s == storages[0] for s in storages), storages
        (_, buffer_bytes), = storages[0]
        assert buffer_bytes == NUM_LAYERS * ACTIVATION_BYTES // 2


def test_profile_counts_forward_recompute_gather_and_synchronize(mp2_results):
    calls = NUM_LAYERS * STEPS
    profile = mp2_results[0]["profile"]
    assert {name: entry["count"] for name, entry in profile.items()} == {
        "forward": calls, "recompute": calls, "gather": calls, "synchronize": 2 * calls}
    assert all(entry["seconds"] > 0 for name, entry in profile.items() if name != "synchronize")


# ----------------------------------------------------------------------------------------------------------------
# Configuration and single-process behaviour

class _SingleRankMpu:
    """The narrow mpu protocol at model-parallel and data-parallel size 1, without torch.distributed."""

    @staticmethod
    def get_model_parallel_world_size():
        return 1

    @staticmethod
    def get_model_parallel_rank():
        return 0

    @staticmethod
    def get_model_parallel_group():
        return None

    @staticmethod
    def get_data_parallel_world_size():
        return 1


@pytest.fixture(autouse=True)
def _unconfigured():
    checkpointing.unconfigure()
    yield
    checkpointing.unconfigure()


def _block(**keys):
    return {"train_batch_size": 1, "activation_checkpointing": keys}


def test_configure_reads_json_dict_and_path_and_arguments_override(tmp_path):
    checkpointing.configure(_SingleRankMpu, deepspeed_config=_block(contiguous_memory_optimization=True,
                                                                     number_checkpoints=4, profile=True))
    config = checkpointing.get_config()
    assert checkpointing.is_configured() and config.contiguous_memory_optimization and config.number_checkpoints == 4
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(_block(cpu_checkpointing=True, synchronize_checkpoint_boundary=True)))
    checkpointing.configure(_SingleRankMpu, deepspeed_config=str(path), checkpoint_in_cpu=False, num_checkpoints=2)
    config = checkpointing.get_config()
    assert (config.cpu_checkpointing, config.synchronize_checkpoint_boundary, config.number_checkpoints) == \
        (False, True, 2)
    assert not config.contiguous_memory_optimization


@pytest.mark.parametrize("kwargs, message", [
    (dict(contiguous_checkpointing=True), "needs number_checkpoints"),
    (dict(contiguous_checkpointing=True, num_checkpoints=0), "number_checkpoints: expected a positive int"),
    (dict(num_checkpoints=2.0), "num_checkpoints=2.0"),
    (dict(partition_activations=1), "partition_activations=1"),
    (dict(deepspeed_config=_block(contiguous_memory_optimization=True)), "needs number_checkpoints"),
    (dict(deepspeed_config=_block(partition_activation=True)), "unknown key 'partition_activation'"),
    (dict(deepspeed_config=_block(cpu_checkpointing="yes")), "cpu_checkpointing: expected bool"),
    (dict(deepspeed_config="/nonexistent/ds_config.json"), "does not exist"),
])
def test_bad_configurations_are_clear_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        checkpointing.configure(_SingleRankMpu, **kwargs)
    assert not checkpointing.is_configured()


def _dropout_mlp(device=None):
    """A dropout MLP on `device` (default: mpu's, the GPU under --device cuda)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.5), nn.Linear(16, 8))
    return model.to(device or mpu.get_device())


def _input(device=None, requires_grad=False):
    return torch.randn(4, 8, device=device or mpu.get_device(), requires_grad=requires_grad)


def _grads_of(model, step):
    """Gradients of 3 steps from one seed, and the state of the generator the model's dropout drew from."""
    torch.manual_seed(5)
    model.zero_grad(set_to_none=True)
    for _ in range(3):
        step().sum().backward()
    device = next(model.parameters()).device
    rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    return [p.grad.clone() for p in model.parameters()], rng


def test_partition_at_mp1_warns_once_and_changes_nothing():
    model = _dropout_mlp()
    x = _input()
    want = _grads_of(model, lambda: model(x))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpointing.configure(_SingleRankMpu, partition_activations=True)
        got = _grads_of(model, lambda: checkpointing.checkpoint(model, x))
    assert [str(w.message) for w in caught if "partition_activations" in str(w.message)] == \
        [str(caught[0].message)] and len(caught) == 1, [str(w.message) for w in caught]
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0])) and torch.equal(got[1], want[1])


def test_non_tensor_arguments_and_input_without_grad_reach_the_parameters():
    model = _dropout_mlp()
    x = _input()  # requires no grad: the parameters must still get theirs

    def scaled(inputs, scale, unused):
        assert unused is None
        return model(inputs) * scale

    want = _grads_of(model, lambda: scaled(x, 3.0, None))
    checkpointing.configure(_SingleRankMpu, contiguous_checkpointing=True, num_checkpoints=1)
    got = _grads_of(model, lambda: checkpointing.checkpoint(scaled, x, 3.0, None))
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0])) and torch.equal(got[1], want[1])


def test_inputs_come_back_on_their_own_device(monkeypatch):
    """A module kept on the host in a run whose device (mpu's) is a GPU: its checkpointed input is restored on the
    host, where the module is, not on the run's device. mpu's device is set to "cuda" for the checkpointing
    module only; the host checkpoint keeps the data off that device, so no GPU is needed (the restore moved it)."""
    monkeypatch.setattr(checkpointing, "get_device", lambda: torch.device("cuda"))
    model = _dropout_mlp("cpu")
    x = _input("cpu", requires_grad=True)
    want = _grads_of(model, lambda: model(x))
    checkpointing.configure(_SingleRankMpu, checkpoint_in_cpu=True, contiguous_checkpointing=True, num_checkpoints=1)
    got = _grads_of(model, lambda: checkpointing.checkpoint(model, x))
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0])) and torch.equal(got[1], want[1])


def test_more_checkpoints_than_slots_is_an_error_until_reset():
    model = _dropout_mlp()
    x = _input(requires_grad=True)
    checkpointing.configure(_SingleRankMpu, contiguous_checkpointing=True, num_checkpoints=2)
    h = checkpointing.checkpoint(model, checkpointing.checkpoint(model, x))
    with pytest.raises(RuntimeError, match="more than num_checkpoints=2 checkpoints before a backward"):
        checkpointing.checkpoint(model, h)
    h.sum().backward()  # frees both slots
    checkpointing.checkpoint(model, checkpointing.checkpoint(model, x)).sum().backward()
    checkpointing.checkpoint(model, checkpointing.checkpoint(model, x))  # no backward: slots stay taken
    checkpointing.reset()
    checkpointing.checkpoint(model, checkpointing.checkpoint(model, x)).sum().backward()


SEED, MASK_SIZE, DRAWS = 4242, 256, 2
SEEDINGS = {"mpu": mpu.model_parallel_cuda_manual_seed, "zero": checkpointing.model_parallel_cuda_manual_seed}


def _dropout_mask(device):
    return nn.functional.dropout(torch.ones(MASK_SIZE, device=device), p=0.5, training=True) != 0


def _masks_from_generator(seed, device):
    """DRAWS dropout masks drawn from the state of a torch.Generator seeded with `seed` (nothing else seeded)."""
    state = torch.Generator(device=device).manual_seed(seed).get_state()
    get, put = ((lambda: torch.cuda.get_rng_state(device), lambda s: torch.cuda.set_rng_state(s, device))
                if device.type == "cuda" else (torch.get_rng_state, torch.set_rng_state))
    saved = get()
    put(state)
    try:
        return [_dropout_mask(device) for _ in range(DRAWS)]
    finally:
        put(saved)


def _seeding_worker():
    """Per seeding function: masks drawn alternately from the default generator and inside tracker.fork(); the
    references from independently seeded generators (mp rank = global rank: the world is one mp=2 group)."""
    import torch.distributed as dist
    device, rank = mpu.get_device(), dist.get_rank()
    out = {"tracker is mpu's": checkpointing.get_cuda_rng_tracker() is mpu.get_cuda_rng_tracker()}
    for name, seed_function in SEEDINGS.items():
        seed_function(SEED)
        default, forked = [], []
        for _ in range(DRAWS):
            default.append(_dropout_mask(device))
            with checkpointing.get_cuda_rng_tracker().fork():
                forked.append(_dropout_mask(device))
        out[name] = (default, forked)
    torch.manual_seed(SEED)
    out["torch.manual_seed"] = [_dropout_mask(device) for _ in range(DRAWS)]
    out["generator(seed)"] = _masks_from_generator(SEED, device)
    out["generator(seed + 2718 + rank)"] = _masks_from_generator(SEED + 2718 + rank, device)
    return _on_cpu(out)


def test_model_parallel_seeding_draws_the_documented_streams():
    """default generator = seed on every mp rank; tracker 'model-parallel-rng' = seed + 2718 + mp rank."""
    results = run_distributed(_seeding_worker, world_size=2, model_parallel_size=2)
    for rank, out in enumerate(results):
        assert out["tracker is mpu's"]
        assert all(torch.equal(a, b) for a, b in zip(out["torch.manual_seed"], out["generator(seed)"]))
        for name in SEEDINGS:
            default, forked = out[name]
            assert all(torch.equal(a, b) for a, b in zip(default, out["generator(seed)"])), (rank, name)
            assert all(torch.equal(a, b) for a, b in zip(forked, out["generator(seed + 2718 + rank)"])), \
                (rank, name)
            assert all(0 < int(m.sum()) < MASK_SIZE for m in default + forked)          # real dropout masks
    for name in SEEDINGS:
        (default0, forked0), (default1, forked1) = results[0][name], results[1][name]
        assert all(torch.equal(a, b) for a, b in zip(default0, default1))          # replicated regions agree
        assert not any(torch.equal(a, b) for a, b in zip(forked0, forked1))       # model-parallel regions differ


def _checkpoint_functions_given_at_build_time():
    from megatron.model import GPT2Model, GPT2ModelConfig
    config = GPT2ModelConfig(num_layers=1, vocab_size=16, hidden_size=8, num_attention_heads=2,
                             max_sequence_length=4, checkpoint_activations=True)
    checkpointing.unconfigure()
    plain = GPT2Model(config).transformer
    checkpointing.configure(_SingleRankMpu)
    zero = GPT2Model(config).transformer
    pairs = [(t.checkpoint_function is mpu.checkpoint, t.checkpoint_function is checkpointing.checkpoint,
              all(layer.attention.rng_tracker is mpu.get_cuda_rng_tracker() for layer in t.layers))
             for t in (plain, zero)]   # read while configured: the model built before keeps mpu's checkpoint
    checkpointing.unconfigure()
    return pairs


def test_model_builder_hands_zero_checkpointing_to_the_transformer_only_when_configured():
    """GPT2Model asks zero.checkpointing.is_configured() once, when built; a model built before configure()
    keeps mpu's checkpoint. There is one RNG tracker either way."""
    plain, zero = run_distributed(_checkpoint_functions_given_at_build_time, 1, model_parallel_size=1)[0]
    assert plain == (True, False, True)
    assert zero == (False, True, True)

"""Any-topology checkpoints: a ZeRO-2 checkpoint saved at mp2 x dp2 loads at mp1 x dp1, mp1 x dp4, mp4 x dp1 and on
the Megatron path at mp2; the loaded full weights, fp32 masters and Adam moments are bitwise the saved ones, and
training continues as the saving run did (dropout off: dropout masks depend on the model-parallel rank). Also: an
mp2 -> mp1 -> mp2 round trip with a vocabulary that is not a multiple of 128 x mp is bitwise; loading a dp1
checkpoint at dp4 touches only each rank's share of the optimizer files; a bf16 mp2 checkpoint loaded (or resized
offline) at mp1 keeps its fp32 masters and Adam moments bitwise (read back from the files by hand); bad inputs name
the problem.

The reference state is gathered independently of megatron.checkpoint.reshard: in the saving run, right after the save, from
the live model and optimizer (all-gather over the data- and model-parallel groups)."""
import json
import os

import pytest
import torch

from megatron.spawn import run_distributed
from tests.helpers import NO_DROPOUT, REPO, set_tracker, TINY, write_config
from tests import warm_python

SAVE_AT, TOTAL = 3, 8
BASE = TINY[:TINY.index("--train-iters")] + ["--train-iters", str(TOTAL), "--log-interval", "100",
                                             "--eval-iters", "0", "--lr", "1e-3", "--warmup", "0", "--seed", "7"]
BASE = BASE + NO_DROPOUT


def _config(directory, **overrides):
    """test_deepspeed_path's ZeRO-2 config with the batch given as train_batch_size 4 only, so the micro batch
    follows the data-parallel size and the global batch stays 4 at every topology."""
    path = write_config(directory, **overrides)
    with open(path) as handle:
        config = json.load(handle)
    del config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    config.setdefault("train_batch_size", 4)
    with open(path, "w") as handle:
        json.dump(config, handle)
    return path


# ---------------------------------------------------------------------------------------------- gathering
def _join(shards, dim, stride):
    """Full tensor from model-parallel shards; stride 3 (fused q/k/v): each shard is [q_r; k_r; v_r]."""
    blocks = [shard.chunk(stride, dim) for shard in shards]
    return torch.cat([blocks[r][j] for j in range(stride) for r in range(len(shards))], dim)


def _gather_mp(tensor, param):
    import torch.distributed as dist
    import mpu
    world = mpu.get_model_parallel_world_size()
    if not getattr(param, "model_parallel", False) or world == 1:
        return tensor.detach().clone()
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=mpu.get_model_parallel_group())
    return _join(parts, param.partition_dim, getattr(param, "partition_stride", 1))


def gather_full_state(model, optimizer):
    """{name: {"weight", "master", "exp_avg", "exp_avg_sq": full fp32 tensors}} of the live model/optimizer."""
    import torch.distributed as dist
    import mpu
    from megatron.utils import unwrap_model
    from megatron.zero import ZeroEngine
    module = unwrap_model(model)
    names = {id(p): n for n, p in module.named_parameters()}
    local = {}   # name -> kind -> this model-parallel rank's shard
    if isinstance(model, ZeroEngine):
        zero = model.optimizer
        for group, master in zip(zero.groups, zero.masters):
            flats = {"master": master, **{k: zero.optimizer.state[master][k] for k in ("exp_avg", "exp_avg_sq")}}
            for kind, partition in flats.items():
                whole = torch.empty(group.padded_numel, dtype=partition.dtype)
                if zero.ctx.data_parallel_size > 1 and group.num_partitions > 1:
                    dist.all_gather_into_tensor(whole, partition.detach().contiguous(),
                                                group=mpu.get_data_parallel_group())
                else:
                    whole[:partition.numel()] = partition.detach()
                for param, (start, end) in zip(group.params, group.offsets):
                    local.setdefault(names[id(param)], {})[kind] = whole[start:end].view(param.shape)
    else:
        masters = dict(zip(map(id, optimizer.model_params), optimizer.master_params)) \
            if hasattr(optimizer, "master_params") else {}
        inner = getattr(optimizer, "optimizer", optimizer)
        for param in module.parameters():
            master = masters.get(id(param), param)
            local[names[id(param)]] = {"master": master.detach().float(),
                                       **{k: inner.state[master][k] for k in ("exp_avg", "exp_avg_sq")}}
    params = dict(module.named_parameters())
    return {name: {"weight": _gather_mp(params[name].float(), params[name]),
                   **{kind: _gather_mp(tensor.float(), params[name]) for kind, tensor in kinds.items()}}
            for name, kinds in local.items()}


# ---------------------------------------------------------------------------------------------- workers
def _train_capturing_saved_state(args_list, capture_at):
    """Train; right after saving iteration `capture_at`, gather the full state (every rank takes part)."""
    import pretrain_gpt
    from megatron import training
    captured = {}
    original = training.save_checkpoint

    def save_and_capture(train_state, model, optimizer, lr_scheduler, options):
        original(train_state, model, optimizer, lr_scheduler, options)
        if train_state.iteration == capture_at:
            captured.update(gather_full_state(model, optimizer))
    training.save_checkpoint = save_and_capture
    history = pretrain_gpt.main(args_list)
    return history, captured


def _load_gather_and_train(args_list):
    """Build and load (--load), gather the loaded full state, then train on."""
    import pretrain_gpt
    from megatron import training
    captured = {}
    original = training.setup_model_and_optimizer

    def setup_and_capture(model_provider):
        model, optimizer, lr_scheduler, train_state = original(model_provider)
        captured.update(gather_full_state(model, optimizer))
        return model, optimizer, lr_scheduler, train_state
    training.setup_model_and_optimizer = setup_and_capture
    return pretrain_gpt.main(args_list), captured


@pytest.fixture(scope="module")
def saved_mp2_dp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    config = _config(str(root))
    save_dir = str(root / "ckpt")
    args = BASE + ["--deepspeed", "--deepspeed_config", config, "--model-parallel-size", "2", "--save", save_dir,
                   "--save-interval", str(SAVE_AT)]
    (history, state), *_ = run_distributed(_train_capturing_saved_state, 4, args=(args, SAVE_AT))
    set_tracker(save_dir, SAVE_AT)
    return str(root), save_dir, history, state


TARGETS = {  # name: (processes, flags); the global batch stays 4
    "mp1xdp1-zero2": (1, ["--deepspeed"]),
    "mp1xdp4-zero2": (4, ["--deepspeed"]),
    "mp4xdp1-zero2": (4, ["--deepspeed", "--model-parallel-size", "4"]),
    "mp2xdp1-megatron": (2, ["--model-parallel-size", "2", "--batch-size", "4"]),
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_zero2_checkpoint_loads_at_any_topology(saved_mp2_dp2, target):
    root, save_dir, straight, saved_state = saved_mp2_dp2
    processes, flags = TARGETS[target]
    if "--deepspeed" in flags:
        flags = flags + ["--deepspeed_config", os.path.join(root, "ds_config.json")]
    (resumed, loaded_state), *_ = run_distributed(_load_gather_and_train, processes,
                                                  args=(BASE + flags + ["--load", save_dir],))
    assert sorted(loaded_state) == sorted(saved_state)
    for name, kinds in saved_state.items():
        for kind, tensor in kinds.items():
            assert torch.equal(loaded_state[name][kind], tensor), (target, name, kind)
    assert resumed["iteration"] == list(range(SAVE_AT + 1, TOTAL + 1))
    expected = straight["lm loss"][SAVE_AT:]
    worst = max(abs(a - b) / abs(b) for a, b in zip(resumed["lm loss"], expected))
    assert worst <= 1e-5, (target, resumed["lm loss"], expected)


# ---------------------------------------------------------------------------------------------- round trip
def _with(args, values):
    """`args` with the values of the flags in `values` replaced."""
    args = list(args)
    for flag, value in values.items():
        args[args.index(flag) + 1] = value
    return args


def _load_and_save(args_list, save_dir):
    """Load --load at this topology (resharding) and save it unchanged to save_dir."""
    from megatron.initialize import initialize_megatron
    from megatron.train_state import CheckpointOptions
    from megatron.training import setup_model_and_optimizer
    from megatron.checkpoint import save_checkpoint
    import pretrain_gpt
    initialize_megatron(args_list=args_list)
    model, optimizer, lr_scheduler, train_state = setup_model_and_optimizer(pretrain_gpt.model_provider)
    save_checkpoint(train_state, model, optimizer, lr_scheduler, CheckpointOptions(save=save_dir))
    return train_state.iteration


def _files(save_dir, iteration, mp):
    return [torch.load(os.path.join(save_dir, f"iter_{iteration:07d}", f"mp_rank_{r:02d}", "model_optim_rng.pt"),
                       weights_only=True) for r in range(mp)]


def test_mp2_to_mp1_to_mp2_round_trip_is_bitwise(tmp_path):
    args = _with(BASE, {"--vocab-size": "100", "--make-vocab-size-divisible-by": "128", "--train-iters": "2"})
    first, second, third = (str(tmp_path / name) for name in ("mp2", "mp1", "mp2-again"))
    from tests.helpers import train
    run_distributed(train, 2, args=(args + ["--model-parallel-size", "2", "--save", first],))
    assert run_distributed(_load_and_save, 1, args=(args + ["--load", first], second)) == [2]
    run_distributed(_load_and_save, 2, args=(args + ["--model-parallel-size", "2", "--load", second], third))
    assert _files(second, 2, 1)[0]["model"]["word_embeddings.weight"].shape[0] == 128   # re-padded for mp 1
    for rank, (original, again) in enumerate(zip(_files(first, 2, 2), _files(third, 2, 2))):
        real_rows = 100 if rank == 0 else 0          # rank 0 holds rows 0..127 of 256, rank 1 rows 128..255

        def same(name, saved, loaded):
            if name != "word_embeddings.weight" or saved.dim() == 0:   # Adam's step is a 0-dim tensor
                return torch.equal(saved, loaded)
            return torch.equal(saved[:real_rows], loaded[:real_rows]) and not loaded[real_rows:].any()
        for name, tensor in original["model"].items():
            assert same(name, tensor, again["model"][name]), (rank, name)
        names = [n for group in original["param_names"] for n in group]
        for index, state in original["optimizer"]["state"].items():
            for key, value in state.items():
                assert same(names[index], value, again["optimizer"]["state"][index][key]), (rank, names[index], key)
        assert again["iteration"] == original["iteration"] == 2


# ---------------------------------------------------------------------------------------------- bf16: fp32 stays fp32
BF16 = _with(BASE, {"--train-iters": str(SAVE_AT), "--lr": "1e-2"})   # lr 1e-2: masters move off the bf16 grid
SPLIT_BY_HAND = {  # name suffix: (dim, stride) of the mp shards (mpu/layers.py's layout); else replicated
    "word_embeddings.weight": (0, 1), "attention.query_key_value.weight": (0, 3),
    "attention.query_key_value.bias": (0, 3), "mlp.dense_h_to_4h.weight": (0, 1), "mlp.dense_h_to_4h.bias": (0, 1),
    "attention.dense.weight": (1, 1), "mlp.dense_4h_to_h.weight": (1, 1)}
OPTIMIZER_KINDS_BY_HAND = ("master", "exp_avg", "exp_avg_sq")


def _saved_zero_state_by_hand(tag_dir, mp):
    """{name: {"weight", "master", "exp_avg", "exp_avg_sq"}} of a dp1 ZeRO checkpoint, read with torch.load alone:
    each mp rank's flat fp32 groups cut in its param_names order, the shards joined by SPLIT_BY_HAND."""
    from megatron.checkpoint import layout as ckpt
    per_rank = []
    for rank in range(mp):
        model = torch.load(os.path.join(tag_dir, ckpt.model_states_name(rank)), weights_only=True)
        optim = torch.load(ckpt.find_optim_states_file(tag_dir, 0, rank), weights_only=True)
        assert optim[ckpt.DATA_PARALLEL_SIZE] == 1
        state = {name: {"weight": tensor} for name, tensor in model[ckpt.MODULE].items()}
        for names, group in zip(model[ckpt.PARAM_NAMES], optim[ckpt.GROUPS], strict=True):
            flats = {"master": group[ckpt.MASTER], **group[ckpt.SLICE_STATE]}
            assert group[ckpt.START] == 0 and all(f.dtype == torch.float32 for f in flats.values())
            offset = 0
            for name in names:
                shape = state[name]["weight"].shape
                for kind, flat in flats.items():
                    state[name][kind] = flat[offset:offset + shape.numel()].view(shape)
                offset += shape.numel()
            assert offset == group[ckpt.END] == flats["master"].numel()
        per_rank.append(state)
    full = {}
    for name in per_rank[0]:
        split = next((v for k, v in SPLIT_BY_HAND.items() if name.endswith(k)), None)
        full[name] = {}
        for kind in per_rank[0][name]:
            shards = [state[name][kind] for state in per_rank]
            if split is None:
                assert all(torch.equal(s, shards[0]) for s in shards), (name, kind)
                full[name][kind] = shards[0].float()
            else:
                full[name][kind] = _join(shards, *split).float()
    return full


def _load_and_gather(args_list):
    """Build and load --load (resharding), return the loaded full state."""
    import pretrain_gpt
    from megatron.initialize import initialize_megatron
    from megatron.training import setup_model_and_optimizer
    initialize_megatron(args_list=args_list)
    model, optimizer, _, train_state = setup_model_and_optimizer(pretrain_gpt.model_provider)
    dtypes = {p.dtype for p in model.parameters()} | {m.dtype for m in model.optimizer.masters}
    return train_state.iteration, dtypes, gather_full_state(model, optimizer)


@pytest.fixture(scope="module")
def saved_bf16_mp2(tmp_path_factory):
    """A bf16 ZeRO-2 checkpoint saved at mp2 x dp1 after 3 steps, and its state read back by hand."""
    root = tmp_path_factory.mktemp("bf16")
    config = _config(str(root), bf16={"enabled": True})
    save_dir = str(root / "ckpt")
    from tests.helpers import train
    run_distributed(train, 2, args=(BF16 + ["--deepspeed", "--deepspeed_config", config, "--model-parallel-size",
                                             "2", "--save", save_dir],))
    expected = _saved_zero_state_by_hand(os.path.join(save_dir, f"iter_{SAVE_AT:07d}"), 2)
    assert sorted(n for n in expected if "query_key_value" in n or "dense_4h_to_h.weight" in n) == [
        f"transformer.layers.{i}.{n}" for i in range(2)
        for n in ("attention.query_key_value.bias", "attention.query_key_value.weight", "mlp.dense_4h_to_h.weight")]
    for kind in OPTIMIZER_KINDS_BY_HAND:   # otherwise a cast to bf16 and back would change nothing
        values = torch.cat([kinds[kind].reshape(-1) for kinds in expected.values()])
        off_grid = (values != values.bfloat16().float()).float().mean().item()
        assert off_grid > 0.9, (kind, off_grid)     # measured: 1.0 for each kind
    assert all(kinds["weight"].equal(kinds["weight"].bfloat16().float()) for kinds in expected.values())
    return config, save_dir, expected


def test_bf16_zero2_mp2_loads_at_mp1_with_fp32_masters_and_moments_bitwise(saved_bf16_mp2):
    """Loading at mp1 (resharding at load time) keeps the fp32 masters and both Adam moments fp32: bitwise the
    saved values, which a round trip through the bf16 parameter dtype would not be; the bf16 weights bitwise too."""
    config, save_dir, expected = saved_bf16_mp2
    iteration, dtypes, loaded = run_distributed(_load_and_gather, 1, args=(
        BF16 + ["--deepspeed", "--deepspeed_config", config, "--load", save_dir],))[0]
    assert iteration == SAVE_AT and dtypes == {torch.bfloat16, torch.float32}
    assert sorted(loaded) == sorted(expected)
    for name, kinds in expected.items():
        for kind, tensor in kinds.items():
            same = torch.equal(loaded[name][kind], tensor)
            assert same, (name, kind, (loaded[name][kind] - tensor).abs().max().item())


def test_bf16_zero2_mp2_resized_offline_keeps_fp32_state_bitwise(saved_bf16_mp2, tmp_path):
    """tools/checkpoint_util.py writing the bf16 mp2 checkpoint at mp1 (ZeRO layout): the written fp32 masters and
    moments are bitwise the saved ones."""
    import sys
    _, save_dir, expected = saved_bf16_mp2
    tool = os.path.join(REPO, "tools", "checkpoint_util.py")
    result = warm_python.run([sys.executable, tool, "--load-dir", save_dir, "--save-dir", str(tmp_path),
                              "--target-tensor-parallel-size", "1", "--make-vocab-size-divisible-by", "8"],
                             capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    resized = _saved_zero_state_by_hand(os.path.join(str(tmp_path), f"iter_{SAVE_AT:07d}"), 1)
    assert sorted(resized) == sorted(expected)
    for name, kinds in expected.items():
        for kind, tensor in kinds.items():
            same = torch.equal(resized[name][kind], tensor)
            assert same, (name, kind, (resized[name][kind] - tensor).abs().max().item())


# ---------------------------------------------------------------------------------------------- host memory
WIDE = _with(BASE, {"--num-layers": "4", "--hidden-size": "64", "--vocab-size": "512", "--train-iters": "1"})


class _CountingTensor(torch.Tensor):
    """A saved optimizer tensor that counts the bytes read from it: slices taken (then copied) and whole-tensor
    uses. (The resident size of a memory-mapped file cannot measure this: the kernel maps page-cache folios of
    up to 2 MiB per touched page.)"""
    bytes_read = [0]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
        if func is torch.Tensor.__getitem__:
            cls.bytes_read[0] += result.numel() * result.element_size()
        elif func not in (torch.Tensor.numel, torch.Tensor.dim, torch.Tensor.size, torch.Tensor.shape.__get__,
                          torch.Tensor.dtype.__get__, torch.Tensor.element_size, torch.Tensor.__len__):
            cls.bytes_read[0] += sum(a.numel() * a.element_size() for a in args if isinstance(a, cls))
        return result


def _counting_optimizer_states(state):
    from megatron.checkpoint import layout as ckpt
    for group in state[ckpt.GROUPS]:
        group[ckpt.MASTER] = group[ckpt.MASTER].as_subclass(_CountingTensor)
        group[ckpt.SLICE_STATE] = {k: v.as_subclass(_CountingTensor) for k, v in group[ckpt.SLICE_STATE].items()}
    return state


def _load_measuring_optimizer_reads(args_list):
    """Load --load; report the optimizer-state bytes read, this rank's share and the largest parameter."""
    import pretrain_gpt
    from megatron.initialize import initialize_megatron
    from megatron.training import setup_model_and_optimizer
    from megatron.checkpoint import layout as ckpt
    original = ckpt.safe_torch_load

    def load(path, *args, **kwargs):
        state = original(path, *args, **kwargs)
        return _counting_optimizer_states(state) if path.endswith("_optim_states.pt") else state
    ckpt.safe_torch_load = load
    initialize_megatron(args_list=args_list)
    model = setup_model_and_optimizer(pretrain_gpt.model_provider)[0]
    groups = model.optimizer.groups
    return {"read": _CountingTensor.bytes_read[0],
            "share": sum(3 * 4 * (end - start) for start, end in (g.own_unpadded_range() for g in groups)),
            "largest": max(p.numel() for g in groups for p in g.params) * 4}


def test_loading_a_dp1_checkpoint_at_dp4_reads_only_each_ranks_share(tmp_path):
    config = _config(str(tmp_path), train_batch_size=4)
    save_dir = str(tmp_path / "dp1")
    zero = ["--deepspeed", "--deepspeed_config", config]
    from tests.helpers import train
    run_distributed(train, 1, args=(WIDE + zero + ["--save", save_dir],))
    for rank, measured in enumerate(run_distributed(_load_measuring_optimizer_reads, 4,
                                                    args=(WIDE + zero + ["--load", save_dir],))):
        total = 4 * measured["share"]
        assert measured["share"] * 0.99 <= measured["read"] <= measured["share"] + measured["largest"], \
            (rank, measured)
        assert measured["read"] < total / 2, (rank, measured)


# ---------------------------------------------------------------------------------------------- rules, bad input
def _partitioning_of_real_parameters():
    from megatron.model import GPT2Model, GPT2ModelConfig
    from megatron.checkpoint.reshard import partitioning
    model = GPT2Model(GPT2ModelConfig(num_layers=1, vocab_size=16, hidden_size=8, num_attention_heads=2,
                                      max_sequence_length=4))
    return [(name, partitioning(name)[:2], (getattr(p, "partition_dim", None) if getattr(p, "model_parallel", False)
                                            else None, getattr(p, "partition_stride", 1)))
            for name, p in model.named_parameters()]


def test_partitioning_rules_match_the_parameters_mpu_builds():
    for name, by_name, by_mpu in run_distributed(_partitioning_of_real_parameters, 2, model_parallel_size=2)[0]:
        assert by_name == by_mpu, name


def _load_expecting_error(args_list):
    import pretrain_gpt
    from megatron.initialize import initialize_megatron
    from megatron.training import setup_model_and_optimizer
    from megatron.checkpoint.layout import CheckpointError
    initialize_megatron(args_list=args_list)
    try:
        setup_model_and_optimizer(pretrain_gpt.model_provider)
    except CheckpointError as error:
        return str(error)
    return None


def test_bad_checkpoints_name_the_problem(saved_mp2_dp2, tmp_path):
    _, save_dir, _, _ = saved_mp2_dp2
    copy = str(tmp_path / "copy")
    import shutil
    shutil.copytree(save_dir, copy)
    tag_dir = os.path.join(copy, f"iter_{SAVE_AT:07d}")
    os.remove(os.path.join(tag_dir, "manifest.json"))  # the structure checks of a checkpoint without a manifest
    mp1 = BASE + ["--load", copy]
    message = run_distributed(_load_expecting_error, 1, args=(_with(mp1, {"--num-layers": "3"}),))[0]
    assert "was saved by another model shape: num_layers 2 (checkpoint) != 3 (this run)" in message, message
    os.remove(os.path.join(tag_dir, "mp_rank_01_model_states.pt"))
    message = run_distributed(_load_expecting_error, 1, args=(mp1,))[0]
    assert "the shards of model-parallel ranks [1] are missing (found [0])" in message, message
    os.remove(os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    message = run_distributed(_load_expecting_error, 1, args=(mp1,))[0]
    assert f"{tag_dir} is not a checkpoint" in message, message


def test_checkpoint_util_resizes_offline_with_the_full_state(saved_mp2_dp2, tmp_path):
    """tools/checkpoint_util.py writes the mp2 x dp2 ZeRO-2 checkpoint at mp1 (ZeRO layout); the engine's own
    loader (no load-time resharding: same path and size) then gives bitwise the saved state and continues alike."""
    import sys
    root, save_dir, straight, saved_state = saved_mp2_dp2
    resized = str(tmp_path / "mp1")
    tool = os.path.join(REPO, "tools", "checkpoint_util.py")
    result = warm_python.run([sys.executable, tool, "--load-dir", save_dir, "--save-dir", resized,
                              "--target-tensor-parallel-size", "1", "--make-vocab-size-divisible-by", "8"],
                             capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "resized checkpoint saved at mp2 x dp2 (zero-2) to mp1 (zero)" in result.stdout
    flags = ["--deepspeed", "--deepspeed_config", os.path.join(root, "ds_config.json"), "--load", resized]
    (resumed, loaded_state), = run_distributed(_load_gather_and_train, 1, args=(BASE + flags,))
    for name, kinds in saved_state.items():
        for kind, tensor in kinds.items():
            assert torch.equal(loaded_state[name][kind], tensor), (name, kind)
    worst = max(abs(a - b) / abs(b) for a, b in zip(resumed["lm loss"], straight["lm loss"][SAVE_AT:]))
    assert resumed["iteration"][0] == SAVE_AT + 1 and worst <= 1e-5, (resumed["lm loss"], straight["lm loss"])
    result = warm_python.run([sys.executable, tool, "--load-dir", save_dir, "--save-dir", str(tmp_path / "mp3"),
                              "--target-tensor-parallel-size", "3"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0
    assert "--target-tensor-parallel-size 3 does not divide the model's 4 attention heads" in result.stderr


@pytest.mark.parametrize("stage", [0, 1])
def test_stage0_and_stage1_checkpoints_load_on_the_megatron_path(tmp_path, stage):
    """Saved by ZeRO stage 0 (every data-parallel file a full copy) or 1 (partitioned masters and moments) at
    dp2, loaded by the Megatron path at dp1: bitwise the saved state, and the same continuation."""
    config = _config(str(tmp_path), zero_optimization={"stage": stage, "reduce_bucket_size": 3000,
                                                       "allgather_bucket_size": 3000})
    save_dir = str(tmp_path / "ckpt")
    args = BASE + ["--deepspeed", "--deepspeed_config", config, "--save", save_dir, "--save-interval", str(SAVE_AT)]
    (straight, saved_state), _ = run_distributed(_train_capturing_saved_state, 2, args=(args, SAVE_AT))
    set_tracker(save_dir, SAVE_AT)
    (resumed, loaded_state), = run_distributed(_load_gather_and_train, 1,
                                               args=(BASE + ["--batch-size", "4", "--load", save_dir],))
    for name, kinds in saved_state.items():
        for kind, tensor in kinds.items():
            assert torch.equal(loaded_state[name][kind], tensor), (stage, name, kind)
    worst = max(abs(a - b) / abs(b) for a, b in zip(resumed["lm loss"], straight["lm loss"][SAVE_AT:]))
    assert worst <= 1e-5, (stage, resumed["lm loss"], straight["lm loss"])

"""LoRA (mpu/lora.py, --lora-*) against PEFT 0.21.2, across model-parallel sizes, ZeRO stages and the export.

- forward == PEFT's LoraConfig on HF GPT2LMHeadModel with the same base weights and random non-zero adapters (alpha
  6, r 4: the scale 1.5 is neither alpha nor 1), at mp 1 and mp 2 (1e-5, fp32); a fresh adapter (B = 0) leaves the
  logits bitwise those of the same model without LoRA, and A is PEFT's kaiming-uniform(a=sqrt(5)) (bound
  1/sqrt(in), the full input width also where A is split).
- mp 2 == mp 1 after LoRA training with random initial B and adapter dropout 0.1 (losses and every adapter, 1e-5);
  the mp 2 LoRA checkpoint resumes at mp 1 with its adapters bitwise.
- a base checkpoint (no LoRA) loads into a LoRA model (--finetune) on the Megatron path, ZeRO-2, ZeRO-3 (dp 2) and
  pipelined (pp 2, activation checkpointing); after training the base weights are bitwise the loaded ones, only the
  adapters have gradients and optimizer state, and the start-up memory estimate equals the real tensors.
- export: the merged GPT2LMHeadModel and PEFT's PeftModel over the unmerged base + the exported adapter give the
  training model's logits (mp 2 ZeRO-2 checkpoint, 1e-5); bad LoRA flags are one line.
"""
import dataclasses
import json
import os
import sys

import pytest
import torch

from megatron.spawn import run_distributed
from tests.helpers import NO_DROPOUT, REPO, TINY, TINY_SHAPE

sys.path.insert(0, os.path.join(REPO, "tools"))

import convert_to_hf  # noqa: E402

RANK, ALPHA = 4, 6.0
LORA = ["--lora-rank", str(RANK), "--lora-alpha", str(ALPHA)]
HF_SHAPE = dict(n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=64, activation_function="gelu_new")
TARGET_MODULES = ["c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"]
ZERO_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
               "zero_optimization": {"reduce_bucket_size": 500, "allgather_bucket_size": 500,
                                     "stage3_param_persistence_threshold": 100}}


def _tokens(vocab, seed):
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))


def _write_zero_config(directory, stage):
    path = os.path.join(directory, f"zero{stage}.json")
    config = json.loads(json.dumps(ZERO_CONFIG))
    config["zero_optimization"]["stage"] = stage
    with open(path, "w") as handle:
        json.dump(config, handle)
    return path


# ---------------------------------------------------------------------------------------------------- workers

def _full(name, tensor):
    """The full tensor of parameter `name` from every model-parallel rank's piece (megatron.checkpoint.reshard's table)."""
    import torch.distributed as dist
    import mpu
    from megatron.checkpoint.reshard import join_shards, partitioning
    dim, stride, _ = partitioning(name)
    world = mpu.get_model_parallel_world_size()
    tensor = tensor.detach().contiguous()
    if dim is None or world == 1:
        return tensor.clone()
    pieces = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(pieces, tensor, group=mpu.get_model_parallel_group())
    return join_shards(pieces, dim, stride)


def _adapters(module):
    import mpu
    return {name: _full(name, p) for name, p in module.named_parameters() if mpu.is_lora_parameter(name)}


def _gpt2(lora=None, seed=1234):
    import mpu
    from megatron.model import GPT2Model, GPT2ModelConfig
    mpu.model_parallel_cuda_manual_seed(seed)
    config = GPT2ModelConfig(num_layers=HF_SHAPE["n_layer"], vocab_size=HF_SHAPE["vocab_size"],
                             hidden_size=HF_SHAPE["n_embd"], num_attention_heads=HF_SHAPE["n_head"],
                             max_sequence_length=HF_SHAPE["n_positions"], lora=lora)
    return GPT2Model(config, parallel_output=False).eval()


def _peft_comparison():
    """Our logits and PEFT's on the same HF base weights and random adapters, and the fresh-adapter checks."""
    import mpu
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import GPT2Config, GPT2LMHeadModel
    from megatron.model.hf_interchange import from_hf_state_dict, from_peft_state_dict
    from megatron.checkpoint.reshard import shard_for
    torch.manual_seed(0)
    hf_config = GPT2Config(**HF_SHAPE, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                           eos_token_id=0)
    hf = GPT2LMHeadModel(hf_config).eval()
    with torch.no_grad():
        for param in hf.parameters():            # LayerNorms and biases away from their init too
            param.add_(torch.randn_like(param) * 0.05)
    base_state = {k: v.clone() for k, v in hf.state_dict().items()}
    peft_model = get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGET_MODULES,
                                               lora_dropout=0.0, fan_in_fan_out=True)).eval()
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    tokens = _tokens(HF_SHAPE["vocab_size"], 1)
    with torch.no_grad():
        theirs = peft_model(tokens).logits
    weights, _ = from_hf_state_dict(base_state, hf_config.to_dict())
    weights.update(from_peft_state_dict(get_peft_model_state_dict(peft_model), HF_SHAPE["n_layer"]))
    ours_model = _gpt2(mpu.LoRAConfig(rank=RANK, alpha=ALPHA))
    world, rank = mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
    names = dict(ours_model.named_parameters())
    assert set(names) == set(weights), set(names) ^ set(weights)
    with torch.no_grad():
        for name, param in names.items():
            param.copy_(shard_for(name, weights[name], world, rank, HF_SHAPE["vocab_size"]))
        ours = ours_model(tokens)
    # fresh adapters: B = 0, A kaiming-uniform over the full input width; the base weights unchanged by LoRA
    fresh, plain = _gpt2(mpu.LoRAConfig(rank=RANK, alpha=ALPHA)), _gpt2(None)
    with torch.no_grad():
        fresh_logits, plain_logits = fresh(tokens), plain(tokens)
    partitioning = {name: (getattr(p, "partition_dim", None) if getattr(p, "model_parallel", False) else None,
                           getattr(p, "partition_stride", 1) if getattr(p, "model_parallel", False) else 1)
                    for name, p in fresh.named_parameters()}
    return {"ours": ours, "theirs": theirs, "fresh_equal": torch.equal(fresh_logits, plain_logits),
            "fresh_adapters": _adapters(fresh), "partitioning": partitioning,
            "trainable": sorted(n for n, p in fresh.named_parameters() if p.requires_grad),
            "all": sorted(names)}


_BUILT = []


def _random_b_model_provider():
    """pretrain_gpt's model with B drawn like A (PEFT's init_lora_weights=False): the adapters matter at once."""
    from megatron.global_vars import get_args
    from megatron.model import GPT2Model, GPT2ModelConfig
    config = GPT2ModelConfig.from_args(get_args())
    model = GPT2Model(dataclasses.replace(config, lora=dataclasses.replace(config.lora, zero_init_b=False)))
    _BUILT.append(model)
    _INITIAL.append({name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad})
    return model


_INITIAL = []   # this rank's pieces of the adapters as _random_b_model_provider built them


def _mp_worker(train_args, resume_args):
    """At this run's model-parallel size: the PEFT comparison, then a LoRA training run with random initial B;
    with `resume_args`, then load another size's LoRA checkpoint (through megatron.checkpoint.reshard) and return its adapters."""
    import pretrain_gpt
    from megatron.initialize import initialize_megatron
    from megatron.training import pretrain, setup_model_and_optimizer
    from megatron.utils import unwrap_model
    result = _peft_comparison()
    history = pretrain(pretrain_gpt.train_valid_test_datasets_provider, _random_b_model_provider,
                       pretrain_gpt.forward_step, args_list=train_args)
    result.update(losses=history["lm loss"], trained=_adapters(_BUILT[-1]),
                  initial={name: _full(name, tensor) for name, tensor in _INITIAL[-1].items()})
    if resume_args is not None:
        initialize_megatron(args_list=resume_args)
        model, optimizer, _, train_state = setup_model_and_optimizer(pretrain_gpt.model_provider)
        result.update(resumed=_adapters(unwrap_model(model)), resumed_iteration=train_state.iteration,
                      resumed_moments=_optimizer_view(model, optimizer)[1])
    return result


def _module_state(model):
    from megatron.utils import unwrap_model
    from megatron.zero import ZeroEngine
    state = model.module_state_dict() if isinstance(model, ZeroEngine) else unwrap_model(model).state_dict()
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def _optimizer_view(model, optimizer):
    """(names of the parameters the optimizer steps, elements of its Adam moments, names with a gradient)."""
    from megatron.utils import unwrap_model
    from megatron.zero import ZeroEngine
    module = unwrap_model(model)
    name_of = {id(p): n for n, p in module.named_parameters()}
    if isinstance(model, ZeroEngine):
        stepped = [name_of[id(p)] for group in optimizer.groups for p in group.params]
    else:
        inner = getattr(optimizer, "optimizer", optimizer)
        stepped = [name_of[id(p)] for group in inner.param_groups for p in group["params"]]
    inner = getattr(optimizer, "optimizer", optimizer)
    moments = sum(v.numel() for state in inner.state.values() for k, v in state.items() if k == "exp_avg")
    with_grad = sorted(n for n, p in module.named_parameters() if p.grad is not None)
    return sorted(stepped), moments, with_grad


def _setup_and_train(args_list, model_provider):
    """pretrain()'s steps, keeping the model and optimizer: (module state after loading, after training,
    optimizer view, history)."""
    import pretrain_gpt
    from megatron.initialize import initialize_megatron
    from megatron.training import build_train_valid_test_data_iterators, setup_model_and_optimizer, train
    initialize_megatron(args_list=args_list)
    model, optimizer, lr_scheduler, train_state = setup_model_and_optimizer(model_provider)
    loaded = _module_state(model)
    iterators = build_train_valid_test_data_iterators(pretrain_gpt.train_valid_test_datasets_provider, train_state)
    history = train(pretrain_gpt.forward_step, model, optimizer, lr_scheduler, iterators[0], iterators[1],
                    train_state)
    return loaded, _module_state(model), _optimizer_view(model, optimizer), history


def _base_then_lora_worker(base_args, lora_args):
    """Train and save a model without LoRA, then load it into a LoRA model (--finetune) and train the adapters."""
    import pretrain_gpt
    from megatron.training import pretrain
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
             pretrain_gpt.forward_step, args_list=base_args)
    loaded, trained, (stepped, moments, with_grad), history = _setup_and_train(lora_args, pretrain_gpt.model_provider)
    return {"loaded": loaded, "trained": trained, "stepped": stepped, "moments": moments,
            "with_grad": with_grad, "losses": history["lm loss"], "estimate": history["model_state_estimate"],
            "measured": history["model_state_measured"]}


def _export_worker(base_args, lora_args, tokens, vocab):
    """A base model (Megatron path) saved, then LoRA with random initial B (ZeRO-2) loaded from it, trained and
    saved; returns the LoRA model's logits over the real vocabulary (gathered)."""
    import pretrain_gpt
    from megatron.training import pretrain
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
             pretrain_gpt.forward_step, args_list=base_args)
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, _random_b_model_provider, pretrain_gpt.forward_step,
             args_list=lora_args)
    module = _BUILT[-1]
    module.eval()
    module.parallel_output = False
    with torch.no_grad():
        return module(tokens)[..., :vocab].clone()


# ---------------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def mp_runs(tmp_path_factory):
    """One launch at mp 2 (2 processes, saving its checkpoint) and one at mp 1 (1 process, then loading that
    checkpoint): the PEFT comparison and a LoRA training run each."""
    save = str(tmp_path_factory.mktemp("lora_mp2") / "ckpt")
    train = TINY + NO_DROPOUT + LORA + ["--lora-dropout", "0.1", "--train-iters", "6", "--batch-size", "4"]
    runs = {2: run_distributed(_mp_worker, 2, args=(train + ["--model-parallel-size", "2", "--save", save], None),
                               model_parallel_size=2)}
    runs[1] = run_distributed(_mp_worker, 1, args=(train, train + ["--load", save]), model_parallel_size=1)
    return runs


BASE_THEN_LORA = {   # name: (world size, flags of both runs, ZeRO stage or None)
    "megatron_dp2": (2, ["--batch-size", "2"], None),
    "zero2_dp2": (2, ["--batch-size", "2"], 2),
    "zero3_dp2": (2, ["--batch-size", "2"], 3),
    "megatron_pp2": (2, ["--batch-size", "4", "--pipeline-model-parallel-size", "2", "--checkpoint-activations"],
                     None),
}


@pytest.fixture(scope="module", params=list(BASE_THEN_LORA))
def base_then_lora(request, tmp_path_factory):
    world, flags, stage = BASE_THEN_LORA[request.param]
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    common = TINY + NO_DROPOUT + flags + ["--train-iters", "3", "--weight-decay", "0.1"]
    if stage is not None:
        common += ["--deepspeed", "--deepspeed_config", _write_zero_config(str(root), stage)]
    base_args = common + ["--save", str(root / "base")]
    lora_args = common + LORA + ["--load", str(root / "base"), "--finetune", "--lr", "1e-2"]
    results = run_distributed(_base_then_lora_worker, world, args=(base_args, lora_args))
    return request.param, str(root / "base"), results


@pytest.fixture(scope="module")
def exported(tmp_path_factory, webtext_data):
    """mp 2: a base model saved (Megatron path), LoRA (ZeRO-2, random initial B) loaded from it, trained, saved;
    then convert_to_hf --peft-adapter."""
    root = tmp_path_factory.mktemp("lora_export")
    vocab = 8192                                    # the default data's BPE
    data = ["--data-path", os.path.join(webtext_data, "webtext_text_document"), "--vocab-file",
            os.path.join(webtext_data, "vocab.json"), "--merge-file", os.path.join(webtext_data, "merges.txt"),
            "--data-cache-path", str(root / "cache")]
    model = TINY_SHAPE + ["--make-vocab-size-divisible-by", "100", "--model-parallel-size", "2", "--batch-size", "2",
             "--log-interval", "100", "--eval-iters", "0", "--warmup", "0", "--lr", "1e-2"] + NO_DROPOUT + data
    base_args = model + ["--train-iters", "2", "--save", str(root / "base")]
    lora_args = model + LORA + ["--train-iters", "3", "--load", str(root / "base"), "--finetune",
                                "--save", str(root / "lora"), "--deepspeed", "--deepspeed_config",
                                _write_zero_config(str(root), 2)]
    tokens = _tokens(vocab, 2)
    logits = run_distributed(_export_worker, 2, args=(base_args, lora_args, tokens, vocab))[0]
    argv = ["--load", str(root / "lora"), "--output", str(root / "merged"), "--peft-adapter", str(root / "adapter")]
    assert convert_to_hf.main(argv) == 0        # alpha and rank come from the checkpoint (model_shape)
    return {"root": root, "tokens": tokens, "logits": logits}


# ---------------------------------------------------------------------------------------------------- PEFT, mp

@pytest.mark.parametrize("mp", [1, 2])
def test_forward_equals_peft(mp_runs, mp):
    for result in mp_runs[mp]:
        assert (result["ours"] - result["theirs"]).abs().max().item() <= 1e-5
    ours, theirs = mp_runs[mp][0]["ours"], mp_runs[mp][0]["theirs"]
    print(f"mp{mp}: max |ours - PEFT| = {(ours - theirs).abs().max().item():.2e}")


@pytest.mark.parametrize("mp", [1, 2])
def test_fresh_adapter_is_peft_init_and_changes_nothing(mp_runs, mp):
    result = mp_runs[mp][0]
    assert result["fresh_equal"]                       # B = 0 and the base weights drawn as without LoRA
    for name, tensor in result["fresh_adapters"].items():
        if name.endswith("lora_B"):
            assert torch.count_nonzero(tensor) == 0, name
        else:
            bound = 1.0 / tensor.shape[1] ** 0.5          # kaiming-uniform(a=sqrt(5)) over the full [r, in]
            assert 0.8 * bound < tensor.abs().max().item() <= bound, (name, tensor.abs().max().item(), bound)
    assert all(n.endswith(("lora_A", "lora_B")) for n in result["trainable"])
    assert len(result["trainable"]) == 2 * 4 * HF_SHAPE["n_layer"]


def test_partitioning_table_matches_the_parameters(mp_runs):
    """megatron.checkpoint.reshard.partitioning (how checkpoints are joined and split) agrees with mpu's attributes for every
    parameter of a LoRA model at mp 2, the adapters included."""
    from megatron.checkpoint.reshard import partitioning
    table = mp_runs[2][0]["partitioning"]
    assert sum(name.endswith(("lora_A", "lora_B")) for name in table) == 2 * 4 * HF_SHAPE["n_layer"]
    for name, (dim, stride) in table.items():
        assert partitioning(name)[:2] == (dim, stride), name


def test_mp2_equals_mp1(mp_runs):
    """Random initial B (the q/k/v stride of B's split matters from step 0), adapter dropout 0.1, 6 steps."""
    one, two = mp_runs[1][0], mp_runs[2][0]
    for other in mp_runs[2][1:]:
        assert other["losses"] == two["losses"]
    loss_diff = max(abs(a - b) for a, b in zip(one["losses"], two["losses"]))
    weight_diff = max((one["trained"][n] - two["trained"][n]).abs().max().item() for n in one["trained"])
    moved = min((one["trained"][n] - one["initial"][n]).abs().max().item() for n in one["trained"])
    initial_diff = max((one["initial"][n] - two["initial"][n]).abs().max().item() for n in one["initial"])
    print(f"mp2 vs mp1: losses {loss_diff:.2e}, adapters {weight_diff:.2e} (initial {initial_diff:.2e}; every "
          f"adapter moved by at least {moved:.2e})")
    assert set(one["trained"]) == set(two["trained"]) == set(one["initial"])
    assert initial_diff == 0.0                   # full-size masters from one seed, split
    assert loss_diff <= 1e-5 and weight_diff <= 1e-5
    assert moved > 1e-3


def test_lora_checkpoint_loads_at_another_model_parallel_size(mp_runs):
    """The mp 2 run's checkpoint resumed at mp 1 (megatron.checkpoint.reshard: the adapters' split dims and stride): its
    adapters bitwise, the iteration and the Adam moments of the adapters only."""
    one, two = mp_runs[1][0], mp_runs[2][0]
    assert one["resumed_iteration"] == 6
    assert set(one["resumed"]) == set(two["trained"])
    for name, tensor in two["trained"].items():
        assert torch.equal(one["resumed"][name], tensor), name
    assert one["resumed_moments"] == sum(t.numel() for t in two["trained"].values())


# ---------------------------------------------------------------------------------------------------- training

def test_only_adapters_train(base_then_lora):
    import mpu
    from megatron.checkpoint.reshard import SavedCheckpoint
    name, base_dir, results = base_then_lora
    base = SavedCheckpoint(base_dir)
    for result in results:
        lora = sorted(n for n in result["trained"] if mpu.is_lora_parameter(n))
        base_names = [n for n in result["trained"] if not mpu.is_lora_parameter(n)]
        assert lora and base_names
        for n in base_names:                    # loaded from the base checkpoint, then bitwise unchanged
            assert torch.equal(result["loaded"][n], base.full_tensor(n)), (name, n)
            assert torch.equal(result["trained"][n], result["loaded"][n]), (name, n)
        assert any(not torch.equal(result["trained"][n], result["loaded"][n]) for n in lora if n.endswith("lora_B"))
        assert result["stepped"] == lora, name
        assert set(result["with_grad"]) <= set(lora), name
        lora_elements = sum(result["trained"][n].numel() for n in lora)
        if name.startswith("zero"):              # this rank's partition of the padded flat group
            assert lora_elements // 2 <= result["moments"] <= lora_elements // 2 + 2 * 32, (name, result["moments"])
        else:
            assert result["moments"] == lora_elements, name
        for kind in ("parameters", "gradients", "master", "moments", "total"):
            assert result["estimate"][kind] == result["measured"][kind], (name, kind, result["estimate"],
                                                                          result["measured"])
        assert result["estimate"]["moments"] == 8 * result["moments"]


# ---------------------------------------------------------------------------------------------------- export

def test_merged_export_equals_the_training_model(exported):
    from transformers import GPT2LMHeadModel
    merged = GPT2LMHeadModel.from_pretrained(str(exported["root"] / "merged")).eval()
    with torch.no_grad():
        logits = merged(exported["tokens"]).logits
    diff = (logits - exported["logits"]).abs().max().item()
    print(f"merged export vs training model: {diff:.2e}")
    assert diff <= 1e-5


def test_peft_loads_the_exported_adapter(exported):
    from peft import PeftModel
    from transformers import GPT2LMHeadModel
    adapter = str(exported["root"] / "adapter")
    base = GPT2LMHeadModel.from_pretrained(os.path.join(adapter, "base")).eval()
    with torch.no_grad():
        base_logits = base(exported["tokens"]).logits
    model = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        logits = model(exported["tokens"]).logits
    diff = (logits - exported["logits"]).abs().max().item()
    effect = (base_logits - exported["logits"]).abs().max().item()
    print(f"PEFT over the exported base + adapter vs training model: {diff:.2e} (the adapter moves logits by "
          f"{effect:.2e})")
    assert diff <= 1e-5
    assert effect > 1e-2                              # the adapters are not a no-op: the comparison can fail
    config = json.load(open(os.path.join(adapter, "adapter_config.json")))
    assert (config["r"], config["lora_alpha"], config["fan_in_fan_out"]) == (RANK, ALPHA, True)
    assert config["target_modules"] == TARGET_MODULES


def test_export_with_a_disagreeing_alpha_is_one_line(exported, capsys, monkeypatch):
    """Refused before any tensor is read: the progress line (here printed at every tensor, as a slow read prints
    it once a second) never comes."""
    import functools
    from megatron import cli
    monkeypatch.setattr(convert_to_hf.cli, "ProgressLine", functools.partial(cli.ProgressLine, interval=0))
    out = str(exported["root"] / "again")
    argv = ["--load", str(exported["root"] / "lora"), "--output", out, "--lora-alpha", str(ALPHA + 1)]
    assert convert_to_hf.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "disagrees with the checkpoint's LoRA alpha" in err, err


# ---------------------------------------------------------------------------------------------------- bad flags

@pytest.mark.parametrize("flags,needle", [
    (["--lora-rank", "-1"], "--lora-rank (-1) must be >= 0"),
    (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha (0.0) must be > 0"),
    (["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout (1.0) must be in [0, 1)"),
    (["--lora-rank", "4", "--lora-targets", "qkv,proj"], "--lora-targets 'qkv,proj'"),
    (["--lora-rank", "4", "--lora-targets", "qkv,qkv"], "at most once"),
])
def test_bad_lora_flags_are_one_line(flags, needle, capsys):
    from megatron.arguments import parse_args
    with pytest.raises(SystemExit) as exit_info:
        parse_args(args_list=["--mock-data"] + flags)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2
    assert len(lines) == 1 and needle in lines[0], lines

"""Hugging Face interchange and consolidation tools: tools/convert_from_hf.py, tools/convert_to_hf.py,
tools/zero_to_fp32.py (through megatron.checkpoint.reshard and megatron.model.hf_interchange).

- import: a random GPT2LMHeadModel saved locally -> our checkpoint at mp 1 and mp 2, both paths -> loaded by the
  training code (setup_model_and_optimizer, --load --finetune) -> our gathered logits == HF's (1e-5, fp32); and
  reading the imported checkpoint back gives HF's tensors bitwise.
- export: checkpoints of short real training runs on the default data (Megatron path at mp 1, ZeRO-2 at mp 2) ->
  GPT2LMHeadModel.from_pretrained(out) logits == the training model's; AutoTokenizer ids == megatron.tokenizer's.
- zero_to_fp32 == the weights gathered over the model-parallel ranks inside the training worker (both paths), -t TAG.
- bad inputs: one line each, exit status 1.

Two worker launches in all (1 process, then 2) do every load and training run; the tools run in this process.
"""
import json
import os
import shutil
import sys

import pytest
import torch

from megatron.spawn import run_distributed

from tests.helpers import gathered_model_parallel, REPO, TINY_SHAPE, train_keeping_model
from tests import warm_python
sys.path.insert(0, os.path.join(REPO, "tools"))

import convert_from_hf  # noqa: E402
import convert_to_hf  # noqa: E402
import zero_to_fp32  # noqa: E402

HF_SHAPE = dict(n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=100, activation_function="gelu_new",
                layer_norm_epsilon=1e-3)   # not the default 1e-5: the epsilon must survive import and export
MODEL = TINY_SHAPE + ["--max-position-embeddings", "16", "--hidden-dropout", "0", "--attention-dropout", "0"]
TRAINED_VOCAB = 8192                 # the default data's BPE
PAD_MULTIPLE = "100"                 # 8192 -> 8200 at mp 1 and mp 2: the export must drop padding rows
IMPORTS = [(1, False), (1, True), (2, False), (2, True)]  # (model-parallel size, --deepspeed)
NUM_TENSORS = 2 + 12 * 2 + 2


def _tokens(vocab, seed):
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))


def _ds_config(directory, name="ds_config.json", **extra):
    path = os.path.join(directory, name)
    with open(path, "w") as handle:
        json.dump({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": 2, "reduce_bucket_size": 5000, "allgather_bucket_size": 5000},
                   **extra}, handle)
    return path


# ---------------------------------------------------------------------------------------------------- workers



def _logits(module, tokens, vocab):
    """Logits over the real vocabulary, gathered over the vocab-parallel ranks."""
    module.eval()
    module.parallel_output = False
    position_ids = torch.arange(tokens.size(1)).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return module(tokens, position_ids)[..., :vocab].clone()


def _worker(imports, trainings, hf_tokens, trained_tokens):
    """Load each imported checkpoint through the training code and return its logits; then run each training
    (saving checkpoints) and return the trained model's gathered weights and logits."""
    import pretrain_gpt
    from megatron.initialize import initialize_megatron
    from megatron.training import setup_model_and_optimizer
    from megatron.utils import unwrap_model
    imported = []
    for flags in imports:
        initialize_megatron(args_list=MODEL + ["--mock-data", "--vocab-size", str(HF_SHAPE["vocab_size"]),
                                               "--layernorm-epsilon", str(HF_SHAPE["layer_norm_epsilon"]),
                                               "--train-iters", "1", "--finetune"] + flags)
        model, _, _, train_state = setup_model_and_optimizer(pretrain_gpt.model_provider)
        assert train_state.iteration == 0
        imported.append(_logits(unwrap_model(model), hf_tokens, HF_SHAPE["vocab_size"]))
    trained = {}
    for name, train_args in trainings.items():
        _, module = train_keeping_model(train_args)
        trained[name] = {"weights": gathered_model_parallel(module),
                         "logits": _logits(module, trained_tokens, TRAINED_VOCAB)}
    return {"imported": imported, "trained": trained}


# ---------------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A random GPT2LMHeadModel saved with save_pretrained (safetensors); LayerNorms and biases perturbed too."""
    from transformers import GPT2Config, GPT2LMHeadModel
    directory = str(tmp_path_factory.mktemp("hf_random"))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**HF_SHAPE, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       bos_token_id=0, eos_token_id=0)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
        tokens = _tokens(HF_SHAPE["vocab_size"], 1)
        logits = model(tokens).logits
    model.save_pretrained(directory, safe_serialization=True)
    return {"dir": directory, "tokens": tokens, "logits": logits}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf_model, webtext_data):
    """Import at every (mp, path); one worker launch per model-parallel size loads those imports and trains."""
    root = tmp_path_factory.mktemp("interchange")
    ds_config = _ds_config(str(root))
    imported_dirs = {}
    for mp, deepspeed in IMPORTS:
        save = str(root / f"imported_mp{mp}{'_zero' if deepspeed else ''}")
        argv = ["--hf", hf_model["dir"], "--save", save, "--model-parallel-size", str(mp)]
        assert convert_from_hf.main(argv + (["--deepspeed"] if deepspeed else [])) == 0
        imported_dirs[mp, deepspeed] = save
    data = ["--data-path", os.path.join(webtext_data, "webtext_text_document"), "--vocab-file",
            os.path.join(webtext_data, "vocab.json"), "--merge-file", os.path.join(webtext_data, "merges.txt"),
            "--data-cache-path", str(root / "cache")]
    train = MODEL + data + ["--make-vocab-size-divisible-by", PAD_MULTIPLE, "--train-iters", "4", "--save-interval",
                            "2", "--lr", "1e-3", "--warmup", "0", "--log-interval", "100", "--eval-iters", "0"]
    deepspeed_flags = ["--deepspeed", "--deepspeed_config", ds_config]
    bf16_config = _ds_config(str(root), "ds_config_bf16.json", bf16={"enabled": True})
    trainings = {  # (model-parallel size of the worker, name): flags
        (1, "megatron_mp1"): train + ["--batch-size", "2"],
        (1, "megatron_bf16_mp1"): train + ["--batch-size", "2", "--bf16", "--train-iters", "2"],
        (1, "zero2_bf16_mp1"): train + ["--deepspeed", "--deepspeed_config", bf16_config, "--train-iters", "2"],
        (2, "zero2_mp2"): train + ["--model-parallel-size", "2"] + deepspeed_flags}
    trained_dirs = {name: str(root / f"trained_{name}") for _, name in trainings}
    trained_tokens = _tokens(TRAINED_VOCAB, 2)
    results = {}
    for mp in (1, 2):
        imports = [["--model-parallel-size", str(mp), "--load", imported_dirs[mp, ds]] + (deepspeed_flags if ds else [])
                   for ds in (False, True)]
        runs_here = {name: flags + ["--save", trained_dirs[name]] for (size, name), flags in trainings.items()
                     if size == mp}
        worker_results = run_distributed(_worker, mp, args=(imports, runs_here, hf_model["tokens"], trained_tokens))
        for rank_result in worker_results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(rank_result["imported"], worker_results[0]["imported"]))
        results.update(worker_results[0]["trained"])
        for ds, logits in zip((False, True), worker_results[0]["imported"]):
            results[mp, ds] = logits
    return {"imported_dirs": imported_dirs, "trained_dirs": trained_dirs, "results": results, "root": root,
            "trained_tokens": trained_tokens, "webtext": webtext_data}


@pytest.fixture(scope="module")
def exported(runs):
    """convert_to_hf of both trained checkpoints (default vocab/merge files: the default data's)."""
    out = {}
    for name in ("megatron_mp1", "zero2_mp2"):
        load = runs["trained_dirs"][name]
        out[name] = str(runs["root"] / f"hf_{name}")
        assert convert_to_hf.main(["--load", load, "--output", out[name]]) == 0
    return out


# ---------------------------------------------------------------------------------------------------- import

@pytest.mark.parametrize("mp,deepspeed", IMPORTS, ids=["mp1", "mp1-zero", "mp2", "mp2-zero"])
def test_imported_checkpoint_gives_hf_logits(runs, hf_model, mp, deepspeed):
    ours = runs["results"][mp, deepspeed]
    assert ours.shape == hf_model["logits"].shape
    assert (ours - hf_model["logits"]).abs().max().item() <= 1e-5


def test_import_then_export_gives_the_original_tensors_bitwise(runs, hf_model):
    from safetensors.torch import load_file
    from megatron.model.hf_interchange import to_hf_config_dict, to_hf_state_dict
    from megatron.checkpoint.full_checkpoint import read_full_checkpoint
    original = load_file(os.path.join(hf_model["dir"], "model.safetensors"))
    original.pop("lm_head.weight", None)
    for key, directory in runs["imported_dirs"].items():
        full = read_full_checkpoint(directory)
        assert {k: full.model_config[k] for k in ("num_layers", "hidden_size", "num_attention_heads",
                                                  "max_sequence_length", "vocab_size")} == {
            "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "max_sequence_length": 16,
            "vocab_size": 100}, key
        assert full.model_config["layernorm_epsilon"] == HF_SHAPE["layer_norm_epsilon"], key
        assert to_hf_config_dict(full.model_config, 0)["layer_norm_epsilon"] == HF_SHAPE["layer_norm_epsilon"], key
        back = to_hf_state_dict(full.weights(), full.model_config)
        assert back.keys() == original.keys(), key
        for name, tensor in original.items():
            assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), (key, name)


# ---------------------------------------------------------------------------------------------------- export

@pytest.mark.parametrize("name", ["megatron_mp1", "zero2_mp2"])
def test_exported_model_gives_the_training_models_logits(runs, exported, name):
    from transformers import GPT2LMHeadModel
    config = json.load(open(os.path.join(exported[name], "config.json")))
    assert (config["model_type"], config["vocab_size"], config["n_layer"], config["n_embd"], config["n_head"],
            config["n_positions"]) == ("gpt2", TRAINED_VOCAB, 2, 32, 4, 16)
    assert config["activation_function"] == "gelu_new" and config["tie_word_embeddings"] is True
    assert config["bos_token_id"] == config["eos_token_id"] == 0  # <|endoftext|> of the trained vocabulary
    model = GPT2LMHeadModel.from_pretrained(exported[name]).eval()
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    with torch.no_grad():
        hf_logits = model(runs["trained_tokens"]).logits
    assert (hf_logits - runs["results"][name]["logits"]).abs().max().item() <= 1e-5


def test_exported_tokenizer_gives_our_ids(runs, exported):
    from transformers import AutoTokenizer
    from megatron.tokenizer.tokenizer import GPT2BPETokenizer
    from tests.helpers import HAND_DOCS, UNICODE_STRESS
    ours = GPT2BPETokenizer(os.path.join(runs["webtext"], "vocab.json"), os.path.join(runs["webtext"], "merges.txt"))
    theirs = AutoTokenizer.from_pretrained(exported["zero2_mp2"])
    assert theirs.eos_token_id == theirs.bos_token_id == ours.eod == 0 and len(theirs) == TRAINED_VOCAB
    texts = [t.replace("<|endoftext|>", "") for t in [UNICODE_STRESS] + HAND_DOCS] + [
        "def f(x):\n    return x ** 2  # square\n", "  leading and trailing  ",
        "Ünïcödé ταυτότητα 日本語 🚀"]
    for text in texts:
        ids = theirs(text)["input_ids"]
        assert ids == ours.tokenize(text), text
        assert theirs.decode(ids) == text
    # transformers reads a literal <|endoftext|> as the special token (ours encodes it as text): documented
    assert theirs("end<|endoftext|>")["input_ids"] == ours.tokenize("end") + [ours.eod]
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json"):
        assert os.path.isfile(os.path.join(exported["zero2_mp2"], name)), name


def test_export_then_import_gives_the_trained_weights_bitwise(runs, exported):
    from megatron.checkpoint.full_checkpoint import read_full_checkpoint
    save = str(runs["root"] / "reimported_mp2")
    assert convert_from_hf.main(["--hf", exported["megatron_mp1"], "--save", save, "--model-parallel-size", "2",
                                 "--make-vocab-size-divisible-by", PAD_MULTIPLE]) == 0
    weights = read_full_checkpoint(save).weights()
    trained = runs["results"]["megatron_mp1"]["weights"]
    assert weights.keys() == trained.keys()
    for name, tensor in trained.items():
        expected = tensor[:TRAINED_VOCAB] if name == "word_embeddings.weight" else tensor
        assert torch.equal(weights[name], expected), name


# ---------------------------------------------------------------------------------------------------- zero_to_fp32

@pytest.mark.parametrize("name", ["megatron_mp1", "zero2_mp2"])
def test_zero_to_fp32_equals_the_gathered_weights(runs, name, tmp_path, capsys):
    output = str(tmp_path / "fp32.pt")
    assert zero_to_fp32.main([runs["trained_dirs"][name], output]) == 0
    assert f"wrote {NUM_TENSORS} fp32 tensors" in capsys.readouterr().out
    state = torch.load(output, weights_only=True)
    trained = runs["results"][name]["weights"]
    assert trained["word_embeddings.weight"].shape[0] == 8200  # padded: the tool drops the padding rows
    assert state.keys() == trained.keys()
    for key, tensor in trained.items():
        expected = tensor[:TRAINED_VOCAB] if key == "word_embeddings.weight" else tensor
        assert state[key].dtype == torch.float32 and torch.equal(state[key], expected.float()), key
    if name == "zero2_mp2":  # a ZeRO-2 checkpoint at mp 2: the fp32 masters are in the optimizer-states files
        assert sorted(f for f in os.listdir(os.path.join(runs["trained_dirs"][name], "iter_0000004"))
                      if f.endswith("_optim_states.pt")) == ["zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                              "zero_pp_rank_0_mp_rank_01_optim_states.pt"]


@pytest.mark.parametrize("name", ["megatron_bf16_mp1", "zero2_bf16_mp1"])
def test_zero_to_fp32_of_bf16_training_gives_the_fp32_masters(runs, name, tmp_path):
    """The bf16 parameters are the masters rounded; the output is the masters (finer than bf16), and
    read_full_checkpoint(...).weights() keeps the saved bf16."""
    from megatron.checkpoint.full_checkpoint import read_full_checkpoint
    output = str(tmp_path / "fp32.pt")
    assert zero_to_fp32.main([runs["trained_dirs"][name], output]) == 0
    state = torch.load(output, weights_only=True)
    trained = runs["results"][name]["weights"]
    saved = read_full_checkpoint(runs["trained_dirs"][name]).weights()
    finer = 0
    for key, tensor in trained.items():
        expected = tensor[:TRAINED_VOCAB] if key == "word_embeddings.weight" else tensor
        assert expected.dtype == saved[key].dtype == torch.bfloat16 and torch.equal(saved[key], expected), key
        assert state[key].dtype == torch.float32 and torch.equal(state[key].bfloat16(), expected), key
        finer += not torch.equal(state[key], expected.float())
    assert finer >= len(trained) // 2, f"only {finer} of {len(trained)} tensors differ from the bf16 weights"


def test_zero_to_fp32_tag(runs, tmp_path):
    save = runs["trained_dirs"]["megatron_mp1"]
    output = str(tmp_path / "iter2.pt")
    assert zero_to_fp32.main([save, output, "-t", "iter_0000002"]) == 0
    state = torch.load(output, weights_only=True)
    saved = torch.load(os.path.join(save, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"),
                       weights_only=True)["model"]
    for key, tensor in saved.items():
        expected = tensor[:TRAINED_VOCAB] if key == "word_embeddings.weight" else tensor
        assert torch.equal(state[key], expected), key
    final = runs["results"]["megatron_mp1"]["weights"]["transformer.final_layernorm.weight"]
    assert not torch.equal(state["transformer.final_layernorm.weight"], final)  # really the older iteration


# ---------------------------------------------------------------------------------------------------- bad inputs

def _error_line(capsys, status):
    """The one stderr line of a tool that returned `status` 1."""
    assert status == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: "), err
    return err


def _hf_variant(source, target, **config_changes):
    shutil.copytree(source, target)
    path = os.path.join(target, "config.json")
    config = json.load(open(path))
    config.update(config_changes)
    json.dump(config, open(path, "w"))
    return target


def test_bad_inputs_give_one_line(runs, hf_model, tmp_path, capsys):
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    # convert_to_hf
    err = _error_line(capsys, convert_to_hf.main(["--load", empty, "--output", str(tmp_path / "o")]))
    assert "is not a checkpoint directory" in err
    err = _error_line(capsys, convert_to_hf.main(["--load", runs["trained_dirs"]["megatron_mp1"], "--output",
                                                  str(tmp_path / "o"), "--vocab-file", str(tmp_path / "none.json")]))
    assert "vocab file" in err and "does not exist" in err
    err = _error_line(capsys, convert_to_hf.main(["--load", runs["imported_dirs"][1, False], "--output",
                                                  str(tmp_path / "o")]))
    assert f"has {TRAINED_VOCAB} tokens but the checkpoint's vocabulary is 100" in err
    # convert_from_hf
    save = str(tmp_path / "save")
    for i, (changes, message) in enumerate([({"model_type": "llama"}, "model_type 'llama'"),
                                            ({"activation_function": "gelu"}, "activation_function 'gelu'"),
                                            ({"vocab_size": 120}, "vocabulary mismatch")]):
        variant = _hf_variant(hf_model["dir"], str(tmp_path / f"hf_variant_{i}"), **changes)
        err = _error_line(capsys, convert_from_hf.main(["--hf", variant, "--save", save]))
        assert message in err, err
    err = _error_line(capsys, convert_from_hf.main(["--hf", hf_model["dir"], "--save", save,
                                                    "--model-parallel-size", "3"]))
    assert "--model-parallel-size 3 does not divide the 4 attention heads" in err
    no_weights = _hf_variant(hf_model["dir"], str(tmp_path / "hf_no_weights"))
    os.remove(os.path.join(no_weights, "model.safetensors"))
    assert "has no weights file" in _error_line(capsys, convert_from_hf.main(["--hf", no_weights, "--save", save]))
    assert "has no config.json" in _error_line(capsys, convert_from_hf.main(["--hf", empty, "--save", save]))
    assert not os.path.exists(save)
    # zero_to_fp32
    err = _error_line(capsys, zero_to_fp32.main([empty, str(tmp_path / "x.pt")]))
    assert "is not a checkpoint directory" in err
    err = _error_line(capsys, zero_to_fp32.main([runs["trained_dirs"]["zero2_mp2"], str(tmp_path / "x.pt"),
                                                 "-t", "iter_0000009"]))
    assert "has no tag directory 'iter_0000009'" in err and "iter_0000004" in err


def test_missing_transformers_gives_the_install_hint(runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    err = _error_line(capsys, convert_to_hf.main(["--load", runs["trained_dirs"]["megatron_mp1"], "--output",
                                                  str(tmp_path / "o")]))
    assert "pip install transformers" in err


@pytest.mark.parametrize("tool,argv", [("convert_to_hf.py", ["--load", "{empty}", "--output", "{empty}/out"]),
                                       ("convert_from_hf.py", ["--hf", "{empty}", "--save", "{empty}/save"]),
                                       ("zero_to_fp32.py", ["{empty}", "{empty}/out.pt"])])
def test_command_line_error_exits_1_without_traceback(tmp_path, tool, argv):
    argv = [a.format(empty=str(tmp_path)) for a in argv]
    result = warm_python.run([sys.executable, os.path.join(REPO, "tools", tool)] + argv, cwd=str(tmp_path),
                             capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr

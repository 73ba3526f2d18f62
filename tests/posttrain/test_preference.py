"""Preference data (tools/preprocess_sft_data.py --preference) and DPO (finetune_gpt.py --objective dpo).

- data: a hand-built file's pairs are documents 2i (chosen) and 2i + 1 (rejected), each the SFT example's ids and
  mask; a bad line drops the whole pair; a PreferenceDataset sample is the pair's two rows.
- DPO against Hugging Face GPT2LMHeadModel (the same weights, imported with tools/convert_from_hf.py): two AdamW
  steps (lr 0.1, eps 1: an update smooth in the gradient) of our run and of a plain-PyTorch DPO on HF (reference =
  a frozen HF copy of the start) on the same pairs in the same order: the logged DPO loss and TRL's rewards/* of
  both steps (1e-5), the weights' change over the two steps (5e-5 of it, worst tensor: their fp32 rounding) at mp1 (2 micro-batches),
  mp2 and ZeRO-3 dp2 (the frozen reference partitioned too). Step 2 is where the policy differs from the reference, so it catches a reference taken from the
  current model.
- the reference: its log-probs are bitwise the same after the model trained (full fine-tuning: a frozen copy;
  LoRA: the adapters off), and with LoRA they and the logits are bitwise the base model's.
"""
import json
import os
import sys

import numpy
import pytest
import torch

from megatron.spawn import run_distributed
from tests.posttrain.test_sft import HF_SHAPE, _bind, _model_flags, _run_jobs, _saved_weights_as_hf, _tokenizer

from tests.helpers import REPO
sys.path.insert(0, os.path.join(REPO, "tools"))

import convert_from_hf  # noqa: E402
import preprocess_sft_data  # noqa: E402

SEQ = 48
SPLIT = "100,0,0"
BETA = 0.5
TWO_STEPS = ["--train-iters", "2", "--lr", "0.1", "--adam-eps", "1", "--weight-decay", "0", "--clip-grad", "0",
             "--lr-decay-style", "constant", "--warmup", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--eval-iters", "0", "--log-interval", "1", "--objective", "dpo", "--dpo-beta", str(BETA),
             "--batch-size", "2", "--global-batch-size", "4"]
RUNS = {1: {"dpo-mp1": []}, 2: {"dpo-mp2": ["--model-parallel-size", "2"],
                                 "dpo-zero3-dp2": ["--deepspeed", "--zero-stage", "3"]}}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def write_pairs(path, count=12):
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    with open(path, "w") as handle:
        for i in range(count):
            a, b = i + 3, 2 * i + 1
            handle.write(json.dumps({"prompt": f"What is {a} plus {b}?", "chosen": f"It is {a + b}.",
                                     "rejected": " ".join(words[:1 + i % 7]) + f" {a * b}"}) + "\n")
    return path


def _preprocess(tmp_path, webtext, jsonl, *flags):
    prefix = str(tmp_path / "pairs")
    preprocess_sft_data.main(["--input", jsonl, "--output-prefix", prefix, "--vocab-file",
                              os.path.join(webtext, "vocab.json"), "--merge-file", os.path.join(webtext, "merges.txt"),
                              "--preference", *flags])
    return prefix


# ---------------------------------------------------------------------------------------------------- data

def test_preference_preprocessing_keeps_pairs_together(tmp_path, webtext_data):
    from megatron.data.indexed_dataset import MMapIndexedDataset
    from megatron.posttrain import TEMPLATES, build_preference_datasets, encode_example
    lines = [{"prompt": "Hi", "chosen": "Hello!", "rejected": "Go away."},
             {"prompt": "Hi", "chosen": "Hello!"},                           # no rejected: the whole pair skipped
             {"prompt": "Two?", "chosen": "2", "rejected": "three or four or five"}]
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines))
    prefix = _preprocess(tmp_path, webtext_data, str(jsonl), "--on-error", "skip")
    ids = MMapIndexedDataset(prefix + "_pairs_input_ids_document")
    mask = MMapIndexedDataset(prefix + "_pairs_loss_mask_document")
    tokenizer = _tokenizer(webtext_data)
    template = TEMPLATES["deepspeed-chat"]
    expected = []
    for line in (lines[0], lines[2]):
        for answer in ("chosen", "rejected"):
            expected.append(encode_example([{"role": "user", "content": line["prompt"]},
                                            {"role": "assistant", "content": line[answer]}], tokenizer, template))
    # by hand: " Human: Hi" " Assistant:" (mask 0), " Hello!" <|endoftext|> (mask 1)
    hand = tokenizer.tokenize(" Human: Hi") + tokenizer.tokenize(" Assistant:")
    assert expected[0][0] == hand + tokenizer.tokenize(" Hello!") + [tokenizer.eod]
    assert expected[0][1] == [0] * len(hand) + [1] * (len(expected[0][0]) - len(hand))
    assert len(ids) == len(mask) == 4
    for document, (want_ids, want_mask) in enumerate(expected):
        assert ids[document].tolist() == want_ids and mask[document].tolist() == want_mask, document
    train, valid, test = build_preference_datasets(prefix, "100,0,0", [4, 0, 0], 32, 1, tokenizer.eod)
    assert valid is None and test is None
    for index in range(len(train)):
        (pair,) = train.samples[index]
        sample = train[index]
        assert sample["text"].shape == (2, 33)
        for row in range(2):
            want_ids, want_mask = expected[2 * pair + row]
            assert sample["text"][row, :len(want_ids)].tolist() == want_ids
            assert sample["loss_mask"][row, 1:len(want_ids)].tolist() == want_mask[1:]
            assert sample["loss_mask"][row, len(want_ids):].sum() == 0


# ---------------------------------------------------------------------------------------------------- DPO vs HF

@pytest.fixture(scope="module")
def setup(tmp_path_factory, webtext_data):
    from transformers import GPT2Config, GPT2LMHeadModel
    root = tmp_path_factory.mktemp("dpo")
    prefix = _preprocess(root, webtext_data, write_pairs(str(root / "pairs.jsonl")), "--seq-length", str(SEQ))
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(**HF_SHAPE, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                    eos_token_id=0))
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    hf_dir = str(root / "hf")
    hf.save_pretrained(hf_dir, safe_serialization=True)
    start = str(root / "imported")
    assert convert_from_hf.main(["--hf", hf_dir, "--save", start]) == 0
    zero3 = str(root / "zero3.json")        # the flags' batch (2 per rank x dp 2) and no clipping
    with open(zero3, "w") as handle:
        json.dump({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                   "zero_optimization": {"stage": 3}}, handle)
    return {"root": root, "prefix": prefix, "hf_dir": hf_dir, "start": start, "webtext": webtext_data,
            "zero3": zero3}


def _dpo_args(setup, name, flags):
    extra = ["--deepspeed_config", setup["zero3"]] if "--deepspeed" in flags else []
    return _model_flags(setup["webtext"]) + ["--data-path", setup["prefix"], "--split", SPLIT, "--load",
                                              setup["start"], "--save", str(setup["root"] / name), "--log-jsonl",
                                              str(setup["root"] / f"{name}.jsonl")] + TWO_STEPS + flags + extra


def _logged(setup, name):
    records = [json.loads(line) for line in open(setup["root"] / f"{name}.jsonl")]
    return [r["losses"] for r in records if r.get("type") == "train"]


# A run stopped after step 1 and resumed (same command, the checkpoint in --save wins): without LoRA the reference is
# read from the --load it started from (finetune_gpt.py adds --dpo-reference), at mp1 and (partitioned) at ZeRO-3.
RESUMED = {1: "dpo-mp1", 2: "dpo-zero3-dp2"}


@pytest.fixture(scope="module")
def runs(setup):
    results = {}
    for world, named in RUNS.items():
        jobs = [(name, "finetune", _dpo_args(setup, name, flags)) for name, flags in named.items()]
        resumed = f"{RESUMED[world]}-resumed"
        schedule = ["--lr-decay-iters", "2"]      # the straight run's (its --train-iters), so the resume matches
        jobs += [(f"{resumed}-first", "finetune", _dpo_args(setup, resumed, named[RESUMED[world]]) + schedule +
                  ["--train-iters", "1"]),
                 (resumed, "finetune", _dpo_args(setup, resumed, named[RESUMED[world]]) + schedule)]
        if world == 1:
            jobs.append(("reference", "call", _bind(_reference_check)))
        results.update(run_distributed(_run_jobs, world, args=(jobs,), timeout=900)[0])
    return results


def _hf_dpo(setup):
    """Two AdamW steps of plain-PyTorch DPO on HF GPT-2 (or the LlamaForCausalLM of setup["hf_dir"]): ([per step
    {loss, rewards/*}], weights before, after)."""
    from transformers import AutoModelForCausalLM
    from megatron.posttrain import build_preference_datasets
    train = build_preference_datasets(setup["prefix"], SPLIT, [8, 0, 0], SEQ, 5, 0)[0]
    policy = AutoModelForCausalLM.from_pretrained(setup["hf_dir"]).float()
    reference = AutoModelForCausalLM.from_pretrained(setup["hf_dir"]).float().eval()
    before = {name: tensor.clone() for name, tensor in policy.state_dict().items()}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.1, eps=1.0, weight_decay=0.0)

    def logps(model, text, mask):
        logits = model(input_ids=text).logits[:, :-1].float()   # padding comes after every answer token: causal
        token = torch.log_softmax(logits, -1).gather(-1, text[:, 1:, None])[..., 0]
        return (token * mask[:, 1:]).sum(-1)
    steps = []
    for step in range(2):
        samples = [train[i] for i in range(4 * step, 4 * step + 4)]
        text = torch.from_numpy(numpy.concatenate([s["text"] for s in samples]))     # c0 r0 c1 r1 ...
        mask = torch.from_numpy(numpy.concatenate([s["loss_mask"] for s in samples])).float()
        with torch.no_grad():
            ref = logps(reference, text, mask).view(-1, 2)
        pol = logps(policy, text, mask).view(-1, 2)
        chosen, rejected = BETA * (pol[:, 0] - ref[:, 0]), BETA * (pol[:, 1] - ref[:, 1])
        loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps.append({"lm loss": loss.item(), "rewards/chosen": chosen.mean().item(),
                      "rewards/rejected": rejected.mean().item(), "rewards/margins": (chosen - rejected).mean().item(),
                      "rewards/accuracies": (chosen > rejected).float().mean().item()})
    return steps, before, policy.state_dict()


@pytest.fixture(scope="module")
def hf_dpo(setup):
    return _hf_dpo(setup)


@pytest.mark.parametrize("name", [name for named in RUNS.values() for name in named])
def test_dpo_loss_rewards_and_steps_equal_hf(setup, runs, hf_dpo, name):
    steps, before, after = hf_dpo
    logged = _logged(setup, name)
    assert len(logged) == 2
    assert abs(steps[0]["lm loss"] - torch.log(torch.tensor(2.0)).item()) < 1e-6   # policy = reference at step 1
    assert abs(steps[1]["lm loss"] - steps[0]["lm loss"]) > 1e-3, steps             # step 2 sees a trained policy
    for ours, theirs in zip(logged, steps):
        for key in ("lm loss",) + METRICS:
            assert abs(ours[key] - theirs[key]) <= 1e-5 * max(1.0, abs(theirs[key])), (name, key, ours, theirs)
    saved = _saved_weights_as_hf(str(setup["root"] / name))
    worst = 0.0
    for key, tensor in saved.items():
        step_hf, step_ours = after[key] - before[key], tensor - before[key]
        assert step_hf.abs().max() > 0, key
        worst = max(worst, ((step_ours - step_hf).abs().max() / step_hf.abs().max()).item())
    print(f"{name}: losses {[r['lm loss'] for r in logged]} (HF {[s['lm loss'] for s in steps]}), "
          f"margins {[r['rewards/margins'] for r in logged]}, two steps vs HF's: {worst:.2e} relative")
    # 5e-5: the weights (|w| up to ~0.3) are fp32, their two-step change ~1e-3, so rounding alone is ~2e-5 of it
    assert worst <= 5e-5, f"{name}: the weights' change differs from HF's by {worst:.2e} (relative, worst tensor)"


@pytest.mark.parametrize("name", list(RESUMED.values()))
def test_a_resumed_run_without_lora_continues_exactly(setup, runs, name):
    """Step 2 of the resumed run (its reference re-read from the starting checkpoint) equals the straight run's."""
    straight, resumed = _logged(setup, name), _logged(setup, f"{name}-resumed")
    assert len(resumed) == 2 and resumed[1]["lm loss"] != resumed[0]["lm loss"]   # the log keeps the first leg
    for key in ("lm loss",) + METRICS:
        assert resumed[1][key] == straight[1][key], (name, key, resumed, straight)


# ---------------------------------------------------------------------------------------------------- reference

def _reference_check():
    """Reference log-probs before/after an update of the model (full and LoRA), and the LoRA reference vs the base
    model's, on random rows."""
    import mpu
    from megatron.posttrain import dpo
    from tests.model.test_gpt2_model import build_model
    mpu.initialize_model_parallel(1)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (4, 12), generator=generator)
    labels = torch.randint(0, 64, (4, 12), generator=generator)
    mask = (torch.rand(4, 12, generator=generator) > 0.4).float()
    positions = torch.arange(12).expand(4, 12)
    out = {}
    for kind in ("full", "lora"):
        lora = mpu.LoRAConfig(rank=2, alpha=4.0, zero_init_b=False) if kind == "lora" else None
        model = build_model(lora=lora).train()
        if lora is not None:
            mpu.mark_only_lora_as_trainable(model)
        reference = dpo.Reference()
        first = reference.log_probs(model, tokens, positions, None, labels, mask)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        dpo.sequence_log_probs(model(tokens, positions, None, labels=labels), mask).sum().backward()
        optimizer.step()
        moved = max((p.detach() - start[n]).abs().max().item() for n, p in model.named_parameters())
        second = reference.log_probs(model, tokens, positions, None, labels, mask)
        with torch.no_grad():
            current = dpo.sequence_log_probs(model.eval()(tokens, positions, None, labels=labels), mask)
        model.train()
        out[kind] = {"first": first, "second": second, "current": current, "moved": moved,
                     "training": model.training}
        if kind == "full":
            out[kind]["copy_unchanged"] = all(torch.equal(p, start[n]) for n, p in reference.frozen.named_parameters())
        else:
            base = build_model().eval()
            with torch.no_grad():
                out[kind]["base"] = dpo.sequence_log_probs(base(tokens, positions, None, labels=labels), mask)
                base_logits = base(tokens, positions)
                lora_model = build_model(lora=lora).eval()
                with_adapters = lora_model(tokens, positions)
                with mpu.adapters_disabled(lora_model):
                    without = lora_model(tokens, positions)
                again = lora_model(tokens, positions)
            out[kind].update(base_logits=base_logits, with_adapters=with_adapters, without=without, again=again)
    mpu.destroy_model_parallel()
    return out


def test_reference_never_changes_and_lora_reference_is_the_base(runs):
    result = runs["reference"]
    for kind in ("full", "lora"):
        r = result[kind]
        assert r["moved"] > 1e-3 and r["training"], kind                     # the model did train
        assert torch.equal(r["first"], r["second"]), kind                    # bitwise the same reference
        assert not torch.allclose(r["current"], r["first"], atol=1e-4), kind  # ... not the current model's
    assert result["full"]["copy_unchanged"]
    lora = result["lora"]
    assert torch.equal(lora["first"], lora["base"])                          # LoRA's reference is the base model
    assert torch.equal(lora["without"], lora["base_logits"])                 # adapters off: the base, bitwise
    assert not torch.allclose(lora["with_adapters"], lora["base_logits"], atol=1e-4)
    assert torch.equal(lora["again"], lora["with_adapters"])                 # restored on exit

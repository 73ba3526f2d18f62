"""RLHF step 3 (train_rlhf.py, megatron/posttrain/rlhf.py) against a plain-PyTorch implementation on Hugging Face
models with the same weights.

- PPO (DeepSpeed-Chat's roles): actor GPT2LMHeadModel, critic and reward model GPT2ForSequenceClassification (the
  same reward checkpoint), reference = the starting actor; greedy experience (each row generated alone by HF
  `generate` equals ours, made in one left-padded batch), the log-probs, values and scores each row alone on HF,
  laid out as DeepSpeed-Chat's left-padded batch, then rlhf_loss's formulas and torch AdamW (eps 1: the update
  follows the gradient smoothly); 2 rollouts x 2 PPO epochs: the logged losses, scores, KL (non-zero in the second
  rollout), clip fraction (non-zero in the first rollout's second epoch), and the weights of actor and critic after the
  4 steps.
- GRPO with a verifiable reward (a reward function of the text) and beta 0.1: our sampled completions scored and
  trained on by the plain implementation; both epochs' loss, reward, clip ratios and kl, and the weights after.
- training after generation and scoring is bitwise the training without them: the same PPO run with dropout 0.1
  replayed with its recorded completions and scores (no generation, no reward model call) logs the same losses.
- PPO-ptx with the EMA actor (DeepSpeed-Chat's --unsupervised_dataset_name, --unsup_coef 27.8 and --enable_ema):
  3 rollouts x 1 epoch, each actor step (the PPO micro-batches and as many pretraining micro-batches, unsup_coef x
  their LM loss, in one accumulation of twice the micro-batches) equal to the plain implementation extended with
  DeepSpeed-Chat's train_unsupervised (HF's loss with labels = input_ids); the PTX samples are the pretraining
  dataset's in order; the EMA saved with each checkpoint equals 0.992 ema + 0.008 actor computed here from the
  saved actors (float64), at mp1 and ZeRO-3 dp2, and for GRPO with LoRA (every parameter: A, B, the frozen base).
- resume is exact: that run (with the EMA actor and PTX) for 1 iteration, saved, then resumed in new model state for
  the second, logs bitwise the losses of the straight run and saves bitwise the same actor, critic and EMA; so does
  the ZeRO-3 dp2 PTX/EMA run (offload_param) resumed after 2 of its 3 iterations.
- GRPO at data-parallel 2 (the group advantages and dapo's token count over both ranks) equals the same plain
  implementation on the two ranks' completions.
- bad flags are one line.
"""
import json
import os

import pytest
import torch

from megatron.spawn import run_distributed
import tests.helpers  # noqa: F401  (puts tools/ on sys.path)
from tests.posttrain.test_reward import _write_start
from tests.posttrain.test_sft import HF_SHAPE, _model_flags, _saved_weights_as_hf, write_examples

import convert_from_hf  # noqa: E402
import preprocess_sft_data  # noqa: E402

SEQ = 48
SPLIT = "80,20,0"
PROMPT, COMPLETION = 24, 8
LR = {"ppo": 0.005, "grpo": 0.01}     # PPO: the second rollout's answers are not all empty and the second epoch
# clips: both hold from 0.004 to 0.006 (and not at 0.003) on the default data 845b8bad124aace2's vocabulary
COMMON = ["--adam-eps", "1", "--weight-decay", "0", "--clip-grad", "0", "--lr-decay-style",
          "constant", "--warmup", "0", "--eval-iters", "0", "--log-interval", "1", "--batch-size", "2",
          "--global-batch-size", "4", "--max-prompt-length", str(PROMPT), "--max-completion-length", str(COMPLETION)]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
PPO = ["--algorithm", "ppo", "--ppo-epochs", "2", "--train-iters", "4", "--greedy", "--lr", str(LR["ppo"])]
PTX_EMA = ["--algorithm", "ppo", "--ppo-epochs", "1", "--train-iters", "3", "--save-interval", "1", "--greedy",
           "--lr", str(LR["ppo"]), "--enable-ema", "--lr-decay-iters", "3"]   # + --unsupervised-data-path (_ptx_flags)
PTX_ROLLOUTS, PTX_COEF, EMA_BETA = 3, 27.8, 0.992
LORA_EMA = ["--lora-rank", "4", "--ppo-epochs", "1", "--train-iters", "2", "--save-interval", "1", "--enable-ema"]
EMA_STEPS = {"ptx-ema-mp1": PTX_ROLLOUTS, "ptx-ema-zero3-dp2": PTX_ROLLOUTS, "grpo-lora-ema-mp1": 2}
GRPO = ["--algorithm", "grpo", "--num-generations", "2", "--ppo-epochs", "2", "--train-iters", "2", "--beta", "0.1",
        "--lr", str(LR["grpo"]),
        "--reward-fn", "tests.posttrain.test_rlhf:vowel_reward"]
TOLERANCE = 1e-5
# mp2 sums the row-parallel partial products in another order; the first rollout's losses agree within 2e-6, but
# Adam at lr 5e-3 turns the rounding noise of near-zero gradients (GPT-2's key bias, whose true gradient is 0) into
# +-lr steps, and the second rollout's losses differ by up to 3.0e-5 on an AVX-512/AMX Xeon (measured 2026-12-07;
# under 1e-5 on the CI machine before). A real mp2 bug (a missed all-reduce, a wrong split) moves them by > 1e-2.
MP2_TOLERANCE = 5e-5


def vowel_reward(completions, **kwargs):
    """A verifiable reward for the tests: the fraction of the answer's characters that are vowels."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


# ---------------------------------------------------------------------------------------------------- workers

def _run_rlhf_jobs(jobs):
    """(name, args, replay_of) jobs in order in one worker; replay_of names an earlier job whose recorded
    completions and scores replace generation and scoring."""
    import mpu
    import train_rlhf
    from megatron.posttrain import rlhf
    results = {}
    for name, args_list, replay_of in jobs:
        if replay_of is None:
            results[name] = train_rlhf.main(args_list)
        else:
            recorded = [results[replay_of][key] for key in ("first_rollout", "last_rollout")]
            generate, score = rlhf.generate_completions, rlhf.score_completions
            rlhf.generate_completions = lambda *args, **kwargs: recorded[0]["completions"]
            rlhf.score_completions = lambda *args, **kwargs: torch.tensor(recorded.pop(0)["scores"])
            try:
                results[name] = train_rlhf.main(args_list)
            finally:
                rlhf.generate_completions, rlhf.score_completions = generate, score
        mpu.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def setup(tmp_path_factory, webtext_data):
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel
    root = tmp_path_factory.mktemp("rlhf")
    jsonl = write_examples(str(root / "examples.jsonl"))
    prefix = str(root / "data" / "qa")
    preprocess_sft_data.main(["--input", jsonl, "--output-prefix", prefix, "--vocab-file",
                              os.path.join(webtext_data, "vocab.json"), "--merge-file",
                              os.path.join(webtext_data, "merges.txt"), "--seq-length", str(SEQ)])
    quiet = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    actor = GPT2LMHeadModel(GPT2Config(**HF_SHAPE, **quiet))
    reward = GPT2ForSequenceClassification(GPT2Config(**HF_SHAPE, **quiet, num_labels=1, pad_token_id=0))
    with torch.no_grad():
        for model, scale in ((actor, 0.05), (reward, 0.05)):
            for param in model.parameters():
                param.add_(torch.randn_like(param) * scale)
        actor.lm_head.weight.mul_(4.0)      # peaked next-token distributions: no near-ties in the greedy choice
        reward.score.weight.mul_(20.0)      # scores of order 1 (the sign: PPO learns to answer, not to stop at once)
        # end-of-text's logit about 5.4 wherever the hidden state is the prompts' mean one: answers of 1 (only
        # end-of-text) to 8 (none) tokens
        hidden = torch.cat([actor.transformer(input_ids=torch.tensor(p)[None]).last_hidden_state[0]
                            for p in _prompts({"prefix": prefix}, 8)]).mean(0)
        actor.transformer.wte.weight[0] = 5.4 * hidden / hidden.norm() ** 2
    actor.save_pretrained(str(root / "hf_actor"), safe_serialization=True)
    reward.save_pretrained(str(root / "hf_reward"), safe_serialization=True)
    assert convert_from_hf.main(["--hf", str(root / "hf_actor"), "--save", str(root / "actor")]) == 0
    return {"root": root, "prefix": prefix, "webtext": webtext_data, "actor": str(root / "actor"),
            "reward": _write_start(str(root / "reward"), reward)}


def _ptx_flags(setup):
    return ["--unsupervised-data-path", os.path.join(setup["webtext"], "webtext_text_document"), "--data-cache-path",
            str(setup["root"] / "ptx_cache")]


def _rlhf_args(setup, name, flags):
    scorer = [] if "--reward-fn" in flags else ["--reward-model", setup["reward"], "--critic-load", setup["reward"]]
    return _model_flags(setup["webtext"]) + ["--data-path", setup["prefix"], "--split", SPLIT, "--load",
                                              setup["actor"], "--save", str(setup["root"] / name), "--log-jsonl",
                                              str(setup["root"] / f"{name}.jsonl")] + COMMON + scorer + flags


@pytest.fixture(scope="module")
def one_process(setup):
    dropout = [flag for flag in PPO if flag != "--greedy"] + _ptx_flags(setup) + [
        "--ppo-epochs", "1", "--train-iters", "2", "--enable-ema", "--lr-decay-iters", "2"]
    # sampled, two rollouts, dropout 0.1, with the EMA actor and PTX; resumed after the first
    jobs = [("ppo-mp1", _rlhf_args(setup, "ppo-mp1", PPO + NO_DROPOUT), None),
            ("grpo-mp1", _rlhf_args(setup, "grpo-mp1", GRPO + NO_DROPOUT), None),
            ("dropout", _rlhf_args(setup, "dropout", dropout), None),
            ("dropout-replayed", _rlhf_args(setup, "dropout-replayed", dropout), "dropout"),
            ("resume-first", _rlhf_args(setup, "resumed", dropout + ["--train-iters", "1"]), None),
            ("resume-second", _rlhf_args(setup, "resumed", dropout), None),
            ("ptx-ema-mp1", _rlhf_args(setup, "ptx-ema-mp1", PTX_EMA + NO_DROPOUT + _ptx_flags(setup)), None),
            ("grpo-lora-ema-mp1", _rlhf_args(setup, "grpo-lora-ema-mp1", GRPO + NO_DROPOUT + LORA_EMA), None)]
    return run_distributed(_run_rlhf_jobs, 1, args=(jobs,), timeout=900)[0]


@pytest.fixture(scope="module")
def two_processes(setup):
    """PPO at mp2 and at ZeRO-3 dp2 (each rank its own rollout of 2 prompts: the same rows as mp1's micro-batches),
    PPO-ptx with the EMA actor at ZeRO-3 dp2 with offload_param (the EMA's partitions in host offload memory too),
    GRPO at dp2 (Megatron's data parallelism)."""
    zero3 = str(setup["root"] / "zero3.json")
    with open(zero3, "w") as handle:
        json.dump({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                   "zero_optimization": {"stage": 3}}, handle)
    offload = str(setup["root"] / "zero3_offload.json")
    with open(offload, "w") as handle:
        json.dump({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                   "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, handle)
    runs = {"ppo-mp2": PPO + ["--model-parallel-size", "2"],
            "ppo-zero3-dp2": PPO + ["--deepspeed", "--zero-stage", "3", "--deepspeed_config", zero3],
            "ptx-ema-zero3-dp2": PTX_EMA + _ptx_flags(setup) + ["--deepspeed", "--zero-stage", "3",
                                                                "--deepspeed_config", offload],
            "grpo-dp2": GRPO}
    zero3_ptx = runs["ptx-ema-zero3-dp2"]
    jobs = [(name, _rlhf_args(setup, name, flags + NO_DROPOUT), None) for name, flags in runs.items()]
    jobs += [(name, _rlhf_args(setup, "zero3-resumed", zero3_ptx + NO_DROPOUT + ["--train-iters", iters]), None)
             for name, iters in (("zero3-resume-first", "2"), ("zero3-resume-second", "3"))]
    results = run_distributed(_run_rlhf_jobs, 2, args=(jobs,), timeout=900)
    for name in runs:      # every rank logs the same step (the losses are summed over the data-parallel group)
        assert results[1][name]["losses"] == results[0][name]["losses"], name
    return results


# ---------------------------------------------------------------------------------------------------- reference

def _prompts(setup, count):
    """The first `count` prompts of the train split in our order: the ids before each example's last answer."""
    from megatron.posttrain import build_sft_datasets
    train = build_sft_datasets(setup["prefix"], SPLIT, [count, 0, 0], SEQ, 5, 0)[0]
    prompts = []
    for index in range(count):
        (ids, mask), = train.examples(index)
        last = max(i for i in range(len(mask)) if mask[i] and not mask[i - 1])
        prompts.append(ids[:last].tolist()[-PROMPT:])
    return prompts


def _hf_log_probs(model, seq):
    """[len(seq) - 1] log p(seq[t + 1] | seq[:t + 1]) of a GPT2LMHeadModel, the row alone."""
    logits = model(input_ids=torch.tensor(seq)[None]).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]


def _hf_values(critic, seq):
    """[len(seq)] the critic's per-token value (its score head on every position), the row alone."""
    return critic.score(critic.transformer(input_ids=torch.tensor(seq)[None]).last_hidden_state)[0, :, 0]


def _laid_out(rows, offsets, width):
    """[n, width] with row i's values at columns offsets[i] ..., 0 elsewhere (differentiable)."""
    out = []
    for row, offset in zip(rows, offsets):
        row = row[:width - offset]
        out.append(torch.cat([row.new_zeros(offset), row, row.new_zeros(width - offset - row.numel())]))
    return torch.stack(out)


class Layout:
    """DeepSpeed-Chat's left-padded batch of prompts + completions, built here from the token lists."""

    def __init__(self, prompts, completions):
        self.width, new = max(map(len, prompts)), max(map(len, completions))
        self.length = self.width + new
        self.offsets = [self.width - len(p) for p in prompts]
        self.seqs = [p + c for p, c in zip(prompts, completions)]
        tokens = torch.zeros(len(prompts), self.length, dtype=torch.long)
        for i, (seq, offset) in enumerate(zip(self.seqs, self.offsets)):
            tokens[i, offset:offset + len(seq)] = torch.tensor(seq)
        self.start = self.width - 1
        self.action_mask = tokens[:, 1:].ne(0).float()
        self.completion_mask = torch.zeros(len(prompts), new)
        for i, completion in enumerate(completions):
            self.completion_mask[i, :len(completion)] = 1

    def log_probs(self, model):
        return _laid_out([_hf_log_probs(model, s) for s in self.seqs], self.offsets, self.length - 1)

    def values(self, critic):
        return _laid_out([_hf_values(critic, s) for s in self.seqs], self.offsets, self.length - 1)


def _hf_generate(model, prompts):
    out = []
    for prompt in prompts:
        ids = model.generate(torch.tensor(prompt)[None], max_new_tokens=COMPLETION, do_sample=False,
                             eos_token_id=0, pad_token_id=0)[0, len(prompt):].tolist()
        out.append(ids[:ids.index(0) + 1] if 0 in ids else ids)
    return out


def _hf_ppo(setup, prompts, rollouts=2, epochs=2, ptx=None):
    """`rollouts` x `epochs` of PPO in plain PyTorch: ([logged metrics per step], completions per rollout, actor
    and critic weights before and after). `ptx`: per rollout the [4, block] pretraining rows of DeepSpeed-Chat's
    train_unsupervised, one micro-batch of 2 after each PPO micro-batch, unsup_coef PTX_COEF, all in one actor
    step of 4 accumulated micro-batches (its doubled gradient_accumulation_steps_actor)."""
    from megatron.posttrain import rlhf_loss as F
    from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel
    actor = GPT2LMHeadModel.from_pretrained(str(setup["root"] / "hf_actor")).float()
    reference = GPT2LMHeadModel.from_pretrained(str(setup["root"] / "hf_actor")).float().eval()
    critic = GPT2ForSequenceClassification.from_pretrained(str(setup["root"] / "hf_reward")).float()
    reward = GPT2ForSequenceClassification.from_pretrained(str(setup["root"] / "hf_reward")).float().eval()
    before = ({k: v.clone() for k, v in actor.state_dict().items()}, {k: v.clone() for k, v in critic.state_dict().items()})
    actor_opt = torch.optim.AdamW(actor.parameters(), lr=LR["ppo"], eps=1.0, weight_decay=0.0)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=LR["ppo"], eps=1.0, weight_decay=0.0)
    logged, generated = [], []
    for rollout in range(rollouts):
        batch = prompts[4 * rollout:4 * rollout + 4]
        with torch.no_grad():
            completions = _hf_generate(actor.eval(), batch)
            generated.append(completions)
            lay = Layout(batch, completions)
            old, ref, old_values = lay.log_probs(actor), lay.log_probs(reference), lay.values(critic)
            scores = reward(input_ids=torch.zeros(1, 1, dtype=torch.long)).logits.new_tensor(
                [reward(input_ids=torch.tensor(s)[None]).logits[0, 0] for s in lay.seqs])
        start, mask = lay.start, lay.action_mask[:, lay.start:]
        rewards = F.compute_rewards(old, ref, scores, lay.action_mask, start)
        rewards, values = F.zero_after_ends(rewards, old_values, F.response_ends(lay.action_mask, start))
        advantages, returns = F.get_advantages_and_returns(values, rewards, start)
        kl = ((old - ref)[:, start:] * mask).sum(1).mean().item()
        for epoch in range(epochs):
            actor.train(), critic.train()
            new = lay.log_probs(actor)[:, start:]
            micro = [slice(0, 2), slice(2, 4)]
            actor_losses = [F.actor_loss_fn(new[m], old[m, start:], advantages[m], mask[m]) if mask[m].any()
                            else (new[m] * 0).sum() for m in micro]     # no answer token: 0
            actor_opt.zero_grad()
            if ptx is None:
                (sum(actor_losses) / 2).backward()
            else:             # DeepSpeed-Chat: backward(actor loss), backward(unsup_coef x LM loss), per micro-batch
                rows = torch.tensor(ptx[rollout])
                ptx_losses = [actor(input_ids=rows[m], labels=rows[m]).loss for m in micro]
                ((sum(actor_losses) + PTX_COEF * sum(ptx_losses)) / 4).backward()
            actor_opt.step()
            new_values = lay.values(critic)[:, start:]
            critic_losses = [F.critic_loss_fn(new_values[m], values[m, start:], returns[m], mask[m])
                             if mask[m].any() else (new_values[m] * 0).sum() for m in micro]
            critic_opt.zero_grad()
            (sum(critic_losses) / 2).backward()
            critic_opt.step()
            ratio = torch.exp((new.detach() - old[:, start:]) * mask)
            clipped = (-advantages * ratio.clamp(0.8, 1.2) > -advantages * ratio).float()
            logged.append({**({} if ptx is None else {"loss/ptx_avg": sum(l.item() for l in ptx_losses) / 2}),
                           "loss/policy_avg": sum(l.item() for l in actor_losses) / 2,
                           "loss/value_avg": sum(l.item() for l in critic_losses) / 2,
                           "objective/scores": scores.mean().item(), "objective/kl": kl,
                           # TRL's: the KL penalty alone (negative when the actor moved), and score + penalty
                           "objective/non_score_reward": -F.KL_CTL * kl,
                           "objective/rlhf_reward": scores.mean().item() - F.KL_CTL * kl,
                           "policy/clipfrac_avg": ((clipped * mask).sum() / mask.sum().clamp(min=1)).item()})
    return logged, generated, before, (actor.state_dict(), critic.state_dict())


def _hf_grpo(setup, prompts, completions):
    """TRL's GRPO (dapo, beta 0.1, 2 epochs) in plain PyTorch on our sampled completions."""
    from megatron.posttrain import rlhf_loss as F
    from megatron.tokenizer import GPT2BPETokenizer
    from transformers import GPT2LMHeadModel
    tokenizer = GPT2BPETokenizer(os.path.join(setup["webtext"], "vocab.json"),
                                 os.path.join(setup["webtext"], "merges.txt"))
    actor = GPT2LMHeadModel.from_pretrained(str(setup["root"] / "hf_actor")).float()
    reference = GPT2LMHeadModel.from_pretrained(str(setup["root"] / "hf_actor")).float().eval()
    before = {k: v.clone() for k, v in actor.state_dict().items()}
    optimizer = torch.optim.AdamW(actor.parameters(), lr=LR["grpo"], eps=1.0, weight_decay=0.0)
    rows = [p for p in prompts for _ in range(2)]
    lay = Layout(rows, completions)
    rewards = torch.tensor(vowel_reward([tokenizer.detokenize([t for t in c if t != 0]) for c in completions]))
    advantages = F.group_advantages(rewards, 2)
    start, mask = lay.start, lay.completion_mask
    with torch.no_grad():
        ref = lay.log_probs(reference)[:, start:]
        old = lay.log_probs(actor)[:, start:]
    logged = []
    for epoch in range(2):
        new = lay.log_probs(actor)[:, start:]
        micro = [slice(0, 2), slice(2, 4)]
        losses, metrics = [], []
        for m in micro:
            per_token, ratio, kl = F.grpo_per_token_loss(new[m], old[m], advantages[m], beta=0.1, ref_logps=ref[m])
            losses.append(F.grpo_loss(per_token, mask[m], "dapo", num_items_in_batch=mask.sum(), micro_batches=2))
            metrics.append(F.grpo_metrics(ratio.detach(), advantages[m], mask[m], per_token_kl=kl.detach()))
        optimizer.zero_grad()
        (sum(losses) / 2).backward()
        optimizer.step()
        record = {"loss": sum(l.item() for l in losses) / 2, "reward": rewards.mean().item()}
        for key in metrics[0]:
            record[key] = (sum(m[key][0] for m in metrics) / sum(m[key][1] for m in metrics)).item()
        logged.append(record)
    return logged, rewards.tolist(), before, actor.state_dict()


@pytest.fixture(scope="module")
def hf_ppo(setup):
    return _hf_ppo(setup, _prompts(setup, 8))


def _close(ours, theirs, what, tolerance=TOLERANCE):
    assert abs(ours - theirs) <= tolerance * max(1.0, abs(theirs)), (what, ours, theirs)


def _weights_change_equal(saved, before, after, what, skip=()):
    """The largest difference of the two weight changes relative to the reference's largest change, per tensor,
    at most 1e-4 unless within one fp32 ulp of the weights (rounding: a LayerNorm weight near 1 that moved 5e-4 is
    resolved to 1.2e-4 of its change)."""
    worst = 0.0
    for key, tensor in saved.items():
        if key in skip:
            continue
        step_hf, step_ours = after[key] - before[key], tensor - before[key]
        if step_hf.abs().max() == 0:
            assert step_ours.abs().max() < 1e-7, (what, key)
            continue
        difference = (step_ours - step_hf).abs().max()
        relative = (difference / step_hf.abs().max()).item()
        worst = max(worst, relative)
        assert relative <= 1e-4 or difference <= torch.finfo(torch.float32).eps * after[key].abs().max(), \
            f"{what}: {key}'s change differs from the reference's by {relative:.2e} (relative)"
    return worst


# ---------------------------------------------------------------------------------------------------- tests

def test_ppo_experience_equals_hf_generate(setup, one_process, hf_ppo):
    _, generated, _, _ = hf_ppo
    ours = one_process["ppo-mp1"]
    prompts = _prompts(setup, 8)
    assert ours["first_rollout"]["prompts"] == prompts[:4] and ours["last_rollout"]["prompts"] == prompts[4:]
    assert ours["first_rollout"]["completions"] == generated[0], (ours["first_rollout"]["completions"], generated[0])
    assert ours["last_rollout"]["completions"] == generated[1]
    assert len({len(c) for c in generated[0] + generated[1]}) > 1      # completions of unequal lengths


@pytest.mark.parametrize("name", ["ppo-mp1", "ppo-mp2", "ppo-zero3-dp2"])
def test_ppo_steps_equal_plain_pytorch(setup, request, hf_ppo, name):
    logged, generated, before, after = hf_ppo
    results = request.getfixturevalue("one_process" if name == "ppo-mp1" else "two_processes")
    if name == "ppo-zero3-dp2":     # rank r generated for prompts 2r, 2r + 1 of each rollout
        for rollout, key in enumerate(("first_rollout", "last_rollout")):
            ranks = [results[rank][name][key]["completions"] for rank in (0, 1)]
            assert ranks[0] + ranks[1] == generated[rollout], name
    ours = (results if name == "ppo-mp1" else results[0])[name]["losses"]
    assert len(ours) == 4
    tolerance = MP2_TOLERANCE if name == "ppo-mp2" else TOLERANCE
    for step, (mine, theirs) in enumerate(zip(ours, logged)):
        for key, value in theirs.items():
            _close(mine[key], value, (step, key), tolerance)
    assert logged[2]["objective/kl"] != 0 and logged[0]["objective/kl"] == 0          # the second rollout's KL
    kl = ours[2]["objective/kl"]        # DeepSpeed-Chat's kl_ctl 0.1, a penalty: -0.1 KL (the KL's sign is the data's)
    assert ours[2]["objective/non_score_reward"] == pytest.approx(-0.1 * kl, rel=1e-5) and kl != 0
    assert logged[1]["policy/clipfrac_avg"] > 0                 # clipping active in the second epoch
    actor = _weights_change_equal(_saved_weights_as_hf(str(setup["root"] / name)), before[0], after[0], "actor")
    critic_saved = _saved_weights_as_hf(str(setup["root"] / name / "critic"))
    critic = _weights_change_equal(critic_saved, before[1], after[1], "critic")
    print(f"{name}: {[(r['loss/policy_avg'], r['loss/value_avg']) for r in ours]} vs plain PyTorch "
          f"{[(r['loss/policy_avg'], r['loss/value_avg']) for r in logged]}; weights' change {actor:.1e}, {critic:.1e}")


@pytest.mark.parametrize("name", ["grpo-mp1", "grpo-dp2"])
def test_grpo_steps_equal_plain_pytorch(setup, request, name):
    ours, ranks = _ours(request, name)          # at dp2 rank r answered prompt r twice
    prompts = _prompts(setup, 2)
    rollout = {key: [value for rank in ranks for value in rank["first_rollout"][key]]
               for key in ("prompts", "completions", "scores")}
    assert rollout["prompts"] == [p for p in prompts for _ in range(2)]
    logged, rewards, before, after = _hf_grpo(setup, prompts, rollout["completions"])
    assert rollout["scores"] == pytest.approx(rewards, abs=1e-7) and len(set(rewards)) > 1
    for step, (mine, theirs) in enumerate(zip(ours["losses"], logged)):
        for key, value in theirs.items():
            _close(mine[key], value, (step, key))
    assert logged[1]["kl"] > 0 and logged[1]["clip_ratio/region_mean"] > 0
    worst = _weights_change_equal(_saved_weights_as_hf(str(setup["root"] / name)), before, after, "grpo")
    print(f"{name}: {ours['losses']} vs {logged}; weights' change {worst:.1e}")


def test_training_after_generation_is_bitwise_training_without_it(one_process):
    straight, replayed = one_process["dropout"], one_process["dropout-replayed"]
    assert straight["first_rollout"]["completions"] != straight["last_rollout"]["completions"]
    assert straight["losses"] == replayed["losses"], (straight["losses"], replayed["losses"])


@pytest.fixture(scope="module")
def hf_ptx(setup, one_process):
    rows = [sum(micro_batches, []) for micro_batches in one_process["ptx-ema-mp1"]["ptx"]]   # per rollout: 4 rows
    return _hf_ppo(setup, _prompts(setup, 4 * PTX_ROLLOUTS), rollouts=PTX_ROLLOUTS, epochs=1, ptx=rows)


def _ours(request, name):
    """(this run's result on rank 0, [each rank's result])."""
    if name.endswith("mp1"):
        result = request.getfixturevalue("one_process")[name]
        return result, [result]
    results = request.getfixturevalue("two_processes")
    return results[0][name], [results[0][name], results[1][name]]


@pytest.mark.parametrize("name", ["ptx-ema-mp1", "ptx-ema-zero3-dp2"])
def test_ppo_ptx_steps_equal_plain_pytorch(setup, request, hf_ptx, name):
    from megatron.posttrain import rlhf
    logged, generated, before, after = hf_ptx
    ours, ranks = _ours(request, name)
    dataset = rlhf.ptx_dataset([os.path.join(setup["webtext"], "webtext_text_document")], PTX_ROLLOUTS * 4,
                               PROMPT + COMPLETION, 5, str(setup["root"] / "ptx_cache"))
    for rollout in range(PTX_ROLLOUTS):    # the pretraining samples in order; rank r's micro-batch: the r-th pair
        rows = [row for rank in ranks for micro_batch in rank["ptx"][rollout] for row in micro_batch]
        assert rows == [dataset[i]["text"].tolist() for i in range(4 * rollout, 4 * rollout + 4)], (name, rollout)
        assert len(rows[0]) == PROMPT + COMPLETION
    assert len(ours["losses"]) == PTX_ROLLOUTS
    for step, (mine, theirs) in enumerate(zip(ours["losses"], logged)):
        for key, value in theirs.items():
            _close(mine[key], value, (name, step, key))
    assert ours["last_rollout"]["completions"] == generated[-1][:len(ours["last_rollout"]["completions"])]
    actor = _weights_change_equal(_saved_weights_as_hf(str(setup["root"] / name)), before[0], after[0], "actor")
    critic = _weights_change_equal(_saved_weights_as_hf(str(setup["root"] / name / "critic")), before[1], after[1],
                                   "critic")
    print(f"{name}: loss/ptx_avg {[r['loss/ptx_avg'] for r in ours['losses']]} vs plain PyTorch "
          f"{[r['loss/ptx_avg'] for r in logged]}; weights' change {actor:.1e}, {critic:.1e}")


@pytest.mark.parametrize("name", list(EMA_STEPS))
def test_ema_actor_is_the_moving_average_of_the_saved_actors(setup, request, name):
    """Every parameter's EMA, with LoRA (GRPO) the adapters A and B each and the frozen base (which stays)."""
    from megatron.checkpoint.full_checkpoint import read_full_checkpoint
    from megatron.checkpoint.layout import iteration_dir_name
    _ours(request, name)
    start = read_full_checkpoint(setup["actor"])
    ema = None
    for iteration in range(1, EMA_STEPS[name] + 1):
        actor = read_full_checkpoint(str(setup["root"] / name), iteration_dir_name(iteration)).weights()
        if ema is None:       # the starting weights; LoRA's: B = 0, A the actor's draw (unmoved by a step at B = 0)
            ema = {key: value.double() for key, value in start.weights().items()}
            ema.update({key: value.double() * key.endswith("lora_A") for key, value in actor.items()
                        if key not in ema})
            first = dict(ema)
        saved = read_full_checkpoint(str(setup["root"] / name / "ema"), iteration_dir_name(iteration))
        assert saved.model_config == start.model_config and sorted(saved.names()) == sorted(actor)
        ema = {key: EMA_BETA * value + (1 - EMA_BETA) * actor[key].double() for key, value in ema.items()}
        weights = saved.weights()
        worst = max(float(((weights[key].double() - value).abs() / value.abs().clamp(min=1e-3)).max())
                    for key, value in ema.items())
        assert worst <= 4 * torch.finfo(torch.float32).eps, (name, iteration, worst)    # fp32 rounding of lerp
        apart = max(float((actor[key].double() - value).abs().max()) for key, value in ema.items())
        assert apart > 1e-4, (name, iteration, apart)    # the EMA is not the actor
    moved = max(float((ema[key] - first[key]).abs().max()) for key in ema)
    assert moved > 1e-5, moved                           # nor the starting weights
    print(f"{name}: the saved EMA actor within {worst:.1e} (relative) of the hand-computed one (moved {moved:.1e} "
          f"from the start, {apart:.1e} from the actor)")


@pytest.mark.parametrize("fixture, runs", [
    ("one_process", ("dropout", "resume-first", "resume-second", "resumed")),
    ("two_processes", ("ptx-ema-zero3-dp2", "zero3-resume-first", "zero3-resume-second", "zero3-resumed"))])
def test_resume_is_exact(setup, request, fixture, runs):
    """(straight run, its first part, the resumed rest, the directory both parts saved in)."""
    from megatron.checkpoint.full_checkpoint import read_full_checkpoint
    results = request.getfixturevalue(fixture)
    results = results if fixture == "one_process" else results[0]
    straight, first, second = (results[name] for name in runs[:3])
    done = len(first["losses"])
    assert len(second["losses"]) == 1 and straight["losses"] == first["losses"] + second["losses"], \
        (straight["losses"], first["losses"], second["losses"])
    assert "loss/ptx_avg" in straight["losses"][done] and straight["ptx"][done] == second["ptx"][0]
    for sub in ("", "critic", "ema"):
        ours, theirs = (read_full_checkpoint(str(setup["root"] / run / sub)).weights() for run in (runs[0], runs[3]))
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[key], theirs[key]) for key in ours), sub or "actor"


def test_bad_flags_are_one_line(setup, capsys):
    import train_rlhf
    base = _model_flags(setup["webtext"]) + ["--data-path", setup["prefix"], "--load", setup["actor"]]
    cases = [(["--reward-fn", "m:f"], "--algorithm ppo trains a critic: pass --critic-load"),
             (["--critic-load", setup["reward"]], "give one scorer"),
             (["--algorithm", "grpo", "--reward-fn", "m:f", "--num-generations", "1"], "must be >= 2"),
             (["--algorithm", "grpo", "--reward-fn", "m:f", "--pipeline-model-parallel-size", "2"],
              "drop --pipeline-model-parallel-size"),
             (["--algorithm", "grpo", "--reward-fn", "m:f", "--ppo-epochs", "2", "--train-iters", "3"],
              "multiples of --ppo-epochs"),
             (["--algorithm", "grpo", "--reward-fn", "m:f", "--max-completion-length", "60"],
              "must fit --max-position-embeddings"),
             (["--algorithm", "grpo", "--reward-fn", "m:f", "--enable-ema", "--save", "s",
               "--pipeline-model-parallel-size", "2"], "drop --pipeline-model-parallel-size"),
             (["--algorithm", "grpo", "--reward-fn", "m:f", "--enable-ema"], "--enable-ema saves the EMA actor"),
             (["--algorithm", "grpo", "--reward-fn", "m:f", "--ema-save", "e"], "add --enable-ema"),
             (["--algorithm", "grpo", "--reward-fn", "m:f", "--unsup-coef", "2"],
              "--unsup-coef weighs the PTX loss of --unsupervised-data-path"),
             (["--algorithm", "grpo", "--reward-fn", "m:f", "--unsupervised-data-path", "p"],
              "is DeepSpeed-Chat's PPO-ptx: use it with --algorithm ppo"),
             (["--reward-fn", "m:f", "--critic-load", setup["reward"], "--unsupervised-data-path"],
              "--unsupervised-data-path takes a PREFIX")]
    for flags, message in cases:
        with pytest.raises(SystemExit) as stop:
            train_rlhf.starting_point(base + ["--train-iters", "2"] + flags)
        error = capsys.readouterr().err
        assert stop.value.code == 2 and len(error.strip().splitlines()) == 1 and message in error, error


def noisy_vowel_reward(completions, **kwargs):
    """vowel_reward, after drawing from every generator training draws from (python, numpy, torch, mpu's tracker)."""
    import random
    import numpy as np
    import mpu
    random.random(), np.random.rand(), torch.rand(3)
    with mpu.get_cuda_rng_tracker().fork():
        torch.rand(3)
    return vowel_reward(completions)


def _next_draws():
    """What training would draw next from each generator (dropout: torch's, or the tracker's under mp)."""
    import random
    import numpy as np
    import mpu
    with mpu.get_cuda_rng_tracker().fork():
        tracker = torch.rand(4).tolist()
    return random.random(), float(np.random.rand()), torch.rand(4).tolist(), tracker


def _score_between_seeds():
    """(next draws after seeding, the scores, next draws after seeding and scoring with noisy_vowel_reward)."""
    import random
    import types
    import numpy as np
    import mpu
    from megatron.posttrain import rlhf

    def seed():
        random.seed(7), np.random.seed(7), torch.manual_seed(7)
        mpu.model_parallel_cuda_manual_seed(7)
    tokenizer = types.SimpleNamespace(eod=0, detokenize=lambda ids: "".join("abcde"[i % 5] for i in ids))
    seed()
    expected = _next_draws()
    seed()
    scores = rlhf.score_completions(rlhf.Roles(actor=None, reward_fn=noisy_vowel_reward), [[1, 2], [3]],
                                    [[4, 1, 0], [0, 2, 3, 5]], tokenizer)
    return expected, scores.tolist(), _next_draws()


def test_a_reward_fn_that_draws_leaves_trainings_random_streams_alone():
    """--reward-fn's call is wrapped in preserved_rng_state: after scoring with a function that draws, every
    generator gives what it gives with no scoring at all (so training after it is bitwise training without it)."""
    expected, scores, after = run_distributed(_score_between_seeds, 1, model_parallel_size=1)[0]
    assert scores == pytest.approx(vowel_reward(["eb", "cda"]))      # the function ran, end-of-text dropped
    assert after == expected

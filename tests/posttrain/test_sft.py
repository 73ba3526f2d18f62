"""Supervised fine-tuning: tools/preprocess_sft_data.py, megatron/posttrain, finetune_gpt.py, generation's
--chat-template.

- data: the deepspeed-chat template's ids and mask for a multi-turn example written out by hand (the default data's
  BPE); bad lines named FILE:LINE and skipped or refused; --seq-length truncation keeps the start.
- loss and step against Hugging Face GPT2LMHeadModel (the same weights, imported with tools/convert_from_hf.py;
  labels -100 off the answers, one batch = our global batch): the logged loss (1e-6) and the weights after one
  AdamW step with eps 1 and lr 1000 (an SGD-like step: the update is 1000 g / (|g| + 1), so it shows the gradient,
  large enough that the weights' fp32 rounding does not hide a difference of 1e-5 of it), at mp1
  with 2 micro-batches, --train-on-prompt (labels everywhere but padding), --pack-sequences, mp2, pp2 and ZeRO-3
  at dp2.
- packing: packed and unpacked rows of the same examples give the same per-token losses; changing one example
  leaves the others' logits unchanged.
- validation at dp2: the printed loss is total loss / total answer tokens over the whole validation split, computed
  here in plain PyTorch on the saved weights; the resumed run equals the straight one bitwise (dropout on).
- the CLI: preprocess, fine-tune from a short pretraining run (validation perplexity printed), generate with
  --chat-template.

Two worker launches (1 process, then 2) run every training; the tools run in subprocesses or in this process.
"""
import json
import math
import os
import random
import sys

import numpy
import pytest
import torch

from megatron.spawn import free_port, run_distributed

from tests.helpers import REPO, set_tracker
from tests import warm_python
sys.path.insert(0, os.path.join(REPO, "tools"))

import convert_from_hf  # noqa: E402
import preprocess_sft_data  # noqa: E402

SEQ = 48
HF_SHAPE = dict(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=8192, activation_function="gelu_new")
SPLIT = "80,20,0"                    # 40 examples: 32 train, 8 valid
SGD_LIKE = ["--train-iters", "1", "--lr", "1000", "--adam-eps", "1", "--weight-decay", "0", "--clip-grad", "0",
            "--lr-decay-style", "constant", "--warmup", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--eval-iters", "0", "--log-interval", "1"]
ONE_PROCESS = {"mp1-2-micro-batches": ["--batch-size", "2", "--global-batch-size", "4"],
               "train-on-prompt": ["--batch-size", "4", "--train-on-prompt"],
               "packed": ["--batch-size", "2", "--global-batch-size", "4", "--pack-sequences",
                          "--checkpoint-activations"]}   # the per-example masks through the recomputation too
TWO_PROCESSES = {"mp2": ["--model-parallel-size", "2", "--batch-size", "2", "--global-batch-size", "4"],
                 "pp2": ["--pipeline-model-parallel-size", "2", "--batch-size", "2", "--global-batch-size", "4"],
                 "zero3-dp2": ["--deepspeed", "--zero-stage", "3"]}    # --deepspeed_config added: micro 2 x dp 2


def _model_flags(webtext):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
            "--max-position-embeddings", "64", "--vocab-file", os.path.join(webtext, "vocab.json"),
            "--merge-file", os.path.join(webtext, "merges.txt"), "--seed", "5"]


def _tokenizer(webtext):
    from megatron.tokenizer import GPT2BPETokenizer
    return GPT2BPETokenizer(os.path.join(webtext, "vocab.json"), os.path.join(webtext, "merges.txt"))


def write_examples(path, count=40, seed=0):
    """Prompt/response and multi-turn lines with answers of varied lengths (so batches differ in answer tokens)."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    with open(path, "w") as handle:
        for i in range(count):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            tail = " ".join(rng.choice(words) for _ in range(rng.randint(0, 9)))
            if i % 3 == 0:
                record = {"messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": f"Add {a} and {b}."},
                                       {"role": "assistant", "content": f"{a + b}."},
                                       {"role": "user", "content": "Say " + tail},
                                       {"role": "assistant", "content": tail or "nothing"}]}
            else:
                record = {"prompt": f"What is {a} plus {b}?", "response": f"It is {a + b}. {tail}".strip()}
            handle.write(json.dumps(record) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------- workers

def _run_jobs(jobs):
    """Run (name, kind, payload) jobs in order in this worker; model-parallel groups are rebuilt for each."""
    import mpu
    import finetune_gpt
    import pretrain_gpt
    results = {}
    for name, kind, payload in jobs:
        if kind == "finetune":
            history = finetune_gpt.main(payload)
            results[name] = {key: history.get(key) for key in ("lm loss", "iteration", "final_valid")}
        elif kind == "pretrain":
            pretrain_gpt.main(payload)
        elif kind == "generate":
            import generate_samples_gpt
            generate_samples_gpt.main(payload)
        else:
            results[name] = payload()
        mpu.destroy_model_parallel()
    return results


def _tracker_to_2(save_dir):
    import torch.distributed as dist
    if dist.get_rank() == 0:
        set_tracker(save_dir, 2)
    dist.barrier()


PACK_VOCAB = 64


def _examples(seed):
    generator = torch.Generator().manual_seed(seed)
    lengths, answers = (7, 5, 9), (3, 2, 4)
    examples = []
    for length, answer in zip(lengths, answers):
        ids = torch.randint(1, PACK_VOCAB, (length,), generator=generator).tolist()
        examples.append((ids, [0] * (length - answer) + [1] * answer))
    return examples


def _packing_check():
    """Per-token losses of each example alone, in a padded batch, and packed into one row; logits of the packed row
    when example 1 changes."""
    import mpu
    from megatron.posttrain import assemble_row, model_inputs
    from tests.model.test_gpt2_model import build_model
    mpu.initialize_model_parallel(1)
    model = build_model(vocab_size=PACK_VOCAB, max_sequence_length=32).eval()

    def run(rows, pack, logits=False):
        batch = {key: torch.from_numpy(value).unsqueeze(0) if value.ndim == 1 else torch.from_numpy(value)
                 for key, value in rows.items()}
        tokens, labels, loss_mask, attention_mask, position_ids = model_inputs(batch, pack)
        with torch.no_grad():
            return model(tokens, position_ids, attention_mask, labels=None if logits else labels), loss_mask
    examples = _examples(0)
    alone = [run(assemble_row([example], len(example[0]), pad_id=0), pack=False)[0][0] for example in examples]
    rows = [assemble_row([example], 9, pad_id=0) for example in examples]               # padded to the longest
    padded, _ = run({key: numpy.stack([r[key] for r in rows]) for key in rows[0]}, pack=False)
    packed, packed_mask = run(assemble_row(examples, 24, pad_id=0), pack=True)
    changed = list(examples)
    changed[1] = (_examples(1)[1][0], examples[1][1])
    packed_logits = run(assemble_row(examples, 24, pad_id=0), pack=True, logits=True)[0][0]
    changed_logits = run(assemble_row(changed, 24, pad_id=0), pack=True, logits=True)[0][0]
    return {"alone": alone, "padded": padded, "packed": packed[0], "packed_mask": packed_mask[0],
            "packed_logits": packed_logits, "changed_logits": changed_logits}


# ---------------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def setup(tmp_path_factory, webtext_data):
    """The preprocessed examples, a random HF model imported as our checkpoint, a ZeRO-3 config."""
    from transformers import GPT2Config, GPT2LMHeadModel
    root = tmp_path_factory.mktemp("sft")
    jsonl = write_examples(str(root / "examples.jsonl"))
    prefix = str(root / "data" / "qa")
    preprocess_sft_data.main(["--input", jsonl, "--output-prefix", prefix, "--vocab-file",
                              os.path.join(webtext_data, "vocab.json"), "--merge-file",
                              os.path.join(webtext_data, "merges.txt"), "--seq-length", str(SEQ)])
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(**HF_SHAPE, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                    eos_token_id=0))
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.05)   # LayerNorms and biases away from 1 and 0
    hf_dir = str(root / "hf")
    hf.save_pretrained(hf_dir, safe_serialization=True)
    start = str(root / "imported")
    assert convert_from_hf.main(["--hf", hf_dir, "--save", start]) == 0
    zero3 = str(root / "zero3.json")
    with open(zero3, "w") as handle:
        json.dump({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                   "zero_optimization": {"stage": 3}}, handle)     # clipping as SGD_LIKE's --clip-grad 0
    return {"root": root, "jsonl": jsonl, "prefix": prefix, "hf_dir": hf_dir, "start": start, "zero3": zero3,
            "webtext": webtext_data}


def _finetune_args(setup, name, flags):
    return _model_flags(setup["webtext"]) + ["--data-path", setup["prefix"], "--split", SPLIT, "--load",
                                              setup["start"], "--save", str(setup["root"] / name)] + flags


@pytest.fixture(scope="module")
def one_process(setup):
    """HF-comparison steps, packing, the exact resume, a short pretraining run and generation, in one process."""
    jobs = [(name, "finetune", _finetune_args(setup, name, SGD_LIKE + flags)) for name, flags in ONE_PROCESS.items()]
    (setup["root"] / "empty-save").mkdir()     # an existing --save with no checkpoint: not a run to resume
    jobs.append(("empty-save", "finetune", _finetune_args(setup, "empty-save",
                                                          SGD_LIKE + ONE_PROCESS["mp1-2-micro-batches"])))
    jobs.append(("packing", "call", _packing_check))
    resume = _finetune_args(setup, "resume", ["--batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
                                               "--save-interval", "2", "--eval-iters", "0", "--lr", "1e-3"])
    jobs += [("straight", "finetune", resume),
             ("tracker", "call", _bind(_tracker_to_2, str(setup["root"] / "resume"))),
             ("resumed", "finetune", resume)]
    pretrained = str(setup["root"] / "pretrained")
    jobs.append(("pretrain", "pretrain", _model_flags(setup["webtext"]) + [
        "--train-data", "webtext", "--train-iters", "2", "--batch-size", "2", "--eval-iters", "0", "--save",
        pretrained, "--data-cache-path", str(setup["root"] / "cache")]))
    prompts = setup["root"] / "prompts.txt"
    prompts.write_text("What is 2 plus 3?\nAdd 4 and 5.\n")
    samples = str(setup["root"] / "samples.txt")
    jobs.append(("generate", "generate", _model_flags(setup["webtext"]) + [
        "--load", str(setup["root"] / "mp1-2-micro-batches"), "--chat-template", "deepspeed-chat", "--greedy",
        "--sample-input-file", str(prompts), "--sample-output-file", samples, "--out-seq-length", "12"]))
    results = run_distributed(_run_jobs, 1, args=(jobs,), timeout=900)[0]
    return {**results, "pretrained": pretrained, "samples": samples}


@pytest.fixture(scope="module")
def two_processes(setup):
    """mp2, pp2 and ZeRO-3 dp2 steps; a dp2 run with validation over the whole validation split."""
    jobs = []
    for name, flags in TWO_PROCESSES.items():
        extra = ["--deepspeed_config", setup["zero3"]] if name.startswith("zero3") else []
        jobs.append((name, "finetune", _finetune_args(setup, name, SGD_LIKE + flags + extra)))
    jobs.append(("validation", "finetune", _finetune_args(setup, "validation", [
        "--batch-size", "2", "--train-iters", "2", "--lr", "1e-2", "--eval-interval", "1000", "--eval-iters", "2",
        "--hidden-dropout", "0", "--attention-dropout", "0"])))
    results = run_distributed(_run_jobs, 2, args=(jobs,), timeout=900)
    for rank_result in results[1:]:
        for name in results[0]:
            assert rank_result[name]["lm loss"] == results[0][name]["lm loss"], f"{name}: ranks disagree"
    return results[0]


class _bind:
    """A picklable fn(*args) for a 'call' job."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __call__(self):
        return self.fn(*self.args)


# ---------------------------------------------------------------------------------------------------- reference

def _raw_examples(prefix, documents):
    """(ids, mask) of the documents, read from the two files directly, cut to SEQ + 1 tokens."""
    from megatron.data.indexed_dataset import MMapIndexedDataset
    ids = MMapIndexedDataset(prefix + "_input_ids_document")
    mask = MMapIndexedDataset(prefix + "_loss_mask_document")
    return [(torch.from_numpy(ids[d][:SEQ + 1].astype("int64")), torch.from_numpy(mask[d][:SEQ + 1].astype("int64")))
            for d in documents]


def _first_batch_documents(setup, pack, global_batch=4):
    from megatron.posttrain import build_sft_datasets
    train = build_sft_datasets(setup["prefix"], SPLIT, [global_batch, 0, 0], SEQ, 5, 0, pack=pack)[0]
    return [d for sample in train.samples[:global_batch] for d in sample]


def _hf_batch(examples, train_on_prompt):
    length = max(len(ids) for ids, _ in examples)
    input_ids = torch.zeros(len(examples), length, dtype=torch.long)
    attention = torch.zeros(len(examples), length, dtype=torch.long)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)
    for row, (ids, mask) in enumerate(examples):
        input_ids[row, :len(ids)] = ids
        attention[row, :len(ids)] = 1
        labels[row, :len(ids)] = ids if train_on_prompt else torch.where(mask.bool(), ids, -100)
    return input_ids, attention, labels


def _hf_step(setup, examples, train_on_prompt):
    """(HF loss with labels -100, HF weights before, after one torch AdamW step with lr 1000, eps 1). The model of
    setup["hf_dir"]: GPT2LMHeadModel, or LlamaForCausalLM (test_llama_posttrain.py)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(setup["hf_dir"]).float()
    before = {name: tensor.clone() for name, tensor in hf.state_dict().items()}
    input_ids, attention, labels = _hf_batch(examples, train_on_prompt)
    loss = hf(input_ids=input_ids, attention_mask=attention, labels=labels).loss
    loss.backward()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1000.0, eps=1.0, weight_decay=0.0)
    optimizer.step()
    return loss.item(), before, hf.state_dict()


def _saved_weights_as_hf(save_dir):
    from megatron.checkpoint.full_checkpoint import read_full_checkpoint
    from megatron.model.hf_interchange import is_llama_config, to_hf_llama_state_dict, to_hf_state_dict
    checkpoint = read_full_checkpoint(save_dir)
    convert = to_hf_llama_state_dict if is_llama_config(checkpoint.model_config) else to_hf_state_dict
    return convert(checkpoint.fp32_weights(), checkpoint.model_config)


# ---------------------------------------------------------------------------------------------------- data tests

def _pieces(tokenizer, *pieces):
    """The ids and mask of hand-written template pieces: (text, mask) pairs, each tokenized alone (the documented
    rule), "<eod>" for the end-of-text id. The ids depend on the default data's BPE (built from what is installed),
    so expected ids are spelled as strings, never as numbers."""
    ids, mask = [], []
    for text, bit in pieces:
        piece = [tokenizer.eod] if text == "<eod>" else tokenizer.tokenize(text)
        ids += piece
        mask += [bit] * len(piece)
    return ids, mask


def test_multi_turn_ids_and_mask_equal_the_hand_built_ones(webtext_data):
    from megatron.posttrain import TEMPLATES, encode_example, parse_example
    tokenizer = _tokenizer(webtext_data)
    messages = parse_example({"messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Hi"},
                                           {"role": "assistant", "content": "Hello!"},
                                           {"role": "user", "content": "Bye"},
                                           {"role": "assistant", "content": "Bye."}]})
    ids, mask = encode_example(messages, tokenizer, TEMPLATES["deepspeed-chat"])
    expected = _pieces(tokenizer, (" System: Be brief.", 0), (" Human: Hi", 0), (" Assistant:", 0),
                       (" Hello!", 1), ("<eod>", 1), (" Human: Bye", 0), (" Assistant:", 0), (" Bye.", 1),
                       ("<eod>", 1))
    assert (ids, mask) == expected
    assert sum(mask) == len(tokenizer.tokenize(" Hello!")) + len(tokenizer.tokenize(" Bye.")) + 2
    assert tokenizer.detokenize(ids) == (" System: Be brief. Human: Hi Assistant: Hello!<|endoftext|>"
                                         " Human: Bye Assistant: Bye.<|endoftext|>")


def test_prompt_response_and_generation_prompt(webtext_data):
    from megatron.posttrain import TEMPLATES, encode_example, encode_prompt, parse_example
    tokenizer, template = _tokenizer(webtext_data), TEMPLATES["deepspeed-chat"]
    ids, mask = encode_example(parse_example({"prompt": "What is 2 plus 3?", "response": "5."}), tokenizer, template)
    prompt_ids, _ = _pieces(tokenizer, (" Human: What is 2 plus 3?", 0), (" Assistant:", 0))
    assert (ids, mask) == _pieces(tokenizer, (" Human: What is 2 plus 3?", 0), (" Assistant:", 0), (" 5.", 1),
                                  ("<eod>", 1))
    prompt = encode_prompt([{"role": "user", "content": "What is 2 plus 3?"}], tokenizer, template)
    assert prompt == prompt_ids == ids[:len(prompt_ids)]                 # what generation feeds: ends "Assistant:"
    import generate_samples_gpt
    assert generate_samples_gpt.Codec(tokenizer, "deepspeed-chat").encode("What is 2 plus 3?") == prompt
    hh = encode_example(parse_example({"prompt": "Hi", "response": "5."}), tokenizer, TEMPLATES["hh"])
    assert hh == _pieces(tokenizer, ("\n\nHuman: Hi", 0), ("\n\nAssistant:", 0), (" 5.", 1), ("<eod>", 1))


def _write_lines(tmp_path, lines):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _preprocess_argv(tmp_path, webtext_data, path, *flags):
    return ["--input", path, "--output-prefix", str(tmp_path / "out"), "--vocab-file",
            os.path.join(webtext_data, "vocab.json"), "--merge-file", os.path.join(webtext_data, "merges.txt"), *flags]


def _preprocess(tmp_path, webtext_data, lines, *flags):
    """(stats, or the SystemExit's code: the error line or the exit status) of the tool's main in this process."""
    path = _write_lines(tmp_path, lines)
    try:
        return preprocess_sft_data.main(_preprocess_argv(tmp_path, webtext_data, path, *flags)), path
    except SystemExit as stop:
        return stop.code, path


BAD_LINES = ['{"prompt": "Hi", "response": "Hello."}',
             '',
             '{"prompt": "Hi"}',
             'not json',
             '{"messages": [{"role": "user", "content": "Hi"}]}',
             '{"messages": [{"role": "robot", "content": "Hi"}, {"role": "assistant", "content": "x"}]}',
             '{"prompt": "Hi", "response": "Hello again."}']


def test_bad_lines_are_named_and_refused_or_skipped(tmp_path, webtext_data, capsys):
    path = _write_lines(tmp_path, BAD_LINES)
    refused = warm_python.run([sys.executable, os.path.join(REPO, "tools", "preprocess_sft_data.py")] +
                              _preprocess_argv(tmp_path, webtext_data, path), capture_output=True, text=True,
                              timeout=120)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines() == [
        f"error: {path}:3: missing key 'response' (a prompt/response example needs both) (--on-error skip skips "
        "such lines)"]
    assert not os.path.exists(str(tmp_path / "out_input_ids_document.bin"))
    stats, _ = _preprocess(tmp_path, webtext_data, BAD_LINES, "--on-error", "skip", "--workers", "2")
    named = [line for line in capsys.readouterr().err.splitlines() if line.startswith("skipped ")]
    assert [line.split(": ")[0] for line in named] == [f"skipped {path}:{n}" for n in (3, 4, 5, 6)]
    assert "role 'robot'" in named[3] and "must end with an assistant answer" in named[2]
    assert stats["bad"] == 4 and stats["examples"] == 2 and "skipped 4 bad lines" in stats["summary"]
    from megatron.posttrain import open_sft_files
    ids, mask = open_sft_files(str(tmp_path / "out"))
    assert len(ids) == 2 and list(ids.sizes) == [len(x) for x in mask]


def test_long_examples_truncated_from_the_start_or_refused(tmp_path, webtext_data, capsys):
    from megatron.posttrain import open_sft_files
    tokenizer = _tokenizer(webtext_data)
    lines = ['{"prompt": "What is 2 plus 3?", "response": "5."}', '{"prompt": "Hi", "response": "Hello!"}']
    first = _pieces(tokenizer, (" Human: What is 2 plus 3?", 0), (" Assistant:", 0), (" 5.", 1), ("<eod>", 1))
    second = _pieces(tokenizer, (" Human: Hi", 0), (" Assistant:", 0), (" Hello!", 1), ("<eod>", 1))
    prompt_1, prompt_2 = first[1].count(0), second[1].count(0)
    assert prompt_1 >= len(second[0]) - 1 > prompt_2       # the sizes the cases below rely on

    # --seq-length = the first prompt's length: its start and one answer token are kept (seq_length + 1 tokens)
    keep = prompt_1 + 1
    kept, _ = _preprocess(tmp_path, webtext_data, lines, "--seq-length", str(prompt_1))
    cut = 1 + (len(second[0]) > keep)
    assert f"cut {cut} examples to --seq-length {prompt_1} + 1 tokens" in kept["summary"] and not kept["dropped"]
    ids, mask = open_sft_files(str(tmp_path / "out"))
    assert list(ids[0]) == first[0][:keep] and list(mask[0]) == [0] * prompt_1 + [1]
    assert list(ids[1]) == second[0][:keep] and list(mask[1]) == second[1][:keep]

    # one token fewer than the second example: the first is left without an answer token and dropped
    short = len(second[0]) - 1
    dropped, _ = _preprocess(tmp_path, webtext_data, lines, "--seq-length", str(short - 1))
    assert (f"cut 2 examples to --seq-length {short - 1} + 1 tokens; dropped 1 of them left without an answer "
            "token") in dropped["summary"]
    ids, mask = open_sft_files(str(tmp_path / "out"))
    assert len(ids) == 1 and list(ids[0]) == second[0][:short] and list(mask[0]) == second[1][:short]

    refused, path = _preprocess(tmp_path, webtext_data, lines, "--seq-length", str(prompt_1), "--on-long", "refuse")
    assert refused == (f"error: {path}:1: the example has {len(first[0])} tokens, more than --seq-length "
                       f"{prompt_1} + 1: raise --seq-length, or pass --on-long truncate to keep its start")
    capsys.readouterr()
    assert _preprocess(tmp_path, webtext_data, lines, "--seq-length", "0")[0] == 2


def test_packing_is_next_fit_and_rows_hold_every_example_once(setup):
    from megatron.posttrain import assemble_row, build_sft_datasets, pack_examples
    assert pack_examples([3, 4, 2, 5], 7) == [[0, 1], [2, 3]]
    assert pack_examples([3, 4, 1], 7) == [[0, 1], [2]]                 # exactly full: the next starts a row
    assert pack_examples([9, 2, 2], 7) == [[0], [1, 2]]                 # longer than a row: alone (cut there)
    row = assemble_row([([5, 6, 7], [0, 1, 1]), ([8, 9], [0, 1])], 7, pad_id=0)
    assert row["text"].tolist() == [5, 6, 7, 8, 9, 0, 0] and row["segments"].tolist() == [1, 1, 1, 2, 2, 0, 0]
    assert row["loss_mask"].tolist() == [0, 1, 1, 0, 1, 0, 0]
    on_prompt = assemble_row([([5, 6, 7], [0, 0, 1]), ([8, 9], [0, 0])], 6, pad_id=0, train_on_prompt=True)
    assert on_prompt["loss_mask"].tolist() == [0, 1, 1, 0, 1, 0]
    train, valid, test = build_sft_datasets(setup["prefix"], SPLIT, [40, 8, 0], SEQ, 5, 0, pack=True)
    assert test is None and [d for s in valid.samples for d in s] == list(range(32, 40))   # in order, one pass
    first_epoch, rows = [], 0
    while len(first_epoch) < 32:
        first_epoch += train.samples[rows]
        rows += 1
    assert sorted(first_epoch) == list(range(32))                       # every train example once per epoch
    for index in range(rows):
        row = train[index]
        used = int((row["segments"] > 0).sum())
        assert used == sum(min(int(train.ids.sizes[d]), SEQ + 1) for d in train.samples[index]) <= SEQ + 1
    assert rows < 32 and len(train) >= 40


# ---------------------------------------------------------------------------------------------------- vs HF

def _check_against_hf(setup, result, name, pack=False, train_on_prompt=False):
    examples = _raw_examples(setup["prefix"], _first_batch_documents(setup, pack))
    hf_loss, before, after = _hf_step(setup, examples, train_on_prompt)
    assert abs(result["lm loss"][0] - hf_loss) <= 1e-6 * max(1.0, hf_loss), (result["lm loss"], hf_loss)
    ours = _saved_weights_as_hf(str(setup["root"] / name))
    worst = 0.0
    for key, tensor in ours.items():
        step_hf, step_ours = after[key] - before[key], tensor - before[key]
        assert step_hf.abs().max() > 0, key
        worst = max(worst, ((step_ours - step_hf).abs().max() / step_hf.abs().max()).item())
    print(f"{name}: loss {result['lm loss'][0]:.8f} (HF {hf_loss:.8f}), step vs HF's: {worst:.2e} relative")
    assert worst <= 1e-5, f"{name}: the step differs from HF's by {worst:.2e} (relative, worst tensor)"


@pytest.mark.parametrize("name", list(ONE_PROCESS))
def test_loss_and_step_equal_hf_one_process(setup, one_process, name):
    _check_against_hf(setup, one_process[name], name, pack=name == "packed", train_on_prompt=name == "train-on-prompt")


@pytest.mark.parametrize("name", list(TWO_PROCESSES))
def test_loss_and_step_equal_hf_two_processes(setup, two_processes, name):
    _check_against_hf(setup, two_processes[name], name)


def test_packed_rows_equal_unpacked_and_examples_do_not_see_each_other(one_process):
    result = one_process["packing"]
    starts = [0, 7, 12]
    for number, (alone, start) in enumerate(zip(result["alone"], starts)):
        predicted = alone.numel()                                   # labels of the example: length - 1
        assert (result["packed"][start:start + predicted] - alone).abs().max() <= 1e-6
        assert (result["padded"][number, :predicted] - alone).abs().max() <= 1e-6
    assert result["packed_mask"][[6, 11]].sum() == 0                # the label after each boundary: masked
    unchanged = torch.cat([torch.arange(0, 7), torch.arange(12, 23)])   # example 1 is 7..11
    assert torch.equal(result["packed_logits"][unchanged], result["changed_logits"][unchanged])
    assert (result["packed_logits"][7:12] - result["changed_logits"][7:12]).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------- validation

def test_validation_loss_is_total_loss_over_total_answer_tokens(setup, two_processes):
    """dp 2 x micro 2 = 4 examples a batch, 2 batches = the 8 validation examples once; plain PyTorch here."""
    from transformers import GPT2Config, GPT2LMHeadModel
    hf = GPT2LMHeadModel(GPT2Config(**HF_SHAPE, bos_token_id=0, eos_token_id=0)).eval()
    hf.load_state_dict(_saved_weights_as_hf(str(setup["root"] / "validation")), strict=False)
    total, count = 0.0, 0
    for ids, mask in _raw_examples(setup["prefix"], range(32, 40)):
        with torch.no_grad():
            logits = hf(input_ids=ids.unsqueeze(0)).logits[0, :-1].double()
        losses = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
        total += float((losses * mask[1:]).sum())
        count += int(mask[1:].sum())
    reported = two_processes["validation"]["final_valid"]["lm loss"]
    print(f"validation: reported {reported:.8f}, plain PyTorch {total / count:.8f} over {count} answer tokens")
    assert abs(reported - total / count) <= 1e-5 * total / count, (reported, total / count)
    assert abs(math.exp(reported) / math.exp(total / count) - 1) <= 1e-5


def test_an_empty_save_directory_starts_from_load(one_process):
    """An existing --save without a tracker file is no checkpoint: the run starts from --load's weights, its first
    loss that of the same run whose --save did not exist (the one checked against HF above), not a random start."""
    assert one_process["empty-save"]["iteration"] == [1]
    assert one_process["empty-save"]["lm loss"] == one_process["mp1-2-micro-batches"]["lm loss"]


def test_resumed_fine_tuning_equals_the_straight_run(one_process):
    assert one_process["resumed"]["iteration"] == [3, 4]
    assert one_process["resumed"]["lm loss"] == one_process["straight"]["lm loss"][2:]   # bitwise, dropout on


# ---------------------------------------------------------------------------------------------------- the CLI

def test_cli_preprocess_finetune_from_pretraining_and_generate(setup, one_process, tmp_path):
    prefix = str(tmp_path / "qa")
    done = warm_python.run([sys.executable, os.path.join(REPO, "tools", "preprocess_sft_data.py"), "--input",
                            setup["jsonl"], "--output-prefix", prefix, "--vocab-file",
                            os.path.join(setup["webtext"], "vocab.json"), "--merge-file",
                            os.path.join(setup["webtext"], "merges.txt"), "--seq-length", str(SEQ), "--workers", "2"],
                           capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Done: 40 examples" in done.stderr
    env = dict(os.environ, MASTER_PORT=str(free_port()))
    command = [sys.executable, os.path.join(REPO, "finetune_gpt.py")] + _model_flags(setup["webtext"]) + [
        "--data-path", prefix, "--split", SPLIT, "--load", one_process["pretrained"], "--train-iters", "3",
        "--batch-size", "4", "--eval-iters", "2", "--eval-interval", "1000", "--log-interval", "1"]
    run = warm_python.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    final = [line for line in run.stdout.splitlines() if "validation loss at the end of training" in line]
    assert len(final) == 1, run.stdout[-3000:]
    value = float(final[0].split("lm loss value: ")[1].split(" |")[0])
    ppl = float(final[0].split("lm loss PPL: ")[1])
    assert abs(ppl / math.exp(value) - 1) <= 1e-5, final[0]
    assert "loaded checkpoint from" in run.stdout and "iteration        3/       3" in run.stdout
    with open(one_process["samples"]) as handle:
        samples = handle.read()
    assert samples.count("Context: ") == 2 and "Context: What is 2 plus 3?" in samples


def test_cli_bad_flags_are_one_line(setup, tmp_path, capsys):
    import finetune_gpt
    from megatron.data.corpora import DataPathError
    from megatron.posttrain import open_sft_files
    base = _model_flags(setup["webtext"]) + ["--data-path", setup["prefix"]]
    cases = [([], "fine-tuning starts from a checkpoint: pass --load DIR"),
             (["--load", str(tmp_path)], f"{tmp_path} holds no latest_checkpointed_iteration.txt"),
             (["--load", setup["start"], "--reset-attention-mask"], "--reset-attention-mask is a pretraining flag"),
             (["--load", setup["start"], "--data-path", "a", "b"], "--data-path takes one PREFIX")]
    for flags, message in cases:
        with pytest.raises(SystemExit) as stop:
            finetune_gpt.starting_point(base + flags)
        error = capsys.readouterr().err
        assert stop.value.code == 2 and len(error.strip().splitlines()) == 1 and message in error, error
    assert finetune_gpt.starting_point(base + ["--load", setup["start"]]) == base + ["--load", setup["start"]]
    with pytest.raises(DataPathError, match=f"--data-path {tmp_path}/nothing: missing .*preprocess_sft_data.py"):
        open_sft_files(str(tmp_path / "nothing"))
    from megatron.posttrain import SFTDataError, build_sft_datasets
    with pytest.raises(SFTDataError, match=r"--split 95,5,0: the valid split has 2 rows \(2 of the 40 examples\), "
                                           r"fewer than one global batch \(4\)"):
        build_sft_datasets(setup["prefix"], "95,5,0", [4, 4, 0], SEQ, 5, 0, global_batch_size=4)

"""tasks/ zero-shot evaluation (WIKITEXT103 perplexity with overlapping windows, LAMBADA accuracy, strict and not)
against hand-computed references over Hugging Face GPT2LMHeadModel logits on the same weights, with the default
data's real BPE vocabulary (8192 ids; the model pads it to 8200 rows to exercise the real-vocabulary clamp)."""
import json
import math
import os
import re
import sys

import pytest
import torch

from megatron.spawn import free_port, run_distributed
from tests.model.test_gpt2_model import copy_into_hf

from tests.helpers import FIXTURES, REPO, TINY_SHAPE
from tests import warm_python


WIKI = os.path.join(FIXTURES, "wiki.test.tokens")
LAMBADA = os.path.join(FIXTURES, "lambada_test.jsonl")
VOCAB, PADDED, SEQ = 8192, 8200, 16
CONFIG = dict(num_layers=2, vocab_size=PADDED, hidden_size=32, num_attention_heads=4, max_sequence_length=SEQ,
              init_method_std=0.1, real_vocab_size=VOCAB)


def _tokenizer():
    from megatron.tokenizer.tokenizer import GPT2BPETokenizer
    return GPT2BPETokenizer(os.path.join(REPO, "data", "webtext", "vocab.json"),
                            os.path.join(REPO, "data", "webtext", "merges.txt"))


def _model():
    import mpu
    from megatron.model import GPT2Model, GPT2ModelConfig
    mpu.model_parallel_cuda_manual_seed(1234)
    return GPT2Model(GPT2ModelConfig(**CONFIG), parallel_output=False).eval()


def _hf(model):
    from transformers import GPT2Config, GPT2LMHeadModel
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=PADDED, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                    eos_token_id=0)).eval()
    copy_into_hf(model, hf)

    def log_probs(ids):  # [len(ids), VOCAB], over the real vocabulary only
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0, :, :VOCAB].double(), -1)
    return log_probs


def _lambada_split(text, tokenizer, strict):
    """The rule as documented in tasks/zeroshot_gpt.py, written out again."""
    if strict:
        word = text.split()[-1]
        return tokenizer.tokenize(text[:text.rfind(word)].strip()), tokenizer.tokenize(" " + word)
    ids = tokenizer.tokenize(text)
    return ids[:-1], ids[-1:]


def _rigged_examples(texts, tokenizer, log_probs, count=5):
    """Examples the model gets right, strict or not, whatever the default data's vocabulary: a word-boundary prefix
    of a fixture text whose greedy next token (the HF model's) is a whole word with its leading space, followed by
    that word. (The greedy token after a text's own context is often a piece without a space, which would merge
    with the word before it.)"""
    rigged = []
    for text in texts:
        words = text.split(" ")
        for end in range(len(words) - 1, 2, -1):
            context = " ".join(words[:end])
            greedy = int(log_probs(tokenizer.tokenize(context)[-SEQ:])[-1].argmax())
            piece = tokenizer.detokenize([greedy])
            if re.fullmatch(r" [A-Za-z]+", piece) and tokenizer.tokenize(piece) == [greedy]:
                rigged.append(context + piece)
                break
        if len(rigged) == count:
            break
    assert rigged, "no fixture prefix has a whole-word greedy continuation"
    return rigged


def _evaluate(with_reference):
    from tasks import zeroshot_gpt
    from tasks.detokenizer import wikitext_detokenize
    tokenizer, model = _tokenizer(), _model()
    raw = open(WIKI, encoding="utf-8").read()
    texts = zeroshot_gpt.read_lambada(LAMBADA)
    out = {strict: zeroshot_gpt.evaluate_lambada(model, tokenizer, texts, SEQ, strict, 3, VOCAB)
           for strict in (False, True)}   # the fixture alone (without the rigged examples below)
    if with_reference:
        log_probs = _hf(model)
        texts += _rigged_examples(texts, tokenizer, log_probs)
    for name, overlap in (("overlap", 5), ("disjoint", SEQ)):
        for batch in (1, 4):
            out[name, batch] = zeroshot_gpt.evaluate_wikitext(model, tokenizer, raw, SEQ, overlap, batch, VOCAB)
    for strict in (False, True):
        for batch in (1, 4):
            out["lambada", strict, batch] = zeroshot_gpt.evaluate_lambada(model, tokenizer, texts, SEQ, strict,
                                                                          batch, VOCAB)
    if not with_reference:
        return out
    ids = tokenizer.tokenize(wikitext_detokenize(raw))
    ref = {}
    for name, stride in (("overlap", 5), ("disjoint", SEQ)):
        total, done, start = 0.0, 0, 0   # done: targets (ids[t + 1] given ids[:t + 1]) scored so far
        while done < len(ids) - 1:
            window = ids[start:start + SEQ + 1]
            lp = log_probs(window[:-1])
            for i in range(len(window) - 1):
                if start + i >= done:
                    total -= lp[i, window[i + 1]].item()
            done, start = start + len(window) - 1, start + stride
        ref[name] = total
    for strict in (False, True):
        correct = 0
        for text in texts:
            context, target = _lambada_split(text, tokenizer, strict)
            full = (context + target)[-(SEQ + 1):]
            lp = log_probs(full[:-1])[-len(target):]
            correct += lp.argmax(-1).tolist() == target
        ref["lambada", strict] = correct
    ref["targets"], ref["words"] = len(ids) - 1, len(raw.strip().split(" "))
    ref["n_lambada"] = len(texts)
    return out, ref


@pytest.fixture(scope="module")
def evaluated():
    return run_distributed(_evaluate, 1, args=(True,), model_parallel_size=1)[0]


def test_wikitext_perplexity_matches_huggingface_sliding_windows(evaluated):
    out, ref = evaluated
    for name in ("overlap", "disjoint"):
        result = out[name, 4]
        assert result["tokens"] - 1 == ref["targets"] and result["words"] == ref["words"]
        loss = ref[name] / ref["targets"]
        assert result["avg_loss"] == pytest.approx(loss, rel=1e-5)
        assert result["ppl"] == pytest.approx(math.exp(loss), rel=1e-5)
        assert result["adjusted_ppl"] == pytest.approx(math.exp(ref[name] / (ref["words"] - 1)), rel=1e-5)
    assert out["overlap", 4]["windows"] > out["disjoint", 4]["windows"] > 1
    # Overlap gives each target more context: a different (here random-model) loss than disjoint windows.
    assert out["overlap", 4]["avg_loss"] != pytest.approx(out["disjoint", 4]["avg_loss"], rel=1e-7)


def test_batch_size_does_not_change_results(evaluated):
    out, _ = evaluated
    for name in ("overlap", "disjoint"):
        for key in ("avg_loss", "ppl", "adjusted_ppl"):
            assert out[name, 1][key] == pytest.approx(out[name, 4][key], rel=1e-6)
    for strict in (False, True):
        assert out["lambada", strict, 1] == out["lambada", strict, 4]


def test_lambada_accuracy_matches_huggingface_argmax_strict_and_not(evaluated):
    out, ref = evaluated
    for strict in (False, True):
        result = out["lambada", strict, 4]
        assert result["total"] == ref["n_lambada"]
        assert result["correct"] == ref["lambada", strict]
        assert 0 < result["correct"] < result["total"]  # the rigged examples make the check non-trivial
        assert result["accuracy"] == result["correct"] / result["total"]


def test_detokenizer_rules():
    from tasks.detokenizer import wikitext_detokenize
    assert wikitext_detokenize(" = = History = = \n 1 @,@ 874 and 31 @.@ 5 m , a well @-@ known ( big ) "
                               "keeper 's \" old lady \" . End") == \
        " == History ==\n1,874 and 31.5 m, a well-known (big) keeper's \"old lady\". End"


def test_model_parallel_and_data_parallel_give_the_same_results(evaluated):
    single, ref = evaluated
    rigged = ref["n_lambada"] - single[False]["total"]    # the rigged examples (only the reference run adds them)
    assert rigged > 0
    for world, mp in ((2, 2), (2, 1)):
        out = run_distributed(_evaluate, world, args=(False,), model_parallel_size=mp)[0]
        for name in ("overlap", "disjoint"):
            assert out[name, 4]["avg_loss"] == pytest.approx(single[name, 4]["avg_loss"], rel=1e-5)
        for strict in (False, True):
            assert out[strict] == single[strict]
            assert out["lambada", strict, 4]["total"] == single["lambada", strict, 4]["total"] - rigged


MODEL = TINY_SHAPE


def _pretrain(save_dir, webtext, extra=()):
    import pretrain_gpt
    pretrain_gpt.main(MODEL + ["--data-path", os.path.join(webtext, "webtext_text_document"),
                               "--vocab-file", os.path.join(webtext, "vocab.json"),
                               "--merge-file", os.path.join(webtext, "merges.txt"),
                               "--data-cache-path", os.path.join(save_dir, "cache"),
                               "--batch-size", "2", "--train-iters", "2", "--log-interval", "100",
                               "--eval-iters", "0", "--lr-decay-iters", "100", "--warmup", "0.1", "--save", save_dir,
                               *extra])


def test_cli_on_a_pretrained_checkpoint_at_model_parallel_2(tmp_path, webtext_data):
    save = str(tmp_path / "save")
    run_distributed(_pretrain, 1, args=(save, webtext_data))
    tokenizer = ["--vocab-file", os.path.join(webtext_data, "vocab.json"),
                 "--merge-file", os.path.join(webtext_data, "merges.txt")]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), "tasks/main.py", *MODEL, *tokenizer, "--model-parallel-size", "2",
               "--load", save, "--task", "WIKITEXT103", "--valid-data", WIKI, "--overlapping-eval", "8"]
    result = warm_python.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    line = re.search(r"validation results on WIKITEXT103 \| avg loss: (\S+) \| ppl: (\S+) \| adjusted ppl: (\S+)",
                     result.stdout)
    assert line, result.stdout[-2000:]
    loss, ppl, adjusted = map(float, line.groups())
    assert 0 < loss < 20 and ppl == pytest.approx(math.exp(loss), rel=1e-5) and adjusted > ppl
    # Bad input: a missing file is one line on stderr and exit status 1.
    missing = warm_python.run([sys.executable, "tasks/main.py", *MODEL, *tokenizer, "--load", save, "--task",
                               "LAMBADA", "--valid-data", str(tmp_path / "none.jsonl")], cwd=REPO,
                              env=dict(os.environ, MASTER_PORT=str(free_port())), capture_output=True, text=True,
                              timeout=120)
    assert missing.returncode == 1
    assert missing.stderr.strip() == f"error: --valid-data {tmp_path / 'none.jsonl'} does not exist"


@pytest.fixture(scope="module")
def zero_checkpoint(tmp_path_factory, webtext_data):
    """A ZeRO-path (--deepspeed) training checkpoint of MODEL, and the same weights exported to Hugging Face."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import convert_to_hf
    from tests.helpers import write_config
    root = tmp_path_factory.mktemp("zero_tasks")
    save = str(root / "save")
    run_distributed(_pretrain, 1, args=(save, webtext_data, ["--deepspeed", "--deepspeed_config",
                                                             write_config(str(root)), "--lr", "3e-3"]))
    convert_to_hf.convert(save, str(root / "hf"), os.path.join(webtext_data, "vocab.json"),
                          os.path.join(webtext_data, "merges.txt"))
    return save, str(root / "hf")


def _rigged_lambada(path, hf, tokenizer):
    """The fixture plus, for each of its first 4 texts, its context followed by the HF model's greedy next token
    (so some answers are right); returns the texts."""
    texts = [json.loads(line)["text"] for line in open(LAMBADA, encoding="utf-8") if line.strip()]
    for text in texts[:4]:
        context = text.rsplit(" ", 1)[0]
        with torch.no_grad():
            logits = hf(torch.tensor([tokenizer.tokenize(context)[-SEQ:]])).logits[0, -1, :VOCAB]
        texts.append(context + tokenizer.detokenize([int(logits.argmax())]))
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    return texts


def test_lambada_cli_on_a_zero_checkpoint_matches_huggingface(tmp_path, zero_checkpoint, webtext_data):
    from transformers import GPT2LMHeadModel
    save, hf_dir = zero_checkpoint
    hf, tokenizer = GPT2LMHeadModel.from_pretrained(hf_dir).eval(), _tokenizer()
    data = tmp_path / "lambada.jsonl"
    texts = _rigged_lambada(data, hf, tokenizer)
    flags = ["--vocab-file", os.path.join(webtext_data, "vocab.json"), "--merge-file",
             os.path.join(webtext_data, "merges.txt"), "--load", save, "--task", "LAMBADA", "--valid-data", str(data)]
    result = warm_python.run([sys.executable, "tasks/main.py", *MODEL, *flags, "--strict-lambada"], cwd=REPO,
                             env=dict(os.environ, MASTER_PORT=str(free_port())),
                             capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    line = re.search(r"validation results on LAMBADA \| number correct: (\d+) \| total examples: (\d+) \| "
                     r"avg accuracy: (\S+)", result.stdout)
    assert line, result.stdout[-2000:]
    correct, total, accuracy = int(line.group(1)), int(line.group(2)), float(line.group(3))
    reference = 0
    for text in texts:   # strict: every token of the last word, tokenized alone, is HF's argmax
        context, target = _lambada_split(text, tokenizer, strict=True)
        full = (context + target)[-(SEQ + 1):]
        with torch.no_grad():
            logits = hf(torch.tensor([full[:-1]])).logits[0, -len(target):, :VOCAB]
        reference += logits.argmax(-1).tolist() == target
    assert total == len(texts) and correct == reference and 0 < correct < total
    assert accuracy == pytest.approx(correct / total, rel=1e-6)


def _task_errors(argvs):
    """The one-line message tasks/main.py prints for each bad command line (the error main() raises)."""
    from megatron.checkpoint.layout import CheckpointError
    from tasks import main as tasks_main
    messages = []
    for argv in argvs:
        try:
            tasks_main.main(argv)
            messages.append(None)
        except (CheckpointError, ValueError) as error:
            messages.append(str(error))
    return messages


def test_checkpoint_of_another_shape_is_one_line(zero_checkpoint, webtext_data):
    save, _ = zero_checkpoint
    tokenizer = ["--vocab-file", os.path.join(webtext_data, "vocab.json"),
                 "--merge-file", os.path.join(webtext_data, "merges.txt")]
    wider = [f if f != "32" else "64" for f in MODEL]   # --hidden-size 64
    message, = run_distributed(_task_errors, 1, args=([
        wider + tokenizer + ["--load", save, "--task", "WIKITEXT103", "--valid-data", WIKI,
                             "--overlapping-eval", "8"]],))[0]
    assert message.startswith(save) and \
        message.endswith("was saved by another model shape: hidden_size 32 (checkpoint) != 64 (this run)")

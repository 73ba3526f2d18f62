"""The lm-evaluation-harness model (megatron/text_generation/lm_eval_model.py) on a ZeRO-path training checkpoint
loaded at model-parallel 2, against lm-eval's own Hugging Face model (HFLM) on the same weights exported with
tools/convert_to_hf.py: loglikelihoods (and greedy flags), rolling loglikelihoods, greedy generate_until. Offline:
the requests are built here, no harness task (those fetch data from the hub)."""
import os
import sys

import pytest

from megatron.spawn import run_distributed

os.environ.setdefault("HF_HUB_OFFLINE", "1")   # nothing here may reach the hub
from tests.helpers import REPO, TINY_SHAPE
sys.path.insert(0, os.path.join(REPO, "tools"))
import convert_to_hf  # noqa: E402

WIKI = os.path.join(REPO, "tests", "fixtures", "wiki.test.tokens")
MODEL = TINY_SHAPE + ["--make-vocab-size-divisible-by", "100"]   # 8192 ids padded to 8200 rows: the real-vocabulary clamp matters
LOGLIKELIHOOD = [("The game began", " development in 2010"), ("", "Valkyria Chronicles"),
                 ("It met with positive sales in Japan , and was praised by both Japanese and western critics .",
                  " After release , it received downloadable content"),   # longer than 17 tokens: left-truncated
                 ("The", " the"), ("The", " ,"), ("The", " ."), ("The", " of"), ("In", " the"), ("and", " the")]
GENERATE = [("The game began development in", {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}),
            ("Valkyria", {"until": [" the"], "max_gen_toks": 8}),
            ("It met with positive sales in Japan , and was praised by both", {"max_gen_toks": 5})]


def _rolling_texts():
    lines = [line.strip() for line in open(WIKI, encoding="utf-8") if line.strip()]
    return [lines[0], " ".join(lines[1:4])]   # a short text and one of several windows


def _requests(pairs):
    from lm_eval.api.instance import Instance
    return ([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
            [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(_rolling_texts())],
            [Instance("generate_until", {}, request, i) for i, request in enumerate(GENERATE)])


def _pretrain(args_list):
    import pretrain_gpt
    pretrain_gpt.main(args_list)


def _ours(megatron_args, pairs):
    """Our harness model from the command-line flags; plus our generate() on the same prompts."""
    from lm_eval.api.registry import get_model
    from megatron.text_generation import generate
    from megatron.text_generation import lm_eval_model
    lm = get_model(lm_eval_model.MODEL_NAME).create_from_arg_string(f"megatron_args={megatron_args},batch_size=4")
    assert isinstance(lm, lm_eval_model.MegatronGPT2LM)
    loglikelihood, rolling, until = _requests(pairs)
    direct = []
    for context, kwargs in GENERATE:
        ids = lm.tok_encode(context)[-(lm.max_length - kwargs["max_gen_toks"]):]   # the harness's left truncation
        new = generate(lm.model, [ids], kwargs["max_gen_toks"], greedy=True, eod_id=lm.eot_token_id)
        text = lm.tok_decode(new[0])
        for stop in kwargs.get("until", []) + [lm.tok_decode([lm.eot_token_id])]:
            text = text.split(stop)[0]
        direct.append(text)
    return {"loglikelihood": lm.loglikelihood(loglikelihood), "rolling": lm.loglikelihood_rolling(rolling),
            "generate_until": lm.generate_until(until), "direct": direct, "max_length": lm.max_length}


@pytest.fixture(scope="module")
def results(tmp_path_factory, webtext_data):
    from tests.helpers import write_config
    root = tmp_path_factory.mktemp("lm_eval")
    save, hf_dir = str(root / "save"), str(root / "hf")
    vocab, merges = os.path.join(webtext_data, "vocab.json"), os.path.join(webtext_data, "merges.txt")
    tokenizer = ["--vocab-file", vocab, "--merge-file", merges]
    run_distributed(_pretrain, 1, args=(MODEL + tokenizer + [
        "--data-path", os.path.join(webtext_data, "webtext_text_document"), "--data-cache-path", str(root / "cache"),
        "--batch-size", "2", "--train-iters", "3", "--lr", "3e-3", "--warmup", "0", "--log-interval", "100",
        "--eval-iters", "0", "--save", save, "--deepspeed", "--deepspeed_config", write_config(str(root))],))
    convert_to_hf.convert(save, hf_dir, vocab, merges)
    hf = _hflm(hf_dir)
    pairs = LOGLIKELIHOOD + _greedy_pairs(hf, ["The", "In the", "It was", "and"])
    megatron_args = " ".join(MODEL + tokenizer + ["--load", save, "--model-parallel-size", "2"])
    ours = run_distributed(_ours, 2, args=(megatron_args, pairs))
    return ours, _reference(hf, pairs)


def _hflm(hf_dir):
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer, GPT2LMHeadModel
    return HFLM(pretrained=GPT2LMHeadModel.from_pretrained(hf_dir).eval(),
                tokenizer=AutoTokenizer.from_pretrained(hf_dir), device="cpu", batch_size=1)


def _greedy_pairs(hf, contexts):
    """(context, the HF model's greedy next token as text): requests whose is_greedy is true."""
    import torch
    pairs = []
    for context in contexts:
        with torch.no_grad():
            logits = hf.model(torch.tensor([hf.tok_encode(context)])).logits[0, -1]
        pairs.append((context, hf.tok_decode([int(logits.argmax())])))
    return pairs


def _reference(hf, pairs):
    loglikelihood, rolling, until = _requests(pairs)
    return {"loglikelihood": hf.loglikelihood(loglikelihood), "rolling": hf.loglikelihood_rolling(rolling),
            "generate_until": hf.generate_until(until), "max_length": hf.max_length}


def test_loglikelihoods_equal_lm_evals_huggingface_model(results):
    ours, reference = results
    assert ours[0]["loglikelihood"] == ours[1]["loglikelihood"]   # both model-parallel ranks
    assert ours[0]["max_length"] == reference["max_length"] == 16
    mine, theirs = ours[0]["loglikelihood"], reference["loglikelihood"]
    assert len(mine) == len(theirs) == len(LOGLIKELIHOOD) + 4
    for (log_prob, greedy), (ref_log_prob, ref_greedy) in zip(mine, theirs):
        assert log_prob == pytest.approx(ref_log_prob, abs=1e-4)
        assert greedy == ref_greedy
    assert any(greedy for _, greedy in theirs) and not all(greedy for _, greedy in theirs)


def test_rolling_loglikelihoods_equal_lm_evals_huggingface_model(results):
    ours, reference = results
    assert len(ours[0]["rolling"]) == len(reference["rolling"]) == 2
    # sums over ~100 tokens: 1e-4, or 1e-6 relative (float32 matmuls split over two ranks vs one)
    assert ours[0]["rolling"] == pytest.approx(reference["rolling"], abs=1e-4, rel=1e-6)
    assert ours[0]["rolling"][1] < ours[0]["rolling"][0] < 0   # the longer text spans several windows


def test_greedy_generate_until_equals_our_generate_and_huggingface(results):
    ours, reference = results
    assert ours[0]["generate_until"] == ours[1]["generate_until"] == ours[0]["direct"]
    assert ours[0]["generate_until"] == reference["generate_until"]
    assert any(text for text in ours[0]["generate_until"])   # not vacuous (which ones are empty depends on the data)


def test_missing_megatron_args_is_one_line():
    from megatron.text_generation.lm_eval_model import MegatronGPT2LM
    with pytest.raises(ValueError, match="needs megatron_args"):
        MegatronGPT2LM()


def test_missing_lm_eval_gives_the_install_hint(monkeypatch):
    import importlib
    for name in [n for n in sys.modules if n == "lm_eval" or n.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)   # `import lm_eval` raises ImportError
    monkeypatch.delitem(sys.modules, "megatron.text_generation.lm_eval_model", raising=False)
    with pytest.raises(ImportError, match=r"needs lm-evaluation-harness .*: pip install lm-eval==0\.4\.13"):
        importlib.import_module("megatron.text_generation.lm_eval_model")


@pytest.mark.parametrize("argv,message", [
    (["--bogus-flag"], "python -m megatron.text_generation.lm_eval_model: error: unrecognized arguments: --bogus-flag"),
    (["run", "--tasks"], "python -m megatron.text_generation.lm_eval_model run: error: argument --tasks/-t: expected "
                         "at least one argument")])
def test_a_bad_flag_is_the_one_line_every_entry_point_prints(monkeypatch, capsys, argv, message):
    """`python -m megatron.text_generation.lm_eval_model` with a bad flag (the harness's parser, or its run
    subcommand's): `PROG: error: ... (see --help)`, exit 2, no usage block."""
    from megatron.text_generation import lm_eval_model
    monkeypatch.setattr(sys, "argv", [lm_eval_model.__file__] + argv)
    with pytest.raises(SystemExit) as exit_info:
        lm_eval_model.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"{message} (see --help)\n"

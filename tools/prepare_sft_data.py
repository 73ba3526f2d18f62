"""Build the embedded default fine-tuning data once: chatterbot-corpus question -> answer pairs, under data/sft/.

    python tools/prepare_sft_data.py        # ~5 s; skipped when data/sft/chatterbot.json exists (delete data/sft/)

Source: the English YAML files of the `chatterbot-corpus` package (1.3.3, BSD; chatterbot_corpus/data/english/
*.yml, read with PyYAML, nothing downloaded). Every pair of consecutive turns of a conversation is one example
{"prompt": turn i, "response": turn i + 1}; repeated pairs are kept once. Split by question (its text case-folded,
whitespace collapsed) so no question is in two splits: the distinct questions, in a random.Random(--seed) order,
go to test until it holds --test-percent of the pairs, then to valid likewise, the rest to train. Writes:

  data/sft/{train,valid,test}.jsonl                    the examples of each split, one {"prompt", "response"} a line
  data/sft/chatterbot_{input_ids,loss_mask}_document.{bin,idx}   train, then valid, then test examples, tokenized by
                                                       tools/preprocess_sft_data.py (template deepspeed-chat) with
                                                       the default data's tokenizer (data/webtext/, built if missing)
  data/sft/preference_{train,valid,test}.jsonl         toy preference pairs: chosen = the example's answer,
                                                       rejected = the answer of a question from another topic
                                                       (YAML file) of the same split, --rejected-per-example of
                                                       them per example (random, --seed)
  data/sft/chatterbot_preference_pairs_{input_ids,loss_mask}_document.{bin,idx}
                                                       those pairs tokenized (preprocess_sft_data.py --preference):
                                                       train_reward_model.py's and --objective dpo's default data
  data/sft/chatterbot.json                             the manifest, written last: counts, the --split to pass,
                                                       the seed and the source (under "preference": the pairs')
Then fine-tune with (scripts/finetune_gpt.sh does):
  finetune_gpt.py ... --data-path data/sft/chatterbot --split TRAIN,VALID,TEST (the manifest's "split": exact
  counts, so finetune_gpt.py's document split is exactly these files' split)
"""
import json
import os
import random
import sys
import tempfile
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TOOLS)
sys.path.insert(0, TOOLS)
sys.path.insert(0, REPO_ROOT)
from megatron import cli  # noqa: E402
from megatron.checkpoint.atomic_io import atomic_write_text  # noqa: E402
from megatron.data.gpt_dataset import get_train_valid_test_split_  # noqa: E402
import prepare_default_data  # noqa: E402
import preprocess_sft_data  # noqa: E402

SPLITS = ("train", "valid", "test")
NAME = "chatterbot"
SOURCE = "chatterbot-corpus==1.3.3"
INSTALL_HINT = "pip install chatterbot-corpus==1.3.3 PyYAML (make install does)"
REJECTED_PER_EXAMPLE = 4    # preference pairs per example (each with another rejected answer)


class SourceError(cli.UserError, RuntimeError):
    """The corpus package or PyYAML is missing, or a YAML file is not in the corpus's shape."""


def corpus_dir():
    """The package's chatterbot_corpus/data/english/ directory."""
    try:
        import chatterbot_corpus
    except ImportError:
        raise SourceError(f"the chatterbot-corpus package is not installed: {INSTALL_HINT}") from None
    return os.path.join(os.path.dirname(chatterbot_corpus.__file__), "data", "english")


def read_pairs(directory):
    """([(file name, prompt, response), ...], conversations skipped): consecutive turns of every conversation, files
    in sorted order, exact repeats of a (prompt, response) kept once (the first). A conversation that is not a list
    of turns (1.3.3's trivia.yml has one string, a question and its answer run together) is skipped."""
    try:
        import yaml
    except ImportError:
        raise SourceError(f"PyYAML is not installed: {INSTALL_HINT}") from None
    names = sorted(name for name in os.listdir(directory) if name.endswith(".yml"))
    if not names:
        raise SourceError(f"{directory}: no .yml files: reinstall the corpus ({INSTALL_HINT})")
    pairs, seen, skipped = [], set(), 0
    for name in names:
        with open(os.path.join(directory, name), encoding="utf-8") as handle:
            document = yaml.safe_load(handle)
        conversations = document.get("conversations") if isinstance(document, dict) else None
        if not isinstance(conversations, list):
            raise SourceError(f"{os.path.join(directory, name)}: no 'conversations' list")
        for turns in conversations:
            if not isinstance(turns, list):
                skipped += 1
                continue
            turns = [str(turn).strip() for turn in turns]   # YAML reads an answer like 22 as a number
            for prompt, response in zip(turns, turns[1:]):
                if prompt and response and (prompt, response) not in seen:
                    seen.add((prompt, response))
                    pairs.append((name, prompt, response))
    return pairs, skipped


def topic_of(pairs):
    """{(prompt, response): its YAML file} of read_pairs' (file name, prompt, response) pairs."""
    return {(prompt, response): name for name, prompt, response in pairs}


def question_key(prompt):
    """What makes two prompts the same question: case-folded, whitespace collapsed."""
    return " ".join(prompt.casefold().split())


def split_pairs(pairs, seed, valid_percent, test_percent):
    """{"train": [...], "valid": [...], "test": [...]} of (prompt, response), every pair of a question in one split."""
    groups = {}
    for _, prompt, response in pairs:
        groups.setdefault(question_key(prompt), []).append((prompt, response))
    keys = list(groups)                 # first-appearance order: a function of the files only
    random.Random(seed).shuffle(keys)
    targets = {"test": len(pairs) * test_percent / 100.0, "valid": len(pairs) * valid_percent / 100.0}
    splits = {name: [] for name in SPLITS}
    current = iter(("test", "valid", "train"))
    name = next(current)
    for key in keys:
        while name != "train" and len(splits[name]) >= targets[name]:
            name = next(current)
        splits[name] += groups[key]
    return splits


def prepare(out_dir, seed=1234, valid_percent=5.0, test_percent=5.0, vocab_dir=None, workers=1,
            rejected_per_example=REJECTED_PER_EXAMPLE):
    """The manifest dict (plus "built": whether this call built it), building out_dir when its manifest is missing
    (idempotent; preference pairs of another kind or count are rebuilt from the splits' files)."""
    manifest_path = os.path.join(out_dir, f"{NAME}.json")
    vocab_dir = vocab_dir or os.path.join(REPO_ROOT, "data", "webtext")
    vocab, merges = os.path.join(vocab_dir, "vocab.json"), os.path.join(vocab_dir, "merges.txt")
    if os.path.exists(manifest_path):
        with open(manifest_path, encoding="utf-8") as handle:
            manifest = json.load(handle)
        if manifest.get("preference", {}).get("rejected_per_example") != rejected_per_example:
            # built before these preference pairs (none, or one random answer each): rebuild them
            splits = {name: [(row["prompt"], row["response"]) for row in map(json.loads, open(
                os.path.join(out_dir, f"{name}.jsonl"), encoding="utf-8"))] for name in SPLITS}
            topics = topic_of(read_pairs(corpus_dir())[0])
            manifest["preference"] = prepare_preference_pairs(out_dir, splits, topics, manifest["seed"],
                                                              rejected_per_example, vocab, merges, workers)
            atomic_write_text(manifest_path, json.dumps(manifest, indent=1) + "\n")
        return dict(manifest, built=False)
    if not (os.path.exists(vocab) and os.path.exists(merges)):
        prepare_default_data.prepare(vocab_dir)     # the tokenizer the pretrained model uses
    pairs, skipped = read_pairs(corpus_dir())
    splits = split_pairs(pairs, seed, valid_percent, test_percent)
    os.makedirs(out_dir, exist_ok=True)
    lines = {name: "".join(json.dumps({"prompt": p, "response": r}, ensure_ascii=False) + "\n"
                           for p, r in splits[name]) for name in SPLITS}
    for name in SPLITS:
        atomic_write_text(os.path.join(out_dir, f"{name}.jsonl"), lines[name])
    counts = [len(splits[name]) for name in SPLITS]
    split = ",".join(str(count) for count in counts)
    bounds = get_train_valid_test_split_(split, sum(counts))
    assert bounds == [0, counts[0], counts[0] + counts[1], sum(counts)], (split, bounds)   # exact by construction
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        joined = os.path.join(tmp, f"{NAME}.jsonl")      # train, valid, test: the document order --split cuts
        with open(joined, "w", encoding="utf-8") as handle:
            handle.write("".join(lines[name] for name in SPLITS))
        options = preprocess_sft_data.get_args(["--input", joined, "--output-prefix", os.path.join(out_dir, NAME),
                                                "--vocab-file", vocab, "--merge-file", merges,
                                                "--workers", str(workers)])
        stats = preprocess_sft_data.preprocess(options)
    if stats["examples"] != sum(counts):
        raise SourceError(f"{stats['examples']} examples tokenized from {sum(counts)} pairs")
    topics = topic_of(pairs)
    preference = prepare_preference_pairs(out_dir, splits, topics, seed, rejected_per_example, vocab, merges,
                                          workers)
    manifest = {"source": SOURCE, "seed": seed, "valid_percent": valid_percent, "test_percent": test_percent,
                "pairs": sum(counts), "skipped_conversations": skipped, "counts": dict(zip(SPLITS, counts)),
                "split": split,
                "questions": {name: len({question_key(p) for p, _ in splits[name]}) for name in SPLITS},
                "data_prefix": NAME, "tokens": stats["tokens"], "answer_tokens": stats["answer_tokens"],
                "template": options.chat_template,   # data_prefix: relative to this file's directory
                "preference": preference}
    atomic_write_text(manifest_path, json.dumps(manifest, indent=1) + "\n")   # last: marks data/sft/ complete
    return dict(manifest, built=True)


def preference_pairs(examples, topics, seed, per_example):
    """A toy preference set from (prompt, response) examples: each example's answer is chosen against
    `per_example` rejected answers (one pair each, together), drawn without replacement by random.Random(seed) from
    the examples of another topic (`topics`: (prompt, response) -> its YAML file). Another topic, not only another
    question: within a topic many answers fit many questions (emotion.yml's answers all fit "how are you?"), and a
    reward model cannot learn a preference that is a coin toss."""
    rng = random.Random(seed)
    pairs = []
    for prompt, response in examples:
        others = [r for p, r in examples if topics[(p, r)] != topics[(prompt, response)] and r != response]
        for rejected in rng.sample(others, min(per_example, len(others))):
            pairs.append({"prompt": prompt, "chosen": response, "rejected": rejected})
    return pairs


def prepare_preference_pairs(out_dir, splits, topics, seed, per_example, vocab, merges, workers):
    """data/sft/preference_{train,valid,test}.jsonl and chatterbot_preference_pairs_... (tokenized
    by tools/preprocess_sft_data.py --preference, pairs kept together; train, valid, test in order): the
    default data of train_reward_model.py and finetune_gpt.py --objective dpo. Returns its manifest entry."""
    pairs = {name: preference_pairs(splits[name], topics, seed, per_example) for name in SPLITS}
    lines = {name: "".join(json.dumps(pair, ensure_ascii=False) + "\n" for pair in pairs[name]) for name in SPLITS}
    for name in SPLITS:
        atomic_write_text(os.path.join(out_dir, f"preference_{name}.jsonl"), lines[name])
    prefix = f"{NAME}_preference"
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        joined = os.path.join(tmp, f"{prefix}.jsonl")
        with open(joined, "w", encoding="utf-8") as handle:
            handle.write("".join(lines[name] for name in SPLITS))
        options = preprocess_sft_data.get_args(["--input", joined, "--output-prefix", os.path.join(out_dir, prefix),
                                                "--vocab-file", vocab, "--merge-file", merges, "--preference",
                                                "--workers", str(workers)])
        stats = preprocess_sft_data.preprocess(options)
    counts = [len(pairs[name]) for name in SPLITS]
    if stats["examples"] != sum(counts):
        raise SourceError(f"{stats['examples']} preference pairs tokenized from {sum(counts)}")
    return {"data_prefix": prefix, "counts": dict(zip(SPLITS, counts)),
            "split": ",".join(str(count) for count in counts), "rejected_per_example": per_example,
            "rejected": "the answer of a question from another topic file (a toy)"}


def main(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default=os.path.join(REPO_ROOT, "data", "sft"))
    parser.add_argument("--seed", type=int, default=1234, help="the order questions are dealt to the splits")
    parser.add_argument("--valid-percent", type=float, default=5.0, help="of the pairs, at least (whole questions)")
    parser.add_argument("--test-percent", type=float, default=5.0, help="of the pairs, at least (whole questions)")
    parser.add_argument("--vocab-dir", default=None, help="vocab.json and merges.txt (default: data/webtext/, "
                        "built by tools/prepare_default_data.py when missing)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--rejected-per-example", type=int, default=REJECTED_PER_EXAMPLE,
                        help="preference pairs per example: its answer against this many answers from other topics")
    args = parser.parse_args(argv)
    cli.require_range(parser, args, positive=("workers", "rejected_per_example"),
                      non_negative=("valid_percent", "test_percent"))
    if args.valid_percent + args.test_percent >= 100:
        parser.error(f"--valid-percent {args.valid_percent} + --test-percent {args.test_percent} leave no training "
                     "data: keep their sum under 100")
    start = time.time()
    try:
        manifest = prepare(args.output_dir, args.seed, args.valid_percent, args.test_percent, args.vocab_dir,
                           args.workers, args.rejected_per_example)
    except (SourceError, preprocess_sft_data.BadLine, OSError) as error:
        raise SystemExit(f"error: {error}")
    state = "exists" if not manifest["built"] else f"built in {time.time() - start:.1f} s"
    counts = manifest["counts"]
    print(f"SFT data {state}: {manifest['pairs']} pairs from {manifest['source']} (train {counts['train']}, valid "
          f"{counts['valid']}, test {counts['test']})\n  --data-path {os.path.relpath(os.path.join(args.output_dir, manifest['data_prefix']))} "
          f"--split {manifest['split']}", file=sys.stderr)
    return manifest


if __name__ == "__main__":
    main()

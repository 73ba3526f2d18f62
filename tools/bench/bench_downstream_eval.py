"""What downstream evaluation while training costs (--eval-tasks): the `make pretrain` recipe
(scripts/ds_pretrain_gpt.sh, its defaults) with a local 500-question multiple-choice task every 100 iterations,
against the standalone harness on the checkpoint the run saved at its end.

    python tools/bench/bench_downstream_eval.py [--questions 500] [--interval 100] [--train-iters 420]

The task: cloze questions from the default data's documents (the first words of a sentence; its next words among
three other sentences' as the choices), written as an lm-eval JSON task in a temporary directory. Printed:
seconds per evaluation (each --log-jsonl downstream record's), their share of the run's wall time (the script's
whole run, start-up included), requests scored per second per rank in training, and the standalone harness's
(MegatronGPT2LM loaded from the final checkpoint, the same batch size: the micro-batch; after one untimed call):
lm_eval's evaluate() on the task loaded before the clock starts, as training has it, and simple_evaluate, the
harness CLI's call (task loading and its environment report included). One process (data-parallel 1), as the recipe, torch's default threads.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
DATA = os.path.join(REPO, "data", "webtext")
TASK = "bench_mc"


def write_task(directory, questions, context_words=8, answer_words=4):
    """A multiple-choice task of `questions` cloze questions from the default data, as lm-eval's JSON task YAML."""
    from megatron.data.indexed_dataset import MMapIndexedDataset
    from megatron.tokenizer.tokenizer import GPT2BPETokenizer
    tokenizer = GPT2BPETokenizer(os.path.join(DATA, "vocab.json"), os.path.join(DATA, "merges.txt"))
    documents = MMapIndexedDataset(os.path.join(DATA, "webtext_text_document"))
    need = context_words + answer_words
    sentences = []
    for index in range(len(documents)):
        text = tokenizer.detokenize(documents[index].tolist())
        sentences += [s.split() for s in text.replace("\n", " ").split(". ") if len(s.split()) >= need]
        if len(sentences) >= questions + 3:
            break
    if len(sentences) < questions + 3:
        raise SystemExit(f"the default data has {len(sentences)} sentences of {need}+ words; ask for fewer questions")
    rows = []
    for i in range(questions):
        answers = [" ".join(sentences[(i + k) % len(sentences)][context_words:need]) for k in (0, 1, 2, 3)]
        label = i % 4
        answers[0], answers[label] = answers[label], answers[0]
        rows.append({"question": " ".join(sentences[i][:context_words]), "choices": answers, "label": label})
    with open(os.path.join(directory, "questions.jsonl"), "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    kwargs = {"data_files": {"test": os.path.join(directory, "questions.jsonl")}, "cache_dir": os.path.join(directory,
                                                                                                           "hf")}
    with open(os.path.join(directory, f"{TASK}.yaml"), "w") as handle:
        handle.write(f"task: {TASK}\ndataset_path: json\ndataset_kwargs: {json.dumps(kwargs)}\ntest_split: test\n"
                     "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
                     "doc_to_target: label\nmetric_list: [{metric: acc}, {metric: acc_norm}]\n")


def train(directory, interval, train_iters):
    """The recipe with --eval-tasks; (wall seconds, the log's records)."""
    save, log = os.path.join(directory, "ckpt"), os.path.join(directory, "log.jsonl")
    env = dict(os.environ, CHECKPOINT_PATH=save, LOG_JSONL=log, TRAIN_ITERS=str(train_iters),
               EXTRA_ARGS=f"--eval-tasks {TASK} --eval-tasks-path {directory} --eval-tasks-interval {interval}",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    start = time.time()
    done = subprocess.run(["bash", "scripts/ds_pretrain_gpt.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.time() - start
    if done.returncode != 0:
        raise SystemExit(f"the recipe failed:\n{done.stderr[-3000:]}")
    return wall, [json.loads(line) for line in open(log)], save


def _standalone_worker(megatron_args, directory, batch_size):
    """{way: (seconds, requests scored, acc)}: the harness's evaluate() on tasks loaded before the clock starts (as
    training has them), and simple_evaluate (the CLI's call: task loading and its environment report included)."""
    import torch
    from lm_eval.evaluator import evaluate, simple_evaluate
    from lm_eval.tasks import TaskManager
    from megatron.text_generation.lm_eval_model import MegatronGPT2LM
    torch.set_num_threads(os.cpu_count())   # torch's default, as the recipe's process has it (spawn sets 1)
    lm = MegatronGPT2LM(megatron_args=megatron_args, batch_size=batch_size)
    manager = TaskManager(include_path=directory, include_defaults=False)
    out, loaded = {}, manager.load([TASK])
    evaluate(lm, loaded, bootstrap_iters=100000)   # untimed: the harness's first-call costs (training pays them too)
    for way, run in (("evaluate", lambda: evaluate(lm, loaded, bootstrap_iters=100000)),
                     ("simple_evaluate", lambda: simple_evaluate(model=lm, tasks=[TASK], task_manager=manager))):
        lm.requests_scored, start = 0, time.time()
        results = run()
        out[way] = (time.time() - start, lm.requests_scored, results["results"][TASK]["acc,none"])
    return out


def standalone(header, save, directory):
    from megatron.spawn import run_distributed
    args = header["args"]
    flags = ["--num-layers", args["num_layers"], "--hidden-size", args["hidden_size"], "--num-attention-heads",
             args["num_attention_heads"], "--seq-length", args["seq_length"], "--max-position-embeddings",
             args["max_position_embeddings"], "--vocab-file", args["vocab_file"], "--merge-file", args["merge_file"],
             "--load", save]
    return run_distributed(_standalone_worker, 1, args=(" ".join(map(str, flags)), directory, args["batch_size"]))[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=500)
    parser.add_argument("--interval", type=int, default=100)
    parser.add_argument("--train-iters", type=int, default=420)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_downstream_") as directory:
        write_task(directory, options.questions)
        wall, records, save = train(directory, options.interval, options.train_iters)
        evaluations = [r for r in records if r.get("type") == "downstream"]
        header = next(r for r in records if r.get("type") == "header")
        alone = standalone(header, save, directory)
    total = sum(r["seconds"] for r in evaluations)
    print(f"# make pretrain recipe, {options.train_iters} iterations, {options.questions}-question multiple-choice "
          f"task ({4 * options.questions} requests) every {options.interval} iterations and at the end; "
          f"dp 1, micro-batch {header['args']['batch_size']}")
    print("| iteration | seconds | requests/s (rank 0) | acc |")
    print("|---|---|---|---|")
    for r in evaluations:
        print(f"| {r['iteration']} | {r['seconds']:.2f} | {r['requests_scored_rank0'] / r['seconds']:.0f} | "
              f"{r['metrics']['acc']:.4f} |")
    later = evaluations[1:] or evaluations
    print(f"run wall time {wall:.1f} s; evaluations {total:.1f} s = {100 * total / wall:.1f}% of it "
          f"({len(evaluations)} evaluations: the first {evaluations[0]['seconds']:.2f} s with the harness's "
          f"first-call costs, the later ones {sum(r['seconds'] for r in later) / len(later):.2f} s on average)")
    for way, (seconds, scored, acc) in alone.items():
        print(f"standalone harness ({way}) on the final checkpoint: {seconds:.2f} s, {scored / seconds:.0f} "
              f"requests/s, acc {acc:.4f}")


if __name__ == "__main__":
    main()

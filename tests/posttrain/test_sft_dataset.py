"""megatron/posttrain/sft_dataset.py on tiny hand-written files (no tokenizer, no training): the train split's
epoch order (epoch e is the e-th permutation numpy's RandomState(seed) draws, as the module documents) and the
validation split's one-global-batch threshold."""
import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, index_file_path
from megatron.posttrain import SFTDataError, build_sft_datasets, output_prefixes

SEQ = 8


def _write_sft_files(prefix, count):
    """tools/preprocess_sft_data.py's two aligned datasets for `count` examples of 3-6 tokens (one per document)."""
    builders = {key: MMapIndexedDatasetBuilder(path + ".bin", dtype=np.int32)
                for key, path in output_prefixes(prefix).items()}
    for i in range(count):
        length = 3 + i % 4
        builders["input_ids"].add_item(np.arange(length) + 10 * i)
        builders["loss_mask"].add_item([0] * (length - 2) + [1, 1])
        for builder in builders.values():
            builder.end_document()
    for key, path in output_prefixes(prefix).items():
        builders[key].finalize(index_file_path(path))
    return prefix


def test_each_train_epoch_is_the_next_seeded_permutation(tmp_path):
    """16 examples split 8/8: 17 requested train samples need three epochs of the 8 train examples, which are the
    first three permutations RandomState(seed) draws, in order (not the first one three times)."""
    prefix = _write_sft_files(str(tmp_path / "sft"), 16)
    seed = 1234
    train, valid, test = build_sft_datasets(prefix, "8,8,0", [17, 0, 0], SEQ, seed, pad_id=0)
    rng = np.random.RandomState(seed)
    epochs = [rng.permutation(8).tolist() for _ in range(3)]
    assert len({tuple(e) for e in epochs}) == 3                   # the seed gives three different orders
    assert train.samples == [[d] for epoch in epochs for d in epoch]
    assert [d for (d,) in valid.samples] == list(range(8, 16)) and test is None    # valid: one pass, in order


def test_validation_split_of_exactly_one_global_batch_is_accepted_and_one_row_fewer_refused(tmp_path):
    prefix = _write_sft_files(str(tmp_path / "sft"), 16)
    _, valid, _ = build_sft_datasets(prefix, "8,8,0", [8, 8, 0], SEQ, 1, pad_id=0, global_batch_size=8)
    assert len(valid) == 8
    with pytest.raises(SFTDataError, match=r"^--split 9,7,0: the valid split has 7 rows \(7 of the 16 examples\), "
                                           r"fewer than one global batch \(8\): give it more \(--split\), or pass "
                                           r"--eval-iters 0$"):
        build_sft_datasets(prefix, "9,7,0", [8, 8, 0], SEQ, 1, pad_id=0, global_batch_size=8)

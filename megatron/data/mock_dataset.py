"""--mock-data: a synthetic, learnable GPT dataset whose sample i is a pure function of (seed, i), so a resumed
run sees exactly the batches the uninterrupted one would have.

Sample i: an arithmetic progression modulo the vocabulary, token[t+1] = (token[t] + step) % V, with start and
step drawn from numpy's generator seeded with (seed, i). A model learns to continue it, so the loss falls.
"""
import numpy as np


class MockGPTDataset:
    def __init__(self, num_samples, seq_length, vocab_size, seed):
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.vocab_size = int(vocab_size)
        self.seed = int(seed)

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        rng = np.random.default_rng([self.seed, int(index)])
        start = rng.integers(0, self.vocab_size)
        step = rng.integers(1, 8)
        text = (start + step * np.arange(self.seq_length + 1)) % self.vocab_size
        return {"text": text.astype(np.int64)}

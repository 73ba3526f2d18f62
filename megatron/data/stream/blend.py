"""A weighted blend of raw-shard streams (--data-path 'w1 DIR1 w2 DIR2 ...'): each source is its own stream, and
global sample g comes from the source Megatron's BlendableDataset would pick (build_blending_indices: the source
furthest below its share w * max(g, 1), ties to the lowest index), computed one sample at a time from the sources'
counts. So the proportions are Megatron's at every prefix, and a resumed blend (each source's record, saved
together) keeps them.

    blend = BlendedStreamLoader([loader_a, loader_b], [0.3, 0.7], micro_batch_size=4, data_parallel_rank=r,
                                data_parallel_size=2)
"""
from .loader import RankBatches
from .shards import StreamDataError

BLEND_VERSION = 1


class BlendedStreamLoader(RankBatches):

    def __init__(self, loaders, weights, micro_batch_size, data_parallel_rank, data_parallel_size):
        total = sum(weights)
        self.loaders, self.weights = loaders, [float(w) / total for w in weights]
        self.micro_batch_size, self.data_parallel_rank = micro_batch_size, data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.samples = 0

    def next_sample(self):
        denominator = max(float(self.samples), 1.0)
        errors = [w * denominator - loader.samples for w, loader in zip(self.weights, self.loaders)]
        sample = self.loaders[errors.index(max(errors))].next_sample()
        self.samples += 1
        return sample

    @property
    def bad_records(self):
        return sum(loader.bad_records for loader in self.loaders)

    def state_dict(self):
        return {"version": BLEND_VERSION, "weights": self.weights, "samples": self.samples,
                "sources": [loader.state_dict() for loader in self.loaders]}

    def load_state_dict(self, record, consumed_samples):
        if record.get("version") != BLEND_VERSION or "sources" not in record:
            raise StreamDataError("the checkpoint's data-stream record is not a blend's: resume with its --data-path")
        if record["weights"] != self.weights or len(record["sources"]) != len(self.loaders):
            raise StreamDataError(f"the checkpoint's blend has weights {record['weights']}, this run "
                                  f"{self.weights}: resume with the same --data-path")
        if record["samples"] != consumed_samples:
            raise StreamDataError(f"the checkpoint's data stream emitted {record['samples']} samples but its "
                                  f"counters consumed {consumed_samples}: the checkpoint is inconsistent")
        for loader, source in zip(self.loaders, record["sources"]):
            loader.load_state_dict(source, source["samples"])
        self.samples = record["samples"]

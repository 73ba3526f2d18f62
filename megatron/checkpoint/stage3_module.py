"""A ZeRO-3 checkpoint's module as the ranks saved it: each data-parallel rank's slice of the 16-bit weights in its
own file (layout.stage3_rank_states_name), so no rank ever holds the whole model to save it.

    module = PartitionedModule(directory, mp_rank, pp_rank, model_states)   # what load_model_states returns
    module["transformer.layers.0.mlp.dense_h_to_4h.weight"]   # the whole tensor, assembled from the slices
    module.shape_of(name)                                      # without reading any weight
    module.group_slices(g)                                     # [(start, end, weight)]: a loader of the same
                                                               # layout copies only the ranges it owns

The model-states file records, per stage-3 group (the optimizer's groups, then the frozen parameters' group), the
parameter names and shapes in flat order (layout.STAGE3_PARTITIONS); each rank's file holds, per group, its
unpadded slice [start, end) of that flat order (layout.PARTITION_WEIGHTS). Files are memory-mapped: reading one
parameter touches only its pieces.
"""
import collections.abc
import os

import torch

from megatron.checkpoint import layout as ckpt


class PartitionedModule(collections.abc.Mapping):
    """{name: whole tensor} over the ranks' slices (parameters) and the model-states file's buffers."""

    def __init__(self, directory, model_parallel_rank, pipeline_rank, model_states):
        self.directory = directory
        self.model_parallel_rank, self.pipeline_rank = model_parallel_rank, pipeline_rank
        self.data_parallel_size = model_states[ckpt.DATA_PARALLEL_SIZE]
        self.buffers = dict(model_states[ckpt.MODULE])
        self.groups = [(list(g["names"]), [torch.Size(s) for s in g["shapes"]])
                       for g in model_states[ckpt.STAGE3_PARTITIONS]]
        self._where = {}             # name -> (group, flat offset, shape)
        for index, (names, shapes) in enumerate(self.groups):
            offset = 0
            for name, shape in zip(names, shapes):
                self._where.setdefault(name, (index, offset, shape))
                offset += shape.numel()
        self._files = None

    def _rank_files(self):
        if self._files is None:
            paths = [os.path.join(self.directory, ckpt.stage3_rank_states_name(r, self.model_parallel_rank,
                                                                               self.pipeline_rank))
                     for r in range(self.data_parallel_size)]
            missing = [os.path.basename(p) for p in paths if not os.path.isfile(p)]
            if missing:
                raise ckpt.CheckpointError(f"{self.directory}: the ZeRO-3 weight partitions {missing} (of "
                                           f"{len(paths)}) are missing")
            self._files = [ckpt.safe_torch_load(p, mmap=True)[ckpt.PARTITION_WEIGHTS] for p in paths]
        return self._files

    def group_slices(self, index):
        """[(start, end, weight)] of group `index`, one per saved rank."""
        return [(f[index][ckpt.START], f[index][ckpt.END], f[index][ckpt.WEIGHT]) for f in self._rank_files()]

    def group_names(self):
        return [names for names, _ in self.groups]

    def shape_of(self, name):
        return self.buffers[name].shape if name in self.buffers else self._where[name][2]

    def __getitem__(self, name):
        if name in self.buffers:
            return self.buffers[name]
        index, start, shape = self._where[name]
        end = start + shape.numel()
        out = None
        for lo, hi, weight in self.group_slices(index):
            if out is None:
                out = torch.zeros(shape.numel(), dtype=weight.dtype)
            a, b = max(start, lo), min(end, hi)
            if a < b:
                out[a - start:b - start] = weight[a - lo:b - lo]
        return out.view(shape)

    def __iter__(self):
        return iter(list(self.buffers) + [n for n in self._where if n not in self.buffers])

    def __len__(self):
        return len(self.buffers) + len([n for n in self._where if n not in self.buffers])


def tensor_shape(weights, name):
    """The shape of `name` in a module mapping, without assembling a partitioned one."""
    return weights.shape_of(name) if isinstance(weights, PartitionedModule) else weights[name].shape

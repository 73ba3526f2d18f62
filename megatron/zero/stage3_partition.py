"""ZeRO stage 3's partitions: one optimizer group's flat order of which this rank holds only its own range
(PartitionedGroup, the layout of partition.py), and their construction from the module's parameters
(partition_parameters: each parameter whole once, broadcast or gathered from zero.Init's pieces, then cut).

The gathering of a unit from these partitions is stage3_buffer.py's, the units and hooks stage3.py's; both names
here are importable from megatron.zero.stage3 too.
"""
import torch
import torch.distributed as dist

from . import offload
from .param_status import assign_id
from .partition import context_for, FlatLayout



class PartitionedGroup(FlatLayout):
    """One optimizer group at stage 3: only this rank's partition of the flat buffer exists, on `device`.

    `full_value(param)` returns the whole parameter (flat or shaped); it is called once per parameter, in group
    order, on every rank (it may be a collective), so at most one full parameter exists at a time here.
    """

    def __init__(self, params, num_partitions, rank, full_value, dtype, device, offloaded=False, pin_memory=False):
        """`offloaded` (offload_param): the partition is host offload memory (pinned with `pin_memory` on CUDA)."""
        super().__init__(params, num_partitions, rank)
        self.offloaded = offloaded
        self.partition = offload.host_zeros(self.partition_size, dtype, pin_memory) if offloaded else \
            torch.zeros(self.partition_size, dtype=dtype, device=device)
        start, end = self.own_range
        with torch.no_grad():
            for index, param in enumerate(self.params):
                value = full_value(param).reshape(-1)
                p_start, p_end = self.offsets[index]
                lo, hi = max(p_start, start), min(p_end, end)
                if lo < hi:
                    self.partition[lo - start:hi - start].copy_(value[lo - p_start:hi - p_start])

    @property
    def dtype(self):
        return self.partition.dtype

    @property
    def device(self):
        return self.partition.device

    def own_partition(self):
        return self.partition

    def parameter_bytes(self):
        return self.partition.numel() * self.partition.element_size()


def partition_parameters(module, param_groups, ctx, zero_config, dtype, device):
    """One PartitionedGroup per optimizer param group, in `dtype` (None: the parameters' own), then one more for
    the frozen parameters (requires_grad False: in no optimizer group, e.g. LoRA's base weights) when there are
    any: partitioned and gathered like the others, without optimizer state. Without an optimizer (no param
    groups: an inference engine) every parameter is in that stateless group. A parameter built whole is first
    broadcast from data-parallel rank 0 (as the other stages do); one built under zero.Init is gathered from its
    pieces. One parameter is whole at a time. `device`: the engine's compute device (where the partitions live
    without offload_param)."""
    from .zero_init import gather_initial

    def full_value(param, data_parallel):
        if hasattr(param, "ds_tensor"):
            if data_parallel is not ctx:
                raise ValueError("an expert parameter built under zero.Init: under expert parallelism build the model "
                                 "without zero.Init (zero.Init partitions over the data-parallel group, the experts "
                                 "belong to the expert-data-parallel one)")
            value = gather_initial(param, device)
            del param.ds_tensor
        else:
            value = param.data
            if data_parallel.data_parallel_size > 1:
                dist.broadcast(value, group_src=0, group=data_parallel.data_parallel_group)
            param.ds_shape, param.ds_numel = value.shape, value.numel()
        return value if dtype is None else value.to(dtype)

    in_groups = {id(p) for group in param_groups for p in group["params"]}
    stateless = [p for p in module.parameters()
                 if id(p) not in in_groups and (not p.requires_grad or not param_groups)]
    groups = []
    for params in [group["params"] for group in param_groups] + ([stateless] if stateless else []):
        group_dtype = dtype or (params[0].dtype if params else torch.float32)
        for param in params:
            assign_id(param)
        context = context_for(params, ctx)            # expert parameters: the expert-data-parallel group
        data_parallel = context or ctx
        groups.append(PartitionedGroup(params, data_parallel.data_parallel_size, data_parallel.data_parallel_rank,
                                       lambda param, data_parallel=data_parallel: full_value(param, data_parallel),
                                       group_dtype, device, zero_config.offload_param.enabled,
                                       zero_config.offload_param.pin_memory))   # pinned: faster copies to the device
        groups[-1].context = context
    return groups

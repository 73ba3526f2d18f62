"""Megatron's local data-parallel wrapper: gradients are all-reduced explicitly by `allreduce_params()`,
one flat buffer per dtype, over the data-parallel group (model-parallel shards are never mixed)."""
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import mpu
from megatron.guards import breadcrumbs


class DistributedDataParallel(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        # context-parallel ranks hold the same parameters too (their gradients cover other tokens)
        self.data_parallel_group = mpu.get_data_parallel_group(with_context_parallel=True)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def allreduce_params(self, reduce_after=True, fp32_allreduce=False):
        """Average gradients across data-parallel ranks.

        reduce_after: divide by the world size after the sum (else before: safer against fp16 overflow).
        fp32_allreduce: reduce fp16/bf16 gradients in fp32.
        """
        world_size = dist.get_world_size(group=self.data_parallel_group)
        if world_size == 1:
            return
        buckets = {}
        for param in self.module.parameters():
            if param.requires_grad and param.grad is not None:
                buckets.setdefault(param.grad.dtype, []).append(param.grad)
        for grads in buckets.values():
            coalesced = _flatten_dense_tensors(grads)
            if fp32_allreduce:
                coalesced = coalesced.float()
            if not reduce_after:
                coalesced.div_(world_size)
            breadcrumbs.all_reduce(coalesced, "local DDP gradient all-reduce", group=self.data_parallel_group)
            if reduce_after:
                coalesced.div_(world_size)
            for grad, synced in zip(grads, _unflatten_dense_tensors(coalesced, grads)):
                grad.copy_(synced)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict=True):
        return self.module.load_state_dict(state_dict, strict=strict)

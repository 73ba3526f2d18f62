"""The offloaded optimizer's host step: torch's fused CPU AdamW where the client chose no kernel (foreach where it
said fused=False; its own choice otherwise), equal to a plain torch AdamW run."""
import pytest
import torch

from megatron import zero
from megatron.zero.optimizer import _host_kernel
from tests.helpers import ds_config, engine_train_step, max_relative_difference, param_groups, reference_run, TinyNet

STEPS, LR = 5, 1e-2


def _offloaded_run(**adam_options):
    model = TinyNet()
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR, **adam_options)
    config = ds_config(2, micro=4, offload_optimizer={"device": "cpu"}, sub_group_size=300)   # several tiles
    engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    losses = [engine_train_step(engine, step, 4) for step in range(STEPS)]
    state = {k: v.detach().float().clone() for k, v in engine.module_state_dict().items()}
    return losses, state, engine.optimizer.param_groups


@pytest.mark.parametrize("client, kernel", [({}, "fused"), ({"fused": False}, "foreach")],
                         ids=["default-fused", "client-fused-false-foreach"])
def test_host_adam_equals_torch_adamw(client, kernel):
    """Stage 2 + offload_optimizer, single process, weight decay on one group and off on the other, masters in
    tiles of 300 elements: losses and weights equal torch's (for-loop) AdamW on the same batches within 1e-6."""
    ref_losses, ref_state = reference_run(STEPS, 4, lr=LR)
    losses, state, groups = _offloaded_run(**client)
    assert all(group.get(kernel) is True for group in groups), groups
    assert max_relative_difference(losses, ref_losses) <= 1e-6
    assert max_relative_difference(state, ref_state) <= 1e-6


def test_host_kernel_choice():
    adamw = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    group = adamw.param_groups[0]
    assert _host_kernel(adamw, group) == {"fused": True}                      # torch >= 2.4 on the CPU
    assert _host_kernel(adamw, {**group, "fused": False}) == {"foreach": True}
    assert _host_kernel(adamw, {**group, "foreach": False}) == {}             # the client's choice kept
    assert _host_kernel(adamw, {**group, "fused": True}) == {}
    assert _host_kernel(adamw, {**group, "differentiable": True}) == {"foreach": True}
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    assert _host_kernel(sgd, sgd.param_groups[0]) == {"foreach": True}

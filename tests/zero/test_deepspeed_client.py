"""DeepSpeed's own client code runs unchanged against megatron.zero (issue 25, item 5): the tutorial client of the
HybridEngine guide, stage 3 + both offloads + fp16, "auto" values for a model without config.hidden_size."""
import sys

from megatron.spawn import run_distributed
from tests.helpers import FIXTURES



def _run_tutorial_client(config_path):
    import contextlib
    import io
    from megatron import zero
    sys.modules["deepspeed"] = zero          # `import deepspeed` in the client resolves to our engine
    sys.path.insert(0, FIXTURES)
    import ds_tutorial_client
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        losses = ds_tutorial_client.main(config_path)
    return losses, printed.getvalue()


def test_the_tutorial_client_trains_unchanged(tmp_path):
    losses, printed = run_distributed(_run_tutorial_client, 1, args=(str(tmp_path / "ds_config.json"),))[0]
    assert len(losses) == 3 and losses[2] < losses[1] < losses[0] and losses[2] < 0.7 * losses[0], losses
    assert ('[zero] "auto" resolved from DeepSpeed\'s defaults (the model has no config.hidden_size): '
            "{'reduce_bucket_size': 500000000, 'stage3_prefetch_bucket_size': 50000000, "
            "'stage3_param_persistence_threshold': 100000}") in printed
    assert "[zero] accepted with no effect here: zero_force_ds_cpu_optimizer (" in printed
    assert "zero_optimization.stage3_max_reuse_distance (stage 3 releases every unit after its use)" in printed

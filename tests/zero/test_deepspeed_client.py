"""DeepSpeed's own client code runs unchanged against megatron.zero (issue 25, item 5): the tutorial client of the
HybridEngine guide, stage 3 + both offloads + fp16, "auto" values for a model without config.hidden_size."""
import importlib.util
import sys

import pytest
import torch

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
    assert "stage3_max_reuse_distance" not in printed        # honoured (stage3.py), so not named as inert


# ---- one client against both libraries (issue 25, item 4) -----------------------------------------------------
CLIENT_CONFIG = {"train_micro_batch_size_per_gpu": 3, "steps_per_print": 10 ** 6, "gradient_clipping": 0.0,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
                 "zero_optimization": {"stage": 2}}


class _Samples(torch.utils.data.Dataset):
    """10 samples (x, y, index): 5 per rank at dp 2, so micro-batches of 3 leave an incomplete last one."""

    def __len__(self):
        return 10

    def __getitem__(self, index):
        x = torch.randn(7, generator=torch.Generator().manual_seed(index))
        return x, torch.sin(x[:6] * 2), index


def _collate(samples):
    """The client's collate_fn: the indices offset by 100 (so its use shows in the batches)."""
    x, y, index = torch.utils.data.default_collate(samples)
    return x, y, index + 100


def _api_client(deepspeed, save_dir, config):
    """What a DeepSpeed user's script calls: initialize(model, model_parameters, training_data, collate_fn, config) with
    the JSON optimizer, the returned DataLoader, train()/eval(), save_checkpoint, save_16bit_model,
    load_checkpoint(load_module_only=True)."""
    from tests.zero.test_deepspeed_checkpoints import OddNet
    model = OddNet()
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=_Samples(), config=config, collate_fn=_collate)
    record = {"indices": [], "losses": [], "batches": len(loader)}
    engine.train()
    for _ in range(2):                                   # 2 epochs; the sampler's epoch stays 0, as DeepSpeed's
        for x, y, index in loader:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            record["indices"].append(index.tolist())
            record["losses"].append(loss.item())
    engine.eval()
    record["eval_mode"] = not engine.module.training
    engine.save_checkpoint(save_dir, tag="epoch2")
    record["saved_16bit"] = engine.save_16bit_model(save_dir, "model.bin")
    saved = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    engine.train()
    x, y, _ = next(iter(loader))
    engine.backward(engine(x, y))
    engine.step()
    steps = engine.global_steps
    engine.load_checkpoint(save_dir, tag="epoch2", load_module_only=True)
    record["steps_after_module_only"] = (steps, engine.global_steps)
    record["module_restored"] = all(torch.equal(p, saved[n]) for n, p in engine.module.named_parameters())
    return record


def _client_on_both(root):
    import os
    from tests.zero.test_deepspeed_oracle import _deepspeed
    from megatron import zero
    deepspeed = _deepspeed()
    # DeepSpeed's loader starts 2 worker processes per epoch (20 s on 2 cores here); the samples' order does not
    # depend on them, so its loader runs in-process, as ours does
    from deepspeed.runtime import dataloader
    original = dataloader.DeepSpeedDataLoader.__init__
    dataloader.DeepSpeedDataLoader.__init__ = \
        lambda self, *args, **kwargs: original(self, *args, **{**kwargs, "num_local_io_workers": 0})
    return {name: _api_client(library, os.path.join(root, name), dict(CLIENT_CONFIG, dataloader_drop_last=drop))
            for library in (deepspeed, zero) for drop in (False, True)
            for name in [f"{library.__name__.split('.')[-1]}_drop{int(drop)}"]}


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is a test requirement")
def test_one_client_script_gives_the_same_results_on_both_libraries(tmp_path):
    import os
    results = run_distributed(_client_on_both, 2, args=(str(tmp_path),), model_parallel_size=1, timeout=600)
    for drop in (0, 1):
        for rank in (0, 1):
            ours, theirs = results[rank][f"zero_drop{drop}"], results[rank][f"deepspeed_drop{drop}"]
            # the loader: DistributedSampler over the data-parallel group, shuffled; the last incomplete micro
            # batch kept unless dataloader_drop_last
            assert ours["indices"] == theirs["indices"] and ours["batches"] == theirs["batches"] == 2 - drop, rank
            assert min(min(batch) for batch in ours["indices"]) >= 100           # through the collate_fn
            assert max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], theirs["losses"])) <= 1e-5
            assert ours["eval_mode"] and ours["saved_16bit"] == theirs["saved_16bit"] is True
            assert ours["steps_after_module_only"] == theirs["steps_after_module_only"] == (2 * (2 - drop) + 1,) * 2
            assert ours["module_restored"] and theirs["module_restored"]
        assert sorted(results[0]["zero_drop0"]["indices"][0] + results[1]["zero_drop0"]["indices"][0]) != \
            list(range(100, 106))    # shuffled
        ours_file = torch.load(os.path.join(tmp_path, f"zero_drop{drop}", "model.bin"), weights_only=True)
        theirs_file = torch.load(os.path.join(tmp_path, f"deepspeed_drop{drop}", "model.bin"), weights_only=True)
        assert ours_file.keys() == theirs_file.keys()
        for name in ours_file:
            assert torch.allclose(ours_file[name], theirs_file[name], rtol=1e-5, atol=1e-7), name

"""Shared pieces of the ZeRO engine tests: a tiny model, deterministic data, the single-process reference."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

IN, HIDDEN, OUT = 16, 32, 8


def device():
    """Where the tests' tensors live: the CPU, or the rank's GPU under `pytest --device cuda` (mpu decides)."""
    import mpu
    return mpu.get_device()


class TinyNet(nn.Module):
    """Linear -> GELU -> LayerNorm -> Linear -> tanh -> Linear; ~1.9k parameters."""

    def __init__(self, seed=1234):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)
        self.to(device())

    def forward(self, x, y):
        h = self.norm(F.gelu(self.fc1(x)))
        return F.mse_loss(self.head(torch.tanh(self.fc2(h))).float(), y.float())


def batch(step, size, seed=99):
    """The global batch of `step`: x [size, IN], y = tanh(x @ teacher) [size, OUT]."""
    teacher = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(seed))
    x = torch.randn(size, IN, generator=torch.Generator().manual_seed(seed * 1000 + step))
    return x.to(device()), torch.tanh(x @ teacher).to(device())


def engine_train_step(engine, step, global_batch):
    """One optimizer step of `engine` on the global batch of `step`; returns the loss averaged over the global
    batch. Data-parallel rank r, micro-step k takes samples [(r * accumulation + k) * micro, ... + micro)."""
    import torch.distributed as dist
    ctx = engine.ctx
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    x, y = batch(step, global_batch)
    total = torch.zeros(1, dtype=torch.float64, device=device())
    for k in range(accumulation):
        lo = (ctx.data_parallel_rank * accumulation + k) * micro
        loss = engine(x[lo:lo + micro], y[lo:lo + micro])
        engine.backward(loss)
        engine.step()
        total += loss.item()
    if ctx.data_parallel_size > 1:
        dist.all_reduce(total, group=ctx.data_parallel_group)
    return float(total) / (ctx.data_parallel_size * accumulation)


def param_groups(model, weight_decay=0.01):
    """Megatron-style groups: weights decay, biases and norms do not."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def reference_run(steps, global_batch, lr=1e-2, clip=0.0, make_model=TinyNet, grad_norms=None):
    """Plain single-process torch AdamW on the whole global batch: (losses, final state_dict). `grad_norms`, a
    list, receives clip_grad_norm_'s return value (the norm before clipping) at every step."""
    model = make_model()
    optimizer = torch.optim.AdamW(param_groups(model), lr=lr)
    losses = []
    for step in range(steps):
        x, y = batch(step, global_batch)
        loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        if clip > 0 or grad_norms is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
            if grad_norms is not None:
                grad_norms.append(float(norm))
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


class ParallelTinyNet(nn.Module):
    """ColumnParallel -> GELU -> RowParallel -> tanh -> LayerNorm -> Linear head (the last two are duplicated
    across model-parallel ranks)."""

    def __init__(self, seed=4321):
        import mpu
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = mpu.ColumnParallelLinear(IN, HIDDEN, gather_output=False)
        self.fc2 = mpu.RowParallelLinear(HIDDEN, HIDDEN, input_is_parallel=True)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)
        self.to(device())

    def forward(self, x, y):
        h = self.norm(torch.tanh(self.fc2(F.gelu(self.fc1(x)))))
        return F.mse_loss(self.head(h), y)


def ds_config(stage, micro, accumulation=1, **zero):
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
              "steps_per_print": 10 ** 6, "zero_optimization": {"stage": stage, **zero}}
    return copy.deepcopy(config)


def max_relative_difference(a, b):
    """max over tensors of max|a - b| / max|b| (a and b: dicts or lists of tensors/floats)."""
    pairs = zip(a.values(), b.values()) if isinstance(a, dict) else zip(a, b)
    worst = 0.0
    for x, y in pairs:
        x, y = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
        worst = max(worst, float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)))
    return worst

"""ZeRO-3's buffer lifecycle, pinned where a one-line slip shows (single process with stage3_resident_at_dp1 off:
stage 3 at data-parallel size 1 then gathers by copying its own partition, with the same hooks, books and release
rules as at dp > 1; by default it keeps the parameters resident, test_zero3_resident.py):

- stage3_max_reuse_distance keeps a contiguous tail of the forward's units gathered into the backward: the first
  unit that does not fit ends it, even when an earlier one would fit after it;
- a no-grad forward keeps nothing gathered: each unit is released after its forward (no reuse: no backward
  comes), and what was prefetched for a unit the forward did not run is released when it ends;
- stage3_max_live_parameters binds the prefetch in forward and backward (the live-element books are kept);
- a buffer whose parameters' gradients arrive across two backward fetches (the head owning the tied weight,
  which the embedding uses too) is released when the last one arrives, not at the end of the backward;
- a buffer held outside the forward (GatheredParameters) stays gathered when its gradients arrive (in a plain
  step no unit holds a buffer during the backward: holders are counted by the forward hooks only);
- overlap_param_gather (stages 1-2): a module's forward pre-hook also waits for the buckets of the parameters it
  declares with register_external_parameter;
- a buffer of frozen weights (LoRA's base) stays gathered until the backward has reached its unit's inputs,
  though its trainable adapters' gradients are all in before the base weight's own backward runs.

Sizes (TinyNet, persistence threshold 40): the persistent buffer 136 elements (fc1, fc2, head biases, the
LayerNorm), fc1's weight 512, fc2's 1024, head's 256; norm has no buffer of its own.
"""
import torch
import torch.nn.functional as F
from torch import nn

from megatron import zero
from megatron.zero.param_gather import ParameterGather
from megatron.zero.partition import FlatGroup
from tests.helpers import HIDDEN, IN, OUT, TinyNet, batch, device, engine_train_step, param_groups
from tests.zero.test_zero3 import _stage3
from tests.zero.test_zero_overlap import _holds

PERSISTENT, FC1, FC2, HEAD = 136, 512, 1024, 256


def _engine(model, **zero_config):
    """A single-process stage-3 engine (micro batch 2) on `model`'s trainable parameters, AdamW in param_groups'
    two groups; the frozen ones (requires_grad False) are partitioned and gathered without optimizer state."""
    groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in param_groups(model)]
    engine, _, _, _ = zero.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-2),
                                      config={"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
                                              **_stage3(**{"stage3_resident_at_dp1": False, **zero_config})},
                                      dist_init_required=False)
    return engine


def _buffer(engine, name):
    return next(b for b in engine.stage3.buffers if b.name == name)


def _gathered(engine):
    """Names of the non-persistent buffers gathered now (ready or in flight)."""
    return {b.name for b in engine.stage3.buffers if b.state != "released" and not b.persistent}


def _on_forward(engine, record):
    """record(name) at each TinyNet unit's forward, after the engine's pre-hook (registered after it)."""
    for name in ("fc1", "norm", "fc2", "head"):
        getattr(engine.module, name).register_forward_pre_hook(lambda *_, name=name: record(name))


def _on_gradient(engine, names, record):
    """record(name) once each parameter's gradient is in, after the engine's hook (registered after it)."""
    params = dict(engine.module.named_parameters())
    for name in names:
        params[name].register_post_accumulate_grad_hook(lambda _, name=name: record(name))


# ---- the reuse tail is contiguous --------------------------------------------------------------------------------
# The units by the end of their forwards, last first: head 256, fc2 1024, norm (nothing of its own), fc1 512.
# 768 = head + fc1: fc1 would fit once fc2 (which does not) is skipped; the tail ends at fc2.
KEPT_AT_DISTANCE = {0: set(), 255: set(), 256: {"head"}, 768: {"head"}, 1279: {"head"},
                    1280: {"head", "fc2"}, 1791: {"head", "fc2"}, 1792: {"head", "fc2", "fc1"}}


def test_reuse_keeps_a_contiguous_tail_of_the_forward():
    """Prefetch off: what stays gathered when the second forward (the order is recorded in the first) ends is the
    reuse tail, and each of its buffers is gathered once in that step (the others twice: forward and backward)."""
    for distance, kept in KEPT_AT_DISTANCE.items():
        engine = _engine(TinyNet(), stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=distance)
        engine_train_step(engine, 0, 2)
        gathers = {name: 0 for name in ("fc1", "fc2", "head")}
        for name in gathers:
            def counted(name=name, start=_buffer(engine, name).start_gather):
                gathers[name] += 1
                start()
            _buffer(engine, name).start_gather = counted
        x, y = batch(1, 2)
        loss = engine(x, y)
        at_turn = _gathered(engine)
        engine.backward(loss)
        engine.step()
        assert at_turn == kept, (distance, at_turn)
        assert gathers == {name: 1 if name in kept else 2 for name in gathers}, (distance, gathers)


# ---- a no-grad forward keeps nothing -----------------------------------------------------------------------------
class _TinyNetFeatures(TinyNet):
    """TinyNet whose forward without targets stops before the head (fc2's activations)."""

    def forward(self, x, y=None):
        if y is None:
            return torch.tanh(self.fc2(self.norm(F.gelu(self.fc1(x)))))
        return super().forward(x, y)


def test_a_no_grad_forward_releases_every_unit_and_what_it_prefetched():
    """Reuse at its default (every unit would fit), prefetch 1100: fc2 (1024) ahead of fc1, head (256) ahead of
    fc2. Live elements at each unit's forward and after the forward: each unit released after its own forward;
    a forward that stops before the head leaves only the persistent buffer, the prefetched head released too."""
    engine = _engine(_TinyNetFeatures(), stage3_prefetch_bucket_size=1100)
    engine_train_step(engine, 0, 2)
    live = []
    _on_forward(engine, lambda name: live.append((name, engine.stage3.live_parameter_elements())))
    x, y = batch(1, 2)
    with torch.no_grad():
        engine(x, y)
        live.append(("after", engine.stage3.live_parameter_elements()))
        engine(x)
        live.append(("after features", engine.stage3.live_parameter_elements()))
    units = [("fc1", PERSISTENT + FC1 + FC2), ("norm", PERSISTENT + FC2), ("fc2", PERSISTENT + FC2 + HEAD),
             ("head", PERSISTENT + HEAD)]
    assert live[:5] == units + [("after", PERSISTENT)], live[:5]
    assert live[5:] == units[:3] + [("after features", PERSISTENT)], live[5:]


# ---- stage3_max_live_parameters binds the prefetch ---------------------------------------------------------------
MAX_LIVE = 1800      # persistent + fc1 + fc2 = 1672 fit; + head = 1928 does not


def test_max_live_parameters_bounds_the_prefetch():
    """Prefetch budget unbounded, reuse off: live elements at each unit's forward (second step) and at the head's
    and each weight's gradient arrival. Forward: fc1 prefetches fc2 but not head (1928 > 1800), which fits once
    fc1 is released (norm); backward: head prefetches fc2 but not fc1, which fits once head is released (fc2)."""
    engine = _engine(TinyNet(), stage3_prefetch_bucket_size=10 ** 9, stage3_max_reuse_distance=0,
                     stage3_max_live_parameters=MAX_LIVE)
    engine_train_step(engine, 0, 2)
    live = []
    record = (lambda name: live.append((name, engine.stage3.live_parameter_elements())))
    _on_forward(engine, record)
    _on_gradient(engine, ["head.bias", "head.weight", "fc2.weight", "fc1.weight"], record)
    engine_train_step(engine, 1, 2)
    peak = max(n for _, n in live)
    assert peak <= MAX_LIVE, f"{peak} elements live: {live}"
    assert live[:4] == [("fc1", PERSISTENT + FC1 + FC2), ("norm", PERSISTENT + FC2 + HEAD),
                        ("fc2", PERSISTENT + FC2 + HEAD), ("head", PERSISTENT + HEAD)], live[:4]
    assert live[4:] == [("head.bias", PERSISTENT + HEAD + FC2), ("head.weight", PERSISTENT + FC2),
                        ("fc2.weight", PERSISTENT + FC1), ("fc1.weight", PERSISTENT)], live[4:]


# ---- a buffer two units use: the head owning the tied weight -----------------------------------------------------
VOCAB, WIDTH, SEQ = 8, 16, 4


class _Embedding(nn.Module):
    """Token rows from the weight it is given (the head's), plus a position table of its own."""

    def __init__(self):
        super().__init__()
        self.position = nn.Parameter(torch.randn(SEQ, WIDTH))

    def forward(self, tokens, weight):
        return F.embedding(tokens, weight) + self.position[:tokens.size(1)]


class _TiedNet(nn.Module):
    """embed (token rows from head.weight) -> body -> tanh -> head, cross-entropy. The head is registered first,
    so its unit owns the tied weight: one buffer {head.weight, head.bias}, which the embedding declares external.
    In the backward the head's bias is done at the head, its weight only at the embedding (two fetches later)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.embed = _Embedding()
        zero.register_external_parameter(self.embed, self.head.weight)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.to(device())

    def forward(self, tokens, targets):
        logits = self.head(torch.tanh(self.body(self.embed(tokens, self.head.weight))))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _tokens(step):
    generator = torch.Generator().manual_seed(step)
    tokens, targets = (torch.randint(VOCAB, (2, SEQ), generator=generator) for _ in range(2))
    return tokens.to(device()), targets.to(device())


def _tied_step(hold=False):
    """Prefetch and reuse off, nothing persistent; the second step (the order recorded in the first). The head
    buffer's state at each gradient arrival (in the backward's order) and after the backward; with `hold`, the
    tied weight held in GatheredParameters across the step, and its shape read inside after the backward."""
    engine = _engine(_TiedNet(), stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0,
                     stage3_param_persistence_threshold=0)
    engine.backward(engine(*_tokens(0)))
    engine.step()
    head = _buffer(engine, "head")
    states = []
    _on_gradient(engine, ["head.bias", "body.weight", "embed.position", "head.weight"],
                 lambda name: states.append((name, head.state)))
    with zero.GatheredParameters(engine.module.head.weight, enabled=hold):
        engine.backward(engine(*_tokens(1)))
        states.append(("after backward", head.state))
        shape = tuple(engine.module.head.weight.shape)
    return states, shape


def test_a_buffer_whose_gradients_arrive_across_two_fetches_is_released_at_the_last():
    """head.bias arrives at the head's backward, head.weight at the embedding's, after the embedding's backward
    fetch gathered the head buffer again (ready already): that fetch must not restart the wait for head.bias."""
    states, _ = _tied_step()
    assert states == [("head.bias", "ready"), ("body.weight", "ready"), ("embed.position", "ready"),
                      ("head.weight", "released"), ("after backward", "released")], states


def test_a_held_buffer_stays_gathered_when_its_gradients_arrive():
    """GatheredParameters holds the head buffer over the forward and backward: every gradient arrives while it is
    held, and the weight is whole inside the context after the backward."""
    states, shape = _tied_step(hold=True)
    assert states == [("head.bias", "ready"), ("body.weight", "ready"), ("embed.position", "ready"),
                      ("head.weight", "ready"), ("after backward", "ready")], states
    assert shape == (VOCAB, WIDTH)


# ---- overlap_param_gather waits for a module's external parameters -----------------------------------------------
class _PendingGather:
    def wait(self):
        pass


def test_overlap_pre_hook_waits_for_external_parameter_buckets():
    """_TiedNet's flat groups at dp 2 (rank 0's; ParameterGather only indexes them), buckets of 16, counted by
    hand: weights {head.weight 128, body.weight 256} (partition 192: 12 buckets; head.weight fills [0, 128) of
    partition 0: 8 of them), the rest {head.bias 8, embed.position 64, body.bias 16} (88, padded 128, partition
    64: 4 buckets, embed.position in all 4). Every bucket in flight, the embedding's forward waits for exactly
    the 12 holding its position table or the head's weight it declared external."""
    model = _TiedNet()
    groups = [FlatGroup(g["params"], 2, 0) for g in param_groups(model)]
    gather = ParameterGather(groups, None, 16, list(model.parameters()))
    gather.install_hooks(model)
    gather.pending = {bucket: _PendingGather() for bucket in gather.buckets}
    model.embed(_tokens(0)[0], model.head.weight)
    expected = [b for b in gather.buckets if _holds(b, [model.embed.position, model.head.weight])]
    assert len(gather.buckets) == 16 and len(expected) == 8 + 4, len(expected)
    index = {bucket: i for i, bucket in enumerate(gather.buckets)}
    assert gather.waited == expected, f"waited for {[index[b] for b in gather.waited]}, " \
                                      f"holding its parameters: {[index[b] for b in expected]}"


# ---- a frozen base weight until the backward reaches its unit's inputs -------------------------------------------
class _LoRALinear(nn.Module):
    """A frozen base weight and a trainable rank-2 update, in mpu's LoRA order (the base product first, so its
    backward runs after the adapters'): y = x W^T + (x A^T) B^T. `on_base_backward()` runs just before the base
    product's backward (a hook on its output's gradient)."""

    def __init__(self, size, rank=2):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(size, size) / size ** 0.5, requires_grad=False)
        self.lora_A = nn.Parameter(torch.randn(rank, size) / size ** 0.5)
        self.lora_B = nn.Parameter(torch.randn(size, rank) / rank ** 0.5)     # non-zero: A gets a gradient
        self.on_base_backward = lambda: None

    def forward(self, x):
        base = F.linear(x, self.weight)
        if base.requires_grad:
            base.register_hook(lambda grad: self.on_base_backward())
        return base + F.linear(F.linear(x, self.lora_A), self.lora_B)


class _LoRANet(nn.Module):
    """fc1 -> GELU -> LoRA linear -> tanh -> head, MSE (the adapted unit's input requires grad: its base weight
    is needed for that input's gradient)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.adapted = _LoRALinear(HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)
        self.to(device())

    def forward(self, x, y):
        return F.mse_loss(self.head(torch.tanh(self.adapted(F.gelu(self.fc1(x))))), y)


def test_a_frozen_weight_buffer_stays_gathered_until_its_unit_inputs_are_reached():
    """The adapted unit's buffer (frozen weight + adapters) through the backward: its adapters' gradients are
    both in before the base product's backward, which still needs the frozen weight; it is released once the
    backward has reached the unit's inputs (before fc1's gradient), not at the end of the backward."""
    engine = _engine(_LoRANet(), stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    adapted, states = _buffer(engine, "adapted"), []
    record = (lambda name: states.append((name, adapted.state)))
    engine.module.adapted.on_base_backward = lambda: record("base backward")
    _on_gradient(engine, ["adapted.lora_B", "adapted.lora_A", "fc1.weight"], record)
    try:
        engine_train_step(engine, 0, 2)
    except RuntimeError as error:       # what reading a released weight in the base product's backward raises
        states.append(("backward failed", str(error)))
    assert states == [("adapted.lora_B", "ready"), ("adapted.lora_A", "ready"), ("base backward", "ready"),
                      ("fc1.weight", "released")], states

"""engine.generate (DeepSpeed's Hybrid Engine) on a Hugging Face GPT-2 wrapped by the engine, data-parallel 2 on gloo,
at ZeRO-3, ZeRO-3 with offload_param, and ZeRO-2: sequences and scores equal Hugging Face's `generate` on a plain
copy of the same weights (before and after a training step), with other prompts, padding and lengths on each rank,
ranks in lockstep (synced_gpus) or not; ZeRO-3 gathers each buffer once per call, whatever the number of tokens;
with "hybrid_engine": {"enabled": true} the module's own `generate` (DeepSpeed-Chat's call) takes the same path;
modes and every RNG state are as found after a call, sampled calls draw what Hugging Face draws on those states;
training with generate calls between its steps is bitwise the training without them (dropout on). For megatron's
GPT2Model engine.generate gives generate_from_training_model's tokens in Hugging Face's layout. One launch."""
import copy
import datetime

import pytest
import torch

from megatron.spawn import run_distributed
from megatron.zero.config import load_config
from tests.helpers import count_stage3_gathers
from tests.inference.test_generation import CONFIG

PROMPTS = {0: [[5, 9, 3, 17], [11, 12]], 1: [[60, 61, 7], [1, 2, 3, 4, 5, 6], [8]]}
NEW = {0: 3, 1: 9}                 # data-parallel rank 1 decodes for longer: rank 0 finishes first
PAD = 0
THRESHOLD = 40                     # the LayerNorms (32 elements) stay whole (the persistent buffer); the rest not
STAGES = {"zero3": {"stage": 3}, "zero3_offload": {"stage": 3, "offload_param": {"device": "cpu"}},
          "zero2": {"stage": 2}}


def _hf_model(dropout=0.1):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(1234)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, initializer_range=0.3,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=PAD,
                        eos_token_id=None, pad_token_id=PAD)
    return GPT2LMHeadModel(config)


def _engine(model, zero_config, hybrid=False):
    import mpu
    from megatron import zero
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
              "zero_optimization": dict(zero_config, stage3_param_persistence_threshold=THRESHOLD),
              "hybrid_engine": {"enabled": hybrid, "max_out_tokens": 64, "inference_tp_size": 1}}
    engine, _, _, _ = zero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=config, mpu=mpu, dist_init_required=False)
    if engine.stage3 is not None:            # a rank gathering alone fails in seconds, not minutes
        engine.stage3.gather_timeout = datetime.timedelta(seconds=30)
    return engine


def _left_padded(prompts):
    """(input_ids [b, s], attention_mask [b, s]) of `prompts` left-padded with PAD, as DeepSpeed-Chat feeds them."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def _train_step(engine, step):
    import mpu
    generator = torch.Generator().manual_seed(100 * step + mpu.get_data_parallel_rank())
    tokens = torch.randint(1, 64, (2, 10), generator=generator)
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
    return loss.detach().clone()


def _same(a, b):
    """Sequences equal and scores within 1e-6 of two return_dict_in_generate results."""
    return torch.equal(a.sequences, b.sequences) and len(a.scores) == len(b.scores) and \
        all((x - y).abs().max().item() <= 1e-6 for x, y in zip(a.scores, b.scores))


def _rng_equal(a, b):
    (cpu_a, device_a, tracker_a), (cpu_b, device_b, tracker_b) = a, b
    return torch.equal(cpu_a, cpu_b) and torch.equal(device_a, device_b) and tracker_a.keys() == tracker_b.keys() \
        and all(torch.equal(tracker_a[k], tracker_b[k]) for k in tracker_a)


def _generation_checks(name, zero_config):
    """One engine: its generate against the plain copy's, gathers, modes, RNG states."""
    import mpu
    from mpu.random import get_rng_states
    rank = mpu.get_data_parallel_rank()
    model = _hf_model()
    plain = copy.deepcopy(model).eval()
    engine = _engine(model, zero_config, hybrid=name == "zero3")
    ids, mask = _left_padded(PROMPTS[rank])
    call = dict(attention_mask=mask, max_new_tokens=NEW[rank], pad_token_id=PAD, do_sample=False,
                output_scores=True, return_dict_in_generate=True)
    out = {}
    # before the first forward (stage 3 has recorded no order yet), ranks in lockstep as DeepSpeed-Chat asks
    states = get_rng_states()
    got = engine.generate(ids, synced_gpus=True, **call)
    out["before"] = _same(got, plain.generate(ids, **call))
    out["rng_after_greedy"] = _rng_equal(states, get_rng_states())
    out["training_after"] = all(m.training for m in engine.module.modules())
    out["new_tokens"] = got.sequences.shape[1] - ids.shape[1]
    out["distinct"] = len(set(got.sequences[:, ids.shape[1]:].flatten().tolist()))
    _train_step(engine, 0)
    calls, restore = count_stage3_gathers()
    try:
        counts = []
        for new in (NEW[rank], 12):     # the first call after the step also refreshes the persistent buffer
            del calls[:]
            got = engine.generate(ids, synced_gpus=False, **dict(call, max_new_tokens=new))
            counts.append(len(calls))
            if new == NEW[rank]:
                after_step = got
        if name == "zero3":     # hybrid_engine enabled: DeepSpeed-Chat's call, module.generate, goes the same way
            del calls[:]
            seq = engine.module.generate(ids, attention_mask=mask, max_length=ids.shape[1] + NEW[rank],
                                         pad_token_id=PAD, synced_gpus=True)
            counts.append(len(calls))
    finally:
        restore()
    plain.load_state_dict(engine.module_state_dict())
    out["after_step"] = _same(after_step, plain.generate(ids, **call))
    if name == "zero3":
        out["module_generate"] = torch.equal(seq, plain.generate(ids, **call).sequences)
    if engine.stage3 is not None:
        out["gathers"] = counts
        out["released_buffers"] = sum(not b.persistent for b in engine.stage3.buffers)
        out["live_after"] = engine.stage3.live_parameter_elements()
        out["persistent_elements"] = engine.stage3.persistent.numel
    engine.eval()                            # DeepSpeed-Chat's flow: eval(), generate, train()
    engine.generate(ids, **call)
    out["eval_kept"] = not any(m.training for m in engine.module.modules())
    engine.train()
    # sampled: the draws of Hugging Face's generate on the RNG states found, back-to-back calls continuing them
    torch.manual_seed(11)
    states = get_rng_states()
    sampled = [engine.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD, do_sample=True)
               for _ in range(2)]
    out["rng_after_sampled"] = _rng_equal(states, get_rng_states())
    torch.manual_seed(11)
    reference = [plain.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD, do_sample=True)
                 for _ in range(2)]
    out["sampled"] = all(torch.equal(a, b) for a, b in zip(sampled, reference))
    out["sampled_differ"] = not torch.equal(sampled[0], sampled[1])
    return out


def _training(zero_config, interleave):
    """3 steps with dropout on; before each (step 0 included) a greedy and a sampled generate when `interleave`:
    (losses, the whole weights after)."""
    import mpu
    rank = mpu.get_data_parallel_rank()
    engine = _engine(_hf_model(), zero_config)
    ids, mask = _left_padded(PROMPTS[rank])
    torch.manual_seed(7)
    losses = []
    for step in range(3):
        if interleave:
            engine.generate(ids, attention_mask=mask, max_new_tokens=NEW[rank], pad_token_id=PAD)
            engine.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD, do_sample=True)
        losses.append(_train_step(engine, step))
    return losses, engine.module_state_dict()


def _megatron_model_checks():
    """GPT2Model at ZeRO-3: engine.generate in Hugging Face's layout == generate_from_training_model's tokens."""
    import mpu
    from megatron import zero
    from megatron.model import GPT2Model, GPT2ModelConfig
    from megatron.text_generation import generate_from_training_model
    from mpu.random import get_rng_states
    rank = mpu.get_data_parallel_rank()
    torch.manual_seed(1234)
    mpu.model_parallel_cuda_manual_seed(1234)
    model = GPT2Model(GPT2ModelConfig(**CONFIG), parallel_output=True)
    engine, _, _, _ = zero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config={"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
                                              "zero_optimization": {"stage": 3}}, mpu=mpu, dist_init_required=False)
    ids, mask = _left_padded(PROMPTS[rank])
    seq = engine.generate(ids, attention_mask=mask, max_length=ids.shape[1] + NEW[rank], pad_token_id=PAD)
    tokens = generate_from_training_model(engine, PROMPTS[rank], NEW[rank], greedy=True)
    expected = torch.cat([ids, torch.tensor(tokens)], dim=1)
    states = get_rng_states()
    sampled = engine.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=True, pad_token_id=PAD)
    return {"tokens": torch.equal(seq, expected), "sampled_shape": tuple(sampled.shape),
            "rng": _rng_equal(states, get_rng_states()), "training": all(m.training for m in engine.module.modules())}


def _everything():
    out = {name: _generation_checks(name, zero_config) for name, zero_config in STAGES.items()}
    for name, zero_config in STAGES.items():
        plain, interleaved = _training(zero_config, False), _training(zero_config, True)
        out[name]["losses"] = all(torch.equal(a, b) for a, b in zip(plain[0], interleaved[0]))
        out[name]["weights"] = all(torch.equal(plain[1][k], interleaved[1][k]) for k in plain[1])
        out[name]["losses_vary"] = len({round(x.item(), 6) for x in plain[0]}) == 3
    out["gpt2model"] = _megatron_model_checks()
    return out


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("transformers")
    return run_distributed(_everything, 2, model_parallel_size=1, timeout=600)


@pytest.mark.parametrize("name", list(STAGES))
def test_greedy_equals_hugging_face_generate_on_the_same_weights(results, name):
    for rank, r in enumerate(results):
        case = r[name]
        assert case["before"] and case["after_step"], (rank, case)
        assert case["new_tokens"] == NEW[rank] and case["distinct"] > 1, (rank, case)   # not one repeated token


def test_zero3_gathers_once_per_call_and_releases(results):
    for r in results:
        for name in ("zero3", "zero3_offload"):
            case = r[name]
            # after the step the persistent buffer is stale: refreshed by the first call, then left whole
            assert case["gathers"][0] == case["released_buffers"] + 1, case
            assert case["gathers"][1:] == [case["released_buffers"]] * (len(case["gathers"]) - 1), case
            assert case["live_after"] == case["persistent_elements"], case
        assert r["zero3"]["module_generate"] and len(r["zero3"]["gathers"]) == 3


@pytest.mark.parametrize("name", list(STAGES))
def test_modes_and_rng_states_as_found_and_sampling_draws_as_hugging_face(results, name):
    for r in results:
        case = r[name]
        assert case["training_after"] and case["eval_kept"], case
        assert case["rng_after_greedy"] and case["rng_after_sampled"], case
        assert case["sampled"] and case["sampled_differ"], case


@pytest.mark.parametrize("name", list(STAGES))
def test_training_with_generate_between_steps_is_bitwise_unchanged(results, name):
    for r in results:
        assert r[name]["losses"] and r[name]["weights"] and r[name]["losses_vary"], r[name]


def test_megatron_gpt2_model_delegates_to_generate_from_training_model(results):
    for rank, r in enumerate(results):
        case = r["gpt2model"]
        assert case["tokens"] and case["rng"] and case["training"], case
        assert case["sampled_shape"] == (len(PROMPTS[rank]), max(map(len, PROMPTS[rank])) + 4), case


def test_hybrid_engine_keys_are_accepted_enabled_honoured_the_rest_named():
    raw = {"enabled": True, "max_out_tokens": 512, "inference_tp_size": 2, "release_inference_cache": True,
           "pin_parameters": False, "tp_gather_partition_size": 4, "enable_cuda_graph": False}
    config = load_config({"train_batch_size": 8, "hybrid_engine": raw}, 2)
    assert config.hybrid_engine.enabled
    assert sorted(config.no_effect) == sorted(f"hybrid_engine.{key}" for key in raw if key != "enabled")
    assert not load_config({"train_batch_size": 8}, 2).hybrid_engine.enabled
    with pytest.raises(Exception, match="hybrid_engine.max_out_tokens must be positive, got 0"):
        load_config({"train_batch_size": 8, "hybrid_engine": {"max_out_tokens": 0}}, 2)
    with pytest.raises(Exception, match="hybrid_engine.enabled: expected bool"):
        load_config({"train_batch_size": 8, "hybrid_engine": {"enabled": "yes"}}, 2)


def _module_generate_routes():
    """{enabled: (engine.module.generate is the class's own method, it is the engine's generate)} at stage 2."""
    routes = {}
    for enabled in (False, True):
        engine = _engine(_hf_model(dropout=0.0), STAGES["zero2"], hybrid=enabled)
        own = engine.module.generate
        routes[enabled] = (getattr(own, "__func__", None) is type(engine.module).generate
                           and "generate" not in vars(engine.module), own == engine.generate)
    return routes


def test_hybrid_engine_disabled_leaves_the_modules_own_generate():
    """`"enabled": false` (the zero2 case of the launch above leaves it out of the checks): module.generate stays
    Hugging Face's method; `"enabled": true` reroutes it to engine.generate, as DeepSpeed's engine does."""
    pytest.importorskip("transformers")
    routes = run_distributed(_module_generate_routes, 1, model_parallel_size=1)[0]
    assert routes == {False: (True, False), True: (False, True)}, routes

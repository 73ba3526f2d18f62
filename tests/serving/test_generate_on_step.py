"""generate's on_step (what the server's streams and stop strings ride on): it sees every step's new ids, and a true
return ends the call there with each row's tokens so far, the prefix of the full run's (two rows of different
lengths, static cache and growing cache)."""
from megatron.spawn import run_distributed

PROMPTS = [[5, 9, 3], [11, 60, 61, 7, 33]]


def _runs():
    from megatron.text_generation import generate
    from tests.inference.test_generation import build_model
    model = build_model()
    out = {}
    for static in (True, False):
        full = generate(model, PROMPTS, 8, greedy=True, static_cache=static)
        seen = []

        def stop_after_three(new):
            seen.append(new.tolist())
            return len(seen) == 3
        cut = generate(model, PROMPTS, 8, greedy=True, static_cache=static, on_step=stop_after_three)
        out[static] = (full, cut, seen)
    return out


def test_on_step_sees_each_step_and_stops_the_call():
    for full, cut, seen in run_distributed(_runs, 1, model_parallel_size=1)[0].values():
        assert cut == [row[:3] for row in full]
        assert seen == [[row[step] for row in full] for step in range(3)]

"""The padded vocabulary rows (real vocabulary V padded to a multiple of make-vocab-size-divisible-by x mp) are out
of the softmax: the vocab-parallel loss (eager and fused) and its gradient equal torch's cross entropy over the
first V logits whatever the padded logits hold, their gradient is exactly 0, so the loss equals Hugging Face
GPT-2's on the unpadded vocabulary and a checkpoint resumed at another model-parallel size (another padding)
continues with the saving run's losses."""

import pytest
import torch
import torch.nn.functional as F

from megatron.spawn import run_distributed
from tests.model.test_gpt2_model import CONFIG, copy_into_hf
from tests.checkpoint.test_reshard import BASE, _files, _with
from tests.helpers import set_tracker, train

PADDED = 48   # the unit tests' padded vocabulary: mp2 gives each rank 24 columns


# ---------------------------------------------------------------------------------------------- the loss itself
def _padded_losses(real_vocabs, fused):
    """For each real vocabulary size and each filling of the padded logits: (this rank's loss, gradient of its
    logit slice, torch's loss, torch's gradient of the same slice)."""
    import mpu
    rank, world = mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()
    out = {}
    for real in real_vocabs:
        generator = torch.Generator().manual_seed(real)
        base = torch.randn(3, 5, PADDED, generator=generator) * 4                # [b, s, padded V]
        target = torch.randint(0, real, (3, 5), generator=generator)
        target[0, :2] = torch.tensor([0, real - 1])                              # both ends of the real range
        grad_output = torch.rand(3, 5, generator=generator)
        for filling in ("random", "+50"):
            full = base.clone()
            if filling == "+50":
                full[..., real:] = 50.0
            leaf = full.chunk(world, dim=-1)[rank].clone().requires_grad_()
            logits = leaf * 1     # a non-leaf: the fused backward overwrites the logits it saved
            loss = mpu.vocab_parallel_cross_entropy(logits, target, fused=fused, real_vocab_size=real)
            loss.backward(grad_output)
            reference = full[..., :real].clone().requires_grad_()                # only the real vocabulary
            expected = F.cross_entropy(reference.reshape(-1, real), target.reshape(-1), reduction="none")
            expected.view(3, 5).backward(grad_output)
            expected_grad = torch.cat([reference.grad, torch.zeros(3, 5, PADDED - real)], -1)
            out[real, filling] = (loss.detach(), leaf.grad, expected.detach().view(3, 5),
                                  expected_grad.chunk(world, dim=-1)[rank])
    return out


REAL_VOCABS = (37, 20)


# The fused loss is checked at mp2 only, in tests/model/test_fused_compute.py (whose processes have compiled the
# fused pieces already): its ranks hold every case mp1 would (rank 0 at V = 20: real columns then padding; rank 1:
# real and padded, or only padding).
@pytest.mark.parametrize("model_parallel_size", [1, 2], ids=["1-eager", "2-eager"])
def test_padded_logits_are_out_of_the_loss_and_get_zero_gradient(model_parallel_size):
    """V = 37 padded to 48 (at mp2 rank 1 holds 13 real and 11 padded columns) and V = 20 (rank 1 holds only
    padding); padded logits random or +50: loss and gradient are torch's over the first V logits (1e-6) and the
    padded logits' gradient is exactly 0."""
    assert_padded_losses(run_distributed(_padded_losses, model_parallel_size, args=(REAL_VOCABS, False),
                                         model_parallel_size=model_parallel_size))


def assert_padded_losses(results_by_rank):
    """_padded_losses' results of every rank: torch's loss and gradient (1e-6), exactly 0 on the padding."""
    width = PADDED // len(results_by_rank)
    for rank, results in enumerate(results_by_rank):
        for (real, filling), (loss, grad, expected, expected_grad) in results.items():
            where = (rank, real, filling)
            torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6, msg=lambda m: f"{where}: {m}")
            torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-6, msg=lambda m: f"{where}: {m}")
            first_padded = max(0, min(width, real - rank * width))
            assert not grad[..., first_padded:].any(), where


def _loss_with_real_vocab_above_padded():
    import mpu
    try:
        mpu.vocab_parallel_cross_entropy(torch.zeros(2, PADDED), torch.zeros(2, dtype=torch.long),
                                         real_vocab_size=PADDED + 1)
    except ValueError as error:
        return str(error)
    return None


def test_real_vocab_larger_than_the_logits_is_refused():
    message = run_distributed(_loss_with_real_vocab_above_padded, 1, model_parallel_size=1)[0]
    assert message == f"real_vocab_size {PADDED + 1} is larger than the vocabulary of the logits ({PADDED})", message


# ---------------------------------------------------------------------------------------------- against HF GPT-2
REAL = 37


def _compare_padded_model_with_hf():
    """Our model at padded vocabulary 48 (padded rows large random values) against HF GPT-2 with the 37 real rows."""
    import mpu
    from transformers import GPT2Config, GPT2LMHeadModel
    from megatron.model import GPT2Model, GPT2ModelConfig
    mpu.model_parallel_cuda_manual_seed(1234)
    model = GPT2Model(GPT2ModelConfig(**dict(CONFIG, vocab_size=PADDED, real_vocab_size=REAL)),
                      parallel_output=False).eval()
    with torch.no_grad():
        padded_rows = model.word_embeddings.weight[REAL:]
        padded_rows.copy_(torch.randn(padded_rows.shape, generator=torch.Generator().manual_seed(5)) * 5)
    hf_config = GPT2Config(vocab_size=PADDED, n_positions=CONFIG["max_sequence_length"], n_embd=CONFIG["hidden_size"],
                           n_layer=CONFIG["num_layers"], n_head=CONFIG["num_attention_heads"], resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    hf = GPT2LMHeadModel(hf_config).eval()
    copy_into_hf(model, hf)
    hf.resize_token_embeddings(REAL)                    # keeps the first 37 rows (lm_head stays tied)
    assert torch.equal(hf.lm_head.weight, model.word_embeddings.weight[:REAL])
    tokens = torch.randint(0, REAL, (3, CONFIG["max_sequence_length"]), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        loss = model(inputs, labels=labels).mean()
        hf_loss = hf(input_ids=tokens, labels=tokens).loss
    return loss.item(), hf_loss.item()


def test_loss_with_nonzero_padded_rows_equals_huggingface_on_the_real_vocabulary():
    loss, hf_loss = run_distributed(_compare_padded_model_with_hf, 1, model_parallel_size=1)[0]
    assert abs(loss - hf_loss) <= 1e-5, (loss, hf_loss)


# ---------------------------------------------------------------------------------------------- resume at mp1
SAVE_AT, TOTAL, VOCAB = 3, 7, 1100   # padded with divisible-by 128: 1,280 at mp2, 1,152 at mp1
RESUME_ARGS = _with(BASE, {"--vocab-size": str(VOCAB), "--make-vocab-size-divisible-by": "128",
                           "--train-iters": str(TOTAL)}) + ["--batch-size", "4"]


def test_mp2_checkpoint_resumes_at_mp1_with_the_losses_of_continuing_at_mp2(tmp_path):
    """Saved at mp2 (vocabulary 1,100 padded to 1,280) and resumed at mp1 (re-padded to 1,152 with zero rows):
    the losses of continuing at mp2 (1e-5 relative), and the padded rows' Adam moments in the mp2 checkpoint are
    exactly 0 (their gradient always was)."""
    save_dir = str(tmp_path / "mp2")
    straight = run_distributed(train, 2, args=(RESUME_ARGS + ["--model-parallel-size", "2", "--save", save_dir,
                                                               "--save-interval", str(SAVE_AT)],))[0]
    set_tracker(save_dir, SAVE_AT)
    resumed = run_distributed(train, 1, args=(RESUME_ARGS + ["--load", save_dir],))[0]
    assert resumed["iteration"] == list(range(SAVE_AT + 1, TOTAL + 1))
    expected = straight["lm loss"][SAVE_AT:]
    worst = max(abs(a - b) / abs(b) for a, b in zip(resumed["lm loss"], expected))
    print(f"mp2 -> mp1 resume: worst relative loss difference {worst:.3g}")
    assert worst <= 1e-5, (resumed["lm loss"], expected)
    for rank, saved in enumerate(_files(save_dir, SAVE_AT, 2)):      # rank 0: rows 0..639, rank 1: 640..1279
        names = [n for group in saved["param_names"] for n in group]
        state = saved["optimizer"]["state"][names.index("word_embeddings.weight")]
        first_padded = VOCAB - 640 * rank
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key][:first_padded].any() and not state[key][first_padded:].any(), (rank, key)

"""Reproducers: a real `deepspeed.initialize` (CPU) in bf16 on two models loaded in fp32 that compute with buffers, two
SGD steps each: Linear-BatchNorm1d-Linear (the running statistics) and a tiny M2M100 (its sinusoidal position table,
in a module without parameters). Stock fails at the first forward; a run that trains must end with the weights (and
buffers) of stock's run with `"data_types": {"buffer_dtype": "bf16"}`, DeepSpeed's own way to cast them, bit for bit.

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

MISMATCHES = ("expected scalar type BFloat16 but found Float", "must have the same dtype",
              "expect parameter to have scalar type of Float")


def batchnorm_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))


def m2m100_model():
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    torch.manual_seed(0)
    config = M2M100Config(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                          decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                          max_position_embeddings=32, pad_token_id=1, decoder_start_token_id=2, dropout=0.1)
    return M2M100ForConditionalGeneration(config)


def batchnorm_loss(engine, step):
    import torch

    generator = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=generator).to(torch.bfloat16)
    return (engine(x).float() ** 2).mean()


def m2m100_loss(engine, step):
    import torch

    ids = torch.tensor([[5 + step, 6, 7, 2], [8, 9 + step, 10, 2]])
    return engine(input_ids=ids, labels=ids).loss


def trained(make, loss_of, stage, **data_types):
    """{name: tensor} of the model's parameters and buffers after two bf16 SGD steps at ZeRO `stage`."""
    import torch

    from dspatch.scenario import gathered_whole, init_deepspeed

    deepspeed = init_deepspeed()
    model = make()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_allow_untested_optimizer": True, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage}, **({"data_types": data_types} if data_types else {})}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    torch.manual_seed(1)  # the model's dropout draws the same numbers in both runs
    for step in range(2):
        engine.backward(loss_of(engine, step))
        engine.step()
    return {**gathered_whole(engine.module.named_parameters()),
            **{name: b.detach().clone() for name, b in engine.module.named_buffers()}}


def judge(make, loss_of, stages, what):
    for stage in stages:
        try:
            got = trained(make, loss_of, stage)
        except RuntimeError as error:
            if any(m in str(error) for m in MISMATCHES):
                raise BugSeen(f"{what} at ZeRO-{stage}: the first forward fails on buffers left in fp32: "
                              f"{str(error).splitlines()[0]}") from error
            raise
        want = trained(make, loss_of, stage, buffer_dtype="bf16")
        differ = [n for n in want if n not in got or got[n].dtype != want[n].dtype or not got[n].equal(want[n])]
        if differ or set(got) != set(want):
            raise AssertionError(f"{what} at ZeRO-{stage}: not the run buffer_dtype bf16 gives: {differ[:4]}")


def batchnorm():
    """Linear-BatchNorm1d-Linear in fp32, bf16 at ZeRO-2 and ZeRO-3: trains as with buffer_dtype bf16, to the bit."""
    judge(batchnorm_model, batchnorm_loss, (2, 3), "a BatchNorm model loaded in fp32, bf16")


def sinusoidal():
    """A tiny M2M100 in fp32 (dropout on), bf16 at ZeRO-0 and ZeRO-1: trains as with buffer_dtype bf16, to the bit."""
    judge(m2m100_model, m2m100_loss, (0, 1), "an M2M100 loaded in fp32, bf16")


PROOF = Proof(
    scenarios={"batchnorm": batchnorm, "sinusoidal": sinusoidal},
    expected_on_stock={"batchnorm": "the first forward fails on buffers left in fp32",
                       "sinusoidal": "the first forward fails on buffers left in fp32"},
    releases_checked=("0.19.2", "0.19.8"),
    proven_in=("ds0192",),
)

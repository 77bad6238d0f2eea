"""Reproducers: a real Accelerator with the DeepSpeed plugin (CPU, one process) on a tiny Llama, a custom loop of 3
optimizer steps (accumulation 1), each `accelerator.backward(out.loss); accelerator.clip_grad_norm_(model.parameters(),
0.01); optimizer.step(); optimizer.zero_grad()`, SGD at rate 1 (an update is the clipped gradient itself), the config's
`gradient_clipping` 1.0, at ZeRO-0, ZeRO-2 and ZeRO-3 (fp32), against plain torch clipping the first step at 1.0 (it
ran inside `accelerator.backward`, before the call) and the next two at 0.01.

Tolerance: relative 1e-5 (flat fp32 buffers sum in another order); the bug moves the weights of the last two steps by
a hundred times the norm asked for. Where the weights differ, the reproducer says "bug" only if they are exactly those
of every step clipped at 1.0, and fails with an error otherwise.

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

STEPS, LR, CONFIGURED, ASKED, RTOL = 3, 1.0, 1.0, 0.01, 1e-5


def config(stage, clipping=CONFIGURED):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "gradient_clipping": clipping, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage}}


def clipped_loop(stage, max_norm=ASKED, clipping=CONFIGURED):
    """The weights (whole, gathered at ZeRO-3) after STEPS steps of the loop above."""
    import torch

    from dspatch.scenario import gathered_whole, init_deepspeed, lm_batches, reset_accelerate, tiny_llama

    init_deepspeed()
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    reset_accelerate()
    try:
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config(stage, clipping)))
        model = tiny_llama()
        rows = [{key: value[0] for key, value in batch.items()} for batch in lm_batches(STEPS)]
        loader = torch.utils.data.DataLoader(rows, batch_size=1)
        engine, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR), loader)
        if type(engine).__name__ != "DeepSpeedEngine":
            raise AssertionError(f"accelerate prepared {type(engine).__name__}, not DeepSpeed")
        for batch in loader:
            accelerator.backward(engine(**batch).loss)
            accelerator.clip_grad_norm_(engine.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad()
        return gathered_whole(engine.module.named_parameters())
    finally:
        reset_accelerate()


def plain_torch(norms):
    """The weights after one plain-torch SGD step per micro-batch, step i's gradient clipped at norms[i]."""
    import torch

    from dspatch.scenario import lm_batches, lm_loss, tiny_llama, weights

    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for batch, norm in zip(lm_batches(STEPS), norms):
        lm_loss(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), norm)
        optimizer.step()
        optimizer.zero_grad()
    return weights(model)


def asked_norm_applied(stage):
    from dspatch.scenario import worst

    got = clipped_loop(stage)
    off = worst(got, plain_torch([CONFIGURED] + [ASKED] * (STEPS - 1)))
    if off <= RTOL:
        return
    if worst(got, plain_torch([CONFIGURED] * STEPS)) <= RTOL:
        raise BugSeen(f"accelerator.clip_grad_norm_(max_norm={ASKED}) at ZeRO-{stage}: DeepSpeed clipped every step "
                      f"at its config's {CONFIGURED}, max_norm ignored (weights {off:.0%} off)")
    raise AssertionError(f"weights {off:.2e} off plain torch, and not as every step clipped at {CONFIGURED}")


def zero0():
    asked_norm_applied(0)


def zero2():
    asked_norm_applied(2)


def zero3():
    asked_norm_applied(3)


IGNORED = "max_norm ignored"
PROOF = Proof(
    scenarios={"zero2": zero2, "zero0": zero0, "zero3": zero3},
    expected_on_stock={"zero2": IGNORED, "zero0": IGNORED, "zero3": IGNORED},
    releases_checked=("0.34.0", "1.15.0"),
    others_with_and_without=({"deepspeed": "0.16.3"}, {"deepspeed": None}),  # the bug needs DeepSpeed, any
    silent="max_norm not applied, no message: proven by numbers",
)

"""Reproducers: a real Accelerator with the DeepSpeed plugin (ZeRO-2, CPU, one process) on a tiny Llama, a custom loop
over `accelerator.accumulate(model)` with gradient accumulation 3 and a prepared dataloader of 4 batches, 2 epochs, SGD
(an update is the gradient itself), against plain torch taking the same optimizer steps accelerate's accumulation
means: each epoch's windows [1, 2, 3] and [4] (accelerate syncs at the end of the dataloader).

Tolerance: relative 1e-5, as deepspeed/zero2-offload-grad-accum's reproducers (flat fp32 buffers sum in another order);
the bug moves weights by tens of percent. Where the weights differ, the reproducer says "bug" only if they are exactly
those of DeepSpeed's own count (windows [1, 2, 3] and [4, 1, 2] across the epochs; the last window never applied), and
fails with an error otherwise.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

GA, BATCHES, EPOCHS, LR, RTOL = 3, 4, 2, 0.5, 1e-5


def _micro_batches():
    """The epochs' micro-batches in order (the dataloader's batches of one example, EPOCHS times)."""
    from dspatch.scenario import lm_batches

    return lm_batches(BATCHES) * EPOCHS


def plain_torch(index_windows):
    """The weights after one SGD step per window (lists of micro-batch indices into the epochs' sequence), each
    micro-batch's loss divided by GA, as accelerate's loop divides it."""
    from dspatch.scenario import sgd_windows, tiny_llama

    sequence = _micro_batches()
    return sgd_windows(tiny_llama(), [[(sequence[i], GA) for i in window] for window in index_windows], LR)


def accelerate_loop(batches=BATCHES, stage=2, accumulate=True, accelerators_ga=GA):
    """The weights after EPOCHS epochs of `with accelerator.accumulate(model): accelerator.backward(out.loss);
    optimizer.step(); optimizer.zero_grad()` under DeepSpeed at ZeRO `stage`, over a dataloader of `batches`
    (`accumulate=False`: the same loop without `accelerator.accumulate`, DeepSpeed counting alone;
    `accelerators_ga`: the Accelerator's own accumulation, the DeepSpeed config's being GA)."""
    import contextlib

    import torch

    from dspatch.scenario import init_deepspeed, lm_batches, reset_accelerate, tiny_llama, weights

    init_deepspeed()
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GA, "steps_per_print": 10**6,
              "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage}}
    reset_accelerate()
    try:
        accelerator = Accelerator(gradient_accumulation_steps=accelerators_ga, deepspeed_plugin=DeepSpeedPlugin(
            hf_ds_config=config, gradient_accumulation_steps=GA if accelerators_ga == GA else None))
        model = tiny_llama()
        rows = [{key: value[0] for key, value in batch.items()} for batch in lm_batches(BATCHES)[:batches]]
        loader = torch.utils.data.DataLoader(rows, batch_size=1)
        engine, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR), loader)
        if type(engine).__name__ != "DeepSpeedEngine" or engine.gradient_accumulation_steps() != GA:
            raise AssertionError(f"accelerate prepared {type(engine).__name__}, not DeepSpeed at accumulation {GA}")
        for _ in range(EPOCHS):
            for batch in loader:
                with accelerator.accumulate(engine) if accumulate else contextlib.nullcontext():
                    accelerator.backward(engine(**batch).loss)
                    optimizer.step()
                    optimizer.zero_grad()
    finally:
        reset_accelerate()
    return weights(model)


def epochs_ga_does_not_divide():
    """4 batches per epoch at accumulation 3, 2 epochs: the steps accelerate's accumulation means (per epoch, [1, 2, 3]
    and [4]), as plain torch takes them."""
    from dspatch.scenario import worst

    got = accelerate_loop()
    off = worst(got, plain_torch([[0, 1, 2], [3], [4, 5, 6], [7]]))
    if off <= RTOL:
        return
    if worst(got, plain_torch([[0, 1, 2], [3, 4, 5]])) <= RTOL:
        raise BugSeen(f"accelerator.accumulate with DeepSpeed, {BATCHES} batches per epoch at accumulation {GA}: "
                      f"DeepSpeed stepped at its own count, windows across epochs, the last one never applied "
                      f"(weights {off:.0%} off accelerate's steps)")
    raise AssertionError(f"weights {off:.2e} off plain torch, and not as DeepSpeed's own count steps")


PROOF = Proof(
    scenarios={"epochs_ga_does_not_divide": epochs_ga_does_not_divide},
    expected_on_stock={"epochs_ga_does_not_divide": "DeepSpeed stepped at its own count, windows across epochs"},
    # The releases of accelerate that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.20.0", "1.8.1"),
    others_with_and_without=({"deepspeed": "0.14.4"}, {"deepspeed": None}),  # the bug needs DeepSpeed, any
    silent="the wrong micro-batches per optimizer step, no message: proven by numbers",
)

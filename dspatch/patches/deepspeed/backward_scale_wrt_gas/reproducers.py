"""Reproducers: real deepspeed.initialize at ZeRO-1 (CPU, one process) on a tiny Llama, gradient accumulation 3, two
SGD steps (an update is the gradient itself): a raw loop that divides its loss by GA itself and passes
`scale_wrt_gas=False`, against plain torch, and the real Trainer (transformers >= 4.49 passes `scale_wrt_gas=False`)
against the same Trainer run without DeepSpeed. A silent bug, proven by numbers.

The raw loop computes its loss from the logits outside the model (the model is called without labels), so its output
holds one tensor on the graph and only this bug can show there, not `deepspeed/output-hooks-gas-per-tensor`. The
Trainer's model returns the loss and the logits, so on 0.18.3 stock meets both (9 times too small at GA 3), and either
patch sets it right. Tolerance (relative 1e-5) as in deepspeed/output-hooks-gas-per-tensor's reproducers; a difference
of another shape than "GA (or GA^2) times too small" is an error, not the bug.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.scenario import weights, worst
from dspatch.spec import BugSeen, Proof
from dspatch.patches.deepspeed.output_hooks_gas_per_tensor.reproducers import (
    GA, LR, RTOL, STEPS, engine_weights, plain_torch)


def outside_loss(out, batch):
    """The causal LM loss from the logits, as a user's own loss function computes it (shifted, mean over tokens)."""
    import torch

    return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())


def raw_loop_divides_itself():
    """`out = engine(input_ids=...)`; `engine.backward(my_loss(out.logits) / GA, scale_wrt_gas=False)`;
    `engine.step()` at accumulation 3: plain torch's weights."""
    got = engine_weights(loss_of=lambda out, batch: outside_loss(out, batch) / GA, labels=False, scale_wrt_gas=False)
    off = worst(got, plain_torch(loss_of=outside_loss))
    if off <= RTOL:
        return
    if worst(got, plain_torch(lr=LR / GA, loss_of=outside_loss)) <= RTOL:
        raise BugSeen(f"engine.backward(loss, scale_wrt_gas=False), accumulation {GA}: the gradient divided by {GA} "
                      f"all the same (weights {off:.0%} off plain torch)")
    raise AssertionError(f"weights {off:.2e} off plain torch, and not as this bug scales them")


def trainer():
    """The Trainer at ZeRO-1, accumulation 3: the grad_norm of every step and the final weights of the same Trainer run
    without DeepSpeed."""
    without = _trainer(None)  # first: a Trainer with DeepSpeed leaves its config in force for later ones of the process
    with_ds = _trainer(1)
    ratios = [b / a for a, b in zip(with_ds[0], without[0])]
    off = worst(with_ds[1], without[1])
    if off <= RTOL and all(abs(r - 1) <= RTOL for r in ratios):
        return
    # the first step starts from the same weights: its grad_norm is too small by exactly the bug's factor (later steps
    # start from weights the bug already moved)
    for factor in (GA, GA * GA):  # this bug alone, or with deepspeed/output-hooks-gas-per-tensor on the logits
        if abs(ratios[0] / factor - 1) <= RTOL * factor and off > RTOL:
            raise BugSeen(f"the Trainer under DeepSpeed (scale_wrt_gas=False), accumulation {GA}: grad_norm "
                          f"{with_ds[0][0]:.4g} at the first step where the run without DeepSpeed logs "
                          f"{without[0][0]:.4g} ({factor} times too small)")
    raise AssertionError(f"grad_norm ratios {ratios}, weights {off:.2e} apart: not this bug's shape")


def _trainer(stage):
    """(grad_norm of each step, final weights) of the Trainer at accumulation GA; `stage` None: without DeepSpeed."""
    from dspatch.scenario import init_deepspeed, lm_rows, sgd_trainer, tiny_llama

    config = None
    if stage is not None:
        init_deepspeed()
        config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                  "gradient_clipping": "auto", "steps_per_print": 10**6, "zero_allow_untested_optimizer": True,
                  "zero_optimization": {"stage": stage}}
    rows = lm_rows(STEPS * GA, 8)  # the engine loops' micro-batches, as the Trainer's dataset
    model = tiny_llama()
    trainer, norms = sgd_trainer(model, rows, config, 1, GA, STEPS, lr=LR)
    if stage is not None and trainer.deepspeed.gradient_accumulation_steps() != GA:
        raise AssertionError(f"the Trainer ran DeepSpeed at accumulation {trainer.deepspeed.gradient_accumulation_steps()}")
    return norms, weights(model)


PROOF = Proof(
    scenarios={"raw_loop_divides_itself": raw_loop_divides_itself, "trainer": trainer},
    expected_on_stock={"raw_loop_divides_itself": "scale_wrt_gas=False), accumulation 3: the gradient divided by 3 all",
                       "trainer": "the Trainer under DeepSpeed (scale_wrt_gas=False), accumulation 3: grad_norm"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.18.2", "0.18.9"),
    silent="every gradient GA times too small, no message: proven by numbers",
    # pins no stack of the matrix has: these sessions of the noxfile prove it too
    proven_in=("ds0183",),
)

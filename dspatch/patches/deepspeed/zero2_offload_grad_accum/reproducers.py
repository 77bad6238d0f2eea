"""Reproducers: real deepspeed.initialize at ZeRO-2 with the optimizer offloaded to the CPU (CPU, one process), on a
tiny Llama, gradient accumulation 3 and 4: the raw engine loop and the Trainer. A silent bug, proven by numbers.

The engine loop is `dspatch canary`'s comparison (dspatch.canary.reference): each step's gradient and update against
plain torch's (each micro-batch's loss / GA, backward, step), relative 1e-5 (flat fp32 buffers sum in another order than
per-parameter ones; the bug leaves whole micro-batches out), and a divergence of any other shape than this bug's is an
error. The Trainer runs the same recipe at ZeRO-2 and at ZeRO-1, both offloaded: ZeRO-1 reduces only at the boundary and
is right on every release, so the two must log the same grad_norm at every step and end with the same weights.

Where the numbers differ, the Trainer checks that every step's grad_norm and the weights differ before it says so; any
other difference is an error. The Trainer's runs are checked to be the ones meant (DeepSpeed at that
stage, the optimizer offloaded, accumulation 4).

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

STEPS, LR, RTOL = 2, 0.5, 1e-5


def _config(stage, accumulation, offload=True, **extra):
    zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulation,
            "steps_per_print": 10**6, "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,  # deepspeed >= 0.19 clips at 1.0 unless told: here an update is the gradient
            # the CPU runs the offload path with a torch optimizer (DeepSpeed's CPU Adam is a JIT-built op)
            "zero_force_ds_cpu_optimizer": False, "zero_optimization": zero, **extra}


def engine_weights(stage, accumulation, offload=True):
    """The weights after STEPS SGD steps of `engine.backward(loss); engine.step()` over one micro-batch at a time."""
    import torch

    from dspatch.scenario import init_deepspeed, lm_batches, tiny_llama, weights

    deepspeed = init_deepspeed()
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=_config(stage, accumulation, offload))
    for batch in lm_batches(STEPS * accumulation):
        engine.backward(engine(**batch).loss)
        engine.step()
    return weights(model)


def engine_loop(accumulation, offload, shape, what):
    """ZeRO-2's raw loop at `accumulation` (the optimizer offloaded or not) against plain torch, by `dspatch canary`'s
    own comparison (dspatch.canary.reference: every step's gradient and update): BugSeen(what...) where the first
    divergence has the bug's `shape` ("middle_dropped": each window's first and last micro-batch only; "last_only")."""
    from dspatch.canary import expect_shape, in_process

    record, found = in_process(_config(2, accumulation, offload))
    if record.error:
        raise AssertionError(f"{what}: the run failed: {record.error}")
    expect_shape(found, shape, what)


def engine_loop_ga3():
    """`engine.backward(loss); engine.step()` over two epochs of 7 micro-batches at accumulation 3: every step's
    gradient and update as plain torch's."""
    engine_loop(3, True, "middle_dropped", "ZeRO-2 + offloaded optimizer, accumulation 3: the update took "
                                           "micro-batches 1 and 3 of each window only")


def trainer_ga4():
    """The Trainer at accumulation 4, optimizer offloaded to the CPU: ZeRO-2 logs ZeRO-1's grad_norm and ends with
    its weights."""
    zero2_against_zero1("ZeRO-2 + offloaded optimizer in the Trainer, accumulation 4", offload=True)


def zero2_against_zero1(what, offload):
    """The Trainer at accumulation 4 at ZeRO-2 and at ZeRO-1 (right on every release): the same grad_norm at every
    step and the same weights, or BugSeen(what...) where every step's grad_norm and the weights differ."""
    from dspatch.scenario import worst

    zero2, zero1 = _trainer(2, offload=offload), _trainer(1, offload=offload)
    norms = [(a, b) for a, b in zip(zero2[0], zero1[0]) if abs(a - b) > RTOL * max(abs(a), abs(b))]
    off = worst(zero2[1], zero1[1])
    if not norms and off <= RTOL:
        return
    if len(norms) == STEPS and off > RTOL:  # the bug's shape here: every step's gradient, and so the weights
        raise BugSeen(f"{what}: grad_norm {', '.join(f'{a:.4g}' for a, _ in norms)} where ZeRO-1 logs "
                      f"{', '.join(f'{b:.4g}' for _, b in norms)} (weights {off:.0%} apart)")
    raise AssertionError(f"grad_norm differences {norms}, weights {off:.2e} apart: not this bug's shape")


def _trainer(stage, accumulation=4, offload=True):
    """(grad_norm of each step, final weights) of the Trainer at ZeRO `stage` (the optimizer offloaded or not)."""
    from dspatch.scenario import init_deepspeed, lm_rows, sgd_trainer, tiny_llama, weights

    init_deepspeed()
    rows = lm_rows(STEPS * accumulation, 8)  # the engine loop's micro-batches, as the Trainer's dataset
    config = _config(stage, "auto", offload, train_micro_batch_size_per_gpu="auto", gradient_clipping="auto")
    model = tiny_llama()
    trainer, norms = sgd_trainer(model, rows, config, 1, accumulation, STEPS, lr=LR)
    engine = trainer.deepspeed  # the run compared is the one meant: DeepSpeed, this stage, offload, this GA
    ran = engine and (engine.zero_optimization_stage(), getattr(engine.optimizer, "cpu_offload", None),
                      engine.gradient_accumulation_steps())
    if ran != (stage, offload, accumulation):
        raise AssertionError(f"the Trainer ran (ZeRO stage, offload, GA) {ran}, wanted {(stage, offload, accumulation)}")
    return norms, weights(model)


PROOF = Proof(
    scenarios={"engine_loop_ga3": engine_loop_ga3, "trainer_ga4": trainer_ga4},
    expected_on_stock={"engine_loop_ga3": "the update took micro-batches 1 and 3 of each window only",
                       "trainer_ga4": "ZeRO-2 + offloaded optimizer in the Trainer, accumulation 4: grad_norm"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.14.0", "0.19.8"),
    silent="micro-batches dropped from the gradient, no message: proven by numbers",
)

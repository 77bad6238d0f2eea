"""Reproducers: `dspatch canary`'s own comparison, in this process: a real engine at ZeRO-1 and at ZeRO-2 with the
optimizer offloaded to the CPU (fp32, the canary's torch AdamW, accumulation 1) on a tiny Llama, two `engine.backward()`
calls before each `engine.step()`, with and without `set_gradient_accumulation_boundary`, each step's gradient and
update checked against plain torch's, which sums the two micro-batches (dspatch.canary.reference). A silent bug,
proven by numbers.

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import Proof


def _two_backwards_a_step(stage, boundary_call):
    from dspatch.canary import expect_shape, in_process

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    what = f"ZeRO-{stage} offloaded, two backwards a step{' (boundary call)' if boundary_call else ''}"
    record, found = in_process(config, backwards=2, boundary_call=boundary_call)
    if record.error:
        raise AssertionError(f"{what}: the run failed: {record.error}")
    expect_shape(found, "last_only", what)


def stage1_two_backwards():
    """ZeRO-1 offloaded, two engine.backward() a step: every step's gradient is the two micro-batches' sum."""
    _two_backwards_a_step(1, boundary_call=False)


def stage2_two_backwards():
    """ZeRO-2 offloaded, two engine.backward() a step: every step's gradient is the two micro-batches' sum."""
    _two_backwards_a_step(2, boundary_call=False)


def stage2_boundary_call():
    """ZeRO-2 offloaded, set_gradient_accumulation_boundary(False) before the first of two backwards: the sum."""
    _two_backwards_a_step(2, boundary_call=True)


PROOF = Proof(
    scenarios={"stage1_two_backwards": stage1_two_backwards, "stage2_two_backwards": stage2_two_backwards,
               "stage2_boundary_call": stage2_boundary_call},
    expected_on_stock={"stage1_two_backwards": "ZeRO-1 offloaded, two backwards a step",
                       "stage2_two_backwards": "ZeRO-2 offloaded, two backwards a step",
                       "stage2_boundary_call": "ZeRO-2 offloaded, two backwards a step (boundary call)"},
    stock_fails_on={"stage2_boundary_call": "<0.19.0"},  # 0.19.0 saves a non-boundary gradient (PR 7981)
    silent="only the last backward's micro-batch trains, no message: proven by numbers",
    releases_checked=("0.14.4", "0.19.8"),
    proven_in=("ds0183", "ds0182", "ds0192"),
)

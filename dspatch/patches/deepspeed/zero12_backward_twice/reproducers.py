"""Reproducers: `dspatch canary`'s own comparison, in this process: a real engine at ZeRO-1 and at ZeRO-2 (fp32, the
canary's torch AdamW, accumulation 1) on a tiny Llama, two `engine.backward()` calls before each `engine.step()`,
each step's gradient and update checked against plain torch's, which sums the two micro-batches
(dspatch.canary.reference).

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
import sys

from dspatch.spec import BugSeen, Proof


def _two_backwards_a_step(stage):
    from dspatch.canary import expect_shape, in_process

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage}}
    record, found = in_process(config, backwards=2)
    if record.error:
        print(record.error.split("\n", 1)[1], file=sys.stderr)  # upstream's traceback, as the job's log shows it
        if record.error.startswith("TypeError") and "independent_gradient_partition_epilogue" in record.error:
            raise BugSeen(f"ZeRO-{stage}, two backwards a step: the second fails in the epilogue: "
                          f"{record.error.splitlines()[0]}")
        raise AssertionError(f"ZeRO-{stage}, two backwards a step: the run failed otherwise: {record.error}")
    expect_shape(found, "last_only", f"ZeRO-{stage}, two backwards a step")


def stage1_two_backwards():
    """ZeRO-1, two engine.backward() a step: every step's gradient is the two micro-batches' sum, as plain torch's."""
    _two_backwards_a_step(1)


def stage2_two_backwards():
    """ZeRO-2, two engine.backward() a step: every step's gradient is the two micro-batches' sum, as plain torch's."""
    _two_backwards_a_step(2)


PROOF = Proof(
    scenarios={"stage1_two_backwards": stage1_two_backwards, "stage2_two_backwards": stage2_two_backwards},
    expected_on_stock={"stage1_two_backwards": "ZeRO-1, two backwards a step",
                       "stage2_two_backwards": "ZeRO-2, two backwards a step"},
    silent="only the last backward's micro-batch trains, no message: proven by numbers",
    loud_on=">=0.17.6,<0.18.3",  # the second backward's TypeError in the epilogue
    releases_checked=("0.17.6", "0.19.8"),
    # pins no stack of the matrix has: these sessions of the noxfile prove it too
    proven_in=("ds0183", "ds0182", "ds0192"),
)

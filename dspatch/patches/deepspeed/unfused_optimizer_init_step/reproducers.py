"""Reproducers: `dspatch canary`'s own comparison, in this process: a real engine at ZeRO stage 0 in bf16 with torch's
AdamW (the canary's client optimizer), the raw engine loop over two epochs of a tiny Llama, each step checked
against plain torch's mixed precision from the weights DeepSpeed had (dspatch.canary.reference).

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import Proof

CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
          "zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}


def stage0_bf16_adamw_trains_as_torch():
    """ZeRO-0 bf16 with torch's AdamW: every step's gradient and update equal plain torch's mixed precision."""
    from dspatch.canary import expect_shape, in_process

    _, found = in_process(CONFIG)
    expect_shape(found, "adam_step_early", "ZeRO-0 bf16 with torch AdamW")


PROOF = Proof(
    scenarios={"stage0_bf16_adamw_trains_as_torch": stage0_bf16_adamw_trains_as_torch},
    expected_on_stock={"stage0_bf16_adamw_trains_as_torch": "as Adam's second step, not its first"},
    silent="the run trains without an error, its first updates smaller and its weights decayed once",
    releases_checked=("0.17.0", "0.19.8"),
)

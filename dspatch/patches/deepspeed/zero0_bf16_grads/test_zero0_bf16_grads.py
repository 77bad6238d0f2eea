"""deepspeed/zero0-bf16-grads beyond the shared proofs (the ds0182 and ds0183 sessions): where the bug cannot happen
(bf16 at ZeRO-1, fp32 at ZeRO-0) every patch active leaves the numbers stock's to the bit; at accumulation 3 every
patch active lands on plain torch, where on 0.18.3 this bug meets the output hooks' (deepspeed/output-hooks-gas-per-
tensor, backward-scale-wrt-gas)."""
import pytest

from conftest import stock_and_patched

pytestmark = pytest.mark.stack

PID = "deepspeed/zero0-bf16-grads"

RUNS = r'''
import json
import torch
from dspatch import _runtime
from dspatch.patches.deepspeed.zero0_bf16_grads.reproducers import (
    LR, RTOL, STEPS, _batches, _config, _engine_weights, _plain_torch)
from dspatch.scenario import digest, init_deepspeed, lm_batches, lm_loss, on_accelerator, tiny_llama, worst

deepspeed = init_deepspeed()
batches = _batches()


def train(config):
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=config)
    for batch in batches:
        engine.backward(lm_loss(engine, batch))
        engine.step()
    return {name: p.detach().float() for name, p in model.named_parameters()}


zero1 = train(_config(1))
fp32 = dict(_config(0))
fp32.pop("bf16")
fp32_zero0 = train(fp32)
# accumulation 3 on 0.18.3, where bugs 3, 4 and 7 meet: a Hugging Face model's out.loss also meets the output hooks
windows = [{key: on_accelerator(value) for key, value in batch.items()} for batch in lm_batches(STEPS * 3)]
composed_off = worst(_engine_weights(windows, accumulation=3), _plain_torch(windows, accumulation=3))
print(json.dumps({"applied": _runtime.applied_ids(), "zero1": digest(zero1), "fp32_zero0": digest(fp32_zero0),
                  "zero1_off": worst(zero1, _plain_torch(batches)),
                  "composed_off": composed_off, "rtol": RTOL}))
'''


@pytest.fixture(scope="module")
def runs():
    return stock_and_patched([PID], RUNS, {"DSPATCH": "1"}, "every_patch")


def test_where_the_bug_cannot_happen_every_patch_leaves_stocks_numbers_to_the_bit(runs):
    """bf16 at ZeRO-1 (DeepSpeed's ZeRO optimizer clears its own gradients and scales bf16 by 1) and fp32 at ZeRO-0
    (no fp16 optimizer at all): stock is right, and unchanged."""
    stock, patched = runs["stock"], runs["every_patch"]
    assert stock["applied"] == [] and PID in patched["applied"]
    for name in ("zero1", "fp32_zero0"):
        assert patched[name] == stock[name], name
    assert stock["zero1_off"] <= stock["rtol"]  # ZeRO-1 is plain torch's mixed precision: the reference holds


def test_with_accumulation_every_patch_composes(runs):
    """bf16 at stage 0, accumulation 3, `engine.backward(engine(**batch).loss)`: with every patch active, plain torch's
    weights (on 0.18.3 the output hooks' patches act in the same backward); stock is off."""
    stock, patched = runs["stock"], runs["every_patch"]
    assert patched["composed_off"] <= patched["rtol"], patched["composed_off"]
    assert stock["composed_off"] > 0.1

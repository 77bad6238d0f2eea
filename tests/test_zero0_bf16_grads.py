"""deepspeed/zero0-bf16-grads beyond the shared proofs (the ds0182 and ds0183 sessions): where the bug cannot happen
(bf16 at ZeRO-1, fp32 at ZeRO-0) every patch active leaves the numbers stock's to the bit; a stock checkpoint's loss
scale (65536, as stock 0.18.3-0.18.5 writes it) loaded into a patched bf16 engine divides nothing (the scale is given
again before every step); at accumulation 3 every patch active lands on plain torch, where on 0.18.3 this bug meets
the output hooks' (deepspeed/output-hooks-gas-per-tensor, backward-scale-wrt-gas)."""
import pytest


from conftest import stock_and_patched

pytestmark = pytest.mark.stack

PID = "deepspeed/zero0-bf16-grads"

RUNS = r'''
import json
import torch
from dspatch import _runtime
from dspatch.patches.deepspeed.zero0_bf16_grads_reproducers import (
    LR, RTOL, SCALE, STEPS, _batches, _config, _engine_weights, _plain_torch)
from dspatch.scenario import digest, init_deepspeed, lm_batches, lm_loss, on_accelerator, tiny_llama, worst

deepspeed = init_deepspeed()
batches = _batches()


def train(config, before=None):
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=config)
    for step, batch in enumerate(batches):
        if before and step == 1:
            before(engine)
        engine.backward(lm_loss(engine, batch))
        engine.step()
    return engine, {name: p.detach().float() for name, p in model.named_parameters()}


def stock_scale(engine):
    """The optimizer's state as stock 0.18.3-0.18.5 writes it in a checkpoint, loaded back (a resume)."""
    state = engine.optimizer.state_dict()
    state.update(dynamic_loss_scale=True, cur_scale=SCALE, last_overflow_iter=-1, scale_factor=2.0, scale_window=1000)
    engine.optimizer.load_state_dict(state)


zero1 = train(_config(1))[1]
fp32 = dict(_config(0))
fp32.pop("bf16")
fp32_zero0 = train(fp32)[1]
engine, resumed = train(_config(0), before=stock_scale)
# accumulation 3 on 0.18.3, where bugs 3, 4 and 7 meet: a Hugging Face model's out.loss also meets the output hooks
windows = [{key: on_accelerator(value) for key, value in batch.items()} for batch in lm_batches(STEPS * 3)]
composed_off = worst(_engine_weights(windows, accumulation=3), _plain_torch(windows, accumulation=3))
print(json.dumps({"applied": _runtime.applied_ids(), "zero1": digest(zero1), "fp32_zero0": digest(fp32_zero0),
                  "zero1_off": worst(zero1, _plain_torch(batches)), "resumed_off": worst(resumed, _plain_torch(batches)),
                  "composed_off": composed_off,
                  "optimizer": type(engine.optimizer).__name__, "rtol": RTOL}))
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


def test_a_stock_checkpoints_loss_scale_divides_nothing(runs):
    """After load_state_dict of the state stock writes (dynamic scale 65536), the patched bf16 engine still lands on
    plain torch; stock does not (on 0.17.6-0.18.2 its backward multiplies by the scale it divides by, but the
    gradients still pile up)."""
    stock, patched = runs["stock"], runs["every_patch"]
    assert patched["optimizer"] == "FP16_UnfusedOptimizer"
    assert patched["resumed_off"] <= patched["rtol"]
    assert stock["resumed_off"] > 0.1


def test_with_accumulation_every_patch_composes(runs):
    """bf16 at stage 0, accumulation 3, `engine.backward(engine(**batch).loss)`: with every patch active, plain torch's
    weights (on 0.18.3 the output hooks' patches act in the same backward); stock is off."""
    stock, patched = runs["stock"], runs["every_patch"]
    assert patched["composed_off"] <= patched["rtol"], patched["composed_off"]
    assert stock["composed_off"] > 0.1

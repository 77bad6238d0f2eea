"""bf16 at ZeRO stage 0: `engine.step()` clears the gradients it applied, and (0.18.3-0.18.5) applies them undivided
by a loss scale that bf16 never multiplied them by (deepspeed 0.17.6-0.18.5).

Stock piles every step's gradient onto the next; from 0.18.3 it also divides them by 65536.

A silent one: no error, no warning. From 0.17.6 (PR 7515) a bf16 model at ZeRO stage 0 gets DeepSpeed's fp16
optimizer in bf16 mode (its config prints `Creating fp16 unfused optimizer with dynamic loss scale` with bf16 on) where
it had the BF16 optimizer. With a torch optimizer (SGD, AdamW: anything but DeepSpeed's fused Adam) that is
`FP16_UnfusedOptimizer`, and two things go wrong:
- `_take_model_step` clears the gradients after the step for bf16 only under ZeRO (the BF16 optimizer cleared its own),
  and `FP16_UnfusedOptimizer.step` leaves the model's: every `engine.backward(); engine.step()` loop and every
  accelerate loop at bf16 stage 0 applies at step k the sum of the gradients of steps 1..k. The Trainer's
  `model.zero_grad()` hides this half.
- the optimizer keeps fp16's dynamic loss scale (65536). On 0.17.6-0.18.2 its `backward` multiplies the loss by it and
  its step divides it out, so the weights are right, but the grad norm DeepSpeed reports (and the Trainer logs) is
  65536 times too large, and the scale doubles every 1000 steps until bf16 overflows and a step is skipped. From
  0.18.3 (PR 7665) `engine.backward` no longer calls the optimizer's `backward`, yet the step still divides: every
  gradient is 65536 times too small, with SGD almost no update, with AdamW (nearly scale-free) one that `eps`
  shrinks, and gradient clipping never reached. The Trainer is hit too.
0.18.6 (PR 7839) clears the gradients after every bf16 step and gives bf16 no loss scale.

The fix does the same, for the optimizer that needs it alone: after a bf16 step at stage 0, an `FP16_UnfusedOptimizer`
clears the model's gradients (the fused fp16 optimizer and the BF16 optimizer of pipelines clear their own, and stay
as on stock); an `FP16_UnfusedOptimizer` built for bf16 gets a static loss scale of 1, on 0.18.3-0.18.5 given again
after `load_state_dict` (a checkpoint written by stock gives back 65536; the diff keeps that scale out too).
On 0.17.6-0.18.2 a resume from a stock checkpoint brings its scale back with the weights still right (backward
multiplies by it again) and the reported grad norm off by it again: left as it is. Nothing changes at fp16 or
under ZeRO. Noticed and left alone: 0.18.6 restores a checkpoint's scale as stock does, so a run resumed on 0.18.6
from a stock 0.18.3-0.18.5 checkpoint divides by 65536 again (read, not run).

Proven by numbers on deepspeed 0.18.3 (the ds0183 session) and 0.18.2 (ds0182), one process: three SGD steps of the
raw engine loop and of a custom accelerate loop at bf16 stage 0 equal plain torch's (a bf16 model, fp32 master
weights) bit for bit, and stock equals plain torch with the gradients piled up (and, on 0.18.3, divided by 65536);
the first step's reported grad norm is plain torch's (stock 0.18.2: 65536 times it); a resume from the state stock
writes lands on plain torch too. The loops, on an H100 (nccl, 0.18.3), as on the CPU; the fused fp16 optimizer's path
(DeepSpeed's Adam), run there too, is bit-identical to stock with the patch. The Trainer's half is read, not run:
transformers refuses bf16 without a GPU.
"""
from dspatch.spec import Patch, Target

ENGINE = "deepspeed.runtime.engine"
STEP = "DeepSpeedEngine._take_model_step"
CONFIGURE = "DeepSpeedEngine._configure_fp16_optimizer"
LOAD = "FP16_UnfusedOptimizer.load_state_dict"
TARGETS = (
    Target(ENGINE, STEP, {"acc542499bb079a7": "0.17.6", "c4b35bc681c7d4d6": "0.18.0-0.18.5"}),
    Target(ENGINE, CONFIGURE, {"c78ebc54586ae368": "0.17.6-0.18.5"}),  # the optimizers built for bf16 are marked here
    # where backward does not multiply by the scale, a stock checkpoint's 65536 given back would divide again
    Target("deepspeed.runtime.fp16.unfused_optimizer", LOAD, {"9ce19aa89eedf6cd": "0.18.3-0.18.5"},
           releases=">=0.18.3"),
)


def without_loss_scale(optimizer):
    """What 0.18.6 gives bf16: a static loss scale of 1 (the gradients are never multiplied, so never divided)."""
    optimizer.cur_scale = 1.0
    optimizer.dynamic_loss_scale = False


def apply(txn):
    import weakref

    import torch

    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    unscaled = weakref.WeakSet()  # the FP16_UnfusedOptimizers built for a bf16 model

    def mark_for_bf16(wrapped, engine, args, kwargs):
        optimizer = wrapped(*args, **kwargs)
        dtype = args[1] if len(args) > 1 else kwargs.get("low_precision_dtype")
        if dtype is torch.bfloat16 and isinstance(optimizer, FP16_UnfusedOptimizer):
            without_loss_scale(optimizer)
            unscaled.add(optimizer)
        return optimizer

    def still_unscaled(wrapped, optimizer, args, kwargs):
        result = wrapped(*args, **kwargs)
        if optimizer in unscaled:  # a checkpoint written by stock gives back its 65536
            without_loss_scale(optimizer)
        return result

    def step_then_clear(wrapped, engine, args, kwargs):
        optimizer = engine.optimizer
        result = wrapped(*args, **kwargs)
        if engine.bfloat16_enabled() and not engine.zero_optimization() \
                and isinstance(optimizer, FP16_UnfusedOptimizer):
            optimizer.zero_grad()  # its step leaves the model's gradients, which stock then keeps
        return result

    txn.wrap(txn.target(STEP), step_then_clear)
    txn.wrap(txn.target(CONFIGURE), mark_for_bf16)
    if txn.has(LOAD):  # 0.18.3-0.18.5: the gate's choice
        txn.wrap(txn.target(LOAD), still_unscaled)


PATCH = Patch(
    id="deepspeed/zero0-bf16-grads",
    summary=("bf16 at ZeRO stage 0 clears the gradients after each step and (0.18.3-0.18.5) does not divide them by "
             "a loss scale bf16 never applied (silent)"),
    cause=("bf16 at ZeRO-0 runs an optimizer that never clears the gradients it applied (and divides by an "
           "unused loss scale)"),
    canary=('piled_up', 'grad_norm', 'update', 'loss_scale'),
    symptom="bf16 at ZeRO-0: gradients silently pile up over steps (0.18.3+: also / 65536)",
    distribution="deepspeed",
    affected=">=0.17.6,<0.18.6",
    fixed_in="0.18.6",
    supported=">=0.17.6",
    targets=TARGETS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/7839", "https://github.com/deepspeedai/DeepSpeed/issues/7837",
           "https://github.com/deepspeedai/DeepSpeed/pull/7515", "https://github.com/deepspeedai/DeepSpeed/pull/7665"),
    diffs=("deepspeed/0018-zero0-bf16-grads-0.17.6-0.18.5.patch",),
    note=("wraps DeepSpeedEngine._take_model_step (clears an FP16_UnfusedOptimizer's gradients after a bf16 step), "
          "_configure_fp16_optimizer and FP16_UnfusedOptimizer.load_state_dict (loss scale 1 for the bf16 one)"),
)

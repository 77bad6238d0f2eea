"""`engine.backward(loss, scale_wrt_gas=False)` leaves the gradient undivided, as it says (deepspeed 0.18.3).

Stock divides it by GA anyway: every Trainer run with gradient accumulation trains on gradients GA times too small.

A silent one: no error, no warning. transformers >= 4.49 divides the loss by the accumulation itself (window-normalized
token counts) and calls `accelerator.backward(loss, scale_wrt_gas=False)`, which accelerate hands to
`DeepSpeedEngine.backward`. 0.18.3 (PR 7665) moved DeepSpeed's division by GA out of `backward` into a backward hook
on every tensor of the model's output (`DeepSpeedEngine._backward_prologue_per_tensor`), and that hook divides
whatever `backward` was told. 0.18.4 fixed it (PR 7724): `backward` records `scale_wrt_gas` and the hook respects it.
With a Hugging Face model the Trainer's output holds the loss and the logits, so on 0.18.3 it also meets
`deepspeed/output-hooks-gas-per-tensor` (the logits divided again): GA^2 too small in all; either patch alone sets the
Trainer right, and this one also a loop whose output is a single tensor.

The fix is 0.18.4's: while an `engine.backward(..., scale_wrt_gas=False)` runs, the per-tensor hooks pass gradients
through. `backward` with the default `scale_wrt_gas=True` and direct `loss.backward()` calls are unchanged.

Proven by numbers on deepspeed 0.18.3 (its own session, `ds0183`, with the mid stack's other pins): at accumulation 3
the Trainer at ZeRO-1 logs the grad_norm and ends with the weights of the same Trainer run without DeepSpeed
(relative 1e-5), and a raw loop that divides its loss itself equals plain torch; stock is 3 (raw loop) and 9 (Trainer)
times too small.
"""
from dspatch.spec import Patch

ENGINE = "deepspeed.runtime.engine"
BACKWARD = "DeepSpeedEngine.backward"
PER_TENSOR = "DeepSpeedEngine._backward_prologue_per_tensor"
FINGERPRINTS = {
    (ENGINE, BACKWARD): {"050cd48d3daa7a4b": "0.18.3"},
    (ENGINE, PER_TENSOR): {"fe0ec5bb47548e42": "0.18.3"},
}

def apply(txn):
    import weakref

    from dspatch.patches.deepspeed.output_hooks_gas_per_tensor import backward_arguments, pass_through_for, while_in

    unscaled = weakref.WeakSet()  # engines in a backward(..., scale_wrt_gas=False)

    def record_unscaled(wrapped, engine, args, kwargs):
        if backward_arguments(*args, **kwargs)[2]:
            return wrapped(*args, **kwargs)
        return while_in(unscaled, engine, lambda: wrapped(*args, **kwargs))

    txn.wrap(txn.target(BACKWARD), record_unscaled)
    txn.wrap(txn.target(PER_TENSOR), pass_through_for(unscaled))


PATCH = Patch(
    id="deepspeed/backward-scale-wrt-gas",
    summary=("engine.backward(loss, scale_wrt_gas=False), as every Trainer with gradient accumulation calls it, no "
             "longer divides the gradient by GA (silent)"),
    cause="`engine.backward(loss, scale_wrt_gas=False)` still divides the gradient by GA",
    canary=('divided_twice',),
    symptom="gradients silently GA times too small in every Trainer run with accumulation",
    distribution="deepspeed",
    affected=">=0.18.3,<0.18.4",
    fixed_in="0.18.4",
    supported=">=0.18.3",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/7724", "https://github.com/deepspeedai/DeepSpeed/issues/7749",
           "https://github.com/huggingface/accelerate/issues/3877"),
    diffs=("deepspeed/0015-backward-scale-wrt-gas-0.18.3.patch",),
    note=("DeepSpeedEngine.backward and DeepSpeedEngine._backward_prologue_per_tensor are wrapped: while a backward "
          "with scale_wrt_gas=False runs, the output hooks pass gradients through"),
)

"""Trainer + DeepSpeed with gradient accumulation: gradients no longer divided by GA twice (transformers 4.46.2-4.48.3).

A silent one: no error, no warning. From 4.46.2 the Trainer normalizes the loss over the whole accumulation window (by
the number of items in it, `num_items_in_batch`, for models that take loss kwargs; 4.48 also divides by
gradient_accumulation_steps itself when it has no such number) and hands it to `accelerator.backward`, which under
DeepSpeed calls `engine.backward(loss)`: DeepSpeed's default `scale_wrt_gas=True` divides by gradient_accumulation_steps
again. The gradients, `grad_norm` and every update are GA times too small, and `max_grad_norm` clipping loosens by the
same factor. transformers 4.49.0 fixed it (PR 35808) by passing `scale_wrt_gas=False` under DeepSpeed.

The fix does the same in `Trainer.training_step` as each release has it, rebuilt from the installed source: one
statement right before `self.accelerator.backward(loss, **kwargs)` that sets `kwargs["scale_wrt_gas"] = False` under
DeepSpeed when the loss given is already normalized over the window. In 4.48.x that is always the case (the Trainer
divides a loss without `num_items_in_batch` itself, before backward); in 4.46.2-4.47.1 only when `num_items_in_batch` is
known (without it the Trainer hands over the plain micro-batch loss, and DeepSpeed's own division is what makes it
right).

Proven by numbers on the bridge stack (transformers 4.46.3): the same 8 samples in 2 SGD steps at accumulation 1
(batches of 4) and 2 (batches of 2), at ZeRO-1, ZeRO-2 and ZeRO-3, give the same `grad_norm` at every step and the same
weights (relative 1e-5: the same sums in another order move fp32 results by a few units in the last place; the bug is a
factor of 2), and equal the Trainer without DeepSpeed; on stock the ratio is exactly 0.500.

Decided: it needs a DeepSpeed that honours `scale_wrt_gas`. deepspeed 0.18.3 divides every gradient by
gradient_accumulation_steps in a per-tensor hook whatever the argument says (fixed in 0.18.4), so with it this patch,
and transformers >= 4.49 as released, still get gradients GA times too small. That is a separate bug of deepspeed's (one
release, and it breaks transformers >= 4.49 alike), not part of this patch; with it, this patch cannot help.
"""
from dspatch.spec import Patch

TRAINER = "transformers.trainer"
STEP = "Trainer.training_step"
FINGERPRINTS = {
    (TRAINER, STEP): {"f390b800c59bafc0": "4.46.2-4.46.3, 4.47.1", "f515dafba68314d0": "4.47.0",
                      "32156c3ec735b953": "4.48.0", "2bda9f8368cff519": "4.48.1-4.48.3"},
}


def no_second_division(definition):
    """Transform: before `self.accelerator.backward(loss, **kwargs)`, under DeepSpeed and when the loss is already
    normalized over the accumulation window, `kwargs["scale_wrt_gas"] = False`."""
    from dspatch.rewrite import find_all, find_statement, statement

    block, index = find_statement(definition, "self.accelerator.backward(loss, **kwargs)",
                                  "`self.accelerator.backward(loss, **kwargs)`")
    # 4.48.x divides a loss without num_items_in_batch itself before backward: the loss is always normalized
    divides_first = bool(find_all(definition, "loss = loss / self.args.gradient_accumulation_steps"))
    normalized = "" if divides_first else " and num_items_in_batch is not None"
    block.insert(index, statement(f"if self.is_deepspeed_enabled{normalized}:\n"
                                  f"    kwargs['scale_wrt_gas'] = False", block[index]))


def apply(txn):
    txn.recode(txn.target(STEP), no_second_division)


PATCH = Patch(
    id="transformers/deepspeed-grad-accum-scale",
    summary=("Trainer + DeepSpeed with gradient accumulation: gradients, grad_norm and updates are no longer "
             "divided by gradient_accumulation_steps twice (silently GA times too small)"),
    cause="The Trainer divides the loss by gradient accumulation and DeepSpeed divides it again",
    canary=('divided_twice',),
    symptom="gradients, `grad_norm` and updates silently divided by `gradient_accumulation_steps` twice",
    distribution="transformers",
    affected=">=4.46.2,<4.49.0",
    fixed_in="4.49.0",
    supported=">=4.46.2",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/transformers/pull/35808",),
    diffs=("transformers/0003-deepspeed-grad-accum-scale-4.46.2-4.47.1.patch",
           "transformers/0003-deepspeed-grad-accum-scale-4.48.0.patch",
           "transformers/0003-deepspeed-grad-accum-scale-4.48.1-4.48.3.patch"),
    note=("Trainer.training_step keeps its object, name and line numbers but runs code rebuilt from the installed "
          "file that passes scale_wrt_gas=False to DeepSpeed's backward for a window-normalized loss"),
)

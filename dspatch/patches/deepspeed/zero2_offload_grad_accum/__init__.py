"""ZeRO-2, optimizer offloaded to the CPU, accumulation >= 3: every micro-batch counts again (deepspeed 0.15.2-0.18.9).

Stock keeps only the first and the last micro-batch of each accumulation window.

A silent one: no error, no warning; the loss still goes down. It is the "low memory" recipe of LLaMA-Factory, ms-swift
and trl users (ZeRO-2, `offload_optimizer: cpu`, accumulation 4 to 16). With the optimizer on the CPU, ZeRO-2 keeps each
parameter's gradient of the window so far in a CPU buffer: `DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu`
copies the first micro-batch's gradient there, and at every later micro-batch adds the buffer into the new gradient.
From 0.15.2 (PR 6550) the buffer is written only after the first micro-batch: from the second on, it still holds the
first gradient alone, so the boundary sees g_first + g_last, and the micro-batches between them are dropped.
Accumulation 2 is exact (it has no middle); ZeRO-1 reduces only at the boundary and is right on every release. 0.19.0
fixed it (PR 7967).

The fix restores what 0.14.0 to 0.15.1 did, rebuilt from the installed source of the method: the buffer takes the sum
after every micro-batch before the boundary (`if not self.is_gradient_accumulation_boundary: copy_gradients_to_cpu()`,
where the stock code copies only after the first). Upstream's own line copies at the boundary too, which 0.19.0 pairs
with a new gate in the caller; on 0.15.2-0.16.4, where ZeRO-1's `micro_step_id` counts every backward of a step, that
copy would leave the step's gradient in the buffer for ZeRO-1 with offload to add into the next step. The older form
is right on every release of the range, so it is the one used.

Proven by numbers on the bridge (0.16.9) and mid (0.16.3) stacks: at accumulation 3, two SGD steps of the raw engine
loop equal plain torch (relative 1e-5; stock is 49% off and equals plain torch without the middle micro-batch); at
accumulation 4 the Trainer at ZeRO-2 logs ZeRO-1's grad_norm and ends with its weights. ZeRO-1 with offload and
ZeRO-2 without it stay bit-identical to stock.
"""
from dspatch.spec import Patch

STAGE_1_AND_2 = "deepspeed.runtime.zero.stage_1_and_2"
ACCUMULATE = "DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu"
FINGERPRINTS = {
    (STAGE_1_AND_2, ACCUMULATE): {"e6f005f01d1d7cbf": "0.15.2-0.18.2", "9d4575c6f0ed36ea": "0.18.3-0.18.9"},
}

STOCK = "if self.micro_step_id > 0:\n    accumulate_gradients()\nelse:\n    copy_gradients_to_cpu()"


def copy_back_every_micro_batch(definition):
    """Transform: `if micro_step_id > 0: accumulate() else: copy()` becomes `if micro_step_id > 0: accumulate()`
    followed by `if not self.is_gradient_accumulation_boundary: copy()`."""
    from dspatch.rewrite import find_statement, statement

    block, index = find_statement(definition, STOCK, "the copy to the CPU buffer after the first micro-batch only")
    choice = block[index]
    choice.orelse = []
    block.insert(index + 1, statement("if not self.is_gradient_accumulation_boundary:\n"
                                      "    copy_gradients_to_cpu()", choice))


def apply(txn):
    txn.recode(txn.target(ACCUMULATE), copy_back_every_micro_batch)


PATCH = Patch(
    id="deepspeed/zero2-offload-grad-accum",
    summary=("ZeRO-2 with the optimizer offloaded to the CPU and gradient accumulation >= 3 trains on every "
             "micro-batch's gradient, not only on the first and last of each window (silent)"),
    cause="ZeRO-2 with CPU offload overwrites the accumulated gradient with each middle micro-batch's",
    canary=('middle_dropped',),
    symptom="each accumulation window's middle micro-batches silently left out of the gradient",
    distribution="deepspeed",
    affected=">=0.15.2,<0.19.0",
    fixed_in="0.19.0",
    supported=">=0.15.2",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/7967", "https://github.com/deepspeedai/DeepSpeed/pull/6550"),
    diffs=("deepspeed/0013-zero2-offload-grad-accum-0.15.2-0.18.9.patch",),
    note=("DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu keeps its object, name and line numbers but "
          "runs code rebuilt from the installed file that copies the running sum back to the CPU buffer after every "
          "micro-batch before the boundary"),
)

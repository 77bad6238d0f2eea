"""ZeRO-2 with gradient accumulation: every micro-batch counts again (deepspeed 0.17.6-0.18.2).

Stock trains on the last micro-batch of each accumulation window only.

A silent one: no error, no warning; the loss still goes down, on 1/GA of the data. ZeRO-2 with accumulation is the
default recipe of LLaMA-Factory, ms-swift and trl users; they found it by comparing grad norms between ZeRO stages
(DeepSpeed issue 7718, trl 4540 and 4631, accelerate 3877). In 0.17.6 (PR 7509, for the Muon optimizer)
`DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue` started to collect each micro-step's reduced
gradients in `self.all_grad_tensors[i]`, but kept deciding between "first micro-step: take them" and "later: add
them" on `self.averaged_gradients[i] is None`, which stays None until the boundary: every micro-step takes, none
adds, and the boundary keeps the last. ZeRO-1 reduces only at the boundary and ZeRO-3 has its own path; the
optimizer offloaded to the CPU takes another branch (deepspeed/zero2-offload-grad-accum has that one). 0.18.3 fixed
it (inside PR 7665).

The fix is 0.18.3's, rebuilt from the installed source of the method: the condition reads `self.all_grad_tensors`,
the dictionary the branches fill.

Proven by numbers on deepspeed 0.18.2 (its own session, `ds0182`, with the mid stack's other pins): at accumulation
3, two SGD steps of the raw engine loop equal plain torch (relative 1e-5; stock equals plain torch with only each
window's last micro-batch); at accumulation 4 the Trainer at ZeRO-2 logs ZeRO-1's grad_norm and ends with its weights.
"""
from dspatch.spec import Patch

STAGE_1_AND_2 = "deepspeed.runtime.zero.stage_1_and_2"
EPILOGUE = "DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue"
FINGERPRINTS = {(STAGE_1_AND_2, EPILOGUE): {"1df76fc5991c316e": "0.17.6-0.18.2"}}

STOCK = "not i in self.averaged_gradients or self.averaged_gradients[i] is None"


def gate_on_the_collected_gradients(definition):
    """Transform: the one `if` that tests `self.averaged_gradients[i]` for the first micro-step tests
    `self.all_grad_tensors[i]`, which that branch assigns and the other adds into."""
    from dspatch.rewrite import expression, find_one

    test = find_one(definition, STOCK, "the first-micro-step test on self.averaged_gradients")
    fixed = expression("i not in self.all_grad_tensors or self.all_grad_tensors[i] is None", test)
    choice = find_one(definition, lambda node: getattr(node, "test", None) is test, "the if it decides")
    choice.test = fixed


def apply(txn):
    txn.recode(txn.target(EPILOGUE), gate_on_the_collected_gradients)


PATCH = Patch(
    id="deepspeed/zero2-grad-accum-last-microbatch",
    summary=("ZeRO-2 with gradient accumulation trains on every micro-batch's gradient, not only on the last of "
             "each window (silent)"),
    cause="ZeRO-2 replaces the accumulated gradient with each micro-batch's instead of adding it",
    canary=('last_only',),
    symptom="only the last micro-batch of each accumulation window silently trains (ZeRO-2)",
    distribution="deepspeed",
    affected=">=0.17.6,<0.18.3",
    fixed_in="0.18.3",
    supported=">=0.17.6",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/issues/7718", "https://github.com/deepspeedai/DeepSpeed/pull/7665",
           "https://github.com/deepspeedai/DeepSpeed/pull/7509"),
    diffs=("deepspeed/0016-zero2-grad-accum-last-microbatch-0.17.6-0.18.2.patch",),
    note=("DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue keeps its object, name and line numbers but "
          "runs code rebuilt from the installed file that decides the first micro-step on self.all_grad_tensors"),
)

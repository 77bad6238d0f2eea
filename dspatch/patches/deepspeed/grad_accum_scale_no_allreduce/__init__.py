"""Micro-steps inside `engine.no_sync()`, and every step of a pipeline, are divided by the accumulation again
(deepspeed 0.16.0-0.18.2).

Stock leaves their loss undivided: those gradients count GA times too much.

A silent one: no error, no warning. Until 0.15.x `DeepSpeedEngine.backward` divided the loss by
`gradient_accumulation_steps` whenever GA > 1. 0.16.0 (PR 6675, which added `engine.no_sync()`) divides it only when
the backward also all-reduces (`do_gradient_reduction`: the engine's `enable_backward_allreduce`, outside `no_sync`),
so:
- inside `engine.no_sync()`: accelerate's `accelerator.accumulate(model)` enters it on every micro-step but the last of
  a window, in every multi-process job at ZeRO-0/1 (and, through `Accelerator.no_sync`, the Trainer of transformers
  4.46.2-4.47.0 and the earlier ones that accumulate with accelerate); those micro-steps count GA times as much as the
  last one;
- a `PipelineEngine` turns `enable_backward_allreduce` off (it all-reduces itself): every pipeline step with GA > 1
  trains on a gradient GA times too big (the first cause of DeepSpeed issue 7773).
0.18.3 moved the division into output hooks that divide whatever the context (PR 7665), which ended it (and brought
the pipeline a cause of its own, 0.18.3-0.19.2: `deepspeed/pipe-grad-accum-scale`).

The fix divides as 0.15.x did, rebuilt from the installed source: the scaling test keeps every term of
`do_gradient_reduction` but the two that say whether this backward all-reduces (`self.enable_backward_allreduce`,
`not self.inside_no_sync_ctxt`); the DeepCompile term stays (DeepCompile scales by itself). The all-reduce itself is
untouched. A loop that never enters `no_sync` outside a pipeline runs the same test as before, bit for bit, with one
more case where stock is wrong and the numbers change: 1-bit Adam, 0/1 Adam and 1-bit LAMB turn
`enable_backward_allreduce` off after their `freeze_step` (they compress the all-reduce themselves), so from then on
stock leaves their loss undivided at GA > 1 and the fix divides it, as 0.15.x and 0.18.3 do (not run here: their
compressed collectives need NCCL or MPI).

Proven by numbers on the mid (0.16.3) and bridge (0.16.9) stacks, one process: at accumulation 3, two SGD steps of the
raw engine loop at ZeRO-1 with `engine.no_sync()` around the first two micro-steps of each window equal plain torch
(relative 1e-5), and so does a one-stage `PipelineModule`; stock equals plain torch with those micro-steps (the whole
pipeline step) left undivided.
"""
from dspatch.spec import Patch, Target

ENGINE = "deepspeed.runtime.engine"
# 0.16.0-0.16.4 scale in `backward`; 0.16.5 moved the same lines into `_backward_prologue`
TARGETS = (
    Target(ENGINE, "DeepSpeedEngine.backward", {"62239b1da4db6e07": "0.16.0-0.16.4"}, releases=">=0.16.0,<0.16.5"),
    Target(ENGINE, "DeepSpeedEngine._backward_prologue",
           {"c7aade3bd141e685": "0.16.5", "52d858be73208cf8": "0.16.6-0.17.4", "6440314865d9dff9": "0.17.5-0.17.6",
            "2b645bbaff049863": "0.18.0-0.18.2"}, releases=">=0.16.5"),
)

SCALE_TEST = "do_gradient_reduction and self.gradient_accumulation_steps() > 1 and scale_wrt_gas"
# the terms of do_gradient_reduction that say whether this backward all-reduces, which the division must not wait for
REDUCES = ("self.enable_backward_allreduce", "not self.inside_no_sync_ctxt")


def divide_whether_or_not_it_reduces(definition):
    """Transform: `if do_gradient_reduction and GA > 1 and scale_wrt_gas:` becomes `if <do_gradient_reduction's other
    terms> and GA > 1 and scale_wrt_gas:` (0.15.x's test where there are none)."""
    import ast

    from dspatch.rewrite import RewriteError, at_line, copy_tree, find_one, matches

    assign = find_one(definition, lambda node: isinstance(node, ast.Assign) and len(node.targets) == 1
                      and matches(node.targets[0], "do_gradient_reduction"), "assignment of do_gradient_reduction")
    terms = assign.value.values if isinstance(assign.value, ast.BoolOp) and isinstance(assign.value.op, ast.And) \
        else [assign.value]
    kept = [term for term in terms if not any(matches(term, reduces) for reduces in REDUCES)]
    if len(kept) != len(terms) - len(REDUCES):
        raise RewriteError(f"{definition.name}: do_gradient_reduction is not `{' and '.join(REDUCES)} [and ...]`")
    test = find_one(definition, SCALE_TEST, "the test that scales the loss by GA")
    test.values[:1] = [at_line(copy_tree(term), test) for term in kept]


def apply(txn):
    for target in txn.patch.targets:
        txn.recode(target, divide_whether_or_not_it_reduces)


PATCH = Patch(
    id="deepspeed/grad-accum-scale-no-allreduce",
    summary=("micro-steps inside engine.no_sync() (accelerate's accumulate at ZeRO-0/1) and pipeline steps divide the "
             "loss by the gradient accumulation steps again (silent)"),
    cause="Micro-steps in `no_sync()` and pipeline steps divide the loss by GA a second time",
    canary=('not_divided', 'scaled'),
    symptom="gradients silently GA times too big in `no_sync` micro-steps (ZeRO-0/1) and pipelines",
    distribution="deepspeed",
    affected=">=0.16.0,<0.18.3",
    fixed_in="0.18.3",
    supported=">=0.16.0",
    targets=TARGETS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/6675", "https://github.com/deepspeedai/DeepSpeed/issues/7773",
           "https://github.com/deepspeedai/DeepSpeed/pull/7665"),
    diffs=("deepspeed/0017-grad-accum-scale-no-allreduce-0.16.0-0.16.4.patch",
           "deepspeed/0017-grad-accum-scale-no-allreduce-0.16.5.patch",
           "deepspeed/0017-grad-accum-scale-no-allreduce-0.16.6-0.17.6.patch",
           "deepspeed/0017-grad-accum-scale-no-allreduce-0.18.0-0.18.2.patch"),
    note=("DeepSpeedEngine.backward (0.16.0-0.16.4) or _backward_prologue (0.16.5-0.18.2) keeps its object, name and "
          "line numbers but runs code rebuilt from the installed file whose division by GA does not wait for the "
          "all-reduce"),
)

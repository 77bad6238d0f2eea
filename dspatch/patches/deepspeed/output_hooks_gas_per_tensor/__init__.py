"""`engine.backward(out.loss)` with accumulation divides the gradient by GA once, not once per output tensor (deepspeed
0.18.3-0.19.5).

Stock divides it by GA once for every tensor of the model's output on the loss's graph: GA^2 for a Hugging Face model
called with labels.

A silent one: no error, no warning; the run trains as if its learning rate were divided by GA again. It is the loop
every accelerate or raw DeepSpeed user writes with a Hugging Face model: `out = engine(**batch, labels=labels)`,
`engine.backward(out.loss)` (or `accelerator.backward(out.loss)` under `accelerator.accumulate`), with gradient
accumulation and the default `scale_wrt_gas=True`. From 0.18.3 (PR 7665) DeepSpeed no longer divides the loss by GA in
`backward`: `forward` puts a backward hook on every tensor of its output that has a gradient function, and each hook
divides the gradient arriving there by GA (`DeepSpeedEngine._backward_prologue_per_tensor`). The output of a causal LM
holds the loss and the logits it was computed from, so the logits' gradient, already divided once at the loss, is
divided again: every weight's gradient is GA^2 times too small, where GA times was meant (ZeRO stages 0-2: at ZeRO-3
the module hooks hand back new output tensors, and the loss was computed from the inner logits, so the hooked logits
are not on its graph). 0.19.6 fixed it (PR 8245):
`backward` divides the loss itself and marks its graph, and the hooks leave a marked graph alone. The Trainer passes
`scale_wrt_gas=False`, which the hooks respect from 0.18.4; on 0.18.3 they do not (`deepspeed/backward-scale-wrt-gas`).

The fix does what 0.19.6 does, where the bug can happen: after a forward whose hooked outputs lie on one another's
graph (found by a search of at most 64 autograd nodes from each), every `engine.backward` divides the loss by GA once
(when `scale_wrt_gas` asks for it), and while it runs the per-tensor hooks pass gradients through; the engine's next
forward decides again. Where the output holds a single tensor (the loss alone, or logits a loss is computed from
outside), or tensors side by side (heads a loss outside reads), nothing changes: each hook divides once, as it should,
and the numbers stay stock's to the bit. Left as on stock: a direct `loss.backward()` without `engine.backward` (as
0.19.6 leaves it), and a loss whose graph runs through another engine's output (a GAN's generator step through the
discriminator engine), which 0.19.6's graph tracking covers and a per-engine decision cannot; and DeepSpeed issue
8224's shape, which PR 8245 fixed too: a loss with a branch around `engine.forward` (`engine(x) +
engine.module(y)`, or the model called through the engine and beside it). There the engine returns one tensor, so
nothing is nested and stock's per-tensor division runs: the engine's branch is divided by GA, the branch around it
not at all, GA times too large (measured on 0.18.3 and 0.19.2 at GA 2, every ZeRO stage, fp32 and bf16, one rank or
two: the update 37% off plain torch's, the same with this patch; right on 0.19.8). Dividing the loss in every
`engine.backward`, as 0.19.6 does, would cover it at the cost of stock's bits where nothing is nested and GA is not a
power of two: left, and said here.

Proven by numbers on deepspeed 0.18.3 (its own session, `ds0183`, with the mid stack's other pins): at accumulation 3,
two SGD steps of the raw engine loop (ZeRO-1 and ZeRO-2) and of a custom accelerate loop equal plain torch (relative
1e-5); stock equals plain torch at a third of the learning rate. A single-tensor output and ZeRO-3 stay bit-identical
to stock. The diff decides the same way in `OutputBackwardHookManager` (one band, 0.18.3-0.19.5) and is proven on
0.18.3 there and on 0.18.9 and 0.19.5's released sources.
"""
from dspatch.spec import Patch

UTILS = "deepspeed.runtime.utils"
REGISTER = "OutputBackwardHookManager.register_hooks_on_outputs"
ENGINE = "deepspeed.runtime.engine"
BACKWARD = "DeepSpeedEngine.backward"
PER_TENSOR = "DeepSpeedEngine._backward_prologue_per_tensor"
FINGERPRINTS = {
    (UTILS, REGISTER): {"608fbddb6fc49566": "0.18.3-0.19.5"},
    (ENGINE, BACKWARD): {"050cd48d3daa7a4b": "0.18.3", "e45eeea0ca5e3f4a": "0.18.4-0.19.3",
                         "4e890042ecd76bcc": "0.19.4-0.19.5"},
    (ENGINE, PER_TENSOR): {"fe0ec5bb47548e42": "0.18.3", "f245b7b18e43cdd6": "0.18.4-0.19.0",
                           "12dfa251dba0bfee": "0.19.1-0.19.5"},
}

def backward_arguments(loss, retain_graph=False, scale_wrt_gas=True):
    """`DeepSpeedEngine.backward`'s arguments, as it binds them (the same on every release of the range)."""
    return loss, retain_graph, scale_wrt_gas


def pass_through_for(engines):
    """A wrapper for `_backward_prologue_per_tensor`: an engine in `engines` (a WeakSet: those whose backward has
    already taken care of GA, while it runs) gets the gradient back unchanged; others as stock."""
    def pass_through(wrapped, engine, args, kwargs):
        if engine in engines:
            return args[0] if args else kwargs["grad"]
        return wrapped(*args, **kwargs)

    return pass_through


def while_in(engines, engine, call):
    """call(), with `engine` in `engines` while it runs."""
    engines.add(engine)
    try:
        return call()
    finally:
        engines.discard(engine)


# how many autograd nodes the search from one output towards another visits at most: a loss computed from logits
# reaches them in under ten (shift, view, float, log-softmax, nll...); outputs not found by then count as apart
NESTED_SEARCH = 64


def nested(tensors, limit=NESTED_SEARCH):
    """Whether one of the hooked output `tensors` lies on the graph of another (the logits under the loss computed
    from them), where stock divides a gradient once per tensor on its path; outputs side by side (heads read by a loss
    computed outside) are divided once each on stock, as they should be."""
    found = {tensor.grad_fn for tensor in tensors}
    for tensor in tensors:
        seen, todo = {tensor.grad_fn}, [tensor.grad_fn]
        while todo and len(seen) <= limit:
            for node, _ in todo.pop(0).next_functions:  # breadth first: the nearest nodes first
                if node is not None and node not in seen:
                    if node in found:
                        return True
                    seen.add(node)
                    todo.append(node)
    return False


def apply(txn):
    import weakref

    import torch

    on_one_path = weakref.WeakSet()  # engines whose last forward hooked outputs that lie on one another's graph
    dividing = weakref.WeakSet()  # engines in a backward that divided the loss itself

    def note_hooked(wrapped, manager, args, kwargs):
        result = wrapped(*args, **kwargs)
        engine = getattr(manager.preprocess_per_tensor_fn, "__self__", None)
        if engine is not None and manager.hook_handles:  # what forward hooked, for the engine whose method divides
            hooked = [t for t in _tensors(torch, args[0] if args else kwargs["outputs"]) if t.grad_fn is not None]
            (on_one_path.add if nested(hooked) else on_one_path.discard)(engine)
        return result

    def divide_at_root(wrapped, engine, args, kwargs):
        if engine not in on_one_path:
            return wrapped(*args, **kwargs)
        loss, retain_graph, scale_wrt_gas = backward_arguments(*args, **kwargs)
        if scale_wrt_gas:
            loss = loss / engine.gradient_accumulation_steps()
        # stock's own return value divides again (it is only that): the loss divided once is returned instead
        while_in(dividing, engine, lambda: wrapped(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas))
        return loss

    txn.wrap(txn.target(REGISTER), note_hooked)
    txn.wrap(txn.target(BACKWARD), divide_at_root)
    txn.wrap(txn.target(PER_TENSOR), pass_through_for(dividing))


def _tensors(torch, outputs):
    """The tensors of a forward's output, walked as DeepSpeed walks it to hook them (tensors, tuples, lists, dicts)."""
    if isinstance(outputs, torch.Tensor):
        yield outputs
    elif isinstance(outputs, (tuple, list)):
        for item in outputs:
            yield from _tensors(torch, item)
    elif isinstance(outputs, dict):
        for value in outputs.values():
            yield from _tensors(torch, value)


PATCH = Patch(
    id="deepspeed/output-hooks-gas-per-tensor",
    summary=("engine.backward(out.loss) with gradient accumulation divides the gradient by GA once, not once per "
             "output tensor on the loss's graph (GA^2 for a model returning loss and logits; silent)"),
    cause="DeepSpeed's output hooks divide the gradient by GA once per output tensor, not once per backward",
    canary=('divided_twice',),
    symptom="gradients silently GA times too small: `engine.backward(out.loss)` with accumulation",
    distribution="deepspeed",
    affected=">=0.18.3,<0.19.6",
    fixed_in="0.19.6",
    supported=">=0.18.3",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/8245",
           "https://github.com/deepspeedai/DeepSpeed/pull/7665"),
    diffs=("deepspeed/0014-output-hooks-gas-per-tensor-0.18.3-0.19.5.patch",),
    fixed_marker=(ENGINE, "_EngineBackwardGraphTracker"),  # 0.19.6's: backward marks the graph it divided
    note=("OutputBackwardHookManager.register_hooks_on_outputs, DeepSpeedEngine.backward and "
          "DeepSpeedEngine._backward_prologue_per_tensor are wrapped: after a forward that hooked two or more output "
          "tensors, backward divides the loss by GA once and the hooks pass gradients through while it runs"),
)

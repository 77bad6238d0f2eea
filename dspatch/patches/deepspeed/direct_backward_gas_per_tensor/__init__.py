"""`out.loss.backward()` on a DeepSpeed engine's output with accumulation divides the gradient by GA once, not once per
output tensor on its path (deepspeed 0.18.3-0.19.8, open upstream).

Stock divides it by GA once for every tensor of the model's output the gradient crosses: GA^2 for a Hugging Face model
called with labels (the loss, then the logits it was computed from), at ZeRO-1 and 2 (ZeRO-0 refuses a direct
backward).

A silent one: no error, no warning; the run trains as if its learning rate were divided by GA again. Since 0.18.3 (PR
7665, `docs/code-docs/source/training.rst`) DeepSpeed documents the PyTorch-style loop, `loss = engine(batch);
loss.backward(); engine.step()`, and scales for accumulation in backward hooks that `forward` puts on every tensor of
its output with a gradient function (`OutputBackwardHookManager`), each dividing the gradient that arrives there by GA
(`DeepSpeedEngine._backward_prologue_per_tensor`). 0.19.6 (PR 8245) fixed `engine.backward`, which now divides the
loss itself and marks its graph so that the hooks leave it alone (`deepspeed/output-hooks-gas-per-tensor` does the
same before 0.19.6); a direct `backward()` marks nothing, and the logits' hook divides again what the loss's hook
already divided.

The fix undoes the second division where it happens, on the edge it happens on: after a forward whose hooked outputs
lie on one another's graph (found by a search of at most 64 autograd nodes from each, as the engine.backward patch
searches), a hook on the autograd node that hands the gradient from one hooked output's graph to another hooked output
multiplies that gradient by GA, in a backward where the first output's hook divided it. Every path from the outputs to
a weight is then divided exactly once, whichever of them the backward starts from: `out.loss`, a loss computed outside
from the logits (no edge crossed, nothing changed), or both added (`out.loss + z_loss(out.logits)`: the loss's share
divided once, the other share once, as plain torch's `/ GA`). (A gradient that enters the model's graph elsewhere, from
a tensor captured inside the forward, is divided by no hook on stock either: left as it is.) Where the hooks divide nothing (engine.backward from 0.19.6, or
with the earlier patch, `scale_wrt_gas=False`, functorch), nothing is multiplied; before 0.19.6 without the earlier
patch, engine.backward's second division is undone the same way (either patch alone sets it right). Where the outputs hold one tensor, or
tensors side by side, or at ZeRO-3 (whose module hooks hand back new output tensors, so the hooked logits are not on
the loss's graph), or at accumulation 1, no hook is added and the numbers stay stock's to the bit. Hooked outputs more
than 64 nodes apart (a model's per-layer hidden states) are counted apart, as stock counts them.

Proven by numbers on deepspeed 0.19.8 (latest, ds0198), 0.19.2 (ds0192) and 0.18.3 (ds0183): at accumulation 3, two
SGD steps of `out.loss.backward(); engine.step()` at ZeRO-1 and ZeRO-2 equal plain torch (relative 1e-5); stock equals
plain torch at a third of the learning rate. The diff does the same in `OutputBackwardHookManager` (one band,
0.18.3-0.19.8).
"""
from dspatch.spec import Patch

UTILS = "deepspeed.runtime.utils"
TRAVERSE = "OutputBackwardHookManager._traverse_and_register_hooks"
MAKE_HOOK = "OutputBackwardHookManager._make_backward_hook"
FINGERPRINTS = {
    (UTILS, TRAVERSE): {"83bb57def87f8b2e": "0.18.3-0.19.8"},
    (UTILS, MAKE_HOOK): {"79095d7ccfec1b29": "0.18.3-0.19.8"},
}
# how many autograd nodes the search from one hooked output towards the others visits at most (breadth first): a loss
# computed from logits reaches them in under ten (shift, view, float, log-softmax, nll...); outputs not found by then
# count as apart
NESTED_SEARCH = 64


class Divided:
    """Whether one hooked output's hook divided its gradient, in which backward (autograd's graph task id) and by
    what. Shared by that hook and the edge hooks below it; it holds no tensor and no node, so that it keeps no graph
    alive."""
    __slots__ = ("task", "factor")

    def __init__(self):
        self.task, self.factor = None, 1


def edges_between(hooked, limit=NESTED_SEARCH):
    """{node: (slots, marks)}: for each autograd node on one hooked output's graph (searched from its gradient function,
    at most `limit` nodes, not past another hooked output's), the input slots through which it hands the gradient to
    another hooked output, and the `Divided` marks of the outputs whose graphs it lies on. `hooked`: [(tensor, mark)]."""
    targets = {(t.grad_fn, t.output_nr) for t, _ in hooked}
    stops = {node for node, _ in targets}
    found = {}
    for tensor, mark in hooked:
        # breadth first: the nearest nodes first, so that a large branch of the loss (a regulariser over every
        # weight) does not spend the budget before the few nodes to the logits are seen
        seen, todo = {tensor.grad_fn}, [tensor.grad_fn]
        while todo and len(seen) <= limit:
            node = todo.pop(0)
            for slot, edge in enumerate(node.next_functions):
                if edge in targets:
                    slots, marks = found.setdefault(node, (set(), []))
                    slots.add(slot)
                    if mark not in marks:
                        marks.append(mark)
                elif edge[0] is not None and edge[0] not in seen and edge[0] not in stops:
                    seen.add(edge[0])
                    todo.append(edge[0])
    return found


def undo_second_division(slots, marks, current_task):
    """A node post-hook: the gradients it hands on through `slots` (to another hooked output, whose hook divides again)
    multiplied back by the factor an output above divided them by, in this backward."""
    def hook(grad_inputs, grad_outputs):
        task = current_task()
        factor = next((m.factor for m in marks if m.task == task), None)
        if factor is None:
            return None
        return tuple(g * factor if i in slots and g is not None else g for i, g in enumerate(grad_inputs))

    return hook


def apply(txn):
    import threading
    import weakref

    import torch

    current_task = torch._C._current_graph_task_id
    pending = weakref.WeakKeyDictionary()  # manager: [(tensor, mark)] hooked by the forward under way
    walking = threading.local()  # the managers whose top-level traversal is running (it recurses into containers)

    def engine_of(manager):
        return getattr(manager.preprocess_per_tensor_fn, "__self__", None)

    def recording(wrapped, manager, args, kwargs):
        hook = wrapped(*args, **kwargs)
        engine = engine_of(manager)
        if engine is None:  # not an engine's output hooks: left as they are
            return hook
        mark = Divided()
        pending.setdefault(manager, []).append((args[0] if args else kwargs["tensor"], mark))

        def backward_hook(grad):
            result = hook(grad)
            if result is not grad and result is not None and grad is not None:  # the engine's hook divided it
                mark.task, mark.factor = current_task(), engine.gradient_accumulation_steps()
            return result

        return backward_hook

    def hook_edges(wrapped, manager, args, kwargs):
        managers = walking.__dict__.setdefault("managers", set())
        if id(manager) in managers:  # a nested container: the top-level call decides once everything is hooked
            return wrapped(*args, **kwargs)
        managers.add(id(manager))
        try:
            result = wrapped(*args, **kwargs)
        finally:
            managers.discard(id(manager))
            hooked = pending.pop(manager, [])  # even if it raised: the entry would hold its own key alive
        engine = engine_of(manager)
        if len(hooked) > 1 and engine is not None and engine.gradient_accumulation_steps() != 1:
            for node, (slots, marks) in edges_between(hooked).items():
                node.register_hook(undo_second_division(frozenset(slots), marks, current_task))
        return result

    txn.wrap(txn.target(MAKE_HOOK), recording)
    txn.wrap(txn.target(TRAVERSE), hook_edges)


PATCH = Patch(
    id="deepspeed/direct-backward-gas-per-tensor",
    summary=("out.loss.backward() on an engine's output with gradient accumulation divides the gradient by GA once, "
             "not once per output tensor on its path (GA^2 for a model returning loss and logits; silent)"),
    cause=("DeepSpeed's output hooks divide the gradient by GA once per output tensor it crosses, and a direct "
           "backward() does not mark its graph as engine.backward() does since 0.19.6"),
    canary=('torch_backward_divided',),  # dspatch canary --backward torch
    symptom="gradients silently GA times too small: `loss.backward()` on the engine's output with accumulation",
    distribution="deepspeed",
    affected=">=0.18.3",
    fixed_in=None,
    supported=">=0.18.3",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/7665", "https://github.com/deepspeedai/DeepSpeed/pull/8245"),
    diffs=("deepspeed/0031-direct-backward-gas-per-tensor-0.18.3-0.19.8.patch",),
    note=("OutputBackwardHookManager._make_backward_hook and ._traverse_and_register_hooks are wrapped: after a forward "
          "whose hooked outputs lie on one another's graph, the gradient handed from one to the other is multiplied "
          "back by GA where the first one's hook divided it"),
)

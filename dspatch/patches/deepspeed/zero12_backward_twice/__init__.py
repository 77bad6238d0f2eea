"""ZeRO-1/2: several `engine.backward()` calls before one `engine.step()` sum their gradients, as ZeRO-0, ZeRO-3 and
plain torch do (deepspeed 0.17.6-0.19.8, open).

With gradient accumulation 1 every backward is a gradient-accumulation boundary. From 0.17.6 (PR 7509) the ZeRO-1/2
optimizer gathers each backward's gradients in `all_grad_tensors` and, at a boundary, builds the partition it steps
(`averaged_gradients`) from them and drops them (`independent_gradient_partition_epilogue`). A second backward before
the step then finds nothing to add to: 0.17.6-0.18.2 fail (`TypeError: 'NoneType' object is not iterable`), 0.18.3 and
later (PR 7665) silently replace the first backward's gradient with the second's. Loops that call `engine.backward`
several times per step (open-instruct's, worked around in its PR 1498; DeepSpeed issue 7352) train on the last
micro-batch only. 0.14.4-0.17.5 sum, as ZeRO-0 and ZeRO-3 do on every release. `set_gradient_accumulation_boundary
(False)` before all but the last backward is a workaround; `managed_gradient_accumulation: false` another (0.19.4+).

The fix: a boundary epilogue that comes while an earlier boundary's gradients have not been consumed by `step()` adds to
them instead of replacing them: the gradients the stock code drops at a boundary are kept, and put back before the
next epilogue while `averaged_gradients` still holds what they built (a step consumes it and ends that). A kept
tensor that is still the parameter's own (`grad_accum` kept across backwards without a forward between, 0.18.5+) already
holds the earlier gradients, and zeros stand in for it. With one backward per step, or accumulation driven by the
engine, no second boundary comes before a step: the stock code runs, bit for bit.

With the optimizer offloaded to the CPU the same loop keeps only the last backward on every release 0.14.4-0.19.8,
through other code (the boundary's copy to the fp32 partition): deepspeed/zero12-offload-backward-twice fixes that
path, and this wrapper leaves an offloaded optimizer to it.

Proof: `dspatch canary`'s check with two `engine.backward()` calls per step at ZeRO-1 and ZeRO-2: stock's gradient is
the last micro-batch's (0.18.3+) or the second backward raises (0.17.6-0.18.2); patched it is the sum, as plain torch's,
on latest, ds0183, ds0182 and ds0192; one backward per step stays stock's to the bit.
"""
from dspatch.spec import Patch, Signature

STAGE12 = "deepspeed.runtime.zero.stage_1_and_2"
EPILOGUE = "DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue"
# every release 0.17.6-0.19.8 (python tests/upstream_releases.py deepspeed/zero12-backward-twice 0.17.6 0.19.8)
FINGERPRINTS = {(STAGE12, EPILOGUE): {"1df76fc5991c316e": "0.17.6-0.18.2", "1e170584951d2d80": "0.18.3-0.18.4",
                                     "827f2a855c0d91bd": "0.18.5-0.19.4", "88bf6af105215fb5": "0.19.5-0.19.7",
                                     "d2f46621de6afcfe": "0.19.8"}}


class _Dropping(dict):
    """`all_grad_tensors` while one epilogue runs: remembers each list of gradients the stock code drops."""

    def __init__(self, data):
        super().__init__(data)
        self.dropped = {}

    def __setitem__(self, key, value):
        if value is None and dict.get(self, key) is not None:
            self.dropped[key] = dict.__getitem__(self, key)
        dict.__setitem__(self, key, value)


def _boundary(optimizer):
    flag = optimizer.is_gradient_accumulation_boundary  # an attribute until 0.19.4, a method from 0.19.5
    return bool(flag() if callable(flag) else flag)


def _gradient(optimizer, param):
    read = getattr(optimizer, "get_param_gradient_attribute", None)
    return read(param) if read is not None else param.grad


def summing(kept):
    """The epilogue's wrapper; `kept` {optimizer: {group: [gradients]}}, weakly keyed: a boundary's gradients that no
    step consumed yet."""
    def epilogue(wrapped, optimizer, args, kwargs):
        if optimizer.cpu_offload or not (_boundary(optimizer) or optimizer in kept):
            return wrapped(*args, **kwargs)  # no boundary, nothing kept: the stock path, untouched
        import torch

        for group, earlier in kept.pop(optimizer, {}).items():
            if optimizer.averaged_gradients.get(group) is None:  # a step consumed them
                continue
            now = [_gradient(optimizer, p) for p in optimizer.params_in_partition[group]]
            held = optimizer.all_grad_tensors.get(group)
            if held is None:  # put the earlier boundary's back (zeros for a tensor that already holds them)
                optimizer.all_grad_tensors[group] = [torch.zeros_like(e) if e is n else e for e, n in zip(earlier, now)]
            else:  # non-boundary backwards since then collected into `held`: the earlier boundary's added
                for h, e, n in zip(held, earlier, now):
                    if e is not n and e is not h:
                        h.add_(e)
        original = optimizer.all_grad_tensors
        optimizer.all_grad_tensors = recording = _Dropping(original)
        try:
            return wrapped(*args, **kwargs)
        finally:
            original.clear()
            original.update(recording)
            optimizer.all_grad_tensors = original
            if recording.dropped:
                kept[optimizer] = recording.dropped

    return epilogue


def apply(txn):
    import weakref

    txn.wrap(txn.target(EPILOGUE), summing(weakref.WeakKeyDictionary()))


def in_the_epilogue(line):
    """A frame of ZeRO-1/2's epilogue, where 0.17.6-0.18.2 zip a dropped list."""
    return "independent_gradient_partition_epilogue" in line


PATCH = Patch(
    id="deepspeed/zero12-backward-twice",
    summary=("ZeRO-1/2: several engine.backward() calls before one engine.step() sum their gradients (not only the "
             "last, not a TypeError), as ZeRO-0, ZeRO-3 and plain torch do"),
    cause=("At accumulation 1 every ZeRO-1/2 backward is a boundary that rebuilds the gradient it steps from its own "
           "micro-batch, dropping what an earlier backward of the same step gave"),
    canary=("last_only",),
    symptom="several backwards per step at ZeRO-1/2: only the last one's gradient silently trains (or a `TypeError`)",
    distribution="deepspeed",
    affected=">=0.17.6",
    fixed_in=None,
    supported=">=0.17.6",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/issues/7352", "https://github.com/allenai/open-instruct/pull/1498",
           "https://github.com/deepspeedai/DeepSpeed/pull/7509"),
    diffs=("deepspeed/0026-zero12-backward-twice-0.17.6-0.18.2.patch",
           "deepspeed/0026-zero12-backward-twice-0.18.3-0.18.4.patch",
           "deepspeed/0026-zero12-backward-twice-0.18.5-0.19.4.patch",
           "deepspeed/0026-zero12-backward-twice-0.19.5-0.19.7.patch",
           "deepspeed/0026-zero12-backward-twice-0.19.8.patch"),
    note=("wraps DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue; with offload_optimizer "
          "deepspeed/zero12-offload-backward-twice"),
    signatures=(Signature(r"'NoneType' object is not iterable", error="TypeError", needs=(in_the_epilogue,)),),
)

"""ZeRO-1/2 on the CPU with `contiguous_gradients: false` all-reduces the gradients (deepspeed <= 0.19.7; fixed in
0.19.8).

Stock never reduces them there: each rank steps its own partition with its own micro-batches' gradient, and the
all-gather after the step makes the ranks agree on weights no single gradient gave.

A silent one: no error, no warning, the ranks stay in step, the loss goes down; only a comparison of the update with
plain torch's (the ranks' gradients averaged) shows it. Without contiguous gradients, ZeRO-1/2 reduce a bucket of
gradients through `buffered_reduce_fallback`, which groups them by type with `split_half_float_double`: it builds the
type strings from the accelerator's device name (`torch.cpu.FloatTensor`), and a CPU tensor's `type()` is
`torch.FloatTensor`, so every bucket comes back empty and nothing is all-reduced. CPU clusters and CI runners hit it
(DeepSpeed PR 8382, in 0.19.8, compares dtypes instead).

The fix groups the gradients as 0.19.8 does: by dtype (half, float, double, bfloat16, in stock's order), dense tensors
only. On an accelerator, whose tensors report `torch.<device>.<Type>Tensor`, that is the grouping stock already makes,
so the numbers there stay stock's to the bit.

Proven by numbers on the old, bridge and mid stacks (deepspeed 0.14.4, 0.16.9, 0.16.3) and on 0.18.3 and 0.19.2 (their
sessions): two ranks, two SGD steps of a small MLP on each rank's own micro-batches at ZeRO-1 and ZeRO-2 with
`contiguous_gradients: false` equal plain torch on the averaged gradient (relative 1e-6); stock is off by more than
half. The diff makes the same change in `split_half_float_double` (one band, 0.14.0-0.19.7).
"""
from dspatch.spec import Patch

ZERO12 = "deepspeed.runtime.zero.stage_1_and_2"
SPLIT = "split_half_float_double"
FINGERPRINTS = {(ZERO12, SPLIT): {"7703871b5b9ccc37": "0.14.0-0.19.7"}}


def by_dtype(wrapped, instance, args, kwargs):
    """split_half_float_double(tensors): the dense tensors grouped by dtype, as stock means to on every device."""
    import torch

    tensors = list(args[0] if args else kwargs["tensors"])
    buckets = []
    for dtype in (torch.half, torch.float, torch.double, torch.bfloat16):
        bucket = [t for t in tensors if t.dtype == dtype and t.layout == torch.strided]
        if bucket:
            buckets.append(bucket)
    return buckets


def apply(txn):
    txn.wrap(txn.target(SPLIT), by_dtype)


PATCH = Patch(
    id="deepspeed/zero12-cpu-grads-not-reduced",
    summary=("ZeRO-1/2 on the CPU with contiguous_gradients false all-reduces the gradients: stock's buckets, built "
             "from device-named type strings, come back empty there (silent)"),
    cause=("split_half_float_double matches gradients against `torch.cpu.FloatTensor`-style type strings that no CPU "
           "tensor reports, so buffered_reduce_fallback all-reduces nothing"),
    canary=("not_averaged",),  # each rank's own gradient: no factor of the average (dspatch canary --ranks 2)
    symptom="each rank silently steps on its own gradient: ZeRO-1/2, CPU, `contiguous_gradients: false`, 2+ ranks",
    distribution="deepspeed",
    affected="<0.19.8",
    fixed_in="0.19.8",
    supported=">=0.14.0",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/8382",),
    diffs=("deepspeed/0032-zero12-cpu-grads-not-reduced-0.14.0-0.19.7.patch",),
    note="deepspeed.runtime.zero.stage_1_and_2.split_half_float_double is wrapped: it groups gradients by dtype",
)

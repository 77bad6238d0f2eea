"""accelerate + DeepSpeed's `"managed_gradient_accumulation": false`: accelerate steps the engine where it syncs
instead of failing at the first backward (accelerate >= 1.8.0 with deepspeed >= 0.19.4, no upstream report).

Stock fails at the first `accelerator.backward`, in custom loops and the Trainer alike: `AssertionError:
set_gradient_accumulation_boundary() is not supported with managed_gradient_accumulation=False; the caller owns the
boundary by calling step()`.

DeepSpeed 0.19.4 added the mode (PRs 8184, 8203, 8217, 8225) and documents it: the caller owns the accumulation
boundary, `engine.backward()` only accumulates (each loss divided by the config's accumulation), and every
`engine.step()` applies one update. accelerate 1.8.0 (PR 3630) made `DeepSpeedEngineWrapper.backward` call
`engine.set_gradient_accumulation_boundary(sync_gradients)` before every backward, which the mode refuses by an
assertion. Through accelerate the caller's boundary is well defined: it is where accelerate syncs.

The fix: for an engine in that mode, `accelerator.backward` runs `engine.backward(loss)` and, where accelerate
syncs, `engine.step()`; it never overrides the boundary, so the engine stays in the mode the user chose. Every other engine
(the default managed mode, deepspeed < 0.19.4) goes through stock, to the bit.

Proven on the latest stack (accelerate 1.15.0, deepspeed 0.19.8): 6 micro-batches at accumulation 3 in an
`accumulate` loop at ZeRO-1 and ZeRO-2 take accelerate's 2 steps, as plain torch does (relative 1e-5); stock fails
with the assertion.
"""
from dspatch.spec import Patch, Signature

ACCELERATOR = "accelerate.accelerator"
BACKWARD = "Accelerator.backward"
FINGERPRINTS = {(ACCELERATOR, BACKWARD): {"5ed0426610c1ddd8": "1.8.0-1.15.0"}}


def step_where_accelerate_syncs(wrapped, accelerator, args, kwargs):
    """Accelerator.backward(loss, **kwargs): for an engine in DeepSpeed's caller-owned mode, its backward, and its
    step where accelerate syncs (accelerate's DeepSpeedEngineWrapper.backward, which overrides the boundary, is not
    called: accelerate/deepspeed-steps-without-accumulate wraps that one)."""
    from accelerate.utils import DistributedType

    wrapper = getattr(accelerator, "deepspeed_engine_wrapped", None)
    managed = getattr(getattr(wrapper, "engine", None), "managed_gradient_accumulation", None)
    if accelerator.distributed_type != DistributedType.DEEPSPEED or not callable(managed) or managed():
        return wrapped(*args, **kwargs)

    def split(loss, **rest):
        return loss, rest

    loss, rest = split(*args, **kwargs)
    wrapper.engine.backward(loss, **rest)
    if accelerator.sync_gradients:
        wrapper.engine.step()


def apply(txn):
    txn.wrap(txn.target(BACKWARD), step_where_accelerate_syncs)


PATCH = Patch(
    id="accelerate/deepspeed-unmanaged-accumulation",
    summary=("accelerate + DeepSpeed with managed_gradient_accumulation false: the engine steps where accelerate "
             "syncs, instead of an AssertionError at the first backward"),
    cause=("accelerate >= 1.8 sets DeepSpeed's accumulation boundary before every backward, which DeepSpeed's "
           "caller-owned mode (managed_gradient_accumulation false, 0.19.4+) refuses"),
    symptom=("AssertionError: set_gradient_accumulation_boundary() is not supported with "
             "managed_gradient_accumulation=False"),
    distribution="accelerate",
    affected=">=1.8.0",
    fixed_in=None,
    supported=">=1.8.0",
    requires={"deepspeed": ">=0.19.4"},
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/accelerate/pull/3630", "https://github.com/deepspeedai/DeepSpeed/pull/8184",
           "https://github.com/deepspeedai/DeepSpeed/pull/8225"),
    diffs=("accelerate/0009-deepspeed-unmanaged-accumulation-1.8.0-1.15.0.patch",),
    # the assertion a caller of set_gradient_accumulation_boundary gets in that mode: accelerate's frames tell this
    # cause (no upstream thread quotes the log yet)
    signatures=(Signature(r"set_gradient_accumulation_boundary\(\) is not supported with "
                          r"managed_gradient_accumulation=False", error="AssertionError",
                          needs=(r"accelerate[/\\]utils[/\\]deepspeed\.py",)),),
    note=("Accelerator.backward is wrapped: an engine with managed_gradient_accumulation false is stepped "
          "where accelerate syncs, its boundary never overridden"),
)

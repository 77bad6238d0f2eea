"""ZeRO-3 with `stage3_allgather_sequential`: a gather handle waited a second time changes nothing (deepspeed
0.18.5-0.19.6).

With `stage3_allgather_sequential` (0.18.5) a gather of several parameters is a list of one `AllGatherHandle` per
parameter, which the coordinator files under each parameter it covers; `fetch_sub_module` then waits it once per
parameter it pops. `AllGatherHandle.wait` and `NoGatherHandle.wait` have no completion flag before 0.19.7: each wait
marks its parameter available again. Where one handle holds the parameters of two modules (a prefetch), the second
module's wait marks the first's parameters available after they were released, with 0 elements of data; the first
module's next forward gathers nothing and fails in `zero/linear.py`: `RuntimeError: size mismatch, got input (N), mat
(NxM), vec (0)` (with a bias: `mat2 must be a matrix, got 1-D tensor`). A training engine forces the prefetch bucket to
one parameter whenever allgather_sequential is on, so it does not meet it; an engine without an optimizer (inference,
evaluation, a reference or teacher model) keeps the default bucket and fails at its third forward. DeepSpeed issue
8486; 0.19.7 (PR 8487) gave both handles a completion flag.

The fix is 0.19.7's, from outside: a handle that has been waited is remembered (weakly), and a second wait returns at
once.

Proof: two gloo ranks on deepspeed 0.19.2 (the ds0192 session), ZeRO-3 without an optimizer,
`stage3_allgather_sequential`, persistence threshold 0, four Linear layers: stock fails at the third forward with the
message above; patched, the four forwards give the losses the same engine gives without allgather_sequential.
"""
from dspatch.spec import Patch, Signature

PARAMETERS = "deepspeed.runtime.zero.partition_parameters"
GATHER = "AllGatherHandle.wait"
LOCAL = "NoGatherHandle.wait"
# every release 0.18.5-0.19.6 (python tests/upstream_releases.py deepspeed/zero3-gather-handle-waited-once 0.18.5
# 0.19.6)
FINGERPRINTS = {(PARAMETERS, GATHER): {"6f59d80acef5a896": "0.18.5-0.19.5", "8f25a8f127cf901d": "0.19.6"},
                (PARAMETERS, LOCAL): {"36931a067aebe464": "0.18.5-0.19.6"}}


def once(done):
    """A wrapper for a handle's wait: the first wait runs, a later one returns at once (0.19.7's completion flag)."""
    def wait(wrapped, handle, args, kwargs):
        if handle in done:
            return None
        result = wrapped(*args, **kwargs)
        done.add(handle)
        return result

    return wait


def apply(txn):
    import weakref

    done = weakref.WeakSet()  # the handles waited: each lives as long as the gather it belongs to
    txn.wrap(txn.target(GATHER), once(done))
    txn.wrap(txn.target(LOCAL), once(done))


# the message's own traceback: the engine's forward (parameters gathered by ZeRO-3's hooks), down to a Linear whose
# weight arrived with no data (torch's linear, or ZeRO-3's own in a training forward); the same words from a ZeRO-3
# model called around its engine (nothing gathered) have no engine frame
ENGINE_FORWARD = r'deepspeed/runtime/engine\.py", line \d+, in forward'
LINEAR = r'(torch/nn/modules/linear\.py|zero/linear\.py)", line \d+, in forward'


PATCH = Patch(
    id="deepspeed/zero3-gather-handle-waited-once",
    summary=("ZeRO-3 with stage3_allgather_sequential: a gather handle waited a second time changes nothing, so a "
             "released parameter is not marked available with no data"),
    cause=("Before 0.19.7 a ZeRO-3 gather handle waited twice marks its parameters available again, after they were "
           "released"),
    symptom="`RuntimeError: size mismatch, got input (N), mat (NxM), vec (0)` in `zero/linear.py` (inference engines)",
    distribution="deepspeed",
    affected=">=0.18.5,<0.19.7",
    fixed_in="0.19.7",
    supported=">=0.18.5",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/issues/8486", "https://github.com/deepspeedai/DeepSpeed/pull/8487"),
    diffs=("deepspeed/0024-zero3-gather-handle-waited-once-0.18.5-0.19.6.patch",),
    signatures=(Signature(r"size mismatch, got input \(\d+\), mat \(\d+x\d+\), vec \(0\)", error="RuntimeError",
                          needs=(ENGINE_FORWARD, LINEAR)),
                Signature(r"mat2 must be a matrix, got 1-D tensor", error="RuntimeError",
                          needs=(ENGINE_FORWARD, LINEAR))),
)

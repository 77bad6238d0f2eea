"""ZeRO-3 on the CPU (gloo): `GatheredParameters` over several parameters can return before they have arrived.

A blocking ZeRO-3 gather of several partitioned parameters (`GatheredParameters([...])`, a save's consolidation,
`zero_gather_16bit_weights_on_model_save`, a user's evaluation or export code) goes through
`Init._allgather_params_coalesced`: one asynchronous all-gather per parameter into a `torch.empty` buffer, then a wait
on the *last* handle only, and each parameter's data is pointed at its buffer. On CUDA that is enough (the all-gathers
run in order on one stream and the device is synchronised after). On the CPU accelerator with gloo, each asynchronous
collective runs on gloo's worker threads with no order between them, and `synchronize()` does nothing: the last gather
can be done while an earlier one is still arriving, and the caller reads that parameter's uninitialised buffer (zeros,
or the bytes of whatever tensor of that size was freed before: another parameter's values, here another layer's weight).
Silent and timing-dependent: a checkpoint, a reference or an evaluation reads wrong weights, more often under load.
Every release 0.14.0-0.19.7; found by this project's own 2-rank tests on the CPU; deepspeed 0.19.8 (PR 8539) waits for
every handle.

The fix, as 0.19.8: wait for every launched all-gather, not only the last. `_allgather_params_coalesced` is rebuilt from
the installed source with that one statement changed; on CUDA the extra waits are on work already done.

Proven on the old, bridge and mid stacks with 2 ranks: 60 gathers of 7 weights (six of 1M values, then a tiny one) each
return every weight whole on both ranks, where stock reads a wrong weight in several of them in every run seen (16 of 16
runs, with and without load). The 2-rank PEFT save test runs with this patch beside transformers/peft-zero3-save (whose
save gathers the adapter at once), as `DSPATCH=1` would.
"""
from dspatch.spec import Patch

PARAMS = "deepspeed.runtime.zero.partition_parameters"
TARGET = "Init._allgather_params_coalesced"

# The released source of the target (tests/test_releases.py recomputes them from every release)
FINGERPRINTS = {(PARAMS, TARGET): {"45cad9eef8c8f693": "0.14.0-0.14.2", "48c13938e9fb85aa": "0.14.3-0.19.2",
                                   "e569c07f0952dfcb": "0.19.3-0.19.5", "135b5378c326256a": "0.19.6-0.19.7"}}


def wait_for_every_gather(definition):
    """Transform: `launch_handles[-1].wait()` becomes a wait on each handle of `launch_handles`."""
    from dspatch.rewrite import find_statement, statement

    body, i = find_statement(definition, "launch_handles[-1].wait()", "`launch_handles[-1].wait()`")
    body[i] = statement("for _handle in launch_handles:\n    _handle.wait()", body[i])


def apply(txn):
    txn.recode(txn.target(TARGET), wait_for_every_gather)


PATCH = Patch(
    id="deepspeed/zero3-gather-waits-all",
    summary=("ZeRO-3 on the CPU (gloo): GatheredParameters over several parameters waits for every all-gather, "
             "not only the last, before they are read"),
    cause="On gloo, `GatheredParameters` over several parameters waits for the last all-gather only",
    symptom="CPU/gloo: gathered weights silently read as zeros or another weight's values",
    distribution="deepspeed",
    affected="<0.19.8",
    fixed_in="0.19.8",
    supported=">=0.14.0",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/8539",),
    diffs=("deepspeed/0011-zero3-gather-waits-all-0.14.0-0.19.7.patch",),
    note=("Init._allgather_params_coalesced keeps its object, name and line numbers but runs code rebuilt from the "
          "installed file that waits for each launched all-gather"),
)

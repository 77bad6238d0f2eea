"""trl 0.8.2-0.15.2 on deepspeed >= 0.16.4: generation under ZeRO-3 (PPO, RLOO, online DPO, GKD, ...) dies.

`trl.models.utils.unwrap_model_for_generation` gathers a ZeRO-3 model's parameters for generation, takes DeepSpeed's
fetch/release hooks off the model (`remove_hooks`) and puts them back at the end of the `with` (`add_hooks`).
`add_hooks` does that by calling `DeepSpeedZeRoOffload._register_hooks_recursively`, which deepspeed 0.16.4 renamed to
`_register_deepspeed_module` (deepspeedai/DeepSpeed PR 6847, together with `module.id` -> `module.ds_id`). So with
deepspeed >= 0.16.4 every trainer that generates from the DeepSpeed engine under ZeRO-3 (GRPO 0.14, PPO, RLOO, online
DPO, GKD) fails at its first generation with `AttributeError: 'DeepSpeedZeRoOffload' object has no attribute
'_register_hooks_recursively'` (huggingface/trl#2962), and the hooks stay off. trl 0.16.0 (PR 2963) calls the new name
on deepspeed >= 0.16.4. (trl 0.15's GRPOTrainer generates from the bare model, on which `remove_hooks`/`add_hooks`
return at once, so it does not hit this; GRPO 0.14 does.)

The patch: `add_hooks` is rebuilt from the installed source (`txn.recode`) with that one call renamed to
`_register_deepspeed_module`, the function every deepspeed >= 0.16.4 registers its hooks with. It is gated on trl
0.8.2-0.15.2 (every release that has `add_hooks`: two released sources) and on deepspeed >= 0.16.4 (`requires`): with an
older deepspeed the old name exists (also under dspatch's deepspeed/zero3-module-id, whose backport renames `.id` and
keeps that method's name) and nothing changes. After generation the hooks are the same as before, and training is
bit-identical to the same run without generation.

The upstream diff (upstream_prs/trl/0002-*) makes `add_hooks` use whichever of the two names the installed deepspeed
has, so one trl works with every deepspeed; the monkeypatch only ever runs where the new name is the one that exists.

Not fixed here (trl 0.16.0 as released has it too, run here; trl 1.5.0 is the first release whose `add_hooks`
invalidates ZeRO-3's trace, which avoids it; deepspeed/zero3-trace-invalidation fixes it in deepspeed): re-registration
renumbers the modules (`count=[0]` carries on), so a generation between a forward that ZeRO-3 recorded in its trace and
the next reset of that trace makes that reset fail with `IndexError: pop from an empty deque` (PPOTrainer at ZeRO-3 on
trl 0.15/0.16, at its second update, seen here; the RLOO reproducer is not hit). With this patch trl 0.15.2 behaves
exactly as trl 0.16.0 does there.
"""
from dspatch.spec import Patch, Signature

UTILS = "trl.models.utils"
OLD, NEW = "_register_hooks_recursively", "_register_deepspeed_module"

# The released source of add_hooks in every trl release that has it (tests/test_releases.py
# recomputes them from every sdist); 0.15.0 added the "no optimizer yet" early return.
FINGERPRINTS = {
    (UTILS, "add_hooks"): {"715953abba3e9aaa": "0.8.2-0.14.0", "a13a05d0629e166a": "0.15.0-0.15.2"},
}

SIGNATURE = r"'?\w+' object has no attribute '_register_hooks_recursively'"  # the quote is lost in pastes
# a copy of trl's add_hooks kept in another project fails with the same message: this patch fixes trl's own, so a
# frame of an add_hooks from another file tells that it is not this bug
OTHER_COPY = r'File "(?![^"]*trl[/\\]models[/\\]utils\.py")[^"]*", line \d+, in add_hooks\b'


def new_registration_name(definition):
    """Transform: the one call `x._register_hooks_recursively(...)` becomes `x._register_deepspeed_module(...)`."""
    import ast

    from dspatch.rewrite import find_one

    # the name used exactly once, and that as a call
    find_one(definition, lambda n: isinstance(n, ast.Attribute) and n.attr == OLD, f"use of .{OLD}")
    find_one(definition, lambda n: isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == OLD, f"call of .{OLD}(...)").func.attr = NEW


def apply(txn):
    # upstream's own add_hooks object gets code rebuilt from the installed source with that one name changed:
    # no wrapper, remove_hooks/unwrap_model_for_generation untouched, nothing else of trl or deepspeed changes
    for target in txn.patch.targets:
        txn.recode(target, new_registration_name)


PATCH = Patch(
    id="trl/zero3-generation-hooks",
    summary=("GRPO/PPO/RLOO/online DPO/GKD generation under ZeRO-3 fails with deepspeed >= 0.16.4 "
             "(_register_hooks_recursively renamed): trl puts the hooks back under the new name"),
    cause="trl calls a ZeRO-3 method that deepspeed 0.16.4 renamed when it puts the hooks back after generation",
    symptom="`'DeepSpeedZeRoOffload' object has no attribute '_register_hooks_recursively'` at generation",
    distribution="trl",
    affected=">=0.8.2,<0.16.0",  # 0.8.2 introduced add_hooks; older releases never take the hooks off
    fixed_in="0.16.0",
    requires={"deepspeed": ">=0.16.4"},
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/trl/issues/2962", "https://github.com/huggingface/trl/pull/2963",
           "https://github.com/deepspeedai/DeepSpeed/pull/6847"),
    supported=">=0.8.2",
    diffs=("trl/0002-zero3-generation-hooks-0.8.2-0.15.2.patch",),
    signatures=(Signature(SIGNATURE, error="AttributeError", unless=(OTHER_COPY,)),),
    note=("trl.models.utils.add_hooks keeps its object, name and line numbers but runs code rebuilt from the "
          "installed file with `_register_hooks_recursively` read as `_register_deepspeed_module`"),
)

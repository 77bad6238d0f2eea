"""`Accelerator.save_model` works on every rank at ZeRO-3 (accelerate 0.21.0-1.0.1).

At ZeRO-3 `save_model` must be called on every rank: the weights are gathered with a collective. Only the main process
gets them; every other rank's `get_state_dict` returns None, and `save_model` goes on to write None: `AttributeError:
'NoneType' object has no attribute 'items'` on every rank but 0 (accelerate issue 2985). A training script that calls
`accelerator.save_model(model, out)` as documented dies on all ranks but one (and the job with them). accelerate 1.1.0
fixed it (PR 3146): a rank that got no state dict returns.

The fix does the same: `Accelerator.save_model` is rebuilt from the installed source with `if state_dict is None:
return` right after the state dict is obtained (`txn.recode`). Proven with 2 ranks (torchrun, gloo) on the old stack
(accelerate 0.34.2): both return, rank 0 writes `model.safetensors`, and the weights written equal the gathered model's.
"""
from dspatch.spec import Patch, Signature

ACCELERATOR = "accelerate.accelerator"
SAVE_MODEL = "Accelerator.save_model"
FINGERPRINTS = {
    (ACCELERATOR, SAVE_MODEL): {"1c90139cceb6dcab": "0.21.0-0.22.0", "65515b391a86e28b": "0.23.0-0.24.1",
                                "db7cf2aebd2ce536": "0.25.0-0.31.0", "0c9d2a4d7524abd6": "0.32.0-1.0.1"},
}
NONE_ITEMS = "'NoneType' object has no attribute 'items'"


def return_without_state_dict(definition):
    """Transform: after the statement that obtains `state_dict = self.get_state_dict(model)` (itself, or the
    if/else holding it), `if state_dict is None: return`."""
    import ast

    from dspatch.rewrite import RewriteError, find_one, statement

    got = find_one(definition, "state_dict = self.get_state_dict(model)")
    holders = [i for i, stmt in enumerate(definition.body) if any(node is got for node in ast.walk(stmt))]
    if len(holders) != 1:
        raise RewriteError(f"{definition.name}: `state_dict = self.get_state_dict(model)` is not in its body")
    at = definition.body[holders[0]]
    definition.body.insert(holders[0] + 1, statement("if state_dict is None:\n    return", at))


def apply(txn):
    txn.recode(txn.target(SAVE_MODEL), return_without_state_dict)


PATCH = Patch(
    id="accelerate/zero3-save-model-all-ranks",
    summary=("Accelerator.save_model at ZeRO-3 returns on every rank (the main one writes) instead of "
             "`'NoneType' object has no attribute 'items'` on all others"),
    cause="At ZeRO-3 `Accelerator.save_model` reads a state dict that only the main rank has",
    symptom="`AttributeError: 'NoneType' object has no attribute 'items'` on every rank but the main one",
    distribution="accelerate",
    affected=">=0.21.0,<1.1.0",
    fixed_in="1.1.0",
    supported=">=0.21.0",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/accelerate/issues/2985", "https://github.com/huggingface/accelerate/pull/3146"),
    diffs=("accelerate/0003-zero3-save-model-all-ranks-0.21.0-0.24.1.patch",
           "accelerate/0003-zero3-save-model-all-ranks-0.25.0-1.0.1.patch"),
    signatures=(Signature(r"'NoneType' object has no attribute 'items'", error="AttributeError",
                          needs=(r"accelerator\.py.* in save_model",)),),
    note=("Accelerator.save_model keeps its object, name and line numbers but runs code rebuilt from the installed "
          "file that returns on a rank without the gathered state dict"),
)

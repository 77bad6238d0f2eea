"""LoRA with `modules_to_save` trains at ZeRO-3 (deepspeed 0.16.5-0.19.2): no `ds_grads_remaining` error.

deepspeed 0.16.5 (PR 7062) builds each module's backward autograd functions once, when it registers the module's ZeRO-3
hooks, and skips that when the module already has them: `if not hasattr(module, "pre_bwd_fn")` (likewise `post_bwd_fn`,
and the counter `applied_pre_backward_ref_cnt`). Children register before their parent, and peft's
`ModulesToSaveWrapper` (what `modules_to_save=["lm_head"]`, `["embed_tokens"]` or `task_type=SEQ_CLS`'s classifier head
become) forwards the attributes it lacks to the module it wraps: `hasattr` finds the child's functions, the wrapper
reuses them, and they count on the child (`original_module`), which never runs forward, so the first backward fails:
`AttributeError: 'Linear' object has no attribute 'ds_grads_remaining'` (0.16.5-0.19.2; DeepSpeed issues 7203 and 7615).
Upstream fixed it in 0.19.3 (PR 8144) by looking these up on the module itself: `"pre_bwd_fn" not in module.__dict__`.

The fix does exactly that: the registration function is rebuilt from the installed source with each of those three
`hasattr(x, name)` tests replaced by `name in x.__dict__` (`txn.recode`; nothing else changes, no wrapper, nothing at
run time, nothing per step). The registration is also wrapped by deepspeed/zero3-trace-invalidation on 0.16.5-0.19.1:
the two compose (that wrapper calls this rebuilt code).

Tested on 0.16.9 (bridge) through the Trainer (LoRA, `modules_to_save=["lm_head"]`) and through `deepspeed.initialize`
(a SEQ_CLS LoRA model): the trained copy, the LoRA weights and the losses equal, bit for bit, the same runs with the
wrapped module trained directly.
"""
from dspatch.spec import Patch, Signature

OFFLOAD = "deepspeed.runtime.zero.parameter_offload"
REGISTER = "DeepSpeedZeRoOffload._register_deepspeed_module"
FINGERPRINTS = {
    (OFFLOAD, REGISTER): {"ee40de67af1e7283": "0.16.5", "e57f4e587a741658": "0.16.6-0.16.7",
                          "5c395ea1f201992d": "0.16.8-0.19.0", "36c70cf5f780a278": "0.19.1",
                          "e58e37665594e45d": "0.19.2"},
}
OWN = ("pre_bwd_fn", "post_bwd_fn", "applied_pre_backward_ref_cnt")  # module-local state, never a child's
MISSING = "object has no attribute 'ds_grads_remaining'"


def own_attributes_only(definition):
    """Transform: `hasattr(x, "<name>")` -> `"<name>" in x.__dict__` for each name in OWN (exactly one each)."""
    from dspatch.rewrite import expression, find_one, replace

    for name in OWN:
        call = find_one(definition, f"hasattr(_, {name!r})")
        test = expression(f"{name!r} in _.__dict__", call)
        test.comparators[0].value = call.args[0]  # the same object expression upstream tests
        replace(definition, call, test)


def apply(txn):
    txn.recode(txn.target(REGISTER), own_attributes_only)


PATCH = Patch(
    id="deepspeed/zero3-modules-to-save-grads",
    summary=("LoRA with modules_to_save (lm_head, embed_tokens, a SEQ_CLS head) trains at ZeRO-3: no "
             "`'Linear' object has no attribute 'ds_grads_remaining'`"),
    cause="ZeRO-3 hooks miss the trainable copies PEFT makes for `modules_to_save`",
    symptom="`AttributeError: 'Linear' object has no attribute 'ds_grads_remaining'` at the first step",
    distribution="deepspeed",
    affected=">=0.16.5,<0.19.3",
    fixed_in="0.19.3",
    supported=">=0.16.5",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/issues/7203", "https://github.com/deepspeedai/DeepSpeed/pull/8144",
           "https://github.com/deepspeedai/DeepSpeed/issues/7615"),
    diffs=("deepspeed/0008-zero3-modules-to-save-grads-0.16.5-0.19.0.patch",
           "deepspeed/0008-zero3-modules-to-save-grads-0.19.1-0.19.2.patch"),
    signatures=(Signature(r"'\w+' object has no attribute 'ds_grads_remaining'", error="AttributeError"),),
    note=("DeepSpeedZeRoOffload's hook registration keeps its object, name and line numbers but runs code rebuilt "
          "from the installed file that looks up a module's own backward functions in its __dict__"),
)

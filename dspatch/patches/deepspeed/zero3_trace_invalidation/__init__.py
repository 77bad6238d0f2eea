"""ZeRO-3: training goes on after generation (`IndexError: pop from an empty deque`), deepspeed 0.15.4-0.19.1.

ZeRO-3's parameter coordinator records the order in which submodules run (its trace) keyed by each module's number,
which DeepSpeed assigns when it registers its hooks (`_register_hooks_recursively`, renamed `_register_deepspeed_module`
in 0.16.4), with a counter that never resets: registering the hooks again renumbers every module. Since 0.15.4 (PR 6662)
the trace is advanced by a forward pre-hook on the root module that removing the hooks does not remove, so a trace still
being recorded survives from the end of one training step to the next forward. Whoever removes ZeRO-3's hooks to
generate and registers them again (trl's `unwrap_model_for_generation` in GRPO/PPO/RLOO/online DPO/GKD before trl 1.5,
deepspeed's own `unwrap_model_for_generation` of 0.15.x-0.16.3, PEFT models generating through their base model,
vendored copies of trl's `add_hooks`) leaves that trace holding the old numbers, and the next training step fails in
`record_parameters`: `IndexError: pop from an empty deque`. Generation that runs the root module's forward (plain
`generate` on the trained model) goes through the pre-hook and does not hit it; generation through a child
(`model.policy.generate` in PPO) does. Upstream threads: trl issues 2304 and 4535, trl PR 4693.

The fix, as deepspeed 0.19.2 does (PR 8043): registering the hooks of the root module invalidates the coordinator's
trace (unless it is invalid already), so it is recorded again on the next forward. In DeepSpeed itself, so every caller
is covered, not only trl (trl 1.5 added the same invalidation to its own `add_hooks`; with it, the trace is invalid
already and nothing more happens).

How: a wrapper on the registration function (either name), which recurses through the class attribute, so the check runs
once per registered module and acts only for the root: at `deepspeed.initialize` and at each re-registration, never in a
training step. A wrapper, not a rebuilt function: deepspeed/zero3-module-id rebuilds `_register_hooks_recursively`
itself on 0.15.4-0.16.3, and the two compose (this wrapper calls whatever code that function runs); it composes with
trl/zero3-generation-hooks as well. PR 8043 also clears the coordinator's fetch-step map in `_clear_trace_structures`;
that line is not backported: no path reads that map between an invalidation and the `reset_step` that replaces it
(`reset_step` is the only place that turns recording on), so no reproducer could show it matters. On 0.15.4-0.16.3 this
patch's upstream diff and deepspeed/zero3-module-id's touch the same lines: apply one of them to a checkout, not both in
sequence.

Tested on 0.16.3 (mid, with deepspeed/zero3-module-id) and 0.16.9 (bridge, with trl 0.15.2 and
trl/zero3-generation-hooks): training with generation between steps gives the same losses and weights, bit for bit, as
without it, through deepspeed's and trl's unwrap; trl's PPO trainer's second update after generation fails on stock and
trains patched.
"""
from dspatch.patches.deepspeed.zero3_module_id import COORDINATOR_FRAME
from dspatch.spec import Patch, Signature, Target

OFFLOAD = "deepspeed.runtime.zero.parameter_offload"

TARGETS = (
    Target(OFFLOAD, "DeepSpeedZeRoOffload._register_hooks_recursively",
           {"beb1744112358e8d": "0.15.4", "90264bf624e8b96e": "0.16.0-0.16.3"}, releases="<0.16.4"),
    Target(OFFLOAD, "DeepSpeedZeRoOffload._register_deepspeed_module",
           {"ab493af3f6e97c9d": "0.16.4", "ee40de67af1e7283": "0.16.5", "e57f4e587a741658": "0.16.6-0.16.7",
            "5c395ea1f201992d": "0.16.8-0.19.0", "36c70cf5f780a278": "0.19.1"}, releases=">=0.16.4"),
)
DEQUE = "pop from an empty deque"
# frames of generation, or of a trainer or framework that generates between training steps
GENERATION = (r"unwrap_model_for_generation|_generate_and_score_completions|\bgenerate\b|remove_hooks|add_hooks|"
              r"(grpo|ppo|rloo|online_dpo|gkd|xpo|nash_md)_trainer\.py|openrlhf|verl[/\\]|experience_maker|rollout")


def invalidate_trace_at_root(wrapped, instance, args, kwargs):
    """Registering the root module's hooks invalidates the recorded trace (deepspeed 0.19.2's first lines)."""
    module = args[0] if args else kwargs.get("module")
    if instance is not None and module is getattr(instance, "module", None):
        coordinator = instance.get_param_coordinator()
        if coordinator is not None and not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()
    return wrapped(*args, **kwargs)


def apply(txn):
    for target in txn.patch.targets:
        txn.wrap(target, invalidate_trace_at_root)


PATCH = Patch(
    id="deepspeed/zero3-trace-invalidation",
    summary=("ZeRO-3 training goes on after generation that removed and re-registered its hooks (trl GRPO/PPO/RLOO/"
             "online DPO/GKD, deepspeed's unwrap_model_for_generation): no `IndexError: pop from an empty deque`"),
    cause="ZeRO-3 keeps its recorded module order after generation re-registered its hooks",
    symptom="`IndexError: pop from an empty deque` in the first training step after generation",
    distribution="deepspeed",
    affected=">=0.15.4,<0.19.2",
    fixed_in="0.19.2",
    supported=">=0.15.4",
    targets=TARGETS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/8043", "https://github.com/huggingface/trl/issues/2304",
           "https://github.com/huggingface/trl/issues/4535", "https://github.com/huggingface/trl/pull/4693",
           "https://github.com/deepspeedai/DeepSpeed/pull/6662"),
    diffs=("deepspeed/0007-zero3-trace-invalidation-0.15.4-0.16.3.patch",
           "deepspeed/0007-zero3-trace-invalidation-0.16.4-0.19.1.patch"),
    # the message is also what a user-set module.id gives on <= 0.16.3 (deepspeed/zero3-module-id): a frame of
    # generation (or of a trainer that generates) in the traceback, or the versions, tell them apart
    signatures=(Signature(r"pop from an empty deque", error="IndexError", context=(COORDINATOR_FRAME + "|" + GENERATION,),
                          hints=(GENERATION,),
                          tell="it comes in training right after generation (trl GRPO/PPO/RLOO/online DPO/GKD, "
                               "unwrap_model_for_generation, an RLHF framework's rollout) on deepspeed 0.15.4-0.19.1"),),
    note=("DeepSpeedZeRoOffload's hook registration is wrapped: registering the root module invalidates ZeRO-3's "
          "recorded trace, as deepspeed 0.19.2 does; nothing runs per step"),
)

"""ZeRO-3 overwrites a user's `module.id`; DeepSpeed's counter moves to `ds_id`, upstream's name since 0.16.4.

DeepSpeed <= 0.16.3 numbers every submodule with `module.id = n` when it registers its ZeRO-3 hooks, and its
parameter coordinator keys the fetch/release bookkeeping on `module.id`. So (a) a model's own `.id` is lost
at `deepspeed.initialize`, and (b) user code that sets `.id` afterwards (expert placement) corrupts that
bookkeeping. Upstream PR 6847 renamed the attribute to `ds_id` in 0.16.4. This patch does the same rename,
in every function that writes or reads it, on the installed source; and (c) it refuses to overwrite a
`ds_id` that DeepSpeed did not set, instead of clobbering it silently.
"""
import sys

from dspatch.spec import BugSeen, Patch, Target

OFFLOAD = "deepspeed.runtime.zero.parameter_offload"
COORDINATOR = "deepspeed.runtime.zero.partitioned_param_coordinator"
REGISTER = "DeepSpeedZeRoOffload._register_hooks_recursively"

# Every function that reads or writes a module's `.id`, and the fingerprint of its source in the releases
# it was written for (tests/test_gating_releases.py recomputes them from every release).
FINGERPRINTS = {
    (OFFLOAD, REGISTER): {"68f7c2b8868a5b97": "0.14.0-0.15.4", "d8d51369b02ab12d": "0.16.0-0.16.3"},
    (OFFLOAD, "DeepSpeedZeRoOffload.post_sub_module_forward_function"): {
        "211210429c05b1ad": "0.14.0-0.15.3", "1c17835fc61a93ab": "0.15.4-0.16.3"},
    (OFFLOAD, "DeepSpeedZeRoOffload.post_sub_module_backward_function"): {
        "ab52797d3cb42a2a": "0.14.0-0.15.3", "e8e198876356edf1": "0.15.4-0.16.3"},
    (COORDINATOR, "PartitionedParameterCoordinator.trace_prologue"): {"6872f1825ac1c09d": "0.14.0-0.16.3"},
    (COORDINATOR, "PartitionedParameterCoordinator.record_module"): {
        "e43da651c20c8f8e": "0.14.0-0.15.3", "22206c3baab48e1b": "0.15.4-0.16.3"},
    (COORDINATOR, "PartitionedParameterCoordinator.record_parameters"): {
        "2ec0d8fcc00c06e4": "0.14.0-0.15.3", "106bb69e71bf8c95": "0.15.4-0.16.3"},
    (COORDINATOR, "PartitionedParameterCoordinator.reset_step"): {
        "983f7642ae5cea4b": "0.14.0-0.15.2", "ed1086c563cde9d9": "0.15.3", "c7b109de769aebee": "0.15.4",
        "e0600b3927cdc8f3": "0.16.0-0.16.3"},
    (COORDINATOR, "PartitionedParameterCoordinator.fetch_sub_module"): {
        "27dbc2287ba434ca": "0.14.0-0.16.2", "a230748ead4cb6e6": "0.16.3"},
    (COORDINATOR, "PartitionedParameterCoordinator.release_sub_module"): {
        "830c11c724ff0ba7": "0.14.0-0.16.2", "b1713fcbe5f8dc43": "0.16.3"},
}

def refuse_foreign_ds_id(module):
    """(c) A `ds_id` that DeepSpeed did not assign belongs to the user: refuse rather than overwrite it.

    DeepSpeed's own assignment is remembered on the module (`_ds_id_assigned`), so re-registration
    (unwrap_model_for_generation, a deepcopy or a pickle of a ZeRO-3 model) is recognised as DeepSpeed's."""
    if hasattr(module, "ds_id"):
        own, assigned = module.ds_id, getattr(module, "_ds_id_assigned", None)
        if not (type(own) is int and own == assigned):
            raise ValueError(
                f"{type(module).__name__} already has an attribute ds_id={own!r} that DeepSpeed did not set. "
                f"ZeRO-3 numbers modules with `ds_id` (upstream since deepspeed 0.16.4; dspatch "
                f"deepspeed/zero3-module-id backports it) and would overwrite yours: rename that attribute.")


def apply(txn):
    from dspatch.rewrite import rebuild, rename_attribute

    to_ds_id = rename_attribute("id", "ds_id")
    for target in txn.patch.targets:
        owner, name, original = txn.resolve(target)
        fixed = rebuild(target, to_ds_id, original)
        if target.qualname != REGISTER:
            txn.replace(target, fixed)  # per-step hot path: the rebuilt function itself, no wrapper
            continue

        def register(wrapped, instance, args, kwargs, fixed=fixed):  # once per module, at initialize
            module = args[0] if args else kwargs["module"]
            refuse_foreign_ds_id(module)
            try:
                return fixed(instance, *args, **kwargs)
            finally:  # even if a child refuses: this module's ds_id is DeepSpeed's now
                if hasattr(module, "ds_id"):
                    module._ds_id_assigned = module.ds_id

        txn.wrap(target, register)


def zero3_engines_alive():
    """Engines built before the patch number their modules with `.id`, after it with `.ds_id`: switching
    while one may still be used would break it, so a late dspatch.apply() or a revert is refused. DeepSpeed
    keeps every engine reachable (utils/debug.py's module-name dicts), so any engine ever built counts."""
    import gc

    offload = sys.modules.get(OFFLOAD)
    if offload is None:
        return None
    gc.collect()
    alive = sum(isinstance(o, offload.DeepSpeedZeRoOffload) for o in gc.get_objects())
    if alive:
        return (f"{alive} ZeRO-3 engine(s) exist in this process, numbered the other way; apply dspatch before "
                f"the first deepspeed.initialize (DSPATCH=1, or dspatch.apply() first)")
    return None


# ----------------------------------------------------------------------------------------------------
# Reproducers: real deepspeed.initialize + ZeRO-3 training of a tiny mixture-of-experts model.

def _moe_model():
    import torch

    class Expert(torch.nn.Module):
        def __init__(self, index):
            super().__init__()
            self.id = index  # the user's own id: which device/slot this expert is placed on
            self.weight = torch.nn.Parameter(torch.randn(16, 16) * 0.1)

        def forward(self, x):
            return torch.relu(x @ self.weight)

    class TinyMoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(8, 16)
            self.experts = torch.nn.ModuleList(Expert(i) for i in range(4))
            self.out = torch.nn.Linear(16, 1)

        def forward(self, x):
            h = self.inp(x)
            for expert in self.experts:
                h = h + expert(h)
            return self.out(h).pow(2).mean()

    torch.manual_seed(0)
    return TinyMoE()


def _train(engine, steps):
    import torch

    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = engine(torch.randn(2, 8, generator=generator))
        engine.backward(loss)
        engine.step()


def expert_ids_through_training(steps=3):
    """The experts' own ids before deepspeed.initialize and after `steps` ZeRO-3 steps."""
    from dspatch.scenario import init_deepspeed, zero3_config

    deepspeed = init_deepspeed()
    model = _moe_model()
    before = [e.id for e in model.experts]
    engine, *_ = deepspeed.initialize(model=model, config=zero3_config(), model_parameters=model.parameters())
    _train(engine, steps)
    return before, [e.id for e in model.experts]


def user_id_survives():
    """(a) The model's own expert ids are the same after initialize and three ZeRO-3 steps."""
    before, after = expert_ids_through_training()
    if after != before:
        raise BugSeen(f"expert ids {before} became {after} under ZeRO-3")


def placement_during_training():
    """(b) Re-placing experts (setting `.id`) while training keeps ZeRO-3's fetch/release bookkeeping whole
    over several steps with prefetching on: no crash, and every parameter released after each step."""
    from dspatch.scenario import init_deepspeed, zero3_config

    deepspeed = init_deepspeed()
    model = _moe_model()
    engine, *_ = deepspeed.initialize(model=model, config=zero3_config(), model_parameters=model.parameters())

    def place(expert, args):
        expert.id = (expert.id + 1) % len(model.experts)

    for expert in model.experts:
        expert.register_forward_pre_hook(place)
    try:
        for _ in range(4):
            _train(engine, 1)
            stuck = [n for n, p in model.named_parameters() if getattr(p, "ds_active_sub_modules", None)]
            if stuck:
                raise BugSeen(f"parameters still marked in use after a step: {stuck}")
    except (IndexError, KeyError, RuntimeError, AssertionError) as e:
        if isinstance(e, BugSeen):
            raise
        raise BugSeen(f"ZeRO-3 bookkeeping broke: {type(e).__name__}: {e}") from e


def own_ds_id_kept():
    """(c) A module's own `ds_id` is never overwritten silently: kept, or initialize refuses clearly."""
    from dspatch.scenario import init_deepspeed, zero3_config

    deepspeed = init_deepspeed()
    model = _moe_model()
    model.experts[2].ds_id = "router-slot-2"
    try:
        deepspeed.initialize(model=model, config=zero3_config(), model_parameters=model.parameters())
    except ValueError as e:
        if "ds_id" not in str(e):
            raise
        return
    if model.experts[2].ds_id != "router-slot-2":
        raise BugSeen(f"the model's own ds_id was overwritten with {model.experts[2].ds_id!r}")


PATCH = Patch(
    id="deepspeed/zero3-module-id",
    summary="ZeRO-3 overwrites a user's module.id; DeepSpeed's counter moves to ds_id (upstream name since 0.16.4)",
    distribution="deepspeed",
    affected="<=0.16.3",
    fixed_in="0.16.4",
    targets=[Target(module, qualname, prints) for (module, qualname), prints in FINGERPRINTS.items()],
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/issues/6772",
           "https://github.com/deepspeedai/DeepSpeed/pull/6847"),
    supported=">=0.14.0",  # the oldest release fingerprinted and run; older ones cannot use the CPU accelerator
    # one diff per band of releases whose files differ around the change (each applies as it is)
    diffs={">=0.14.0,<=0.15.3": "deepspeed/0001-zero3-module-id-to-ds_id-0.14.0-0.15.3.patch",
           "==0.15.4": "deepspeed/0001-zero3-module-id-to-ds_id-0.15.4.patch",
           ">=0.16.0,<=0.16.2": "deepspeed/0001-zero3-module-id-to-ds_id-0.16.0-0.16.2.patch",
           "==0.16.3": "deepspeed/0001-zero3-module-id-to-ds_id-0.16.3.patch"},
    scenarios={"user_id_survives": user_id_survives, "placement_during_training": placement_during_training,
               "own_ds_id_kept": own_ds_id_kept},
    expected_on_stock=("user_id_survives", "placement_during_training"),
    in_use=zero3_engines_alive,
    fixed_marker=(OFFLOAD, "DeepSpeedZeRoOffload._register_deepspeed_module"),  # PR 6847's new name
)

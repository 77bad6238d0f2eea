"""ZeRO-3 treats the sparse mixture-of-experts blocks of transformers 4.36-4.57 that run only the experts their tokens
reached as leaf modules, so that ranks whose tokens reach different experts no longer wait on each other for ever
(every deepspeed release; 0.18.0 does it for three of the classes).

Stock hangs at the first forward (NCCL), or aborts on a collective of another size (gloo).

The hang users of mixture-of-experts models report most (Mixtral, Qwen2-MoE, Qwen3-MoE and more: DeepSpeed issue
7461, ms-swift 5875, LLaMA-Factory 9222, trl 4204, open-r1 701). A sparse MoE block that runs only the experts which
received tokens (`expert_hit`, or `if top_x.shape[0] == 0: continue`) runs a different set of modules on each rank.
Under ZeRO-3 each expert is a module whose parameters are gathered by a collective when it runs, so two ranks whose
tokens reach different experts enter different collectives and wait on each other for ever. DeepSpeed's remedy is to
make the whole block a ZeRO-3 leaf (PR 4966, after Mixtral's hang of January 2024, `deepspeed.utils.
set_z3_leaf_modules`): its parameters are gathered together when the block runs, on every rank. 0.18.0 (PR 7604)
marks Mixtral's, Qwen2-MoE's and Qwen3-MoE's blocks by default (`zero_optimization.leaf_module`), and no other; trl
and the Trainer mark none. transformers 5 keeps each block's experts in one module's tensors, so there every rank
gathers the same parameters.

The classes with that routing and one module per expert, read from every transformers release 4.36.0-4.57.6
(`SPARSE_MOE_BLOCKS` below; the patch's own test reads the released sources where the list changes):
- MixtralSparseMoeBlock: 4.36.0-4.39.3 (`continue`), then again from 4.52 (`expert_hit`); 4.40-4.51 run every expert;
- JambaSparseMoeBlock (4.40+) and PhimoeSparseMoeBlock (4.46+): `continue`, since they were added;
- Qwen2MoeSparseMoeBlock from 4.52 (every expert before), Qwen3MoeSparseMoeBlock and MiniMaxSparseMoeBlock (4.53+),
  Ernie4_5_MoeSparseMoeBlock (4.54+), HunYuanMoEV1Moe (4.56+), Qwen3NextSparseMoeBlock and the two Qwen3OmniMoe text
  blocks (4.57): `expert_hit`.
DBRX and gpt-oss skip experts too, but keep every expert in one module's tensors: not affected.

It changes behaviour, not code: when a ZeRO-3 engine sets up its parameter hooks (`DeepSpeedZeRoOffload.__init__`)
on a model where no module is a leaf yet, the instances of those classes in the model become leaves, as
`set_z3_leaf_modules` would make them, where the installed transformers runs that class's experts apart (Mixtral on
4.40-4.51 is left as it is: its own test, on old and bridge); on 0.18.0 and later DeepSpeed has marked its three first, and then the patch adds
nothing for them. The user's choice wins: a model with any leaf already set (by the user, or by DeepSpeed's config)
is left as it is, and so is one whose config sets `zero_optimization.leaf_module` itself (even to nothing);
`DSPATCH_DISABLE=deepspeed/zero3-moe-leaf-modules` leaves it out. A leaf gathers all its experts at once: more memory
for the block while it runs, as upstream's remedy has.

Proven with 2 ranks (gloo) on the old, bridge and mid stacks (transformers 4.44.2, 4.46.3, 4.57.6): a tiny Jamba (a
class no DeepSpeed release marks) and a tiny Mixtral, ZeRO-3, each rank's tokens reaching other experts, two SGD
steps: stock aborts at the first forward with gloo's size mismatch (each run is bounded by a deadline, for NCCL's
hang; Mixtral only where its block skips experts, on deepspeed < 0.18.0); patched trains, with losses equal, to the
bit, to the same job with the block set as a leaf by hand. Its own tests run PhiMoE the same way on bridge, and Ernie
4.5 MoE on ds0183 (the user's choices).
"""
from dspatch.spec import Patch, Signature, Target

OFFLOAD = "deepspeed.runtime.zero.parameter_offload"
INIT = "DeepSpeedZeRoOffload.__init__"
TARGETS = (Target(OFFLOAD, INIT, {"185b57320c77593a": "0.14.0-0.15.3", "84bc616262e778d9": "0.15.4",
                                  "b59cbbff3d8de77d": "0.16.0-0.16.2", "84233647a419fa26": "0.16.3",
                                  "f90371604fd114b1": "0.16.4-0.18.0", "1308c4ff9b0f3993": "0.18.1-0.18.7",
                                  "fcf8ec8473fe9f91": "0.18.8-0.19.4", "080003b1024f660a": "0.19.5-0.19.8"}),)
# {transformers module: {block class whose forward runs only the experts its tokens reached, one module each: the
# transformers releases where it does so (any of the specifiers)}}; transformers 5 has none (`requires`)
SPARSE_MOE_BLOCKS = {
    "transformers.models.mixtral.modeling_mixtral": {"MixtralSparseMoeBlock": ("<4.40.0", ">=4.52.0")},
    "transformers.models.jamba.modeling_jamba": {"JambaSparseMoeBlock": (">=4.40.0",)},
    "transformers.models.phimoe.modeling_phimoe": {"PhimoeSparseMoeBlock": (">=4.46.0",)},
    "transformers.models.qwen2_moe.modeling_qwen2_moe": {"Qwen2MoeSparseMoeBlock": (">=4.52.0",)},
    "transformers.models.qwen3_moe.modeling_qwen3_moe": {"Qwen3MoeSparseMoeBlock": (">=4.53.0",)},
    "transformers.models.minimax.modeling_minimax": {"MiniMaxSparseMoeBlock": (">=4.53.0",)},
    "transformers.models.ernie4_5_moe.modeling_ernie4_5_moe": {"Ernie4_5_MoeSparseMoeBlock": (">=4.54.0",)},
    "transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe": {"HunYuanMoEV1Moe": (">=4.56.0",)},
    "transformers.models.qwen3_next.modeling_qwen3_next": {"Qwen3NextSparseMoeBlock": (">=4.57.0",)},
    "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe": {
        "Qwen3OmniMoeThinkerTextSparseMoeBlock": (">=4.57.0",), "Qwen3OmniMoeTalkerTextSparseMoeBlock": (">=4.57.0",)},
}


# a frame of a sparse-MoE model's forward (a file of SPARSE_MOE_BLOCKS), and of ZeRO-3's fetch, in the log (a hang or
# gloo's abort shows both)
SPARSE_MOE_FRAME = r"modeling_(%s)\.py" % "|".join(module.rpartition(".modeling_")[2] for module in SPARSE_MOE_BLOCKS)
COORDINATOR_FRAME = r"partitioned_param_coordinator\.py"


def skips_experts(module_name, class_name, transformers_version):
    """Whether that class of that transformers release runs only the experts its tokens reached (SPARSE_MOE_BLOCKS)."""
    from dspatch.versions import within_any

    return within_any(transformers_version, SPARSE_MOE_BLOCKS.get(module_name, {}).get(class_name, ()))


def sparse_moe_blocks(module):
    """The modules of `module` whose class runs only the experts its tokens reached, on the transformers imported
    (by module and name: nothing more is imported)."""
    import sys

    version = getattr(sys.modules.get("transformers"), "__version__", None)
    return [m for m in module.modules() if version and skips_experts(type(m).__module__, type(m).__name__, version)]


def _user_set_leaf_modules(ds_config):
    """Whether the DeepSpeed config (the user's dict or JSON file, as the engine passes it) sets
    zero_optimization.leaf_module itself (0.18.0 and later read it)."""
    import json

    if isinstance(ds_config, str):
        try:
            with open(ds_config) as f:
                ds_config = json.load(f)
        except (OSError, ValueError):
            return False
    config = ds_config if isinstance(ds_config, dict) else getattr(ds_config, "_param_dict", None) or {}
    zero = config.get("zero_optimization")
    return isinstance(zero, dict) and "leaf_module" in zero


def apply(txn):
    def leaves_first(wrapped, offload, args, kwargs):
        module = args[0] if args else kwargs.get("module")
        ds_config = args[2] if len(args) > 2 else kwargs.get("ds_config")
        if module is not None and not _user_set_leaf_modules(ds_config):
            from deepspeed.utils import z3_leaf_module

            if not any(z3_leaf_module(m) for m in module.modules()):  # the user's (or DeepSpeed's) choice wins
                for block in sparse_moe_blocks(module):
                    block._z3_leaf = True  # what set_z3_leaf_modules sets on each instance
        return wrapped(*args, **kwargs)

    txn.wrap(txn.target(INIT), leaves_first)


PATCH = Patch(
    id="deepspeed/zero3-moe-leaf-modules",
    summary=("ZeRO-3 makes the sparse mixture-of-experts blocks of transformers 4.36-4.57 leaf modules where the user "
             "set none, so ranks routing tokens to different experts do not hang"),
    cause=("Ranks that route tokens to different experts fetch different ZeRO-3 parameters, and their "
           "collectives never meet"),
    symptom="ZeRO-3, Mixtral/Qwen-MoE/Jamba and more on transformers 4.36-4.57: the first forward hangs",
    distribution="deepspeed",
    affected=">=0",
    fixed_in=None,
    supported=">=0.14.0",
    requires={"transformers": ">=4.36.0,<5.0.0"},
    targets=TARGETS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/issues/7461", "https://github.com/deepspeedai/DeepSpeed/pull/7604",
           "https://github.com/deepspeedai/DeepSpeed/pull/4966", "https://github.com/huggingface/trl/issues/4204"),
    signatures=(
        Signature(r"Received data size doesn't match expected size\. Is there a distributed collective mismatch",
                  context=(SPARSE_MOE_FRAME, COORDINATOR_FRAME)),
        # a timeout says only that a collective was not reached: offered as likely, beside any other hang
        Signature(r"Watchdog caught collective operation timeout", context=(SPARSE_MOE_FRAME, COORDINATOR_FRAME),
                  tell="no module is a ZeRO-3 leaf and the ranks' tokens reach different experts of a sparse MoE "
                       "block (it hangs at the first forward; `set_z3_leaf_modules` by hand makes it train)",
                  also="a hang of another cause: any collective one rank never reaches times out with these words"),
    ),
    diffs=("deepspeed/0023-zero3-moe-leaf-modules-0.14.0-0.16.5.patch",
           "deepspeed/0023-zero3-moe-leaf-modules-0.16.6-0.19.0.patch",
           "deepspeed/0023-zero3-moe-leaf-modules-0.19.1-0.19.8.patch"),
    note=("changes behaviour, not code: marks the sparse-MoE blocks of the model as ZeRO-3 leaves when none is set "
          "(DSPATCH_DISABLE or your own leaf modules / zero_optimization.leaf_module win)"),
)

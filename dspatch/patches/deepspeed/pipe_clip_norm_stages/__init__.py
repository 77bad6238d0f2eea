"""A pipeline whose fp32 gradients the engine clips (ZeRO-0, neither bf16 nor fp16) clips by the norm of every
stage's gradients, not the first stage's only (deepspeed 0.14.4-0.19.8, open).

Stock clips by the first stage's norm: too little, whenever the model's is over the limit.

A silent one, found by the canary's pipeline loop (no upstream report found). `DeepSpeedEngine.
clip_fp32_gradients` calls `deepspeed.runtime.utils.clip_grad_norm_` with the engine's `mpu`; for a pipeline that is
its `PipelineParallelGrid`, whose "model-parallel" group is the pipeline's stages (times the tensor slices). To count a
replicated tensor once, `clip_grad_norm_` counts a gradient only where `mpu.get_model_parallel_rank() == 0` or the
parameter is tensor-parallel, then sums over that group: on a pipeline only the first stage's gradients count (with
tensor parallelism, the later stages' tensor-parallel ones too, not their replicated ones). Every stage then clips by
max_norm / |first stage's gradients|. The same module's `get_weight_norm` and `get_grad_zeros` already ask the right
questions: the tensor-parallel rank (`bwc_tensor_model_parallel_rank`), and a parameter a pipeline ties across stages
counted on its first owner only (`ds_pipe_replicated`). From 0.19.3, which clips at 1.0 where the config sets no
`gradient_clipping`, a ZeRO-0 fp32 pipeline meets it without asking for clipping. bf16 (BF16_Optimizer) and ZeRO-1 compute their norms elsewhere, across the stages, and are right.

The fix asks `clip_grad_norm_` those two questions instead of the model-parallel rank (the rank once, before the loop,
as its siblings do), rebuilt from the installed source. Without an `mpu` (no pipeline, no tensor parallelism) the rank
is 0 and the test never runs: stock's numbers, bit for bit; a one-stage pipeline, AutoTP's groups, and Megatron's mpu
of the old convention give the same ranks as before.

Proven by numbers on the old, bridge, mid and latest stacks (0.14.4, 0.16.9, 0.16.3, 0.19.8): `dspatch canary`'s
comparison of a 2-stage `PipelineModule` at ZeRO-0 in fp32 on 2 ranks, SGD, `gradient_clipping` 0.5: stock's first
step is SGD's with the gradient clipped by the first stage's norm (0.805 where the model's is 1.446), patched every
step is plain torch's.
"""
from dspatch.spec import Patch, Target

UTILS = "deepspeed.runtime.utils"
# every release 0.14.4-0.19.8 (python tests/upstream_releases.py deepspeed/pipe-clip-norm-stages 0.14.4 0.19.8)
TARGETS = (Target(UTILS, "clip_grad_norm_", {"10153c5028cf7663": "0.14.4-0.19.6", "953145e8fab53364": "0.19.7-0.19.8"}),)

FIRST_RANK_ONLY = "mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p)"
RANK_ONCE = "tensor_mp_rank = bwc_tensor_model_parallel_rank(mpu=mpu)"  # asked once, before the loop, as its siblings
ONCE_PER_TENSOR = "(tensor_mp_rank == 0 or is_model_parallel_parameter(p)) and not getattr(p, PIPE_REPLICATED, False)"


def count_every_stage(definition):
    """Transform: before the norm's loop over the parameters, the tensor-parallel rank; in it, `if
    mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p):` becomes that rank's test, a pipeline's
    tied copies counted once."""
    import ast

    from dspatch.rewrite import RewriteError, expression, find_one, statement

    test = find_one(definition, lambda node: isinstance(node, ast.If) and ast.unparse(node.test) == FIRST_RANK_ONLY,
                    "the test that counts a gradient on model-parallel rank 0")
    loop = find_one(definition, lambda node: isinstance(node, ast.For) and any(n is test for n in ast.walk(node)),
                    "the loop over the parameters around that test")
    test.test = expression(ONCE_PER_TENSOR, test)
    for node in ast.walk(definition):
        for field in ("body", "orelse"):
            block = getattr(node, field, None)
            if isinstance(block, list) and any(item is loop for item in block):
                block.insert(block.index(loop), statement(RANK_ONCE, loop))
                return
    raise RewriteError(f"{definition.name}: the loop over the parameters is in no block")


def apply(txn):
    txn.recode(txn.target("clip_grad_norm_"), count_every_stage)


PATCH = Patch(
    id="deepspeed/pipe-clip-norm-stages",
    summary=("a pipeline's fp32 gradient clipping (ZeRO-0) takes the norm of every stage's gradients, not the first "
             "stage's only (silent)"),
    cause="clip_grad_norm_ counts gradients on model-parallel rank 0 only, and a pipeline's stages are that group",
    canary=("stage_clipping",),  # dspatch canary --loop pipeline with gradient_clipping at ZeRO-0 in fp32
    symptom="a ZeRO-0 fp32 pipeline silently clips by the first stage's gradient norm, too little",
    distribution="deepspeed",
    affected=">=0.14.4",
    fixed_in=None,
    supported=">=0.14.4",
    targets=TARGETS,
    apply=apply,
    # PR 1252 brought a pipeline's accounting (ds_pipe_replicated) to ZeRO-2's norm; clip_grad_norm_ never got it
    links=("https://github.com/deepspeedai/DeepSpeed/pull/1252",),
    diffs=("deepspeed/0029-pipe-clip-norm-stages-0.14.4-0.19.6.patch",
           "deepspeed/0029-pipe-clip-norm-stages-0.19.7-0.19.8.patch"),
    note=("deepspeed.runtime.utils.clip_grad_norm_ keeps its object (the engine imported it by name) but runs code "
          "rebuilt from the installed file that counts a gradient by its tensor-parallel rank"),
)

"""ZeRO-3's coalesced all-gather gathers parameters of different dtypes, each into a buffer of its own dtype (deepspeed
0.19.2): LoRA's fp32 adapters on a bf16 base model train again.

Stock fails at the first optimizer step: `TypeError: output tensor must have the same type as input tensor` (NCCL),
`ProcessGroupGloo::allgather: invalid tensor type` (gloo).

Until 0.19.1 DeepSpeed cast a ZeRO-3 model to bf16 whole, adapters included. 0.19.2 (PR 8066) keeps each parameter's
own dtype, and PEFT keeps LoRA adapters in fp32 on a bf16 base by default (`autocast_adapter_dtype=True`). After each
step ZeRO-3 gathers the persistent parameters (the small ones: LoRA matrices, norms, biases) in one call of
`Init._allgather_params_coalesced`, which allocates every output buffer with the first parameter's dtype: the first
fp32 adapter after a bf16 weight (or the reverse) meets a buffer of the other dtype, and the collective refuses it
(DeepSpeed issue 8072, trl issue 6089; fixed in 0.19.3, PRs 8073 and 8128). Every ZeRO-3 LoRA run in bf16 on 0.19.2
stops there: the Trainer, trl's SFT/DPO/GRPO, accelerate loops.

The fix gathers a mixed list one dtype at a time, in the order the dtypes first appear (each call's buffers then
have its parameters' dtype, as 0.19.3 allocates them): a wrapper on `_allgather_params_coalesced`, which a list of one
dtype passes through unchanged. It composes with `deepspeed/zero3-gather-waits-all`, which rebuilds the same function
(the wrapper calls the rebuilt code).

Proven with 2 ranks (gloo) on 0.19.2 with the latest stack's other pins: a tiny Llama built in bf16 under `zero.Init`,
PEFT's LoRA on it (fp32 adapters), bf16 ZeRO-3, two steps of `engine.backward(loss); engine.step()`: stock fails with
gloo's message at the first step; patched trains both steps on both ranks, finite losses, the adapters moved and
still fp32.
"""
from dspatch.spec import Patch, Signature, Target

PARAMS = "deepspeed.runtime.zero.partition_parameters"
COALESCED = "Init._allgather_params_coalesced"
TARGETS = (Target(PARAMS, COALESCED, {"48c13938e9fb85aa": "0.19.2"}),)
FRAME = r"in _allgather_params_coalesced"


def apply(txn):
    def one_dtype_at_a_time(wrapped, init, args, kwargs):
        params = list(args[0] if args else kwargs["param_list"])
        by_dtype = {}
        for param in params:
            by_dtype.setdefault(param.ds_tensor.dtype, []).append(param)
        if len(by_dtype) < 2:
            return wrapped(*args, **kwargs)
        rest, kwargs = args[1:], {k: v for k, v in kwargs.items() if k != "param_list"}
        for same_dtype in by_dtype.values():  # each call's buffers take that dtype, as 0.19.3 allocates them
            wrapped(same_dtype, *rest, **kwargs)
        return None  # as upstream's: the gathered values are in the parameters

    txn.wrap(txn.target(COALESCED), one_dtype_at_a_time)


PATCH = Patch(
    id="deepspeed/zero3-lora-mixed-dtype-allgather",
    summary=("ZeRO-3 gathers persistent parameters of different dtypes (LoRA's fp32 adapters on a bf16 base) into "
             "buffers of their own dtype"),
    cause="ZeRO-3 gathers parameters of several dtypes into buffers of the first one's dtype",
    symptom="ZeRO-3 LoRA in bf16: `TypeError: output tensor must have the same type as input tensor`",
    distribution="deepspeed",
    affected="==0.19.2",
    fixed_in="0.19.3",
    supported="==0.19.2",
    targets=TARGETS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/8073", "https://github.com/deepspeedai/DeepSpeed/pull/8128",
           "https://github.com/deepspeedai/DeepSpeed/issues/8072", "https://github.com/huggingface/trl/issues/6089",
           "https://github.com/deepspeedai/DeepSpeed/pull/8066"),
    diffs=("deepspeed/0022-zero3-lora-mixed-dtype-allgather-0.19.2.patch",),
    signatures=(Signature(r"output tensor must have the same type as input tensor", error="TypeError",
                          needs=(FRAME,)),
                Signature(r"ProcessGroupGloo::allgather: invalid tensor type", needs=(FRAME,))),
    note="wraps Init._allgather_params_coalesced: a list of parameters of several dtypes is gathered one dtype at a "
         "time",
)

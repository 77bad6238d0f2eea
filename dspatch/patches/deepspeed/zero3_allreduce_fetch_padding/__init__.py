"""ZeRO-3's all-reduce fetch (`stage3_use_all_reduce_for_fetch_params: true`) lays each parameter out at its padded
size, so no partition's padding lands in the next parameter (deepspeed < 0.19.4), and it runs at all on 0.16.3-0.17.2.

Stock sums padding into the next weight (inf, then NaN), or fails at the first forward.

With `stage3_use_all_reduce_for_fetch_params` and 2 or more ranks, ZeRO-3 fetches a module's parameters by an
all-reduce of one flat buffer where each rank has written its own partitions. The buffer is sized by each
parameter's padded length (`ds_numel_aligned`), but the loop that places the parameters advances by the unpadded
one (`ds_numel`). A parameter whose size the number of ranks does not divide has padding in its last partition, and
the last rank writes that padding over the start of the next parameter, where the all-reduce adds it to the
parameter's first values: whatever the padding holds (uninitialised memory) is summed into the weights the forward
reads. Seen as an inf loss, then NaN (PR 8158, fixed 0.19.4). And on 0.16.3-0.17.2 the option fails at once: the
parameter coordinator waits on every fetch handle with `handle_dependency=`, which the all-reduce handle does not
take (`TypeError: AllReduceCoalescedHandle.wait() got an unexpected keyword argument 'handle_dependency'`, PR 7414,
fixed 0.17.3).

The fix is upstream's two lines: the placing loop advances by the padded length (0.19.4), and the all-reduce
handle's `wait` takes the keyword and ignores it, as 0.17.3's does. Only the all-reduce fetch runs other code: the
default all-gather fetch, quantized and secondary-tensor fetches are stock's.

Proven by numbers with 2 ranks (gloo): an MLP whose parameters' sizes are odd, built under `zero.Init`, three SGD
steps with the all-reduce fetch equal, to the bit, the same steps with the default all-gather fetch; the padding is
set to NaN before `deepspeed.initialize` (it is uninitialised memory, which the fix must not read whatever it holds).
Stock: NaN losses from the first step (0.14.4), or the TypeError (0.16.3, 0.16.9).
"""
from dspatch.spec import Patch, Signature, Target

PARAMS = "deepspeed.runtime.zero.partition_parameters"
CONVERT = "Init._convert_to_deepspeed_param"
WAIT = "AllReduceCoalescedHandle.wait"
TARGETS = (
    Target(PARAMS, CONVERT, {"a25d2a09885d1498": "0.14.3-0.16.2", "34e97d144f00b031": "0.16.3-0.17.1",
                             "8d8997b36eb38d5e": "0.17.2-0.17.4", "409a4b9ba5f839f1": "0.17.5",
                             "57b81979a14f8d58": "0.17.6-0.18.4", "1ef06a1ae2b116f9": "0.18.5-0.18.6",
                             "e79b436d218225a6": "0.18.7-0.19.2", "b2089b92c1752266": "0.19.3"}),
    # the coordinator passes handle_dependency= from 0.16.3; 0.17.3's wait takes it
    Target(PARAMS, WAIT, {"aac562168013b4bf": "0.16.3-0.17.2"}, releases=">=0.16.3,<0.17.3"),
)


def advance_by_the_padded_length(definition):
    """Transform: the all-reduce fetch's `start_param += param.ds_numel` advances by `param.ds_numel_aligned`."""
    from dspatch.rewrite import find_statement, statement

    body, i = find_statement(definition, "start_param += param.ds_numel", "`start_param += param.ds_numel`")
    body[i] = statement("start_param += param.ds_numel_aligned", body[i])


def apply(txn):
    def takes_handle_dependency(wrapped, handle, args, kwargs):
        return wrapped(*args)  # the coordinator's handle_dependency=: 0.17.3's wait(**kwargs) ignores it too

    txn.recode(txn.target(CONVERT), advance_by_the_padded_length)
    if txn.has(WAIT):  # 0.16.3-0.17.2
        txn.wrap(txn.target(WAIT), takes_handle_dependency)


PATCH = Patch(
    id="deepspeed/zero3-allreduce-fetch-padding",
    summary=("ZeRO-3's all-reduce fetch (stage3_use_all_reduce_for_fetch_params) no longer sums a partition's "
             "padding into the next parameter, and runs on 0.16.3-0.17.2"),
    cause="The all-reduce fetch places parameters by unpadded length, summing one rank's padding into the next weight",
    canary=('nan',),
    symptom="`stage3_use_all_reduce_for_fetch_params`: inf/NaN loss, or a `handle_dependency` TypeError",
    distribution="deepspeed",
    affected=">=0.14.3,<0.19.4",  # the option came with 0.14.3
    fixed_in="0.19.4",
    supported=">=0.14.0",
    targets=TARGETS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/8158", "https://github.com/deepspeedai/DeepSpeed/pull/7414"),
    diffs=("deepspeed/0021-zero3-allreduce-fetch-padding-0.14.3-0.16.2.patch",
           "deepspeed/0021-zero3-allreduce-fetch-padding-0.16.3-0.17.2.patch",
           "deepspeed/0021-zero3-allreduce-fetch-padding-0.17.3-0.18.4.patch",
           "deepspeed/0021-zero3-allreduce-fetch-padding-0.18.5-0.19.2.patch",
           "deepspeed/0021-zero3-allreduce-fetch-padding-0.19.3.patch"),
    signatures=(Signature(message=r"AllReduceCoalescedHandle\.wait\(\) got an unexpected keyword argument "
                                  r"'handle_dependency'", error="TypeError"),),
    note=("Init._convert_to_deepspeed_param runs code rebuilt from the installed file whose all-reduce fetch "
          "advances by the padded length; on 0.16.3-0.17.2 AllReduceCoalescedHandle.wait takes handle_dependency"),
)

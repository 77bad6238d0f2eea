"""`zero_to_fp32` with `safe_serialization=True` writes a model with tied weights (deepspeed 0.15.3-0.19.8, open).

Converting a ZeRO-2/3 checkpoint of a model with tied weights (`lm_head.weight` tied to `model.embed_tokens.weight`, as
in most decoder-only models) recovers the tied name as the very tensor it is tied to, and the shard to write keeps that
aliasing. `torch.save` stores shared memory once; `safetensors.torch.save_file` refuses it: `RuntimeError: Some tensors
share memory, this will lead to duplicate memory on disk and potential differences when loading them again:
[{'lm_head.weight', 'model.embed_tokens.weight'}]`, and nothing is written. Every release with `safe_serialization`
(0.15.3 on, 0.19.8 included) has it; DeepSpeed PR 8376 is open, so the patch is gated by fingerprint: a later release
with the same converter source gets the fix, a changed one is reported.

The fix: the converter (`convert_zero_checkpoint_to_fp32_state_dict`, from 0.19.7
`convert_zero_checkpoint_to_state_dict`, which the fp32 function calls) is rebuilt from the installed source with the
shard it hands to `save_file` passed through `untie` (this module) first, which gives every tensor that overlaps the
memory of an earlier one in the shard its own copy. The file then holds both names with equal values, which
`from_pretrained` (it ties them again) and a strict `load_state_dict` both read; the pickle path (`torch.save`) is
untouched, and a shard with no shared memory is passed on as it is. Decided: a copy rather than dropping the tied name,
since a file with both names loads with a strict `load_state_dict` as well as with transformers (it costs one tensor's
memory while its shard is written). Proven at ZeRO-2 and ZeRO-3 on the bridge, mid and latest stacks: the file holds the
trained weights bit for bit, and `from_pretrained` loads it tied, with the trained model's logits.

Not reachable: the copy of `zero_to_fp32.py` that `save_checkpoint` puts in each checkpoint folder runs as a script,
which no import hook sees. There, call `deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(...)`
from Python with `DSPATCH=1`, or apply the diff to the installed deepspeed (later checkpoints get the fixed copy) or to
the copy.
"""
from dspatch.spec import Patch, Signature, Target

CONVERTER = "deepspeed.utils.zero_to_fp32"

# 0.19.7 moved the conversion into convert_zero_checkpoint_to_state_dict (with a dtype), and the fp32 function
# calls it: the save_file call is in one or the other
TARGETS = (
    Target(CONVERTER, "convert_zero_checkpoint_to_fp32_state_dict",
           {"0cbb053b8f62d487": "0.15.3-0.15.4", "80dda1d56086675f": "0.16.0", "25f38917134dd912": "0.16.1-0.19.6"},
           releases="<0.19.7"),
    Target(CONVERTER, "convert_zero_checkpoint_to_state_dict",
           {"77c3c11b6041de16": "0.19.7", "68fd92ec95e3caba": "0.19.8"}, releases=">=0.19.7"),
)
SHARED = "Some tensors share memory"
CONVERTING = (r"zero_to_fp32|Processing zero checkpoint|Detected checkpoint of type zero stage|"
              r"Reconstructed (Trainable |Frozen )?fp32 state dict")


def untie(tensors):
    """`tensors` (a shard: {name: tensor}) with each tensor whose memory overlaps an earlier one's copied."""
    spans = {}  # storage address -> [(first byte, end byte)] of the tensors kept as they are
    untied = {}
    for name, tensor in tensors.items():
        if hasattr(tensor, "untyped_storage") and tensor.numel():
            storage = tensor.untyped_storage().data_ptr()
            first = storage + tensor.storage_offset() * tensor.element_size()
            end = first + tensor.numel() * tensor.element_size()
            kept = spans.setdefault(storage, [])
            if any(first < e and f < end for f, e in kept):
                tensor = tensor.clone()
            else:
                kept.append((first, end))
        untied[name] = tensor
    return untied


def write_untied(definition):
    """Transform: the one `save_file(<shard>, ...)` call gets `untie(<shard>)` as its first argument."""
    import ast

    from dspatch.rewrite import call_into, expression, find_one, matches

    call = find_one(definition, lambda n: isinstance(n, ast.Call) and matches(n.func, "save_file") and n.args,
                    "`save_file(<shard>, ...)`")
    shard = call.args[0]
    wrapped = expression(f"{call_into(__name__, 'untie')}(_)", shard)
    wrapped.args[0] = shard
    call.args[0] = wrapped


def apply(txn):
    for target in txn.patch.targets:
        txn.recode(target, write_untied)


PATCH = Patch(
    id="deepspeed/zero-to-fp32-tied-weights",
    summary=("zero_to_fp32 with safe_serialization writes a model with tied weights (embeddings / lm_head) instead "
             "of `RuntimeError: Some tensors share memory`"),
    cause="`zero_to_fp32` saves tied weights as two tensors sharing memory, which safetensors refuses",
    symptom="`RuntimeError: Some tensors share memory`, no file written (tied embeddings / `lm_head`)",
    distribution="deepspeed",
    affected=">=0.15.3",  # open upstream (no fixed_in): the fingerprints decide for releases after 0.19.8
    fixed_in=None,
    supported=">=0.15.3",
    targets=TARGETS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/8376",),
    diffs=("deepspeed/0010-zero-to-fp32-tied-weights-0.15.3-0.15.4.patch",
           "deepspeed/0010-zero-to-fp32-tied-weights-0.16.0-0.19.6.patch",
           "deepspeed/0010-zero-to-fp32-tied-weights-0.19.7-0.19.8.patch"),
    # safetensors' message wherever tied weights are saved: zero_to_fp32's frames or its own output decide
    signatures=(Signature(SHARED, error="RuntimeError", context=(CONVERTING,)),),
    note=("deepspeed.utils.zero_to_fp32's converter keeps its object, name and line numbers but runs code rebuilt "
          "from the installed file that gives tied tensors their own copy before safetensors writes them"),
)

"""An `"auto"` ZeRO-3 config starts on deepspeed >= 0.15 (transformers 4.38.0-4.44.2).

The Trainer fills the `"auto"` entries of a DeepSpeed config from the model
(`HfTrainerDeepSpeedConfig.trainer_config_finalize`); for ZeRO-3's `stage3_prefetch_bucket_size` it writes `0.9 *
hidden_size * hidden_size`, a float. deepspeed >= 0.15 validates its config with pydantic 2, whose `int` field refuses a
float with a fraction: `ValidationError: 1 validation error for DeepSpeedZeroConfig stage3_prefetch_bucket_size Input
should be a valid integer, got a number with a fractional part`, and the documented `"auto"` ZeRO-3 config cannot start
once deepspeed is upgraded (DeepSpeed issue 6525 and its duplicates). transformers 4.45.0 fixed it (PR 33402) by
rounding to an int; older deepspeed accepted the float, so the gate needs both packages (`requires`: deepspeed >= 0.15).

The fix does the same: `trainer_config_finalize` is rebuilt from the installed source with that one expression wrapped
in `int(...)` (`txn.recode`).

No stack of the test matrix pairs these releases, so a session of its own, `tf444_ds16` (transformers 4.44.2, deepspeed
0.16.3, accelerate 0.34.2), runs this patch's proofs only: a Trainer with the auto config fails on stock and trains
patched, DeepSpeed getting `921` for a hidden size of 32.
"""
from dspatch.spec import Patch, Signature

DS_INTEGRATION = "transformers.integrations.deepspeed"
FINALIZE = "HfTrainerDeepSpeedConfig.trainer_config_finalize"
FINGERPRINTS = {(DS_INTEGRATION, FINALIZE): {"a0acb0255963d2b8": "4.38.0-4.44.2"}}
REFUSED = "Input should be a valid integer, got a number with a fractional part"


def names_the_bucket(line):
    """A line that names the field, or the value no other program writes there: transformers' "auto" bucket,
    0.9 * hidden_size**2 with a fraction (15099494.4 for a hidden size of 4096), as pydantic shows it."""
    import math
    import re

    if re.match(r"\s*stage3_prefetch_bucket_size\s*$", line):
        return True
    value = re.search(r"input_value=(\d+\.\d+)", line)
    if value is None:
        return False
    value = float(value.group(1))
    hidden = round(math.sqrt(value / 0.9))
    return hidden >= 64 and math.isclose(0.9 * hidden * hidden, value, rel_tol=1e-12)


def whole_bucket(definition):
    """Transform: `0.9 * hidden_size * hidden_size` -> `int(0.9 * hidden_size * hidden_size)`."""
    from dspatch.rewrite import expression, find_one, replace

    product = find_one(definition, "0.9 * hidden_size * hidden_size")
    call = expression("int(_)", product)
    call.args[0] = product
    replace(definition, product, call)


def apply(txn):
    txn.recode(txn.target(FINALIZE), whole_bucket)


PATCH = Patch(
    id="transformers/deepspeed-prefetch-bucket-int",
    summary=("The Trainer fills an \"auto\" ZeRO-3 stage3_prefetch_bucket_size with an int: the documented auto config "
             "starts on deepspeed >= 0.15 (no pydantic ValidationError)"),
    cause='The Trainer fills an "auto" `stage3_prefetch_bucket_size` with a float that deepspeed >= 0.15 refuses',
    symptom="`ValidationError`: `stage3_prefetch_bucket_size` ... got a number with a fractional part",
    distribution="transformers",
    affected="<4.45.0",
    fixed_in="4.45.0",
    supported=">=4.38.0",
    requires={"deepspeed": ">=0.15.0"},
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/issues/6525", "https://github.com/huggingface/transformers/pull/33402"),
    diffs=("transformers/0004-deepspeed-prefetch-bucket-int-4.38.0-4.44.2.patch",),
    signatures=(Signature(r"Input should be a valid integer, got a number with a fractional part",
                          needs=(names_the_bucket,)),),
    note=("HfTrainerDeepSpeedConfig.trainer_config_finalize keeps its object, name and line numbers but runs code "
          "rebuilt from the installed file that fills stage3_prefetch_bucket_size with an int"),
)

"""A bf16 or fp16 engine runs a model loaded in fp32 that computes with its buffers (deepspeed 0.19.2-0.19.8, open
upstream by design).

Stock fails at the model's first forward, at every ZeRO stage: `RuntimeError: expected scalar type BFloat16 but found
Float` in a BatchNorm (its running statistics), `mixed dtype (CPU): expect parameter to have scalar type of Float` or
`mat1 and mat2 must have the same dtype` after a sinusoidal position table (M2M100, NLLB, XGLM, Speech2Text), the same
after DETR's frozen batch norm. Up to 0.19.1 the engine cast the whole module (`module.bfloat16()`); 0.19.2 (PR 8066)
casts its parameters only and leaves every buffer as loaded, so that rotary `inv_freq` tables stay fp32 (a model
casts those itself, and computing positions in bf16 spoils them), with `"data_types": {"buffer_dtype": "bf16"}`
(undocumented in the user docs) as the way back.

No rule read off a model tells a buffer it computes with from one it casts itself: M2M100's table and a rotary
`inv_freq` are both non-persistent buffers of a module without parameters, and a buffer cast that a model did not need
changes its numbers. So the fix leaves every buffer as loaded, and changes nothing, until a forward fails on one: when
the engine's forward raises a dtype mismatch while the model holds floating buffers of another dtype than its
parameters, those buffers take the engine's dtype, as `buffer_dtype` would have cast them (and as 0.19.1 did), except
rotary frequency tables (a buffer named `inv_freq`, `original_inv_freq`) and, on 0.19.8, those DeepSpeed's
`keep_in_fp32_modules` keeps; the random number generators are put back as the failed attempt found them, the forward
runs again, once, and one warning names the buffers cast. The run is then the run `buffer_dtype` gives, to the bit.
If the second attempt fails as well, the buffers are put back and the first error is raised, as stock raises it.
After the first forward that succeeds, nothing more is watched. A config that sets `buffer_dtype`, an fp32 engine and
a model whose buffers are all in the engine's dtype are not touched at all.

Proven on deepspeed 0.19.8 (latest) and 0.19.2 (ds0192): a Linear-BatchNorm-Linear model and a tiny M2M100,
loaded in fp32, bf16 at ZeRO-0 to ZeRO-3, fail at the first forward on stock and, patched, take two SGD steps whose
weights equal, bit for bit, stock's with `buffer_dtype: "bf16"`. The diff does the same in
`DeepSpeedEngine._cast_module_mixed_precision` and `forward` (four bands, for the lines around them).
"""
import re

from dspatch.spec import Patch, Signature

ENGINE = "deepspeed.runtime.engine"
CAST = "DeepSpeedEngine._cast_module_mixed_precision"
FORWARD = "DeepSpeedEngine.forward"
FINGERPRINTS = {
    (ENGINE, CAST): {"ec9be006a7cec139": "0.19.2-0.19.7", "f6f5f0589095881f": "0.19.8"},
    (ENGINE, FORWARD): {"82aca0af58a14af0": "0.19.2", "647f23979d3b717b": "0.19.3", "42b90d68b5906a28": "0.19.4-0.19.8"},
}
# the rotary frequency tables PR 8066 keeps in fp32: the models that hold them cast them themselves
ROTARY = re.compile(r"(^|_)inv_freq$")
# how torch words a dtype mismatch, across ops and releases ("expected scalar type BFloat16 but found Float", "mat1
# and mat2 must have the same dtype", "mixed dtype (CPU): expect parameter to have scalar type of Float", "Input type
# (float) and bias type (c10::BFloat16) should be the same")
MISMATCH = re.compile(r"dtype|scalar type|\btype \(|same type", re.IGNORECASE)


def castable(module, dtype, kept):
    """[(name, buffer)]: the floating buffers of `module` not in `dtype`, rotary tables and `kept` ids aside."""
    return [(name, b) for name, b in module.named_buffers()
            if b.is_floating_point() and b.dtype != dtype and id(b) not in kept and not ROTARY.search(name.split(".")[-1])]


def apply(txn):
    import weakref

    watched = weakref.WeakKeyDictionary()  # engine: (the engine's dtype, ids of buffers DeepSpeed keeps in fp32)

    def remember(wrapped, engine, args, kwargs):
        """After stock's cast: an engine that cast parameters and no buffer, whose model holds buffers of another
        dtype, is watched until its first forward succeeds."""
        result = wrapped(*args, **kwargs)
        names = ("param_dtype", "buffer_dtype", "is_zero_init_model", "keep_pattern")
        given = {**dict(zip(names, args)), **kwargs}
        dtype, keep = given["param_dtype"], given.get("keep_pattern")
        if dtype is not None and given["buffer_dtype"] is None:
            kept = set()
            if keep is not None:  # 0.19.8: buffers of data_types.keep_in_fp32_modules stay fp32
                from deepspeed.runtime.keep_in_fp32 import buffers_to_keep_in_fp32

                kept = {id(b) for b in buffers_to_keep_in_fp32(engine.module, keep)}
            if castable(engine.module, dtype, kept):
                watched[engine] = (dtype, kept)
        return result

    def forward(wrapped, engine, args, kwargs):
        if engine not in watched:
            return wrapped(*args, **kwargs)
        import torch
        from deepspeed.accelerator import get_accelerator

        # what a failed attempt may have moved before it failed, put back before the second: the random number
        # generators, and every buffer (BatchNorm counts the batch before it computes); once, at the first forward
        accelerator = get_accelerator()
        rng = torch.get_rng_state(), accelerator.get_rng_state()
        before = [(b, b.detach().clone()) for b in engine.module.buffers()]
        try:
            result = wrapped(*args, **kwargs)
        except RuntimeError as error:
            dtype, kept = watched[engine]
            buffers = castable(engine.module, dtype, kept)
            if isinstance(error, torch.OutOfMemoryError) or not MISMATCH.search(str(error)) or not buffers:
                raise
            with torch.no_grad():
                for b, value in before:
                    b.copy_(value)
            loaded = [(b, b.data) for _, b in buffers]
            for b, data in loaded:
                b.data = data.to(dtype)
            torch.set_rng_state(rng[0])
            accelerator.set_rng_state(rng[1])
            try:
                result = wrapped(*args, **kwargs)
            except BaseException as again:
                for b, data in loaded:  # as stock had them: this cast did not make the model run
                    b.data = data
                if not isinstance(again, Exception):
                    raise
                raise error from None
            del watched[engine]
            from deepspeed.utils import logger

            logger.warning(
                f"dspatch (deepspeed/bf16-buffers-left-fp32): the first forward failed on buffers left in "
                f"{loaded[0][1].dtype} ({error}); {len(buffers)} buffers now "
                f"take the engine's {dtype}, as data_types.buffer_dtype would cast them (rotary inv_freq tables "
                f"kept): {', '.join(name for name, _ in buffers[:8])}{' ...' if len(buffers) > 8 else ''}. Set "
                f"data_types.buffer_dtype in the DeepSpeed config to choose yourself.")
            return result
        del watched[engine]  # it runs as loaded: nothing more to watch
        return result

    txn.wrap(txn.target(CAST), remember)
    txn.wrap(txn.target(FORWARD), forward)


# the frames that tell this cause: the engine's forward, then a module computing with its buffers
ENGINE_FORWARD = r"deepspeed[/\\]runtime[/\\]engine\.py.*in forward"
BUFFER_USER = r"batchnorm\.py|in batch_norm|FrozenBatchNorm|SinusoidalPositionalEmbedding|modeling_(m2m_100|nllb_moe|xglm|speech_to_text)\.py"
TELL = ("deepspeed >= 0.19.2 with bf16/fp16 leaves buffers as loaded: a model loaded in fp32 with BatchNorm or a "
        "sinusoidal table fails so; inputs in the wrong dtype fail alike")

PATCH = Patch(
    id="deepspeed/bf16-buffers-left-fp32",
    summary=("a bf16/fp16 engine runs a model loaded in fp32 that computes with its buffers (BatchNorm statistics, "
             "sinusoidal tables): they take the engine's dtype where the first forward fails on them"),
    cause=("since 0.19.2 (PR 8066) the engine casts parameters only and leaves every buffer as loaded, so that rotary "
           "inv_freq stays fp32; a model that computes with another buffer mixes dtypes"),
    symptom=("the first forward fails with a dtype mismatch (`expected scalar type BFloat16 but found Float`, `mat1 "
             "and mat2 must have the same dtype`): bf16/fp16, a model with floating buffers loaded in fp32"),
    distribution="deepspeed",
    affected=">=0.19.2",
    fixed_in=None,
    supported=">=0.19.2",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/8066",),
    diffs=("deepspeed/0034-bf16-buffers-left-fp32-0.19.2.patch", "deepspeed/0034-bf16-buffers-left-fp32-0.19.3.patch",
           "deepspeed/0034-bf16-buffers-left-fp32-0.19.4-0.19.7.patch",
           "deepspeed/0034-bf16-buffers-left-fp32-0.19.8.patch"),
    signatures=(Signature(r"expected scalar type (BFloat16|Half) but found Float", error="RuntimeError",
                          needs=(ENGINE_FORWARD, BUFFER_USER), tell=TELL),
                Signature(r"mat1 and mat2 must have the same dtype|mixed dtype \(CPU\): expect parameter to have "
                          r"scalar type of Float", error="RuntimeError", needs=(ENGINE_FORWARD, BUFFER_USER),
                          tell=TELL)),
    note=("DeepSpeedEngine._cast_module_mixed_precision and .forward are wrapped: where the first forward fails on a "
          "dtype mismatch, the buffers (rotary inv_freq aside) take the engine's dtype and it runs again, once"),
)

"""Reproducers: a tiny Llama with tied embeddings (lm_head.weight is model.embed_tokens.weight) trained one step
with real deepspeed.initialize (CPU) at ZeRO-2 and ZeRO-3, saved with engine.save_checkpoint, and converted with
deepspeed's own zero_to_fp32 with safe_serialization=True.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.patches.deepspeed.zero_to_fp32_tied_weights import SHARED
from dspatch.scenario import on_accelerator
from dspatch.spec import BugSeen, Proof


def _trained(stage, root):
    """The engine's model after one step at `stage`, its checkpoint saved under `root`/ckpt; returns the model's
    own state dict (fp32 on the CPU: the master weights themselves), gathered at ZeRO-3."""
    import torch

    from dspatch.scenario import init_deepspeed, tiny_llama, zero3_config

    deepspeed = init_deepspeed()
    model = tiny_llama(tie_word_embeddings=True)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        raise AssertionError("the tiny Llama's lm_head is not tied to its embeddings")
    config = zero3_config()
    config["zero_optimization"] = {"stage": stage} if stage < 3 else config["zero_optimization"]
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    ids = on_accelerator(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(f"{root}/ckpt")
    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):
        weights = {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
    model.config.save_pretrained(f"{root}/out")  # the converted folder, as a user makes it loadable
    return weights


def convert_tied(stage):
    """zero_to_fp32 --safe_serialization of a stage-`stage` checkpoint writes model.safetensors, whose tensors are
    the trained weights bit for bit (both tied names), and which transformers loads back, tied, with the same
    logits as the trained model."""
    import re
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as root:
        weights = _trained(stage, root)
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
        from safetensors.torch import load_file
        from transformers import LlamaForCausalLM

        from dspatch.scenario import loads_past_weights_only_bug

        with loads_past_weights_only_bug():
            try:
                convert_zero_checkpoint_to_fp32_state_dict(f"{root}/ckpt", f"{root}/out", safe_serialization=True)
            except RuntimeError as e:
                if SHARED not in str(e):
                    raise
                names = re.search(r"\[\{.*?\}\]", str(e))
                raise BugSeen(f"zero_to_fp32 --safe_serialization at ZeRO-{stage}: RuntimeError: {SHARED} "
                              f"{names.group(0) if names else ''}") from e
        saved = load_file(f"{root}/out/model.safetensors")
        if sorted(saved) != sorted(weights) or any(not torch.equal(saved[n], weights[n]) for n in weights):
            raise AssertionError(f"ZeRO-{stage}: model.safetensors is not the trained state dict: names "
                                 f"{sorted(set(saved) ^ set(weights))} differ, or values do")
        loaded = LlamaForCausalLM.from_pretrained(f"{root}/out")
        if loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr():
            raise AssertionError("the converted model loads with its lm_head untied")
        trained = LlamaForCausalLM(loaded.config)
        trained.load_state_dict(weights)
        ids = torch.arange(8).view(1, 8)
        with torch.no_grad():
            if not torch.equal(loaded(input_ids=ids).logits, trained(input_ids=ids).logits):
                raise AssertionError("the converted model's logits differ from the trained model's")


def convert_tied_zero2():
    """ZeRO-2: zero_to_fp32 --safe_serialization of a tied-embedding model writes the trained weights, loadable."""
    convert_tied(2)


def convert_tied_zero3():
    """The same at ZeRO-3."""
    convert_tied(3)


PROOF = Proof(
    scenarios={"convert_tied_zero2": convert_tied_zero2, "convert_tied_zero3": convert_tied_zero3},
    expected_on_stock={"convert_tied_zero2": f"ZeRO-2: RuntimeError: {SHARED}",
                       "convert_tied_zero3": f"ZeRO-3: RuntimeError: {SHARED}"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.14.0", "0.19.8"),
)

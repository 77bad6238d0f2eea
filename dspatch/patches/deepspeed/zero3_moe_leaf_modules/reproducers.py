"""Reproducers: a 2-rank job of this module (gloo, CPU): a tiny Mixtral, Jamba (attention and experts only) or Ernie
4.5 MoE (1 layer, 4 experts, one expert per token) built from a config, ZeRO-3 with every parameter partitioned, SGD,
two steps of `engine.backward(loss); engine.step()`, each rank on its own tokens, which its router sends to other
experts than the other rank's (the job checks that it is so, from the router's own choice).

Stock's ranks enter different collectives at the first forward: gloo aborts on the size mismatch (NCCL would wait for
ever; every launch here is bounded by a deadline, and a rank that passes it counts as the bug too). The reference is
the same job with the blocks set as leaves by hand (`deepspeed.utils.set_z3_leaf_modules`), the remedy upstream
documents: patched, the losses of both ranks equal it to the bit.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

STEPS, LR, DEADLINE = 2, 0.1, 120


def _model(kind):
    """(a tiny sparse-MoE model, its block class): Mixtral (which DeepSpeed >= 0.18.0 marks itself), Jamba (4.40+),
    PhiMoE (4.46+) or Ernie 4.5 MoE (4.54+; no DeepSpeed release marks those three); one layer, 4 experts, one expert
    per token (PhiMoE: 8 experts, two per token)."""
    import torch
    import transformers

    torch.manual_seed(0)
    shape = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=32)
    if kind == "ernie":
        from transformers.models.ernie4_5_moe import modeling_ernie4_5_moe as ernie

        config = transformers.Ernie4_5_MoeConfig(**shape, moe_num_experts=4, moe_k=1, moe_intermediate_size=32,
                                                 moe_num_shared_experts=0, moe_layer_start_index=0)
        return transformers.Ernie4_5_MoeForCausalLM(config), ernie.Ernie4_5_MoeSparseMoeBlock
    if kind == "phimoe":  # its router picks two experts of eight per token
        from transformers.models.phimoe import modeling_phimoe as phimoe

        config = transformers.PhimoeConfig(**shape, num_local_experts=8, num_experts_per_tok=2)
        return transformers.PhimoeForCausalLM(config), phimoe.PhimoeSparseMoeBlock
    if kind == "jamba":  # one attention layer with experts: no Mamba layer, so no Mamba kernels either
        from transformers.models.jamba import modeling_jamba as jamba

        config = transformers.JambaConfig(**shape, num_experts=4, num_experts_per_tok=1, attn_layer_period=1,
                                          attn_layer_offset=0, expert_layer_period=1, expert_layer_offset=0,
                                          use_mamba_kernels=False, use_cache=False)
        return transformers.JambaForCausalLM(config), jamba.JambaSparseMoeBlock
    from transformers.models.mixtral import modeling_mixtral as mixtral

    config = transformers.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=1)
    return transformers.MixtralForCausalLM(config), mixtral.MixtralSparseMoeBlock


def _tokens(rank):
    """Each rank's two micro-batches: rank 0 the low half of the vocabulary, rank 1 the high half."""
    import torch

    generator = torch.Generator().manual_seed(11 + rank)
    low, high = (0, 32) if rank == 0 else (32, 64)
    return [torch.randint(low, high, (1, 8), generator=generator) for _ in range(STEPS)]


def _experts_hit(model, block_class, rank):
    """The experts the router picks for this rank's first micro-batch, before any training (plain torch)."""
    import torch

    block = next(m for m in model.modules() if isinstance(m, block_class))
    seen = []
    router = block.router if hasattr(block, "router") else block.gate  # Jamba's name, the others'
    handle = router.register_forward_hook(lambda m, i, out: seen.append(out.argmax(-1).flatten().tolist()))
    with torch.no_grad():
        model(_tokens(rank)[0])
    handle.remove()
    return sorted(set(seen[0]))


def _job(folder, kind, by_hand):
    import torch

    from dspatch.scenario import finish_rank, init_deepspeed, on_accelerator, settle, zero3_config

    deepspeed = init_deepspeed()
    settle()
    rank = torch.distributed.get_rank()
    model, block_class = _model(kind)
    hit = _experts_hit(model, block_class, rank)
    if by_hand == "by_hand":
        deepspeed.utils.set_z3_leaf_modules(model, [block_class])
    config = zero3_config()
    config.pop("optimizer")
    config.update(train_micro_batch_size_per_gpu=1, gradient_clipping=0.0, zero_allow_untested_optimizer=True)
    if by_hand == "config_none":  # the user's own choice, on deepspeed >= 0.18.0: no leaf module at all
        config["zero_optimization"]["leaf_module"] = {"classes": []}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config)
    losses = []
    for ids in _tokens(rank):
        loss = engine(input_ids=on_accelerator(ids), labels=on_accelerator(ids)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    finish_rank(folder, {"hit": hit, "losses": losses})


def run(kind, by_hand):
    """The ranks' results, or the error of a job that failed or passed the deadline (a string)."""
    from dspatch.scenario import launch_ranks

    import subprocess

    try:
        return launch_ranks(__name__, args=(kind, by_hand or "-"), timeout=DEADLINE)
    except (RuntimeError, subprocess.TimeoutExpired) as e:  # a rank aborted, or the job passed the deadline
        return f"{type(e).__name__}: {e}"


def _how_it_failed(error):
    """gloo's abort on a collective of another size (SIGABRT), or its error for one (which of the two a rank meets
    depends on timing: both were seen on bridge), or the deadline (NCCL's hang); None: otherwise."""
    if " exited -6:" in error or "SIGABRT" in error:  # forked ranks, or torchrun's report
        return "gloo aborted on a collective of another size"
    if "Received data size doesn't match expected size" in error:
        return "gloo refused a collective of another size"
    if " exited -9:" in error or error.startswith("TimeoutExpired"):
        return f"the job passed the {DEADLINE} s deadline"
    return None


def _routed_apart(kind):
    """2 ranks whose tokens reach different experts: both train, with the losses of the blocks set as leaves by hand."""
    want = run(kind, "by_hand")
    if isinstance(want, str):
        raise AssertionError(f"the job with the leaves set by hand failed: {want[-2000:]}")
    if want[0]["hit"] == want[1]["hit"]:  # the run is the one meant
        raise AssertionError(f"both ranks' tokens reach the same experts {want[0]['hit']}: nothing to diverge")
    got = run(kind, "")
    if isinstance(got, str):
        # gloo aborts the rank that receives a collective of another size (SIGABRT: "Received data size doesn't
        # match expected size"); a rank past the deadline is killed: NCCL's hang
        how = _how_it_failed(got)
        if how is None:
            raise AssertionError(f"the job failed otherwise: {got[-3000:]}")
        raise BugSeen(f"ZeRO-3, {kind}'s sparse MoE block, ranks routing to experts {want[0]['hit']} and {want[1]['hit']}: "
                      f"the ranks' collectives diverge at the first forward ({how})")
    if [r["losses"] for r in got] != [r["losses"] for r in want]:
        raise AssertionError(f"trained, but not as with the leaves set by hand: {got} against {want}")


def mixtral_routed_apart():
    """Mixtral, 2 ranks whose tokens reach different experts: both train, as with the blocks set as leaves by hand."""
    _routed_apart("mixtral")


def jamba_routed_apart():
    """Jamba (a class no DeepSpeed release marks; transformers 4.40+, Mixtral before), the same."""
    from dspatch.upstream import installed_version
    from dspatch.versions import Version

    _routed_apart("jamba" if Version(installed_version("transformers")) >= Version("4.40.0") else "mixtral")


PROOF = Proof(
    scenarios={"mixtral_routed_apart": mixtral_routed_apart, "jamba_routed_apart": jamba_routed_apart},
    expected_on_stock={"mixtral_routed_apart": "the ranks' collectives diverge at the first forward",
                       "jamba_routed_apart": "the ranks' collectives diverge at the first forward"},
    # Mixtral's block runs every expert on transformers 4.40-4.51, and 0.18.0 marks it itself
    stock_fails_on={"mixtral_routed_apart": {"deepspeed": "<0.18.0", "transformers": ("<4.40.0", ">=4.52.0")},
                    "jamba_routed_apart": {"transformers": ">=4.40.0"}},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.14.0", "0.19.8"),
    others_with_and_without=({"transformers": "4.57.6"}, {"transformers": "5.0.0"}),
    own_tests_in=("ds0183",),  # its own tests only (not the shared proofs) run there too
)


if __name__ == "__main__":
    import sys

    _job(sys.argv[1], sys.argv[2], sys.argv[3] if sys.argv[3] != "-" else "")

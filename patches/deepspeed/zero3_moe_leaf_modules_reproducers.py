"""Reproducers: a 2-rank job of this module (gloo, CPU): a tiny Mixtral (1 layer, 4 experts, one expert per token)
built from a config, ZeRO-3 with every parameter partitioned, SGD, two steps of `engine.backward(loss);
engine.step()`, each rank on its own tokens, which its router sends to other experts than the other rank's (the job
checks that it is so, from the router's own choice).

Stock's ranks enter different collectives at the first forward: gloo aborts on the size mismatch (NCCL would wait for
ever; every launch here is bounded by a deadline, and a rank that passes it counts as the bug too). The reference is
the same job with the blocks set as leaves by hand (`deepspeed.utils.set_z3_leaf_modules`), the remedy upstream
documents: patched, the losses of both ranks equal it to the bit.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen

STEPS, LR, DEADLINE = 2, 0.1, 120


def _mixtral():
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                        num_experts_per_tok=1, max_position_embeddings=32)
    return transformers.MixtralForCausalLM(config)


def _tokens(rank):
    """Each rank's two micro-batches: rank 0 the low half of the vocabulary, rank 1 the high half."""
    import torch

    generator = torch.Generator().manual_seed(11 + rank)
    low, high = (0, 32) if rank == 0 else (32, 64)
    return [torch.randint(low, high, (1, 8), generator=generator) for _ in range(STEPS)]


def _experts_hit(model, rank):
    """The experts the router picks for this rank's first micro-batch, before any training (plain torch)."""
    import torch

    block = model.model.layers[0].block_sparse_moe
    seen = []
    handle = block.gate.register_forward_hook(lambda m, i, out: seen.append(out.argmax(-1).flatten().tolist()))
    with torch.no_grad():
        model(_tokens(rank)[0])
    handle.remove()
    return sorted(set(seen[0]))


def _job(folder, by_hand):
    import torch

    from dspatch.scenario import finish_rank, init_deepspeed, on_accelerator, settle, zero3_config

    deepspeed = init_deepspeed()
    settle()
    rank = torch.distributed.get_rank()
    model = _mixtral()
    hit = _experts_hit(model, rank)
    if by_hand == "by_hand":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        deepspeed.utils.set_z3_leaf_modules(model, [MixtralSparseMoeBlock])
    config = zero3_config()
    config.pop("optimizer")
    config.update(train_micro_batch_size_per_gpu=1, gradient_clipping=0.0, zero_allow_untested_optimizer=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config)
    losses = []
    for ids in _tokens(rank):
        loss = engine(input_ids=on_accelerator(ids), labels=on_accelerator(ids)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    finish_rank(folder, {"hit": hit, "losses": losses})


def run(by_hand):
    """The ranks' results, or the error of a job that failed or passed the deadline (a string)."""
    from dspatch.scenario import launch_ranks

    try:
        return launch_ranks(__name__, args=(by_hand,), timeout=DEADLINE)
    except (RuntimeError, TimeoutError) as e:  # a rank aborted, or the job passed the deadline
        return str(e)


def routed_apart():
    """2 ranks whose tokens reach different experts: both train, with the losses of the blocks set as leaves by hand."""
    want = run("by_hand")
    if isinstance(want, str):
        raise AssertionError(f"the job with the leaves set by hand failed: {want[-2000:]}")
    if want[0]["hit"] == want[1]["hit"]:  # the run is the one meant
        raise AssertionError(f"both ranks' tokens reach the same experts {want[0]['hit']}: nothing to diverge")
    got = run("")
    if isinstance(got, str):
        # gloo aborts the rank that receives a collective of another size (SIGABRT: "Received data size doesn't
        # match expected size"); a rank past the deadline is killed (SIGKILL): NCCL's hang
        how = next((why for code, why in ((" exited -6:", "gloo aborted on a collective of another size"),
                                          (" exited -9:", f"the job passed the {DEADLINE} s deadline"))
                    if code in got), None)
        if how is None:
            raise AssertionError(f"the job failed otherwise: {got[-3000:]}")
        raise BugSeen(f"ZeRO-3, a sparse MoE block, ranks routing to experts {want[0]['hit']} and {want[1]['hit']}: "
                      f"the ranks' collectives diverge at the first forward ({how})")
    if [r["losses"] for r in got] != [r["losses"] for r in want]:
        raise AssertionError(f"trained, but not as with the leaves set by hand: {got} against {want}")


SCENARIOS = {"routed_apart": routed_apart}
EXPECTED_ON_STOCK = {"routed_apart": "the ranks' collectives diverge at the first forward"}
# The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
RELEASES_CHECKED = ("0.14.0", "0.19.8")
OTHERS_WITH_AND_WITHOUT = ({"transformers": "4.57.6"}, {"transformers": "4.51.3"})


if __name__ == "__main__":
    import sys

    _job(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")

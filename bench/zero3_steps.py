"""Time ZeRO-3 training steps of a tiny Llama in this process (stock, or DSPATCH=1 through dspatch.pth).
Prints {"step_s": median seconds per step, "losses": [...], "applied": [...], "wrapped_calls_per_step": n}
as its last line."""
import json
import statistics
import sys
import time


def main(steps):
    from dspatch.scenario import init_deepspeed, zero3_config

    deepspeed = init_deepspeed()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import dspatch._runtime

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    engine, *_ = deepspeed.initialize(model=model, config=zero3_config(), model_parameters=model.parameters())
    generator = torch.Generator().manual_seed(1)
    times, losses = [], []
    warmup = 10  # the first steps record ZeRO-3's trace and warm the allocator
    for i in range(steps + warmup):
        ids = torch.randint(0, config.vocab_size, (2, 32), generator=generator)
        t = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if i >= warmup:
            times.append(time.perf_counter() - t)
        losses.append(float(loss.item()).hex())
    print(json.dumps({"step_s": statistics.median(times), "losses": losses, "applied": dspatch._runtime.applied_ids(),
                      "wrapped_calls_per_step": wrapped_calls_per_step(engine, config, generator)}))


def wrapped_calls_per_step(engine, config, generator, steps=3):
    """How often a function that dspatch put behind a wrapt wrapper runs in one training step (the rebuilt
    functions it installs directly cost what upstream's cost: same bytecode, one attribute name changed)."""
    import cProfile
    import pstats

    import torch
    import wrapt

    import dspatch._runtime

    txn = dspatch._runtime._applied.get("deepspeed/zero3-module-id")
    if txn is None:
        return None
    names = {q.rsplit(".", 1)[-1] for q, (_, new) in txn.originals().items() if isinstance(new, wrapt.FunctionWrapper)}
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (2, 32), generator=generator)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    calls = sum(primitive for (path, _, name), (primitive, *_rest) in stats.items()
                if name in names and "deepspeed/runtime/zero" in path)
    return calls / steps


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)

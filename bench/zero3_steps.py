"""Time ZeRO-3 training steps of a tiny Llama in this process (stock, or DSPATCH=1 through dspatch.pth); with
`zero2-offload` as the second argument, ZeRO-2 steps with the optimizer offloaded to the CPU (torch's AdamW) instead.
Prints {"step_s": median seconds per step, "losses": [...], "applied": {id: [changes in force, targets]},
"opcodes_per_step": n} as its last line. `opcodes_per_step` counts the Python bytecode instructions one step
executes (sys.settrace): deterministic, so stock and patched compare exactly, where wall time on a shared
2-core machine cannot resolve 1%."""
import json
import statistics
import sys
import time


def main(steps, workload="zero3"):
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
    if workload == "zero2-offload":  # the path deepspeed/zero12-offload-backward-twice wraps
        offload = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
                   "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
                   "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
        engine, *_ = deepspeed.initialize(model=model, config=offload,
                                          optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    else:
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
    runtime = dspatch._runtime
    applied = {pid: [len(txn.targets_changed()) if txn.intact() else 0, len(txn.patch.targets)]
               for pid, txn in runtime.state.applied.items()}
    print(json.dumps({"step_s": statistics.median(times), "losses": losses, "applied": applied,
                      "opcodes_per_step": opcodes_per_step(engine, config, generator)}))


def opcodes_per_step(engine, config, generator, steps=2):
    """Python bytecode instructions executed per training step, counted with sys.settrace."""
    import torch

    count = [0]

    def trace(frame, event, arg):
        if event == "call":
            frame.f_trace_opcodes, frame.f_trace_lines = True, False
        elif event == "opcode":
            count[0] += 1
        return trace

    batches = [torch.randint(0, config.vocab_size, (2, 32), generator=generator) for _ in range(steps)]
    sys.settrace(trace)
    try:
        for ids in batches:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
    finally:
        sys.settrace(None)
    return count[0] / steps


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40, *sys.argv[2:3])

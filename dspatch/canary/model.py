"""The tiny model and the data both sides of a canary run train: built from a config with a fixed seed (nothing from a
hub), the same on both sides, bit for bit."""

VOCAB, LENGTH, LABELS = 64, 8, 3
HIDDEN = 16  # every model's hidden size: what the Trainer fills ZeRO's hidden-size "auto" values from


def token_loss(logits, labels):
    """A causal LM's loss without the shift: the mean cross-entropy of the tokens not labelled -100, in fp32."""
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                             ignore_index=-100)


def _token_mlp():
    """The pipeline loop's model: embedding, Linear-Tanh, an output head, as plain layers (a PipelineModule cuts a
    list of layers into stages; a Llama's decoder layers take rotary embeddings from the model around them, which a
    stage does not have). Called as a Llama is, `model(input_ids=, labels=).loss`, for the reference."""
    import types

    import torch

    class TokenMLP(torch.nn.Sequential):
        def forward(self, input_ids, labels):
            return types.SimpleNamespace(loss=token_loss(super().forward(input_ids), labels))

    return TokenMLP(torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, 32), torch.nn.Tanh(),
                    torch.nn.Linear(32, VOCAB))


def build(plan):
    """The model the plan names, its weights drawn after torch.manual_seed(plan["seed"])."""
    import torch
    import transformers

    torch.manual_seed(plan["seed"])
    if plan["model"] == "mlp":
        return _token_mlp()
    if plan["model"] == "moe":  # a sparse mixture of experts: four experts, two per token
        config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32,
                                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                            max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(config)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      num_labels=LABELS, pad_token_id=0)
    head = {"causal": "LlamaForCausalLM", "sequence": "LlamaForSequenceClassification",
            "token": "LlamaForTokenClassification"}[plan["head"]]
    return getattr(transformers, head)(config)


def parameter_count(model):
    """How many parameters the tiny model `model` ("llama", "moe", "mlp") has: the scale of ZeRO's sizes."""
    return sum(p.numel() for p in build({"model": model, "seed": 0, "head": "causal"}).parameters())


def rows(plan, rank=0):
    """The rows of one epoch (dicts of lists), micro_batch x per_epoch of them, the same every epoch; each rank its
    own."""
    import torch

    count = plan["micro"] * plan["per_epoch"] * plan.get("backwards", 1)
    generator = torch.Generator().manual_seed(3 + rank)
    ids = torch.randint(4, VOCAB, (count, LENGTH), generator=generator)
    if plan["head"] == "sequence":
        labels = torch.randint(0, LABELS, (count,), generator=generator).tolist()
    elif plan["head"] == "token":
        labels = torch.randint(0, LABELS, (count, LENGTH), generator=generator).tolist()
    else:  # a causal LM: the ids, the first left out (every release then counts the tokens a loss divides by alike)
        labels = [[-100] + row[1:] for row in ids.tolist()]
    return [{"input_ids": i, "labels": label} for i, label in zip(ids.tolist(), labels)]


def micro_batches(plan, rank=0):
    """One epoch's micro-batches of a rank, in order: dicts of tensors of plan["micro"] rows."""
    import torch

    epoch = rows(plan, rank)
    size = plan["micro"]
    return [{key: torch.tensor([row[key] for row in epoch[start:start + size]]) for key in ("input_ids", "labels")}
            for start in range(0, len(epoch), size)]


def groups(model, lrs):
    """The parameter groups of a run: one (every parameter) at lrs[0], or with a second rate the output head (lm_head
    or score) in a group of its own at lrs[1]."""
    if len(lrs) < 2:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "lr": lrs[0]}]
    head = [p for n, p in model.named_parameters() if n.split(".")[0] in ("lm_head", "score", "classifier")]
    body = [p for n, p in model.named_parameters() if n.split(".")[0] not in ("lm_head", "score", "classifier")]
    return [{"params": body, "lr": lrs[0]}, {"params": head, "lr": lrs[1]}]


def optimizer_of(plan, params):
    """The torch optimizer the run's config means (SGD, Adam, AdamW with the params it gives, torch's defaults for the
    rest, as DeepSpeed's `torch_adam` builds it), or AdamW where the config names none: at torch's defaults for the
    engine and accelerate loops (the canary's client optimizer), without weight decay for the Trainer (its own)."""
    import torch

    block = plan["config"].get("optimizer")
    kind = str(block.get("type", "AdamW")).lower() if block else "adamw"
    given = {k: v for k, v in ((block or {}).get("params") or {}).items()
             if v != "auto" and k in ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov")}
    given["lr"] = plan["lrs"][0]
    if "betas" in given:
        given["betas"] = tuple(given["betas"])
    if not block and plan["loop"] == "trainer":
        given["weight_decay"] = 0.0
    if kind == "sgd":
        return torch.optim.SGD(params, **given)
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode says otherwise (its torch_adam likewise)
    decoupled = kind == "adamw" or ((block or {}).get("params") or {}).get("adam_w_mode", True)
    return (torch.optim.AdamW if decoupled else torch.optim.Adam)(params, **given)

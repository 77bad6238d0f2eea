"""Reproducers: one optimizer step of the real Trainer (plain SGD at a constant rate, no clipping) on the same
global batch of four rows, as one micro-batch (GA 1), two (GA 2) and four (GA 4): the update and the logged loss must
not depend on how the batch is cut. Tiny Llama heads (the Generic* heads of 4.54+) and BERT's (5.x), with and without
DeepSpeed (ZeRO-2).

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

LABELS, ROWS, LENGTH = 3, 4, 6
ZERO2 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "steps_per_print": 10**6,
         "zero_optimization": {"stage": 2}}


def _model(kind, head):
    import torch

    from dspatch.scenario import tiny_llama

    if kind == "llama":
        return tiny_llama(head=f"LlamaFor{head}Classification", num_labels=LABELS, pad_token_id=0)
    from transformers import BertConfig, BertForSequenceClassification, BertForTokenClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, num_labels=LABELS, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return (BertForSequenceClassification if head == "Sequence" else BertForTokenClassification)(config)


def _rows(head):
    import torch

    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(4, 64, (ROWS, LENGTH), generator=generator).tolist()
    labels = torch.randint(0, LABELS, (ROWS, LENGTH), generator=generator).tolist()
    return [{"input_ids": row, "labels": (marks[0] if head == "Sequence" else marks)} for row, marks in zip(ids, labels)]


def _step(kind, head, accumulation, deepspeed):
    """(the update of one Trainer step, its logged loss)."""
    from dspatch.scenario import init_deepspeed, sgd_trainer, weights

    if deepspeed:
        init_deepspeed()
    model = _model(kind, head)
    before = weights(model)
    trainer, _ = sgd_trainer(model, _rows(head), ZERO2 if deepspeed else None, batch=ROWS // accumulation,
                             accumulation=accumulation, steps=1, lr=0.1)
    after = weights(model)
    loss = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    return {name: after[name] - before[name] for name in before}, float(loss)


def _same_at_every_accumulation(kind, head, deepspeed=False):
    import torch

    def norm(update):
        return torch.sqrt(sum((u.double() ** 2).sum() for u in update.values())).item()

    base, loss = _step(kind, head, 1, deepspeed)
    for accumulation in (2, 4):
        update, logged = _step(kind, head, accumulation, deepspeed)
        apart = norm({name: update[name] - base[name] for name in base}) / norm(base)
        if apart > 1e-4 or abs(logged - loss) > 1e-4 * abs(loss):
            raise BugSeen(f"{kind}'s {head.lower()}-classification head at GA {accumulation}"
                          f"{' under DeepSpeed' if deepspeed else ''}: the update is {norm(update) / norm(base):.4g} "
                          f"times GA 1's and the logged loss {logged:.5g} against {loss:.5g}, for the same batch")


def llama_sequence_head():
    """LlamaForSequenceClassification: the update and the logged loss at GA 2 and 4 equal GA 1's (no DeepSpeed)."""
    _same_at_every_accumulation("llama", "Sequence")


def llama_token_head():
    """LlamaForTokenClassification: the update and the logged loss at GA 2 and 4 equal GA 1's (no DeepSpeed)."""
    _same_at_every_accumulation("llama", "Token")


def llama_sequence_head_deepspeed():
    """LlamaForSequenceClassification under DeepSpeed ZeRO-2: the update and the logged loss at GA 2 and 4 equal GA 1's."""
    _same_at_every_accumulation("llama", "Sequence", deepspeed=True)


def bert_sequence_head():
    """BertForSequenceClassification: the update and the logged loss at GA 2 and 4 equal GA 1's (no DeepSpeed)."""
    _same_at_every_accumulation("bert", "Sequence")


PROOF = Proof(
    scenarios={"llama_sequence_head": llama_sequence_head, "llama_token_head": llama_token_head,
               "llama_sequence_head_deepspeed": llama_sequence_head_deepspeed, "bert_sequence_head": bert_sequence_head},
    expected_on_stock={"llama_sequence_head": "llama's sequence-classification head at GA 2",
                       "llama_token_head": "llama's token-classification head at GA 2",
                       "llama_sequence_head_deepspeed": "llama's sequence-classification head at GA 2 under DeepSpeed",
                       "bert_sequence_head": "bert's sequence-classification head at GA 2"},
    # Llama's heads take **kwargs from 4.54 (the Generic* heads), BERT's from 5.0
    stock_fails_on={"llama_sequence_head": ">=4.54.0", "llama_token_head": ">=4.54.0",
                    "llama_sequence_head_deepspeed": ">=4.54.0", "bert_sequence_head": ">=5.0.0"},
    silent="the run trains without an error, its updates and logged loss GA times too large",
    releases_checked=("4.49.0", "5.24.0"),
)

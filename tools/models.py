"""Random Qwen2 checkpoints for the tools' jobs: a model of a chosen shape with the embedded
tokenizer, saved where `model.path=` can point, so that a bench needs no download."""

from __future__ import annotations


def build_random_qwen2(folder: str, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int,
                       long_answers: bool = False, eos_rate: float | None = None,
                       max_positions: int = 256) -> int:
    """A randomly initialised Qwen2ForCausalLM with the embedded tokenizer, saved into `folder`;
    returns its parameter count. `long_answers`: a random head samples EOS as often as any other
    of the 15 tokens, ending most responses within a few tokens; with its EOS row zeroed (logit 0)
    and the other rows scaled up (logits of a few units, one dominant), EOS is all but never drawn
    and every response runs to data.max_response_length, as a trained model's long answers do.
    `eos_rate`: EOS drawn with this probability at every position (and pad/bos/unk never), so
    response lengths spread geometrically, a long tail (see `set_token_rates`)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from spmdsplit.embedded import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=mlp,
                         max_position_embeddings=max_positions, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    if long_answers:
        with torch.no_grad():
            model.lm_head.weight.mul_(20.0)
            model.lm_head.weight[tokenizer.eos_token_id] = 0.0
    if eos_rate is not None:
        never = [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.unk_token_id]
        set_token_rates(model, tokenizer.eos_token_id, eos_rate, never)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def set_token_rates(model, eos_id: int, eos_rate: float, never: list[int]) -> None:
    """Makes the model draw `eos_id` with probability ~`eos_rate` at every position and the
    `never` ids not at all, whatever the input. A Qwen2 head has no bias, so this builds one: hidden
    channel 0 of every token embedding is set to 1, far above the other channels (init std 0.02),
    and the random blocks add too little to move it, so after the final RMSNorm channel 0 is a
    near-constant c ~ sqrt(hidden) and the head's column 0 acts as a per-token bias (column 0 times
    c). The other tokens' logits stay near 0 (near-uniform among them), EOS gets
    log(eos_rate / (1 - eos_rate) * others), the `never` ids -20 or less."""
    import math

    import torch

    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        # c as the model computes it: run one input through and read channel 0 after the norm.
        hidden = model.model(torch.tensor([[eos_id]])).last_hidden_state
        c = float(hidden[0, -1, 0])
        head = model.lm_head.weight
        head[:, 0] = 0.0
        others = head.shape[0] - 1 - len(never)
        head[eos_id, 0] = math.log(eos_rate / (1 - eos_rate) * others) / c
        for i in never:
            head[i, 0] = -20.0 / abs(c)

"""Random Qwen2 checkpoints for the tools' jobs: a model of a chosen shape with the embedded
tokenizer, saved where `model.path=` can point, so that a bench needs no download."""

from __future__ import annotations


def build_random_qwen2(folder: str, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int,
                       long_answers: bool = False) -> int:
    """A randomly initialised Qwen2ForCausalLM with the embedded tokenizer, saved into `folder`;
    returns its parameter count. `long_answers`: a random head samples EOS as often as any other
    of the 15 tokens, ending most responses within a few tokens; with its EOS row zeroed (logit 0)
    and the other rows scaled up (logits of a few units, one dominant), EOS is all but never drawn
    and every response runs to data.max_response_length, as a trained model's long answers do."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from spmdsplit.embedded import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=mlp,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    if long_answers:
        with torch.no_grad():
            model.lm_head.weight.mul_(20.0)
            model.lm_head.weight[tokenizer.eos_token_id] = 0.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())

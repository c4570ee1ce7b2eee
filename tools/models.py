"""A model's shape, and random Qwen2 checkpoints of a shape for the tools' jobs.

`ModelShape` is the one place a Hugging Face config's fields are read into the planners' names
(tools/plan/: the memory model, the memory plan, the efficiency report; tools/device/gpu_check.py)
and written back into a Qwen2 config (`qwen2_config`: the memory plan's weightless models and
`build_random_qwen2`'s checkpoints), so that the MLP's width, the attention heads' width and tied
embeddings mean one thing everywhere. `build_random_qwen2` saves a model of a chosen shape with the
embedded tokenizer where `model.path=` can point, so that a bench needs no download.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelShape:
    """A LLaMA-like decoder (Qwen2, Llama, Mistral): SwiGLU MLP of width `mlp` (HF's
    intermediate_size), `heads` query and `kv_heads` key/value heads of width `head_dim`."""
    name: str = field(compare=False)  # a label for the tables, not part of the shape
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    tied: bool = False  # tie_word_embeddings: the LM head is the embedding, no weights of its own
    head_dim: int = 0  # 0: hidden // heads, what transformers takes where a config sets none

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @classmethod
    def from_config(cls, config, name: str = "") -> ModelShape:
        """From a config.json's dict or a transformers config (named by its _name_or_path, else
        `name`). An explicit head_dim is honoured: Qwen3 or Gemma set one that is not hidden // heads."""
        c = config if isinstance(config, dict) else config.to_dict()
        return cls(c.get("_name_or_path") or name, c["hidden_size"], c["num_hidden_layers"],
                   c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"],
                   c["intermediate_size"], c["vocab_size"], tied=bool(c.get("tie_word_embeddings", False)),
                   head_dim=c.get("head_dim") or 0)

    @classmethod
    def from_folder(cls, folder: str) -> ModelShape:
        """From the config.json in `folder` (a config.json's own path also does)."""
        folder = os.path.dirname(folder) if folder.endswith(".json") else folder
        with open(os.path.join(folder, "config.json")) as f:
            return cls.from_config(json.load(f), os.path.basename(os.path.normpath(folder)))

    def qwen2_config(self, **extra):
        """A transformers Qwen2Config of this shape; `extra`: its other fields."""
        from transformers import Qwen2Config

        # head_dim only where it is not Qwen2's own default, so configs written before stay the same.
        own = {} if self.head_dim == self.hidden // self.heads else {"head_dim": self.head_dim}
        return Qwen2Config(vocab_size=self.vocab, hidden_size=self.hidden, num_hidden_layers=self.layers,
                           num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                           intermediate_size=self.mlp, tie_word_embeddings=self.tied, **own, **extra)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def block_params(self) -> int:
        """One Qwen2 decoder layer's parameters: q, k, v (with biases), o, the SwiGLU MLP, two RMSNorms."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        attention = h * q + q + 2 * (h * kv + kv) + q * h
        return attention + 3 * h * self.mlp + 2 * h

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """The causal LM's parameter count (Qwen2 architecture)."""
        head = 0 if self.tied else self.embed_params
        return self.layers * self.block_params + self.embed_params + head + self.hidden

    @property
    def critic_params(self) -> int:
        """The value model: the backbone and a one-output head instead of the LM head."""
        return self.layers * self.block_params + self.embed_params + self.hidden + self.hidden + 1

    def layer_weights(self) -> int:
        """One decoder layer's matmul weights (what its FLOPs are counted from): q, k, v, o, and the
        MLP's gate, up and down."""
        h, d = self.hidden, self.head_dim
        return h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h + 3 * h * self.mlp

    def body_weights(self) -> int:
        return self.layers * self.layer_weights()


def add_shape_flags(parser) -> None:
    """--hidden, --layers, --heads, --kv-heads, --mlp: the random Qwen2 a bench builds
    (build_random_qwen2); the same defaults in every bench that takes them."""
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--mlp", type=int, default=2048)


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
    from transformers import Qwen2ForCausalLM

    from spmdsplit.embedded import build_tokenizer

    tokenizer = build_tokenizer()
    config = ModelShape("", hidden, layers, heads, kv_heads, mlp, len(tokenizer)).qwen2_config(
        max_position_embeddings=max_positions, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
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

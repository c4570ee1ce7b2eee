"""A small chat model for the agent tests, built locally: a character-level tokenizer over printable
ASCII with ChatML-style special tokens and a Hermes-style chat template written here (tools as JSON
in a system block, calls as <tool_call>{...}</tool_call>, tool responses in a user block), and a
tiny random Qwen2 (head size 32, as vLLM's CPU kernel needs)."""

from __future__ import annotations

import string

import torch

SPECIALS = {"pad_token": "<pad>", "eos_token": "<|im_end|>", "unk_token": "<unk>"}
IM_START = "<|im_start|>"

HERMES_TEMPLATE = (
    "{%- if tools %}" + IM_START + "system\n<tools>\n"
    "{%- for t in tools %}{{ t | tojson }}\n{% endfor -%}"
    "</tools>\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n{% endif -%}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}" + IM_START + "user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{%- else %}" + IM_START + "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}"
)


def chat_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    words = list(SPECIALS.values()) + [IM_START] + chars
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=SPECIALS["unk_token"]))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, additional_special_tokens=[IM_START], **SPECIALS)
    tokenizer.padding_side = "left"
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


def save_chat_model(folder: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from spmdsplit.models import hf_tensors, save_hf_folder

    tokenizer = chat_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = Qwen2ForCausalLM(config)
    save_hf_folder(model, hf_tensors(model), folder, tokenizer)
    return folder

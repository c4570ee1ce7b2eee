"""The embedded default model: a tiny Qwen2-architecture causal LM and a character-level
tokenizer, built locally (no download) and saved with `save_pretrained`, so the job loads it
back through the same `from_pretrained` path a real Hugging Face model takes.

Every rank may call `ensure_embedded_model` at once, with no collective: each builds the same
deterministic files into its own temporary folder and renames it into place; the first rename
wins and the others find the folder there and discard theirs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import torch

from spmdsplit.data.synthetic import TOOL_CALL, TOOL_CLOSE, TOOL_OPEN, agent_vocabulary, prompt_vocabulary
from spmdsplit.models import hf_tensors, save_hf_folder

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}

# Small enough to train in minutes on two CPU cores, with the structure of a real model
# (rotary attention, grouped-query heads, SwiGLU MLP) so the same code path is exercised.
MODEL_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,  # head size 32: vLLM's CPU attention kernel rejects 16
    num_key_value_heads=1,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
BUILD_SEED = 1234

# The agent model's chat template (data.task=lookup): messages' contents end to end, a tool
# response as "=<content>;". Tools are not rendered: a 2-layer character model cannot read a JSON
# schema; it learns the compact call "@" (spmdsplit/agent/parsers.py) from the reward alone.
AGENT_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}" + TOOL_OPEN + "{{ m['content'] }}" + TOOL_CLOSE +
    "{%- else -%}{{ m['content'] }}{%- endif -%}"
    "{%- endfor -%}"
)


def build_tokenizer(agent: bool = False):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(SPECIAL_TOKENS.values()) + (agent_vocabulary() if agent else prompt_vocabulary())
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=SPECIAL_TOKENS["unk_token"]))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")  # one token per character
    core.decoder = decoders.Fuse()  # decode without spaces between characters
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, **SPECIAL_TOKENS)
    tokenizer.padding_side = "left"
    if agent:
        tokenizer.chat_template = AGENT_CHAT_TEMPLATE
    return tokenizer


# The agent model's prior to call its tool: about this much added to the logit of the compact call "@"
# (the LM head's row moved along the mean final hidden state: Qwen2's head has no bias), so a random
# policy calls in most episodes. Without it ~30 % did, and the lookup task's policy learned to guess
# digits instead (0.06-0.08) in every recipe tried. An instruct model starts knowing its tool-call
# format from its fine-tuning; this toy starts knowing only that "@" is likely. RL still has to learn
# to use what the tool says, and to call when it pays.
CALL_PRIOR = 2.0


def build_model(tokenizer, agent: bool = False):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),  # the tokenizer's real size, specials included
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **MODEL_SHAPE,
    )
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        torch.manual_seed(BUILD_SEED)
        model = Qwen2ForCausalLM(config)
    if agent:
        with torch.no_grad():
            every_token = torch.arange(len(tokenizer))[None]
            mean = model.model(input_ids=every_token).last_hidden_state[0].mean(0)
            model.lm_head.weight[tokenizer.convert_tokens_to_ids(TOOL_CALL)] += CALL_PRIOR * mean / mean.dot(mean)
    return model


def _fingerprint(agent: bool = False) -> str:
    spec = {"shape": MODEL_SHAPE, "vocab": prompt_vocabulary(), "seed": BUILD_SEED}
    if agent:  # the default model's fingerprint (and folder) stay what they were
        spec.update(vocab=agent_vocabulary(), chat_template=AGENT_CHAT_TEMPLATE, call_prior=CALL_PRIOR)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]


def default_cache_dir() -> str:
    return os.environ.get("SPMDSPLIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "spmdsplit")


def ensure_embedded_model(cache_dir: str = "", agent: bool = False) -> str:
    """Returns the folder of the embedded model, building it there first if it isn't yet; `agent`:
    the same model with the agent task's characters and chat template (data.task=lookup)."""
    cache_dir = cache_dir or default_cache_dir()
    target = os.path.join(cache_dir, f"tiny-qwen2{'-agent' if agent else ''}-{_fingerprint(agent)}")
    return build_model_folder(target, lambda: build_tokenizer(agent), lambda tokenizer: build_model(tokenizer, agent))


def build_model_folder(target: str, make_tokenizer, make_model) -> str:
    """`target` (a model folder), unless it is there already: `make_model(make_tokenizer())` saved
    into a staging folder beside it, then renamed into place. Safe for callers building it at once:
    each builds its own, the first rename wins and the others find the folder there."""
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    cache_dir = os.path.dirname(target)
    os.makedirs(cache_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".building-", dir=cache_dir)
    os.chmod(staging, 0o755)  # mkdtemp makes it private; a shared cache must be readable by all
    try:
        tokenizer = make_tokenizer()
        model = make_model(tokenizer)
        save_hf_folder(model, hf_tensors(model), staging, tokenizer)
        try:
            os.rename(staging, target)  # atomic: readers see no folder or a whole one
        except OSError:
            if not os.path.isfile(os.path.join(target, "config.json")):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target

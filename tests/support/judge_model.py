"""A small LLM judge of the embedded `repeat` task, built locally: the embedded tokenizer's
characters with a chat template of its own, and a tiny Qwen2 trained here (supervised, on CPU, in
about three minutes of one core) to read "{prompt}{response}=" and write the digit round(9 * score) then its EOS,
where score is the rule's `positional_match_score(response, ground_truth)`. A generative reward
model for the tests and presets: the job sends it the judge prompt per (prompt, response) and reads
the last number of what it writes, over 9.

The suite reads the folder the repository ships (tests/data/judge_repeat, 0.8 MB: its build costs
about three minutes of one core, more than CI can pay on every run), as long as its FINGERPRINT is
this recipe's. A changed recipe builds once into the cache beside the embedded model
(spmdsplit.embedded.default_cache_dir), in a folder named with a fingerprint of everything that
determines it, atomically as `ensure_embedded_model` does: concurrent callers each build the same
files into a staging folder and the first rename wins; `python -m tests.support.judge_model
--ship` builds it anew and writes it over the shipped folder. `python -m tests.support.judge_model`
prints the folder (configs/judge.yaml's reward.judge.path).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile

import torch

from spmdsplit.data.synthetic import DIGITS, SEPARATOR, make_dataset
from spmdsplit.rewards.rule import positional_match_score

# What the runtime renders for the judge, per (prompt, response): the policy prompt's text and the
# response's, both decoded without special tokens (the response without its EOS).
JUDGE_PROMPT = [{"role": "user", "content": "{prompt}{response}="}]

# Each message's content end to end after a BOS (a fixed first position for attention to rest
# on), nothing for the generation prompt: the judge writes its digit right after the "=".
JUDGE_CHAT_TEMPLATE = "{{ bos_token }}{%- for m in messages -%}{{ m['content'] }}{%- endfor -%}"

MODEL_SHAPE = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=3,  # 2 layers plateaued near 0.6-0.8: finding the target digit takes two hops
    num_attention_heads=2,  # head size 32: vLLM's CPU attention kernel rejects 16
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=100.0,  # more rotary frequencies that tell offsets 0-16 apart (with 10000: plateau at 0.78)
    tie_word_embeddings=False,
)

# Everything else that determines the weights; all of it goes into the folder's fingerprint.
RECIPE = dict(
    init_seed=2024,
    data_seed=7,  # prompts: make_dataset("repeat", ..., data_seed); responses: Random(data_seed + 1)
    train_prompts=50_000,
    steps=2500,
    batch_size=128,
    lr=3e-3,
    warmup=200,
    weight_decay=0.01,
    # The response distribution (sample_response): lengths 0-6, mostly 4-6; per response a
    # probability p that each character is the target digit, else a random digit, rarely "=".
    lengths=[0, 1, 2, 3, 4, 5, 6],
    length_weights=[2, 2, 3, 4, 45, 22, 22],
    p_values=[0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0],
    separator_rate=0.03,
    exact_rate=0.15,
    version=1,
)

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "judge_repeat")
HELD_OUT_SEED = 99  # judge_accuracy's default: not RECIPE["data_seed"]


def verdict_for(score: float) -> int:
    """The digit the judge writes for a rule score in [0, 1]."""
    return round(9 * score)


def judge_tokenizer():
    from spmdsplit.embedded import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = JUDGE_CHAT_TEMPLATE
    tokenizer.init_kwargs["padding_side"] = "left"  # saved too: set as an attribute only, it is not
    return tokenizer


def judge_messages(prompt: str, response: str) -> list[dict]:
    return [{k: v.format(prompt=prompt, response=response) for k, v in m.items()} for m in JUDGE_PROMPT]


def sample_response(rng: random.Random, target: str, p_values=None) -> str:
    """A response like a learning policy's on the repeat task, whose answer is `target` * 4."""
    if rng.random() < RECIPE["exact_rate"] and p_values is None:
        return target * 4
    length = rng.choices(RECIPE["lengths"], RECIPE["length_weights"])[0]
    p = rng.choice(p_values or RECIPE["p_values"])
    chars = []
    for _ in range(length):
        if rng.random() < p:
            chars.append(target)
        elif rng.random() < RECIPE["separator_rate"]:
            chars.append(SEPARATOR)
        else:
            chars.append(rng.choice(DIGITS))
    return "".join(chars)


def judge_samples(num_samples: int, seed: int, p_values=None) -> list[tuple[str, str, int]]:
    """(policy prompt, response, verdict) triples: prompts from make_dataset("repeat", n, seed),
    responses from Random(seed + 1)."""
    rng = random.Random(seed + 1)
    out = []
    for row in make_dataset("repeat", num_samples, seed):
        truth = row["reward_model"]["ground_truth"]
        response = sample_response(rng, truth[0], p_values)
        out.append((row["prompt"], response, verdict_for(positional_match_score(response, truth))))
    return out


def _training_tensors(tokenizer, num_samples: int, seed: int):
    """Right-padded ids (pads after the EOS: a causal model never sees them) and labels on the
    verdict digit and the EOS only. One token per character, so ids come from the vocabulary
    directly (the template rendered and tokenized for the first sample checks that they agree)."""
    vocab = tokenizer.get_vocab()
    seqs = []
    for prompt, response, verdict in judge_samples(num_samples, seed):
        content = JUDGE_PROMPT[0]["content"].format(prompt=prompt, response=response)
        seqs.append([tokenizer.bos_token_id] + [vocab[c] for c in content + str(verdict)] + [tokenizer.eos_token_id])
    first = judge_samples(1, seed)[0]
    text = tokenizer.apply_chat_template(judge_messages(*first[:2]), tokenize=False, add_generation_prompt=True)
    assert tokenizer(text + str(first[2]), add_special_tokens=False)["input_ids"] == seqs[0][:-1], text
    width = max(map(len, seqs))
    input_ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, ids in enumerate(seqs):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, len(ids) - 2: len(ids)] = input_ids[i, len(ids) - 2: len(ids)]
    return input_ids, labels


def build_judge(tokenizer, log=None):
    """The trained judge model (on CPU, one thread, deterministic)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **MODEL_SHAPE)
    input_ids, labels = _training_tensors(tokenizer, RECIPE["train_prompts"], RECIPE["data_seed"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same numbers each time, and the build's cost on one core
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
            torch.manual_seed(RECIPE["init_seed"])
            model = Qwen2ForCausalLM(config)
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=RECIPE["lr"], weight_decay=RECIPE["weight_decay"],
                                    betas=(0.9, 0.98))
            steps, warmup = RECIPE["steps"], RECIPE["warmup"]
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * s / steps)).item()))
            gen = torch.Generator().manual_seed(RECIPE["data_seed"])
            n = input_ids.shape[0]
            order = torch.randperm(n, generator=gen)
            at = 0
            for step in range(steps):
                if at + RECIPE["batch_size"] > n:
                    order, at = torch.randperm(n, generator=gen), 0
                idx = order[at: at + RECIPE["batch_size"]]
                at += RECIPE["batch_size"]
                ids, lab = input_ids[idx], labels[idx]
                width = int((ids != tokenizer.pad_token_id).sum(1).max())
                loss = model(input_ids=ids[:, :width], labels=lab[:, :width]).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                if log is not None:
                    log(step, loss, model)
            model.eval()
    finally:
        torch.set_num_threads(threads)
    return model


def _fingerprint() -> str:
    from spmdsplit.data.synthetic import prompt_vocabulary

    spec = {"shape": MODEL_SHAPE, "vocab": prompt_vocabulary(), "recipe": RECIPE, "template": JUDGE_CHAT_TEMPLATE,
            "judge_prompt": JUDGE_PROMPT, "padding_side": "left"}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]


def ensure_judge_model(cache_dir: str = "") -> str:
    """The folder of the judge (an HF causal LM and its tokenizer), building it there first if it
    isn't yet (about three minutes of one core: over the 90 s
    asked for; shorter schedules had not yet passed the jump in accuracy near step 2000)."""
    from spmdsplit.embedded import build_model_folder, default_cache_dir

    if not cache_dir and shipped_fingerprint() == _fingerprint():
        return SHIPPED
    target = os.path.join(cache_dir or default_cache_dir(), f"judge-qwen2-{_fingerprint()}")
    return build_model_folder(target, judge_tokenizer, build_judge)


def judge_generate(model, tokenizer, pairs: list[tuple[str, str]], batch_size: int = 500) -> list[str]:
    """Greedy verdict texts for (prompt, response) pairs, rendered as the runtime renders them:
    the chat template, no special tokens added beyond it, left padding, two new tokens."""
    texts = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start: start + batch_size]
        rendered = [tokenizer.apply_chat_template(judge_messages(p, r), tokenize=False, add_generation_prompt=True)
                    for p, r in chunk]
        enc = tokenizer(rendered, add_special_tokens=False, padding=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return texts


def read_verdict(text: str) -> int | None:
    """The digit a judge's text gives, read by the runtime's parser (the last number, in [0, 9])."""
    from spmdsplit.rewards import verdicts

    try:
        return round(verdicts.last_number(text, 0, 9) * 9)
    except verdicts.NoVerdict:
        return None


def judge_accuracy(path: str, num_samples: int = 2000, seed: int = HELD_OUT_SEED, p_values=None) -> float:
    """Held-out share of samples whose greedy generation is exactly the right digit (then EOS or
    nothing): prompts from make_dataset("repeat", n, seed), responses from the training
    distribution with Random(seed + 1); `p_values`: only responses with those match rates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if seed == RECIPE["data_seed"]:
        raise ValueError(f"seed {seed} is the judge's training seed: not held out")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    samples = judge_samples(num_samples, seed, p_values)
    texts = judge_generate(model, tokenizer, [(p, r) for p, r, _ in samples])
    return sum(t.strip() == str(v) for t, (_, _, v) in zip(texts, samples)) / len(samples)


def shipped_fingerprint() -> str | None:
    try:
        with open(os.path.join(SHIPPED, "FINGERPRINT")) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def ship() -> str:
    """Builds the judge anew (in a temporary cache) and writes it over the shipped folder."""
    with tempfile.TemporaryDirectory() as cache:
        built = ensure_judge_model(cache)
        shutil.rmtree(SHIPPED, ignore_errors=True)
        shutil.copytree(built, SHIPPED)
    for name in os.listdir(SHIPPED):
        os.chmod(os.path.join(SHIPPED, name), 0o644)
    with open(os.path.join(SHIPPED, "FINGERPRINT"), "w") as f:
        f.write(_fingerprint() + "\n")
    return SHIPPED


if __name__ == "__main__":
    import sys

    print(ship() if "--ship" in sys.argv[1:] else ensure_judge_model())

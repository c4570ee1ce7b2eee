"""An LLM judge (reward.judge.*): a causal LM on each rank of the reward group that reads a response
and writes a verdict, which becomes the response's score (rewards/verdicts.py).

Each scoring rank holds its own judge (no collective: a rank scores its own rows). The judge's
engine (a rollout engine, inference/hf.py) is owned by an EngineDriver (serving/driver.py) for the
whole job, so the rows this rank scores and the calls a custom reward function makes through the
judge's OpenAI-compatible endpoint (serving/server.py, on 127.0.0.1, started when a custom function
is set) go into the same engine steps: a batch of verdicts, however they were asked for.

- `score(samples)`: each sample's judge prompt (reward.judge.prompt, placeholders filled, rendered
  with the judge's chat template exactly as the endpoint renders chat messages) continued by the
  engine, reward.judge.n times; the verdicts parsed; the sample scores their mean. A verdict that
  cannot be read scores reward.judge.on_parse_error and is counted.
- verdict=yes_no: no generation: one forward pass of the judge's model over each prompt, with the
  driver paused so that nothing else runs on the engine meanwhile.
- A prompt over the judge's context (with max_tokens of room) stops the job with one line, or loses
  the start or end of its response until it fits (reward.judge.truncation).

What it measured since the last `pop_metrics` goes to reward/judge/* (roles/reward.py).
"""

from __future__ import annotations

import glob
import json
import math
import os
import string
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from spmdsplit.errors import ConfigError
from spmdsplit.rewards import verdicts
from spmdsplit.rewards.calls import Sample, Scored
from spmdsplit.rewards.rule import normalize_result
from spmdsplit.serving.driver import EngineDriver, make_driver
from spmdsplit.serving.protocol import render_chat
from spmdsplit.usercode import call_within

# How long the judge's engine, found idle, waits for more verdict requests to batch with the first
# (serving/driver.py): a custom function's concurrent calls arrive over milliseconds, and the HF
# engine decodes a whole verdict per step, so a request that misses a step waits a whole verdict.
GATHER_S = 0.02
PLACEHOLDERS = ("prompt", "response", "ground_truth", "data_source", "extra_info")


class JudgeContextError(RuntimeError):
    """A judge prompt does not fit the judge's context and reward.judge.truncation=error."""


def check_prompt(messages) -> None:
    """reward.judge.prompt: chat messages whose placeholders are ours; a ConfigError naming the key."""
    if not messages:
        raise ConfigError("reward.judge.prompt is empty: give the judge's chat messages")
    for i, m in enumerate(messages):
        if set(m) - {"role", "content"} or "role" not in m or "content" not in m:
            raise ConfigError(f"reward.judge.prompt[{i}]: expected {{role, content}}, got keys {sorted(m)}")
        try:
            fields = [name for _, name, _, _ in string.Formatter().parse(m["content"]) if name is not None]
        except ValueError as e:
            raise ConfigError(f"reward.judge.prompt[{i}].content: {e} (a literal brace is written twice)") from None
        for name in fields:
            root = name.split("[", 1)[0].split(".", 1)[0]
            if root not in PLACEHOLDERS:
                raise ConfigError(f"reward.judge.prompt[{i}].content: unknown placeholder {{{name}}}; expected "
                                  f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)} (a literal brace is written twice)")


def check_tokenizer(cfg, tokenizer) -> None:
    """What reward.judge asks of the judge's tokenizer: a chat template, and for yes_no its yes and
    no each one token."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"reward.judge.path={cfg.path!r}: its tokenizer has no chat template to render "
                          "reward.judge.prompt with (set one in its tokenizer_config.json)")
    if cfg.verdict == "yes_no":
        for key in ("yes", "no"):
            if cfg[key] in ("True", "False"):  # the schema's str of a bool: YAML's yes/no/on/off
                raise ConfigError(f"reward.judge.{key}={cfg[key]}: YAML and the command line read yes, no, on and off "
                                  f"as booleans; quote the token, e.g. reward.judge.{key}='\"Yes\"'")
            ids = tokenizer.encode(cfg[key], add_special_tokens=False)
            if len(ids) != 1:
                raise ConfigError(f"reward.judge.{key}={cfg[key]!r} is {len(ids)} tokens of the judge's tokenizer; "
                                  "verdict=yes_no reads one token's probability")


def footprint_bytes(cfg, dtype: torch.dtype) -> tuple[int, int]:
    """(weights, KV cache) a judge of reward.judge takes on its rank, in bytes: its parameters in
    `dtype` (counted from its checkpoint's safetensors headers, no tensor read) and a KV cache for
    reward.judge.max_num_seqs verdicts at the judge's whole context (what the HF engine's batch holds
    at most: a key and a value per layer, KV head and position)."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(cfg.path, "*.safetensors")))
    if files:
        count = 0
        for path in files:
            with safe_open(path, "pt") as f:
                for name in f.keys():
                    count += math.prod(f.get_slice(name).get_shape())
    else:  # .bin checkpoints: their size on disk, read as fp32
        count = sum(os.path.getsize(p) for p in glob.glob(os.path.join(cfg.path, "*.bin"))) // 4
    size = torch.finfo(dtype).bits // 8
    config = text_config(cfg.path)
    heads = config.get("num_attention_heads", 1)
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
    kv_per_position = 2 * config.get("num_hidden_layers", 0) * config.get("num_key_value_heads", heads) * head_dim * size
    context = config.get("max_position_embeddings", 0)
    return count * size, kv_per_position * context * cfg.max_num_seqs


def text_config(path: str) -> dict:
    """A model folder's config.json as a dict; of a multimodal checkpoint, its language model's."""

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    return config.get("text_config", config)


def available_bytes(device: torch.device, ranks_on_host: int) -> int:
    """What a rank may take: its GPU's free memory, or on a CPU its share of the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:  # Linux's estimate of what can be taken without swapping
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return kib * 1024 // max(ranks_on_host, 1)


def check_fits(cfg, dtype: torch.dtype, device: torch.device, ranks_on_host: int) -> None:
    """The judge's footprint against what its rank has: a ConfigError of one line naming the keys.
    The HF engine: its weights and a KV cache for max_num_seqs verdicts at its context; vLLM: what its
    engine reserves."""
    weights, cache = footprint_bytes(cfg, dtype)
    have, gib = available_bytes(device, ranks_on_host), 2**30
    if cfg.engine == "vllm":
        # vLLM takes its share of the whole GPU on top of what is resident (weights and KV cache inside
        # it); on CPU, the weights and its explicit KV cache.
        if device.type == "cuda":
            need, what = cfg.gpu_memory_utilization * torch.cuda.get_device_properties(device).total_memory, \
                f"reward.judge.gpu_memory_utilization={cfg.gpu_memory_utilization} of the GPU"
        else:  # a rank of a tensor-parallel judge holds its share of the weights
            need, what = weights / cfg.tensor_model_parallel_size + cfg.kv_cache_memory_gb * gib, \
                f"reward.judge.path's weights and reward.judge.kv_cache_memory_gb={cfg.kv_cache_memory_gb}"
        if need > have:
            raise ConfigError(f"reward.judge does not fit: {what} make {need / gib:.1f} GiB, the rank has "
                              f"{have / gib:.1f} GiB free on {device}")
        return
    if weights + cache > have:
        raise ConfigError(
            f"reward.judge does not fit: reward.judge.path's weights ({weights / gib:.1f} GiB in {dtype}) and the KV "
            f"cache of reward.judge.max_num_seqs={cfg.max_num_seqs} verdicts at its context ({cache / gib:.1f} GiB) "
            f"need {(weights + cache) / gib:.1f} GiB, the rank has {have / gib:.1f} GiB free on {device}; lower "
            "max_num_seqs, take a smaller judge, or give it a pool of its own (placement.roles.reward)")


@dataclass
class Verdicts:
    """One sample's judging: its score, the first verdict's text, how many of its verdicts could not
    be read, its verdict tokens."""
    score: float
    text: str
    failures: int
    tokens: int


class Judge:
    def __init__(self, cfg, engine, tokenizer, verdict_fn: Callable | None = None, timeout_s: float = 300.0,
                 sleeps: bool = False):
        """`cfg`: reward.judge; `engine`: a stepwise rollout engine over the judge's model, sampling as
        cfg says; `verdict_fn`: reward.judge.verdict_fn's function (verdict=custom), each call bounded
        by `timeout_s` (reward.timeout_s); `sleeps`: `sleep` offloads the engine (a vLLM judge whose
        device a critic trains on)."""
        self.cfg, self.engine, self.tokenizer, self.verdict_fn = cfg, engine, tokenizer, verdict_fn
        self.timeout_s, self.sleeps = timeout_s, sleeps
        self.low, self.high = (float(x) for x in cfg.range)
        self.driver: EngineDriver | None = None  # the engine's owner once started (the server's, when serving)
        self.server = None
        self.sums: Counter = Counter()  # what pop_metrics reports
        self.engine_seen = (0, 0)  # the driver's requests and tokens at the last pop_metrics
        self.spans: list[tuple[int, int]] = []  # its measured scoring calls (time.time_ns), for the timeline

    # ---- its life

    def start(self, serve: bool, port: int = 0, peers=None) -> Judge:
        """Starts the engine's driver; `serve`: and the endpoint on 127.0.0.1:`port` (0: any free).
        `peers`: the gloo group of a tensor-parallel judge's ranks, which put every rank's requests
        into their engine together (serving/driver.py LockstepDriver): each rank scores its own rows
        and serves its own endpoint, and the engine runs them all."""
        if serve:
            from spmdsplit.serving import OpenAIServer

            sampling = JudgeSampling(self.cfg)
            self.server = OpenAIServer(self.engine, self.tokenizer, "judge", sampling, port=port,
                                       gather_s=GATHER_S, peers=peers).start()
            self.driver = self.server.driver  # one driver: the rows' verdicts and the endpoint's calls share steps
        else:
            self.driver = make_driver(self.engine, self.tokenizer, peers, name="spmdsplit-judge", gather_s=GATHER_S)
            self.driver.start()
        return self

    def sleep(self) -> None:
        """While the critic trains on this device: the engine free (its requests wait) and, where it
        sleeps, offloaded. Every rank of a tensor-parallel judge calls it at the same point."""
        if self.sleeps:
            self.driver.pause()
            self.engine.offload()

    def wake(self) -> None:
        if self.sleeps:
            self.engine.restore()
            self.driver.resume()

    @property
    def router_address(self) -> str | None:
        """verl's `reward_router_address`: "127.0.0.1:<port>" (an `openai` client's base_url is
        f"http://{address}/v1"); None without the endpoint."""
        return None if self.server is None else self.server.base_url.removeprefix("http://").removesuffix("/v1")

    def close(self) -> None:
        if self.server is not None or self.driver is not None:
            (self.server or self.driver).stop()

    # ---- scoring

    def score(self, samples: list[Sample], measure: bool = True) -> tuple[list[Scored], list[str]]:
        """Each sample's Scored (extras: rule_score with reward.judge.log_rule_score) and its first
        verdict's text (yes_no: the probability, written); `measure`: counted in `pop_metrics`."""
        start = time.time_ns()
        fitted = [self.prompt_ids(s) for s in samples]
        prompts = [ids for ids, _ in fitted]
        judged = self._yes_no(prompts) if self.cfg.verdict == "yes_no" else self._generate(prompts, samples)
        end = time.time_ns()
        wall = (end - start) / 1e9
        tokens = sum(j.tokens for j in judged)
        if measure:
            self.spans.append((start, end))
            self.sums.update({"calls": 1, "latency_s": wall, "verdicts": len(judged) * self.cfg.n, "verdict_tokens": tokens,
                              "parse_failures": sum(j.failures for j in judged), "truncated": sum(c for _, c in fitted),
                              "tokens_per_s": tokens / max(wall, 1e-9)})
        scored = [Scored(j.score, self._rule_extras(s)) for j, s in zip(judged, samples)]
        return scored, [j.text for j in judged]

    def prompt_ids(self, sample: Sample) -> tuple[list[int], bool]:
        """The sample's judge prompt as token ids, fitted to the judge's context (reward.judge.truncation),
        and whether its response was cut to fit."""
        room = self.driver.max_model_len - (0 if self.cfg.verdict == "yes_no" else self.cfg.max_tokens)
        response = sample.solution_str
        for _ in range(4):  # a cut response may tokenize a little differently in its context: fit again
            ids = render_chat(self.messages(sample, response), self.tokenizer)
            over = len(ids) - room
            if over <= 0:
                return ids, response is not sample.solution_str
            response_ids = self.tokenizer.encode(response, add_special_tokens=False)
            if self.cfg.truncation == "error" or over >= len(response_ids):
                cut = "" if self.cfg.truncation == "error" else " even without its response"
                raise JudgeContextError(
                    f"reward.judge: a judge prompt of {len(ids)} tokens{cut} leaves less than "
                    f"{'no' if self.cfg.verdict == 'yes_no' else f'reward.judge.max_tokens={self.cfg.max_tokens}'} "
                    f"room in the judge's context of {self.driver.max_model_len} tokens (data_source "
                    f"{sample.data_source!r}); reward.judge.truncation=left|right cuts the response to fit")
            kept = response_ids[over:] if self.cfg.truncation == "left" else response_ids[:-over]
            response = self.tokenizer.decode(kept)
        raise JudgeContextError("reward.judge: a judge prompt could not be cut to fit the judge's context")

    def messages(self, sample: Sample, response: str) -> list[dict]:
        fields = dict(prompt=sample.prompt_str, response=response, ground_truth=sample.ground_truth,
                      data_source=sample.data_source, extra_info=sample.extra_info if sample.extra_info is not None else {})
        return [{"role": m["role"], "content": m["content"].format_map(fields)} for m in self.cfg.prompt]

    def _generate(self, prompts: list[list[int]], samples: list[Sample]) -> list[Verdicts]:
        n = self.cfg.n
        futures = [self.driver.submit(ids, self.cfg.max_tokens) for ids in prompts for _ in range(n)]
        completions = [f.result() for f in futures]
        out = []
        for i, sample in enumerate(samples):
            texts = [c.text for c in completions[i * n:(i + 1) * n]]
            scores = [self.read(text, sample) for text in texts]
            failures = sum(s is None for s in scores)
            values = [self.cfg.on_parse_error if s is None else s for s in scores]
            out.append(Verdicts(sum(values) / n, texts[0], failures,
                                sum(len(c.token_ids) for c in completions[i * n:(i + 1) * n])))
        return out

    def read(self, text: str, sample: Sample) -> float | None:
        """A verdict's score, or None when it cannot be read: by the built-in parser, or by the user's
        verdict function, which is contained (what it raises, an overrun of timeout_s, a result that is
        not a score: the verdict cannot be read, and is counted so)."""
        if self.cfg.verdict != "custom":
            try:
                return verdicts.parse(text, self.cfg.verdict, self.low, self.high, self.cfg.tag)
            except verdicts.NoVerdict:
                return None
        try:
            result = call_within(self.timeout_s, self.verdict_fn, text=text, data_source=sample.data_source,
                                 ground_truth=sample.ground_truth, extra_info=sample.extra_info)
            return normalize_result(result, sample.data_source, text, sample.ground_truth)[0]
        except Exception:  # noqa: BLE001 - the user's function's fault, contained and counted
            return None

    @torch.no_grad()
    def _yes_no(self, prompts: list[list[int]]) -> list[Verdicts]:
        """p(yes) / (p(yes) + p(no)) at the position after each prompt: one forward pass per batch
        of prompts, left-padded, with the engine's driver paused (its model is the engine's)."""
        model = self.engine.model
        yes, no = (self.tokenizer.encode(self.cfg[k], add_special_tokens=False)[0] for k in ("yes", "no"))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out = []
        self.driver.pause()
        try:
            for start in range(0, len(prompts), self.cfg.max_num_seqs):
                rows = prompts[start:start + self.cfg.max_num_seqs]
                width = max(len(r) for r in rows)
                ids = torch.full((len(rows), width), pad, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for i, r in enumerate(rows):
                    ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
                positions = (mask.cumsum(-1) - 1).clamp(min=0)
                logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                               position_ids=positions.to(model.device), use_cache=False).logits[:, -1].float()
                pairs = torch.log_softmax(logits, -1)[:, [yes, no]].cpu().tolist()
                for log_yes, log_no in pairs:
                    try:
                        p = verdicts.yes_probability(log_yes, log_no)
                        out.append(Verdicts(p, f"{p:.4f}", 0, 0))
                    except verdicts.NoVerdict:
                        out.append(Verdicts(self.cfg.on_parse_error, "", 1, 0))
        finally:
            self.driver.resume()
        return out

    def _rule_extras(self, sample: Sample) -> dict[str, float]:
        if not self.cfg.log_rule_score:
            return {}
        from spmdsplit.rewards import rule

        if rule.find_scorer(sample.data_source) is None:
            return {}
        try:
            score, _ = rule.normalize_result(rule.compute_score(sample.data_source, sample.solution_str,
                                                                sample.ground_truth, sample.extra_info))
        except Exception:  # noqa: BLE001 - a logged number only: a scorer that fails leaves it out
            return {}
        return {"rule_score": score}

    def pop_spans(self) -> list[tuple[int, int]]:
        """The (start, end) of each measured scoring call since the last pop (time.time_ns)."""
        spans, self.spans = self.spans, []
        return spans

    def pop_metrics(self) -> dict[str, tuple[float, float]]:
        """reward/judge/* since the last call, each as (sum, weight) for a pool-wide reduction: totals
        (weight None: the caller's) parse_failures, truncated, and the engine's requests and tokens
        (the rows' verdicts and the endpoint's calls together); means verdict_tokens per verdict,
        latency_s and tokens_per_s per scoring call of the rows' verdicts."""
        s, self.sums = self.sums, Counter()
        # The engine's own counts take in the endpoint's calls too (a custom function's).
        now = (self.driver.requests, self.driver.tokens)
        requests, tokens = (a - b for a, b in zip(now, self.engine_seen))
        self.engine_seen = now
        return {"parse_failures": (s["parse_failures"], None), "truncated": (s["truncated"], None),
                "engine_requests": (requests, None), "engine_tokens": (tokens, None),
                "verdict_tokens": (s["verdict_tokens"], s["verdicts"]),
                "latency_s": (s["latency_s"], s["calls"]), "tokens_per_s": (s["tokens_per_s"], s["calls"])}


def vllm_view(cfg):
    """The job's config as VLLMEngine reads it, for the judge's engine: rollout.* and data.* from
    reward.judge (its sampling, its context: the judge's max_position_embeddings, max_tokens of it for
    the verdict), its tensor parallel size and sleep, no LoRA."""

    from omegaconf import OmegaConf

    j = cfg.reward.judge
    context = text_config(j.path).get("max_position_embeddings", 4096)
    sampling = JudgeSampling(j)
    rollout = dict(temperature=sampling.temperature, top_p=j.top_p, top_k=j.top_k,
                   do_sample=sampling.do_sample, max_num_seqs=j.max_num_seqs,
                   tensor_model_parallel_size=j.tensor_model_parallel_size,
                   gpu_memory_utilization=j.gpu_memory_utilization, kv_cache_memory_gb=j.kv_cache_memory_gb,
                   free_cache_engine=j.free_cache_engine, enable_prefix_caching=False)
    return OmegaConf.merge(cfg, {"rollout": rollout, "model": {"lora_rank": 0},
                                 "data": {"max_prompt_length": context - j.max_tokens, "max_response_length": j.max_tokens}})


def checkpoint_tensors(path: str):
    """The (name, tensor) pairs of a checkpoint folder's safetensors files, one file at a time."""

    from safetensors import safe_open

    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class JudgeSampling:
    """The judge's sampling as the engines and the server read it (rollout.*'s names)."""

    def __init__(self, cfg):
        self.do_sample = cfg.temperature > 0
        self.temperature = cfg.temperature if self.do_sample else 0.0
        self.top_p, self.top_k = cfg.top_p, cfg.top_k
        self.hf_step_tokens = cfg.max_tokens  # the HF engine decodes a whole verdict in one step
        self.max_num_seqs = cfg.max_num_seqs


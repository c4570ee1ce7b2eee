"""The LM head and what a role computes from its logits (log-probs, entropy), a chunk of tokens at
a time, forward and backward: no [tokens, vocab] tensor larger than one chunk exists.

At Qwen's 152k vocabulary the logits of a 16k-token micro-batch are ~5 GB in bf16, and as much
again for their gradient. Here the head runs *inside* the model's forward, as transformers calls
it, so that the engines' parameter handling applies unchanged: for one forward the output
embedding's `forward` (an instance attribute, the module itself stays in place: no state-dict
name, checkpoint or weight-stream name changes, tied embeddings stay tied) computes, from the
hidden states at the kept positions, the role's head chunk by chunk, each chunk's logits and head
under `torch.utils.checkpoint` so the backward recomputes them one chunk at a time.

Why that is enough for the sharded engines (read in torch 2.13 and DeepSpeed 0.19's sources):
- FSDP2 (`fully_shard`): the head and embeddings belong to the root's group, unsharded in the
  root's pre-forward and, for the root, not resharded after the forward (`_lazy_init` sets the
  root group's `post_forward_mesh_info` to None), so the recompute in the backward finds the
  whole weight in the module's attribute, where FSDP2 put it.
- DeepSpeed ZeRO-3: the module's own hooks gather its weight before our forward and release it
  after, once per forward as without chunking; in the backward, its pre-backward function on our
  output (registered by the forward hook) gathers the weight again before any chunk's backward
  recomputes, and the post-backward function on the hidden states (the module's input) releases
  it after the last. The recompute calls the module's forward without hooks (no extra gather).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

# Config keys of models whose forward changes the head's output before returning it as the logits:
# Gemma 2/3/3n/4's soft-capping, Cohere's logit_scale, Granite's logits_scaling. Their head cannot
# be replaced by the role's; their logits are computed whole, only the role's head in chunks.
_CHANGES_HEAD_OUTPUT = ("final_logit_softcapping", "logit_scale", "logits_scaling")


# A chunk's logits: at most this many (128 MB in fp32), whatever actor.logits_chunk_size asks. The
# update's backward recomputes a chunk and holds about five fp32 tensors of its logits' size at once
# (the head's output, scaled, log-softmax, softmax, their gradients): at Qwen's 152k vocabulary
# 512 tokens made an actor rank's peak 1.39 GB higher than the same job's at a 4k vocabulary, 1.14 GB
# of it such tensors alive together in the update (tests/jobs/logits_watch.py, 8 x 256 tokens).
# Capped, 220 tokens there; below a 64k vocabulary the requested chunk stands.
CHUNK_LOGITS = 1 << 25


def chunk_tokens(requested: int, module: torch.nn.Module) -> int:
    """The tokens of a chunk for `module` (a transformers causal LM): `requested`, fewer where its
    vocabulary would make a chunk's logits more than CHUNK_LOGITS."""
    config = module.config.get_text_config() if hasattr(module.config, "get_text_config") else module.config
    return max(1, min(requested, CHUNK_LOGITS // config.vocab_size))


def head_runs_in_chunks(module: torch.nn.Module) -> bool:
    """Whether `module` (a transformers causal LM) can have its output embedding replaced by the
    role's head for one forward: it has one, and its config sets none of the keys above."""
    config = module.config
    configs = (config, config.get_text_config()) if hasattr(config, "get_text_config") else (config,)
    changes = any(getattr(c, key, None) is not None for c in configs for key in _CHANGES_HEAD_OUTPUT)
    return not changes and module.get_output_embeddings() is not None


def in_chunks(fn: Callable, head: Callable, inputs: torch.Tensor, tokens: torch.Tensor, chunk: int):
    """head(fn(inputs), tokens) for inputs [..., N, D] and tokens [..., N], `chunk` positions at a
    time (flattened in order), each chunk checkpointed when grad is on: its fn and head run again
    in the backward instead of keeping their intermediates. Returns head's outputs (a tensor
    [..., N] or a tuple of them, Nones kept), chunks joined back."""
    lead = tokens.shape
    flat_inputs, flat_tokens = inputs.reshape(-1, inputs.shape[-1]), tokens.reshape(-1)
    returns_tuple = []  # what head returned, seen in its first call

    def one(part, part_tokens):
        out = head(fn(part), part_tokens)
        returns_tuple.append(isinstance(out, tuple))
        return out if isinstance(out, tuple) else (out,)

    parts = []
    for start in range(0, max(flat_tokens.numel(), 1), chunk):
        args = flat_inputs[start:start + chunk], flat_tokens[start:start + chunk]
        parts.append(checkpoint(one, *args, use_reentrant=False) if torch.is_grad_enabled() else one(*args))
    joined = tuple(None if outs[0] is None else torch.cat(outs).reshape(lead) for outs in zip(*parts))
    return joined if returns_tuple[0] else joined[0]


class HeadInChunks:
    """For one forward of `module` (a transformers causal LM, `head_runs_in_chunks`): its output
    embedding computes `in_chunks(its own forward, head, hidden[..., positions, :], tokens, chunk)`
    from the hidden states it is given (those at the kept positions, `logits_to_keep`; `positions`
    of them predict the N `tokens`), and returns the head's outputs stacked [..., N, k] where the
    model puts its logits. `outputs(out.logits)` then gives them back as `head` returned them.

        with HeadInChunks(module, head, tokens, chunk, positions) as chunked:
            outputs = chunked.outputs(model(..., logits_to_keep=...).logits)
    """

    def __init__(self, module: torch.nn.Module, head: Callable, tokens: torch.Tensor, chunk: int, positions: slice):
        self.lm_head = module.get_output_embeddings()
        self.model_name = type(module).__name__
        self.head, self.tokens, self.chunk, self.positions = head, tokens, chunk, positions
        self.stacked = None

    def __enter__(self):
        # An instance `forward` someone set before (accelerate's hooks) is kept and called per chunk.
        self.own_forward = self.lm_head.__dict__.get("forward")
        original = self.lm_head.forward

        def forward(hidden):
            outputs = in_chunks(original, self.head, hidden[..., self.positions, :], self.tokens, self.chunk)
            # which outputs are None, or None when head returned one tensor
            self.nones = [o is None for o in outputs] if isinstance(outputs, tuple) else None
            kept = [o for o in outputs if o is not None] if isinstance(outputs, tuple) else [outputs]
            self.with_grad = [o.requires_grad for o in kept]
            self.stacked = torch.stack(kept, -1)
            self.version = None if self.stacked.is_inference() else self.stacked._version
            return self.stacked

        self.lm_head.forward = forward
        return self

    def __exit__(self, *exc):
        if self.own_forward is None:
            del self.lm_head.forward
        else:
            self.lm_head.forward = self.own_forward

    def outputs(self, logits: torch.Tensor):
        """The head's outputs from the model's `logits`, which must be what the output embedding
        returned, untouched (an engine's hook may hand on a view of it: DeepSpeed's does)."""
        stacked = self.stacked
        untouched = (stacked is not None and logits.shape == stacked.shape and logits.data_ptr() == stacked.data_ptr()
                     and (self.version is None or logits._version == self.version))
        if not untouched:
            raise RuntimeError(f"{self.model_name} changes its LM head's output before returning the logits (or "
                               "does not call its output embedding), so the head cannot run in chunks: set "
                               "actor.logits_chunk_size=0")
        # An output without a graph (entropy for logging only) stays without one once unstacked.
        columns = iter(c if grad else c.detach() for c, grad in zip(logits.unbind(-1), self.with_grad))
        if self.nones is None:
            return next(columns)
        return tuple(None if none else next(columns) for none in self.nones)

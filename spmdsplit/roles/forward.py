"""The forward over a batch of rows that the actor, the critic and the reward model share: the
model run on the prompts and responses (trimmed to the micro-batch's extent, or packed without
padding), its head applied at the positions that predict response tokens."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from spmdsplit.attention import VARLEN
from spmdsplit.batch import Batch
from spmdsplit.roles.lm_head import HeadInChunks, chunk_tokens, head_runs_in_chunks, in_chunks
from spmdsplit.roles.micro_batches import Extent, extent_of, row_shapes

# head(logits [..., N, V], tokens [..., N]) -> a tensor [..., N], or a tuple of them (None allowed):
# what a role computes from the model's output at the N positions that predict response tokens.
Head = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | tuple"]


def forward_response(model, micro: Batch, head: Head, remove_padding: bool = False, response_only: bool = False,
                     extent: Extent | None = None, chunk: int = 0):
    """`head` of the model's output at the positions that *predict* each response token (one to
    the left), as [b, R] per output of `head`: column t scores response token t (its log-prob, or
    the value of the state before it), 0 past each response.

    Padded (default): the micro-batch trimmed to its own widest row (prompt columns that are
    padding in every row dropped, response columns past its longest response too; the result is
    the same, causal attention never looks right and masked keys weigh nothing), then the
    outputs put back at the full width R. remove_padding: every row's valid tokens packed into one
    sequence (`_packed_forward`).

    response_only: compute the model's head only at the positions `head` reads (transformers'
    `logits_to_keep`), not on the prompt's: at a 152k vocabulary the LM head's output is the
    largest tensor of the forward. Causal LMs take it; the critic's token-classification head
    does not (and its one-wide output is small), so it leaves it off.

    chunk (with response_only): the LM head and `head` run `chunk` response positions at a time,
    each chunk recomputed in the backward (`_response_head`): no [tokens, vocab] tensor larger
    than one chunk. 0: the logits of the whole micro-batch at once.

    extent: where the micro-batch's tokens begin and end, known on the host from its plan
    (roles/micro_batches.py), so that the forward reads nothing back from the device; None: read
    here, once (a caller without a plan).
    """
    response_mask = micro["response_mask"].bool()
    extent = extent_of(row_shapes(micro)) if extent is None else extent
    forward = _packed_forward if remove_padding else _trimmed_forward
    outputs = forward(model, micro, head, response_only, extent, chunk)
    return _each(lambda out: torch.where(response_mask, out, 0), outputs)


def _each(fn, outputs):
    """fn applied to each of a head's outputs (one tensor, or a tuple with Nones kept)."""
    if isinstance(outputs, tuple):
        return tuple(None if out is None else fn(out) for out in outputs)
    return fn(outputs)


def _trimmed_forward(model, micro: Batch, head: Head, response_only: bool, extent: Extent, chunk: int):
    mask = micro["attention_mask"]
    R = micro["responses"].shape[1]
    P = mask.shape[1] - R
    # From the first column some row's prompt uses (a prompt has at least one real token) to the
    # last response column the longest response of this micro-batch fills (at least one).
    width = extent.width
    cols = slice(extent.first, P + width)
    inputs = dict(input_ids=micro["input_ids"][:, cols], attention_mask=mask[:, cols],
                  position_ids=micro["position_ids"][:, cols], use_cache=False)
    tokens = micro["responses"][:, :width]
    if response_only:  # the last kept position predicts past the response
        outputs = _response_head(model, {**inputs, "logits_to_keep": width + 1}, head, tokens, chunk,
                                 slice(-width - 1, -1))
    else:
        outputs = head(model(**inputs).logits[:, -width - 1 : -1], tokens)
    return _each(lambda x: torch.nn.functional.pad(x, (0, R - width)), outputs)  # back to full width


def _packed_forward(model, micro: Batch, head: Head, response_only: bool, extent: Extent, chunk: int):
    """The micro-batch's valid tokens as one sequence [1, T], position ids restarting at each row.

    What keeps the rows apart depends on the attention kernel (`packed_attention_kwargs`).
    FlashAttention-2 and varlen (spmdsplit/attention.py, torch's own varlen kernel on cuda): the
    rows' boundaries, `cu_seq_lens_q/k` and `max_length_q/k`, computed once here and passed down
    to every layer, and attention_mask=None. (Given only the position ids,
    transformers 5 would derive them again in every layer: `_flash_attention_forward` checks
    `_is_packed_sequence` and calls `prepare_fa_kwargs_from_position_ids`, a nonzero and a max on
    the device each, and the varlen kernel's int max_seqlen then costs a host sync per layer.)
    sdpa and eager get an explicit block-causal 4-D float mask, which transformers passes through.
    (transformers 5.19 also finds packed rows from restarting position ids by itself, but only
    with no cache: with use_cache on, rows see each other, 0.24 off on the embedded model, and a
    remote-code model may not look at all; the explicit mask holds either way.) It takes
    O(T^2) memory and computes every score between two rows: varlen, the default, needs neither.

    The token counts come from the extent, on the host: `nonzero_static` and indexing by its
    positions select what `tensor[mask]` and `nonzero()` select, without the device-to-host read
    of the count that sizes their output (torch runs `nonzero` on CUDA as a count, a copy of it
    to the host and a wait, then the fill; `nonzero_static` has a CUDA kernel of its own).
    """
    mask = micro["attention_mask"].bool()
    R = micro["responses"].shape[1]
    P = mask.shape[1] - R
    b = mask.shape[0]
    valid = mask.flatten().nonzero_static(size=sum(extent.lengths)).squeeze(1)  # row by row, in order
    input_ids = micro["input_ids"].flatten()[valid][None]
    position_ids = micro["position_ids"].flatten()[valid][None]
    # Where each valid (row, column) lands in the packed sequence; a response token is predicted
    # by the token before it in the packed sequence, its row's previous valid token (the prompt
    # has at least one).
    packed_index = (mask.flatten().cumsum(0) - 1).view(mask.shape)
    rows, cols = mask[:, P:].nonzero_static(size=extent.response_tokens).unbind(1)
    predictors = packed_index[:, P:][rows, cols] - 1
    inputs = dict(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                  **packed_attention_kwargs(model, mask.sum(1), extent.lengths))
    tokens = micro["responses"][rows, cols][None]
    if response_only:
        outputs = _response_head(model, {**inputs, "logits_to_keep": predictors}, head, tokens, chunk, slice(None))
    else:
        outputs = head(model(**inputs).logits[:, predictors], tokens)
    # Each [1, N] output to its (row, column) of a zero [b, R] (differentiable).
    return _each(lambda x: x.new_zeros(b, R).index_put((rows, cols), x[0]), outputs)


def _response_head(model, inputs: dict, head: Head, tokens: torch.Tensor, chunk: int, positions: slice):
    """`head` of the logits at the positions that predict `tokens` ([b, N]): `positions` of those
    `inputs`' logits_to_keep keeps. chunk 0: the model's logits whole. Otherwise `chunk`
    positions at a time, checkpointed (roles/lm_head.py): the LM head itself in chunks, inside
    the model's forward, where the model hands its head's output on untouched; else (soft-capped
    logits, `head_runs_in_chunks`) the logits whole and only `head` in chunks."""
    if not chunk:
        return head(model(**inputs).logits[:, positions], tokens)
    module = _module(model)
    chunk = chunk_tokens(chunk, module)
    if not head_runs_in_chunks(module):
        logits = model(**inputs).logits
        # The other kept positions score token 0, then are dropped: the logits go to in_chunks
        # whole, where a slice of them would be copied to flatten it.
        padded = tokens.new_zeros(logits.shape[:-1])
        padded[:, positions] = tokens
        return _each(lambda out: out[:, positions], in_chunks(lambda x: x, head, logits, padded, chunk))
    with HeadInChunks(module, head, tokens, chunk, positions) as chunked:
        return chunked.outputs(model(**inputs).logits)


def packed_attention_kwargs(model, lengths: torch.Tensor, host_lengths: Sequence[int]) -> dict:
    """The model's keyword arguments that keep rows of these lengths apart once packed into one
    sequence (see `_packed_forward`): under FlashAttention-2 and spmdsplit's varlen kernel
    (spmdsplit/attention.py) no mask and the rows' boundaries (`flash_varlen_kwargs`); under sdpa
    or eager a block-causal mask. `host_lengths`: the same lengths on the host, for the sizes (no
    read of the device)."""
    kernel = str(_config(model)._attn_implementation)
    if kernel.startswith("flash_attention") or kernel == VARLEN:
        return {"attention_mask": None, **flash_varlen_kwargs(lengths, max(host_lengths))}
    return {"attention_mask": block_causal_mask(lengths, _compute_dtype(model), sum(host_lengths))}


def flash_varlen_kwargs(lengths: torch.Tensor, longest: int | None = None) -> dict:
    """What transformers' FlashAttention path takes for packed rows of these lengths instead of
    deriving it from the position ids in every layer: `cu_seq_lens_q/k`, each row's start and the
    end ([b + 1] int32, on the lengths' device, as the varlen kernel wants), and `max_length_q/k`,
    the longest row as a Python int (the kernel takes an int: `longest`, known on the host, or
    else read from the lengths, once, instead of once per layer). Queries and keys are the same
    tokens, so q and k share both."""
    starts = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    longest = int(lengths.max()) if longest is None else longest
    return {"cu_seq_lens_q": starts, "cu_seq_lens_k": starts, "max_length_q": longest, "max_length_k": longest}


def block_causal_mask(lengths: torch.Tensor, dtype: torch.dtype, total: int | None = None) -> torch.Tensor:
    """[1, 1, T, T] additive mask for rows of these lengths packed one after another: 0 where a
    token may attend (same row, not later), the dtype's minimum elsewhere. `total`: T when the
    host knows it (else `repeat_interleave` reads it from the device)."""
    row = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths, output_size=total)
    position = torch.arange(len(row), device=lengths.device)
    allowed = (row[:, None] == row[None, :]) & (position[None, :] <= position[:, None])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=lengths.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def _module(model) -> torch.nn.Module:
    """The model itself, whether given bare or as the engine around it."""
    return model if isinstance(model, torch.nn.Module) else model.model


def _config(model):
    return _module(model).config


def _compute_dtype(model) -> torch.dtype:
    """The dtype the attention computes in (an engine's mixed-precision dtype, or the weights')."""
    dtype = getattr(model, "compute_dtype", None)
    return dtype if dtype is not None else next(_module(model).parameters()).dtype

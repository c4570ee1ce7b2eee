"""`varlen`: the attention kernel spmdsplit registers with transformers for packed micro-batches
without the flash-attn package. A packed pass (roles/forward.py `_packed_forward`) hands every
layer the rows' boundaries (`cu_seq_lens_q/k`, `max_length_q/k`, as FlashAttention-2 takes them)
and no mask; each row then attends only to itself, so no [T, T] mask is built and no score
between two rows is computed. Any other call (a padded batch, a single sequence, generation with
a cache) is transformers' own sdpa, with the mask transformers builds for it.

Where the rows are attended:
  * on cuda, in fp16/bf16, where torch has it: PyTorch's own variable-length kernel,
    `torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 built into torch: the same kernel
    as flash_attention_2, without the package). Its signature moved between releases (torch 2.10:
    `is_causal=`; 2.11 on: `window_size=(-1, 0)` for causal, then `scale=` and `enable_gqa=`),
    so the keywords are read from the function itself;
  * elsewhere (CPU; a torch without it; fp32): one `scaled_dot_product_attention` per row, causal
    and mask-free, on the rows' own tokens. On 2 CPU cores, forward and backward of the long-tail
    bench's attention shape (4 heads of 64, 1 KV head) took 2.5 ms against 8.0 ms with the dense
    block-causal mask at 512 packed tokens, 6.6 vs 35 ms at 1024, 1.8 vs 4.4 ms for 32 rows of
    ~10 tokens (docs/performance.md). torch's flex_attention with a document mask is no
    alternative here: on CPU it has no backward (torch 2.13 refuses it), and its forward took
    3.2 ms after a 22 s compile.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

VARLEN = "varlen"  # the name under transformers' AttentionInterface, and model.attn_implementation's value


def register() -> str:
    """Makes `VARLEN` a valid `attn_implementation` for transformers (before a model is built
    with it: from_pretrained / from_config check the name against the registered ones). Its mask
    entry: sdpa's mask where the model is given a 2-D padding mask, none otherwise (with no mask
    and restarting position ids transformers would build a [T, T] block-causal one)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if VARLEN not in AttentionInterface._global_mapping:  # once per process
        AttentionInterface.register(VARLEN, varlen_attention_forward)
        AttentionMaskInterface.register(VARLEN, _padding_mask_only)
    return VARLEN


def _padding_mask_only(*, attention_mask=None, **kwargs):
    from transformers.masking_utils import sdpa_mask

    return None if attention_mask is None else sdpa_mask(attention_mask=attention_mask, **kwargs)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' attention function contract: query [1, H, T, D], key and value [1, Hkv, T, D]
    (grouped-query heads not repeated: Hkv divides H), `scaling` the model's softmax scale, and
    the packed rows' boundaries in kwargs; returns ([1, T, H, D], None)."""
    starts = kwargs.get("cu_seq_lens_q")
    if starts is None:  # not a packed pass
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, sliding_window=sliding_window, **kwargs)
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError("varlen attention: a packed pass is one sequence [1, T] with its rows' boundaries, no mask")
    if dropout:  # torch's varlen kernel fixes dropout at 0; spmdsplit's models run without (models._no_dropout)
        raise ValueError(f"varlen attention: dropout {dropout} in training; set the model's attention_dropout to 0")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"varlen attention: {name} (use model.attn_implementation=sdpa)")
    causal = module.is_causal if is_causal is None else is_causal
    longest = kwargs["max_length_q"]
    if _kernel_runs(query):
        # The kernel's layout: [T, heads, D] with the head dim innermost (transformers' flash
        # path makes the same contiguous copy).
        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
        return torch_varlen(q, k, v, starts, longest, scaling, causal, sliding_window)[None], None
    out = rows_one_by_one(query, key, value, starts, scaling, causal, sliding_window)
    return out.transpose(1, 2).contiguous(), None


def _kernel_runs(query: torch.Tensor) -> bool:
    """torch's varlen kernel is FlashAttention-2's: CUDA, half precision."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and _torch_varlen() is not None


@functools.cache
def _torch_varlen():
    """torch's `varlen_attn` and the names of its parameters, or None where this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def torch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, longest: int,
                 scale: float | None, causal: bool, window: int | None) -> torch.Tensor:
    """torch's `varlen_attn` on packed rows: q [T, H, D], k and v [T, Hkv, D], `starts` the rows'
    cumulative boundaries [b + 1] (int32), `longest` the longest row (a Python int: the kernel
    sizes its grid by it). Returns [T, H, D]. What a keyword this torch lacks would have done is
    done around the call instead."""
    varlen_attn, params = _torch_varlen()
    extra = {}
    if "window_size" in params:  # (-1, 0): causal; (W - 1, 0): causal within a sliding window of W
        extra["window_size"] = (-1 if window is None else window - 1, 0 if causal else -1)
    elif window is not None:
        raise NotImplementedError(f"varlen attention: a sliding window needs torch >= 2.11 (torch {torch.__version__})")
    else:
        extra["is_causal"] = causal
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and "enable_gqa" in params:
        extra["enable_gqa"] = True
    elif groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    if "scale" in params:
        extra["scale"] = scale
    elif scale is not None:  # the kernel's own scale is D^-0.5: the difference goes into q
        q = q * (scale * q.shape[-1] ** 0.5)
    return varlen_attn(q, k, v, starts, starts, longest, longest, **extra)


def rows_one_by_one(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: torch.Tensor,
                    scale: float | None, causal: bool, window: int | None) -> torch.Tensor:
    """The packed rows attended one at a time, each on its own tokens (query [1, H, T, D], key and
    value [1, Hkv, T, D]; returns [1, H, T, D]): sdpa's causal kernel with no mask, unless a
    sliding window shorter than the row needs the row's own band. Reads the boundaries on the
    host (free on CPU; a device sync per layer on cuda, where torch_varlen runs instead)."""
    lengths = starts.diff().tolist()
    gqa = key.shape[1] != query.shape[1]
    out = []
    for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2)):
        n = q.shape[2]
        band = None
        if window is not None and window < n:
            band = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(-(window - 1))
            band = band.tril() if causal else band.tril(window - 1)
        out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=band, is_causal=causal and band is None,
                                                  scale=scale, enable_gqa=gqa))
    return torch.cat(out, 2)

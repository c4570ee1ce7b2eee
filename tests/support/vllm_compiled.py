"""Imported by the vLLM tests' warm server (tests/support/launch.py) after vLLM itself: compiles, once,
the one function vLLM 0.32 runs through torch.compile on our sampling path, so that every engine the
tests fork from the server finds it compiled instead of compiling it again (~3 s of a core each).

`vllm.v1.sample.ops.logprobs.batched_count_greater_than` (the sampled token's rank, computed with
every log-prob request: Sampler.gather_logprobs) is decorated with torch.compile (Inductor on CPU);
Dynamo keeps the compiled code with the function's code object, and a forked process inherits it.
Called as the sampler calls it (dim 0 marked unbacked) at two vocabulary sizes, dim 1 becomes dynamic
too (Dynamo's automatic dynamic shapes on the second size), so the one graph serves every test model.
A process that compiles it itself gets the same function: this changes when it is compiled, not what runs.
"""

import torch
import torch._inductor.config
from vllm.v1.sample.ops.logprobs import batched_count_greater_than

torch._inductor.config.compile_threads = 1  # no compile worker pool in a process that forks ranks

for vocab in (15, 40):
    logprobs = torch.randn(3, vocab)
    token_logprobs = logprobs[:, :1].clone()
    torch._dynamo.decorators.mark_unbacked(logprobs, 0)
    torch._dynamo.decorators.mark_unbacked(token_logprobs, 0)
    batched_count_greater_than(logprobs, token_logprobs)

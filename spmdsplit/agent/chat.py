"""The tokens a multi-turn episode appends after a policy turn: the tool responses, rendered by
the model's own chat template, and whatever markup the template puts around them.

Token in, token out: the policy's tokens are kept as sampled and never decoded and re-encoded
(a re-tokenised turn can split differently, and its log-probs would then score tokens the
policy never chose). Only the new text is tokenised, once, from the template:

    end   = what the template writes after an assistant message's content (e.g. "<|im_end|>\\n")
    delta = what it adds for the tool messages and the next generation prompt

A turn that stopped on the EOS has written the start of `end` itself (the EOS is "<|im_end|>"):
only the rest of `end` is glue. A turn that stopped on a parser's stop token (compact format) or
that wrote no EOS gets all of `end`. `end` is rendered once; the tool messages are rendered for
each episode's turn (a template may lay out several responses together), about 0.15 ms each.
"""

from __future__ import annotations

from spmdsplit.serving.protocol import SENTINEL


class ToolChat:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("rollout.multi_turn needs a tokenizer with a chat template (tool messages are rendered "
                             "by it): use a chat model or set one on the tokenizer")
        convo = [{"role": "user", "content": "u"}, {"role": "assistant", "content": SENTINEL}]
        self.before_tools = self._render(convo, add_generation_prompt=False)
        self.end = self.before_tools[self.before_tools.rindex(SENTINEL) + len(SENTINEL):]
        self.convo = convo

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def tool_turn_ids(self, contents: list[str], turn_end: str, role: str = "tool") -> list[int]:
        """The tokens that follow a policy turn whose last token's text is `turn_end` ("" if it
        stopped without one): the rest of the assistant message's markup, one `role` message per
        content (tool responses; an environment's observation is a user message), and the
        generation prompt of the next assistant turn."""
        full = self._render(self.convo + [{"role": role, "content": c} for c in contents], add_generation_prompt=True)
        if full.startswith(self.before_tools):
            text = self.end + full[len(self.before_tools):]
        else:  # a template that renders earlier messages otherwise once more follow: the text after the content
            text = full[full.rindex(SENTINEL) + len(SENTINEL):]
        if turn_end and text.startswith(turn_end):
            text = text[len(turn_end):]
        return self.tokenizer.encode(text, add_special_tokens=False)

    def opening_ids(self, content: str) -> list[int]:
        """The tokens that open an environment's episode after its prompt, which was rendered
        without the generation prompt (data/parquet.render_prompt): the first observation as a
        user message ("": none) and the generation prompt of the first assistant turn."""
        user = self.convo[:1]
        before = self._render(user, add_generation_prompt=False)
        full = self._render(user + ([{"role": "user", "content": content}] if content else []), add_generation_prompt=True)
        if not full.startswith(before):
            raise ValueError("the chat template renders a conversation's first message differently once another "
                             "follows; environment episodes need a template that only appends")
        return self.tokenizer.encode(full[len(before):], add_special_tokens=False)

"""Structured output: JSON (any object, or one matching a JSON Schema) by constrained decoding with xgrammar.

The JSON is compact (no whitespace between its tokens, as vLLM's `disable_any_whitespace`): free
whitespace is where small models loop until `max_tokens` cuts the value off.

Each constrained sequence holds a grammar matcher. Before sampling, the tokens its grammar does not allow
next are masked out of its logits (the model's own logits stay as they are for logprobs); after, the sampled
token advances the matcher. A matcher that reaches the end of its grammar ends the sequence.
"""

from __future__ import annotations

import json
from typing import Any

from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rayapp.engine.sampling_params import StructuredOutput

# OpenAI's `json_object`: any JSON object.
ANY_OBJECT = '{"type": "object"}'


class Grammars:
    """Compiles each request's grammar (cached by xgrammar) for one tokenizer and vocabulary."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler: Any = None

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh matcher for `spec`; ValueError says what in the schema the grammar library refused."""
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info)
        schema = spec.json_schema if spec.json_schema is not None else ANY_OBJECT
        try:
            json.loads(schema)
            compiled = self._compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        except (ValueError, RuntimeError) as error:
            # xgrammar's messages start with its source location: keep what follows it.
            raise ValueError(f"the JSON schema cannot be used: {str(error).strip().split(': ', 1)[-1]}") from None
        return xgr.GrammarMatcher(compiled)


def constrain(logits: Tensor, matchers: list[Any]) -> Tensor:
    """`logits` ([B, V]) with the tokens each row's matcher (None: unconstrained) forbids next set to -inf;
    `logits` itself when no row is constrained, else a masked copy."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    import xgrammar as xgr

    masked = logits.clone()
    bitmask = xgr.allocate_token_bitmask(len(matchers), masked.shape[-1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(masked, bitmask.to(masked.device), indices=rows)
    return masked


def accept(matcher: Any, token_id: int) -> bool:
    """Advance `matcher` by the sampled token; True when its grammar is complete (the sequence ends)."""
    if not matcher.accept_token(token_id):
        raise RuntimeError(f"the grammar matcher refused token {token_id}, which its own mask allowed")
    return bool(matcher.is_terminated())

"""POST /tokenize and POST /detokenize, in vLLM's shapes: the engine's own tokenizer (and chat
template) without running the model, on the tokenizer thread. Refusals are 400s in OpenAI's error shape: both or neither
of ``prompt`` and ``messages``, a lone surrogate in the text, token ids outside the vocabulary.
"""
from __future__ import annotations

from tandem.server.chat import chat_token_ids
from tandem.server.errors import bad_request
from tandem.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from tandem.server.serving import ServingContext
from tandem.server.validation import check_text


async def tokenize(ctx: ServingContext, body: TokenizeRequest) -> TokenizeResponse:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt (a string) and messages (a chat)", "prompt")
    check_text(body)
    if body.prompt is not None:
        ctx.bounds.check_prompts(body.prompt)
    else:
        ctx.bounds.check_messages(body.messages)
    ctx.check_model(body.model)
    ctx.check_ready()
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        token_ids = await ctx.tokenize(_encode, body.prompt, add_special)
    else:
        token_ids = await chat_token_ids(ctx, body.messages, body.add_generation_prompt,
                                         bool(body.add_special_tokens), body.tools)
    strs = await ctx.tokenize(_token_strs, token_ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(token_ids), max_model_len=ctx.engine.max_model_len,
                            tokens=token_ids, token_strs=strs)


async def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> DetokenizeResponse:
    ctx.check_model(body.model)
    ctx.check_ready()
    vocab_size = min(ctx.engine.vocab_size, len(ctx.tokenizer))
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"tokens holds token ids {bad[:5]} outside the vocabulary [0, {vocab_size})",
                          "tokens")
    return DetokenizeResponse(prompt=await ctx.tokenize(_decode, body.tokens))


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _token_strs(tokenizer, token_ids: list[int]) -> list[str]:
    return tokenizer.convert_ids_to_tokens(token_ids)


def _decode(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids)

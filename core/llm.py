"""The offline API, shaped like vLLM's ``LLM`` so that users' scripts carry over::

    from tandem import LLM, SamplingParams
    llm = LLM(model="/path/to/hf-folder", max_num_seqs=32)
    for out in llm.generate(["Hello", "The capital of"], SamplingParams(temperature=0, max_tokens=32)):
        print(out.outputs[0].text)
    llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=32))
    llm.generate({"prompt": "Hello", "cache_salt": "tenant-1"})   # vLLM's prompt dict
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tandem.chat_template import apply_chat_template, content_text
from tandem.config import load_config
from tandem.engine import LLMEngine
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

PromptType = str | Sequence[int] | Mapping[str, Any]
"""A string, token ids, or vLLM's prompt dict: ``{"prompt": str}`` or ``{"prompt_token_ids":
[...]}``, with an optional ``"cache_salt"``."""


class LLM:
    """Loads a model and generates for batches of prompts with continuous batching.

    ``model`` is a local Hugging Face folder or llama.cpp GGUF file (None: the default model,
    ``tandem.models.default_model``); any other keyword overrides a config field by its
    name (``max_num_seqs=8``, ``num_kv_blocks=64``, ``dtype="float32"``, ``"engine.block_size"``…),
    on top of ``config_file`` (TOML) and ``TANDEM_*`` environment variables.
    """

    def __init__(self, model: str | None = None, *, config_file: str | None = None, **overrides: Any):
        if model is not None:
            overrides["model.path"] = model
        self.config = load_config(config_file, overrides)
        from tandem.models.default_model import resolve_model

        self.config.model.path, served_name = resolve_model(self.config.model.path)
        self.config.model.served_model_name = self.config.model.served_model_name or served_name
        self.engine = LLMEngine(self.config)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The params a prompt gets when none are given: ``SamplingParams()`` with the model's
        sampling defaults (generation_config.json; ``model.generation_config``), as vLLM's."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished RequestOutput per prompt, in input order.

        ``prompts``: a string, a list of token ids, a prompt dict (``PromptType``: its
        ``cache_salt`` keeps its prefix-cache blocks apart from other salts'), or a list of any of
        these. ``sampling_params``: one for all prompts or one per prompt; None: ``get_default_sampling_params()``. A prompt that can never be served raises ValueError
        before anything runs. A request the engine fails alone (see ``tandem.engine``) is
        returned finished with ``finish_reason`` "error" and its ``error`` message; an engine
        that cannot go on raises ``EngineDeadError``.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _as_params_list(sampling_params, len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        ids = []
        try:
            for (prompt, salt), p, prio in zip(prompt_list, params, priorities):
                ids.append(self.engine.add_request(prompt, p, priority=prio, cache_salt=salt))
        except BaseException:  # a refusal, or a plugin that raises: nothing stays queued
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        cache_salt: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate a reply to each conversation, as vLLM's ``LLM.chat``: ``messages`` is one
        conversation (a list of ``{"role", "content"}`` dicts, content a string or text parts)
        or a list of them; each goes through the tokenizer's chat template (with the assistant's
        generation prompt unless ``add_generation_prompt`` is false) and is generated for as by
        ``generate`` on its token ids (with ``cache_salt``, as the server's ``cache_salt``) —
        one output per conversation, in order. ValueError when the tokenizer has no chat
        template or a message is malformed."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [{"prompt_token_ids": apply_chat_template(tokenizer, [_turn(m) for m in conversation],
                                                            add_generation_prompt),
                    "cache_salt": cache_salt} for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="requests", unit="req")
        final_only, self.engine.final_outputs_only = self.engine.final_outputs_only, True
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            self.engine.final_outputs_only = final_only
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


def _turn(message: Mapping[str, Any]) -> dict[str, str]:
    if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
        raise ValueError(f"a chat message is a dict with 'role' and 'content' (got {message!r:.80})")
    return {"role": message["role"], "content": content_text(message["content"])}


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[tuple[str | list[int], str | None]]:
    """(text or token ids, cache salt) of each prompt."""
    if isinstance(prompts, (str, Mapping)):
        return [_prompt_and_salt(prompts)]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [(prompts, None)]
    return [_prompt_and_salt(p) for p in prompts]


def _prompt_and_salt(prompt: PromptType) -> tuple[str | list[int], str | None]:
    salt = None
    if isinstance(prompt, Mapping):
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("a prompt dict holds one of 'prompt' and 'prompt_token_ids', and "
                             f"optionally 'cache_salt' (got the keys {sorted(prompt)})")
        salt = prompt.get("cache_salt")
        prompt = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
    if not isinstance(prompt, str) and not all(isinstance(t, int) for t in prompt):
        raise ValueError("each prompt must be a string, a list of token ids or a prompt dict")
    return (prompt if isinstance(prompt, str) else list(prompt)), salt


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params

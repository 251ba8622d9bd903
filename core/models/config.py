"""The architecture of a checkpoint, parsed from its config.json by our own code.

transformers is only the file format and the test oracle: the engine never builds a transformers
config. Both spellings of config.json are read — transformers 4.x (``rope_theta``, ``rope_scaling``,
``torch_dtype``) and 5.x (``rope_parameters = {"rope_type", "rope_theta", ...}``, ``dtype``).

Also here: the shape of the instance's KV pool, which depends only on the architecture::

    pool[num_blocks, num_hidden_layers, 2 (K, V), block_size, num_key_value_heads, head_dim]
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """A RoPE frequency scaling. ``linear`` divides every inverse frequency by ``factor``;
    ``llama3`` divides the low frequencies by ``factor``, keeps the high ones and interpolates
    between ``original_max_position_embeddings / low_freq_factor`` and ``/ high_freq_factor``
    wavelengths. ``longrope`` (Phi-3) divides frequency ``i`` by ``short_factor[i]``, or by
    ``long_factor[i]`` for the tokens of a sequence past ``original_max_position_embeddings``
    (see tandem.models.rotary), and scales cos and sin by ``attention_factor``."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(slots=True, frozen=True)
class ModelArchConfig:
    """What the model code needs to know about a decoder-only checkpoint (Llama family)."""

    architectures: tuple[str, ...]
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    rotary_dim: int = 0
    """Leading dimensions of each head the rotary embedding turns (``partial_rotary_factor``);
    0 = all of ``head_dim``."""
    sliding_rope: tuple[float, RopeScaling | None] | None = None
    """(theta, scaling) of the sliding-window layers when they differ from the others (Gemma 3's
    local base frequency); None = every layer uses ``rope_theta``/``rope_scaling``."""
    query_pre_attn_scalar: float | None = None
    """Attention scale ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5`` (Gemma)."""
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_layers: tuple[bool, ...] = ()
    """Per layer, whether it applies the rotary embedding (SmolLM3's ``no_rope_layers``: 0 = no
    position encoding in that layer); empty = every layer does."""
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    """Granite's scalings: embeddings × embedding_multiplier, each block's output ×
    residual_multiplier before the residual add, attention scores × attention_multiplier (instead
    of head_dim ** -0.5), logits / logits_scaling."""
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization_config: dict[str, Any] = field(default_factory=dict)

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings

    def uses_rope(self, layer_idx: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer_idx]

    def sliding_window_for(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (None = full causal attention)."""
        if self.sliding_window is None or self.layer_types[layer_idx] != SLIDING_ATTENTION:
            return None
        return self.sliding_window

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> ModelArchConfig:
        """From the folder's config.json, or from the metadata of a GGUF file (``path`` ending
        in .gguf; ``tandem.models.gguf_config``)."""
        from tandem.models.gguf_file import is_gguf, read_gguf

        if is_gguf(path):
            from tandem.models.gguf_config import gguf_config_dict

            return cls.from_dict(gguf_config_dict(read_gguf(path)))
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} does not exist: not a Hugging Face model folder")
        return cls.from_dict(json.loads(config_file.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        rope_theta, rope_scaling, sliding_rope = _parse_rope(cfg)
        sliding_window = _sliding_window(cfg)
        return cls(
            architectures=tuple(cfg.get("architectures") or ()),
            model_type=cfg.get("model_type", ""),
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rotary_dim=_rotary_dim(cfg),
            sliding_rope=sliding_rope,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            rope_layers=tuple(bool(v) for v in cfg.get("no_rope_layers") or ()),
            embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
            attention_multiplier=cfg.get("attention_multiplier"),
            logits_scaling=float(cfg.get("logits_scaling", 1.0)),
            # HF's Gemma configs tie by default and often leave the key out of config.json
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", cfg.get("model_type", "").startswith("gemma"))),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act", "silu"),
            sliding_window=sliding_window,
            layer_types=_layer_types(cfg, layers, sliding_window),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_ids(cfg.get("eos_token_id")),
            quantization_config=dict(cfg.get("quantization_config") or {}),
        )


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None, tuple[float, RopeScaling | None] | None]:
    """(theta, scaling) of the full-attention layers, and of the sliding-window layers when they
    differ: transformers 5.x nests ``rope_parameters`` by layer type, 4.x Gemma 3 configs give
    the sliding layers' theta as ``rope_local_base_freq``."""
    params = cfg.get("rope_parameters")
    if params is not None and any(isinstance(v, dict) for v in params.values()):
        unknown = set(params) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise ValueError(f"unsupported rope_parameters layer types {sorted(unknown)}")
        full = _rope_from(params.get(FULL_ATTENTION) or {}, cfg)
        sliding = params.get(SLIDING_ATTENTION)
        return (*full, None if sliding is None else _rope_from(sliding, cfg))
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
    local = cfg.get("rope_local_base_freq")
    return (*_rope_from(params, cfg), None if local is None else (float(local), None))


def _rope_from(params: dict[str, Any], cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first spelling
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if rope_type == "longrope":
        return theta, _longrope(params, cfg)
    return theta, RopeScaling(
        "llama3",
        float(params["factor"]),
        float(params["low_freq_factor"]),
        float(params["high_freq_factor"]),
        int(params.get("original_max_position_embeddings") or cfg["max_position_embeddings"]),
    )


def _longrope(params: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling:
    """HF's longrope parameters: ``factor`` defaults to max / original positions, and the
    attention factor to ``sqrt(1 + ln(factor) / ln(original))`` (1 when factor <= 1)."""
    original = int(params.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
    factor = float(params.get("factor") or cfg.get("max_position_embeddings", original) / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return RopeScaling("longrope", factor, original_max_position_embeddings=original,
                       short_factor=tuple(float(f) for f in params["short_factor"]),
                       long_factor=tuple(float(f) for f in params["long_factor"]),
                       attention_factor=float(attention))


def _rotary_dim(cfg: dict[str, Any]) -> int:
    params = cfg.get("rope_parameters") or {}
    factor = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(head_dim * factor)


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    # Qwen2 keeps a sliding_window value in config.json even when use_sliding_window is false.
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        return None
    return cfg.get("sliding_window")


def _layer_types(cfg: dict[str, Any], layers: int, sliding_window: int | None) -> tuple[str, ...]:
    if sliding_window is None:
        return (FULL_ATTENTION,) * layers
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
    if pattern:  # Gemma 3 (transformers 4.x): every pattern-th layer attends to everything
        return tuple(FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(layers))
    # Qwen2 slides only from layer max_window_layers on; Mistral slides everywhere.
    first_sliding = cfg.get("max_window_layers", 0) if "use_sliding_window" in cfg else 0
    return tuple(SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(layers))


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)


def kv_cache_shape(config: ModelArchConfig, num_blocks: int, block_size: int,
                   parallel: Any = None) -> tuple[int, ...]:
    """``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)``: block-major, so one
    block's K and V of every layer are one contiguous region. With ``parallel`` (a
    ``tandem.distributed.ParallelContext``): one rank's pool, the layers of its pipeline
    stage and the KV heads it holds."""
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    if parallel is not None:
        layers, heads = len(parallel.stage_layers(layers)), parallel.num_local_kv_heads(heads)
    return (num_blocks, layers, 2, block_size, heads, config.head_dim)


def kv_shards(config: ModelArchConfig, block_size: int, dtype: Any, tp_size: int, pp_size: int) -> tuple:
    """Every rank's ``tandem.interfaces.KVShard`` of a ``tp_size`` × ``pp_size`` instance, in rank
    order (``rank = pp_rank * tp_size + tp_rank``): its stage's layers and the KV heads it holds
    (``ParallelContext.kv_head_split``: split, or whole heads replicated)."""
    from tandem.distributed import ParallelContext
    from tandem.interfaces import KVShard

    shards = []
    for rank in range(tp_size * pp_size):
        place = ParallelContext(tp_size=tp_size, tp_rank=rank % tp_size, pp_size=pp_size,
                                pp_rank=rank // tp_size)
        layers = place.stage_layers(config.num_hidden_layers)
        parts, index = place.kv_head_split(config.num_key_value_heads)
        per = config.num_key_value_heads // parts
        shards.append(KVShard(layers.start, layers.stop, index * per, (index + 1) * per, block_size,
                              config.head_dim, dtype.itemsize))
    return tuple(shards)


def kv_bytes_per_block(config: ModelArchConfig, block_size: int, dtype: Any, parallel: Any = None) -> int:
    """Bytes of one block of the pool (of one rank's, with ``parallel``) for element type
    ``dtype`` (a torch.dtype)."""
    _, layers, two, _, heads, head_dim = kv_cache_shape(config, 1, block_size, parallel)
    return layers * two * heads * head_dim * block_size * dtype.itemsize

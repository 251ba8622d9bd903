"""tandem.config: defaults, the file < environment < overrides precedence, error messages, byte
sizes, plugin-name checks and the TOML round trip. Expected values are written out by hand from
the configuration contract (docs/architecture.md §4), never read back from the code."""
from __future__ import annotations

import re
import textwrap
import tomllib
from pathlib import Path

import pytest

from tandem.config import (
    ConfigError,
    TandemConfig,
    format_bytes,
    load_config,
    parse_bytes,
    validate_plugin_names,
)

EXAMPLE_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "config.toml"


def load(config_file=None, overrides=None, env=None):
    return load_config(config_file, overrides, env={} if env is None else env, check_plugins=False)


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tandem.toml"
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- defaults and layers


def test_the_defaults_validate_and_survive_the_toml_round_trip(tmp_path):
    defaults = load()
    assert load(write_toml(tmp_path, defaults.to_toml())) == defaults


def test_settings_class_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_ENGINE__MAX_NUM_SEQS", "5")
    assert TandemConfig().engine.max_num_seqs == 5


def test_load_config_reads_os_environ_when_no_env_is_given(monkeypatch):
    monkeypatch.setenv("TANDEM_SERVER__PORT", "9123")
    assert load_config(check_plugins=False).server.port == 9123


def test_overrides_beat_environment_beat_file_beat_defaults(tmp_path):
    path = write_toml(tmp_path, textwrap.dedent("""
        [engine]
        max_num_seqs = 8
        block_size = 8
        max_num_batched_tokens = 512
        [server]
        port = 9000
    """))
    env = {"TANDEM_ENGINE__MAX_NUM_SEQS": "16", "TANDEM_ENGINE__BLOCK_SIZE": "32"}
    config = load(path, {"engine.max_num_seqs": 4}, env)
    assert config.engine.max_num_seqs == 4            # override > env > file
    assert config.engine.block_size == 32             # env > file
    assert config.engine.max_num_batched_tokens == 512  # file > default
    assert config.server.port == 9000
    assert config.server.host == "127.0.0.1"          # default


def test_a_file_sets_nested_lists(tmp_path):
    path = write_toml(tmp_path, """
[disaggregation]
role = "prefill"
instances = [{url = "http://10.0.0.2:8000/", role = "prefill"}, {url = "https://d", role = "decode"}]
""")
    instances = load(path).disaggregation.instances
    assert [(i.url, i.role) for i in instances] == [("http://10.0.0.2:8000", "prefill"),
                                                      ("https://d", "decode")]


def test_environment_values_are_parsed_by_type():
    env = {
        "TANDEM_ENGINE__ENABLE_PREFIX_CACHING": "false",
        "TANDEM_MODEL__MAX_MODEL_LEN": "4096",
        "TANDEM_ENGINE__GPU_MEMORY_UTILIZATION": "0.5",
        "TANDEM_DISAGGREGATION__INSTANCES": '[{"url": "http://a:1", "role": "decode"}]',
        "UNRELATED": "x",
    }
    config = load(env=env)
    assert config.engine.enable_prefix_caching is False
    assert config.model.max_model_len == 4096
    assert config.engine.gpu_memory_utilization == 0.5
    assert config.disaggregation.instances[0].url == "http://a:1"


def test_bare_override_names_resolve_to_their_section_and_none_is_skipped():
    config = load(overrides={"max_num_seqs": 3, "path": "/m", "role": "decode", "port": None,
                             "server.host": "0.0.0.0"})
    assert config.engine.max_num_seqs == 3
    assert config.model.path == "/m"
    assert config.disaggregation.role == "decode"
    assert config.server.port == 8000
    assert config.server.host == "0.0.0.0"


def test_overrides_are_validated_like_the_file():
    assert load(overrides={"max_model_len": "100", "kv_cache_memory": "512MiB"}).model_dump()[
        "model"]["max_model_len"] == 100
    with pytest.raises(ConfigError, match=r"engine\.max_num_seqs"):
        load(overrides={"max_num_seqs": 0})


# --------------------------------------------------------------------------- errors


def test_unknown_override_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown configuration key 'max_num_seq'.*max_num_seqs"):
        load(overrides={"max_num_seq": 3})
    with pytest.raises(ConfigError, match=r"'engine\.bogus'"):
        load(overrides={"engine.bogus": 1})


def test_unknown_keys_in_the_file_name_the_field_and_the_allowed_keys(tmp_path):
    path = write_toml(tmp_path, "[engine]\nmax_num_seqs = 4\nmax_num_seq = 4\n[servers]\nport = 1\n")
    with pytest.raises(ConfigError) as info:
        load(path)
    message = str(info.value)
    assert re.search(r"engine\.max_num_seq: unknown key; allowed keys here: device, block_size", message)
    assert "servers: unknown key; allowed keys here: model, engine, parallel, server, disaggregation" in message


def test_unknown_key_in_a_list_item_is_located(tmp_path):
    path = write_toml(tmp_path, '[disaggregation]\n'
                                'instances = [{url = "http://a", role = "decode", rol = 1}]\n')
    with pytest.raises(ConfigError) as info:
        load(path)
    expected = "disaggregation.instances[0].rol: unknown key; allowed keys here: url, role"
    assert expected in str(info.value)


def test_unknown_key_from_the_environment_is_an_error():
    with pytest.raises(ConfigError, match=r"engine\.max_num_seq: unknown key"):
        load(env={"TANDEM_ENGINE__MAX_NUM_SEQ": "4"})


def test_bad_literal_names_the_field_and_the_allowed_values():
    with pytest.raises(ConfigError) as info:
        load(overrides={"dtype": "float64"})
    assert "model.dtype" in str(info.value)
    assert "'auto', 'float32', 'float16' or 'bfloat16'" in str(info.value)
    assert "float64" in str(info.value)


def test_wrong_types_name_each_field(tmp_path):
    path = write_toml(tmp_path, '[engine]\nmax_num_seqs = "many"\ndevice = "tpu"\n'
                                '[model]\nmax_model_len = "long"\n[server]\nport = 70000\n')
    with pytest.raises(ConfigError) as info:
        load(path)
    message = str(info.value)
    assert re.search(r"engine\.max_num_seqs: .*integer.*'many'", message)
    assert "engine.device: must be 'auto', 'cpu', 'cuda' or 'cuda:N' (got 'tpu')" in message
    assert "model.max_model_len: must be a positive integer or 'auto' (got 'long')" in message
    assert re.search(r"server\.port: .*65535", message)


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_accepts_its_documented_spellings(device):
    assert load(overrides={"device": device}).engine.device == device


@pytest.mark.parametrize("key, value", [
    ("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.5), ("num_kv_blocks", 1),
    ("block_size", 0), ("kv_load_failure_policy", "retry"), ("role", "router"),
    ("instances", [{"url": "ftp://x", "role": "decode"}]), ("kv_cache_memory", "lots"),
    ("max_logprobs", -1), ("stream_stall_timeout_s", 0.0), ("stream_stall_timeout_s", -1.0),
    ("stream_stall_timeout_s", float("nan")), ("stream_stall_timeout_s", float("inf")),
])
def test_out_of_range_values_are_rejected(key, value):
    with pytest.raises(ConfigError, match=key):
        load(overrides={key: value})


def test_invalid_toml_is_a_config_error_naming_the_file(tmp_path):
    path = write_toml(tmp_path, "[engine\nmax_num_seqs = 4\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(path)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "missing.toml")


def test_malformed_json_in_the_environment_is_a_config_error():
    with pytest.raises(ConfigError, match="TANDEM_"):
        load(env={"TANDEM_DISAGGREGATION__INSTANCES": "[{"})


# --------------------------------------------------------------------------- byte sizes


@pytest.mark.parametrize("text, expected", [
    ("2GiB", 2 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5GiB", 3 * 1024**3 // 2),
    ("64KiB", 65536), ("2GB", 2_000_000_000), ("10mb", 10_000_000), ("4096", 4096),
    ("1 TiB", 1024**4), (1024, 1024), ("0", 0),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "2 gigs", "-1", "1e9", True, -5])
def test_parse_bytes_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_byte_fields_accept_strings_and_ints(tmp_path):
    path = write_toml(tmp_path, '[engine]\nkv_cache_memory = "256MiB"\ncpu_kv_cache_memory = 4096\n')
    engine = load(path).engine
    assert engine.kv_cache_memory == 256 * 1024**2
    assert engine.cpu_kv_cache_memory == 4096


@pytest.mark.parametrize("num_bytes, text", [(1024**3, "1GiB"), (3 * 1024**2, "3MiB"),
                                              (1536, 1536), (2048, "2KiB"), (1000, 1000)])
def test_format_bytes_spells_exact_binary_units(num_bytes, text):
    assert format_bytes(num_bytes) == text


# --------------------------------------------------------------------------- plugin names


class FakeRegistry:
    """What validate_plugin_names needs of a Registry: the installed names of each kind."""

    def __init__(self, **names: list[str]):
        self._names = names

    def names(self, kind: str) -> list[str]:
        return sorted(self._names.get(kind, []))


BUILTIN_NAMES = FakeRegistry(
    scheduler=["fcfs", "priority"], kv_allocator=["paged"], attention_backend=["torch"],
    quant_method=["gptq", "unquantized"], kv_connector=["nixl"],
    routing_policy=["least_loaded", "round_robin"], structured_output_backend=["xgrammar"],
)


def test_default_names_validate_against_the_builtins():
    validate_plugin_names(load(), BUILTIN_NAMES)


def test_unknown_scheduler_names_the_field_and_the_installed_names():
    config = load(overrides={"scheduler": "spf"})
    with pytest.raises(ConfigError) as info:
        validate_plugin_names(config, BUILTIN_NAMES)
    assert "engine.scheduler: no scheduler named 'spf'; allowed: 'fcfs', 'priority'" in str(info.value)


def test_auto_and_none_are_accepted_besides_registered_names():
    validate_plugin_names(load(overrides={"attention_backend": "torch", "quantization": "none"}),
                          BUILTIN_NAMES)
    with pytest.raises(ConfigError) as info:
        validate_plugin_names(load(overrides={"attention_backend": "flash", "quantization": "awq"}),
                              BUILTIN_NAMES)
    message = str(info.value)
    assert ("engine.attention_backend: no attention_backend named 'flash'; "
            "allowed: 'auto', 'torch'") in message
    assert ("model.quantization: no quant_method named 'awq'; "
            "allowed: 'auto', 'none', 'gptq', 'unquantized'") in message


def test_disaggregation_names_are_checked_only_when_disaggregated():
    no_connectors = FakeRegistry(scheduler=["fcfs"], kv_allocator=["paged"], structured_output_backend=["xgrammar"])
    validate_plugin_names(load(), no_connectors)
    with pytest.raises(ConfigError) as info:
        validate_plugin_names(load(overrides={"role": "decode"}), no_connectors)
    message = str(info.value)
    assert "disaggregation.kv_connector: no kv_connector named 'nixl'; allowed: none installed" in message
    assert "disaggregation.routing_policy" in message
    assert "disaggregation.decode_routing_policy" in message
    router = load(overrides={"instances": [{"url": "http://a", "role": "both"}]})
    with pytest.raises(ConfigError, match="disaggregation.routing_policy"):
        validate_plugin_names(router, no_connectors)


def test_the_tool_call_parser_is_checked_when_set():
    validate_plugin_names(load(overrides={"tool_call_parser": "hermes"}),
                          FakeRegistry(**BUILTIN_NAMES._names, tool_parser=["hermes"]))
    with pytest.raises(ConfigError) as info:
        validate_plugin_names(load(overrides={"tool_call_parser": "mistral"}),
                              FakeRegistry(**BUILTIN_NAMES._names, tool_parser=["hermes", "llama3_json"]))
    assert ("server.tool_call_parser: no tool_parser named 'mistral'; allowed: 'hermes', "
            "'llama3_json'") in str(info.value)


def test_auto_tool_choice_needs_a_parser():
    with pytest.raises(ConfigError, match="enable_auto_tool_choice needs tool_call_parser"):
        load(overrides={"enable_auto_tool_choice": True})
    assert load(overrides={"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}).server.tool_call_parser == "hermes"


# --------------------------------------------------------------------------- TOML out, example file


def test_to_toml_round_trips_a_non_default_config(tmp_path):
    config = load(overrides={
        "path": "/m/ü \"q\"", "max_model_len": 1024, "kv_cache_memory": "3GiB", "num_kv_blocks": 9,
        "enable_chunked_prefill": False, "shutdown_timeout_s": 2.5,
        "instances": [{"url": "http://a:1", "role": "prefill"}],
    })
    text = config.to_toml()
    parsed = tomllib.loads(text)
    assert parsed["model"]["path"] == "/m/ü \"q\""
    assert parsed["engine"]["kv_cache_memory"] == "3GiB"
    assert parsed["engine"]["cpu_kv_cache_memory"] == "1GiB"
    assert parsed["engine"]["enable_chunked_prefill"] is False
    assert parsed["disaggregation"]["instances"] == [{"url": "http://a:1", "role": "prefill"}]
    assert "router_admin_key" not in parsed["disaggregation"]
    assert load(write_toml(tmp_path, text)) == config


def test_the_kv_transfer_secret_is_read_from_the_environment_and_never_shown(tmp_path):
    secret = "0123456789abcdef-secret"
    config = load(env={"TANDEM_DISAGGREGATION__KV_TRANSFER_SECRET": secret})
    assert config.disaggregation.kv_transfer_secret.get_secret_value() == secret
    assert secret not in repr(config) + str(config) + config.to_toml()
    reread = load(write_toml(tmp_path, config.to_toml()))
    assert reread.disaggregation.kv_transfer_secret is None  # a secret never goes into a file
    with pytest.raises(ConfigError, match="kv_transfer_secret: must be at least 16") as info:
        load(overrides={"kv_transfer_secret": "too short"})
    assert "too short" not in str(info.value)
    with pytest.raises(ConfigError, match="kv_transfer_secret"):
        load(overrides={"kv_transfer_secret": "sixteen chars é ok"})


def test_example_config_holds_the_defaults():
    assert load(EXAMPLE_CONFIG) == load()


def test_example_config_mentions_every_field():
    text = EXAMPLE_CONFIG.read_text()
    sections = tomllib.loads(text)
    defaults = load().model_dump()
    assert list(sections) == list(defaults)
    for section, fields in defaults.items():
        for name, default in fields.items():
            if default is None:  # TOML has no null: shown commented out
                assert re.search(rf"^# {name} = ", text, re.MULTILINE), f"{section}.{name}"
            else:
                assert name in sections[section], f"{section}.{name}"


@pytest.mark.parametrize("section, name", [("server", "api_key"), ("disaggregation", "router_admin_key"),
                                           ("disaggregation", "kv_transfer_secret")])
def test_keys_and_secrets_come_from_env_or_file_and_are_never_shown(tmp_path, section, name):
    value = "key-or-secret-0123456789"
    env_name = f"TANDEM_{section.upper()}__{name.upper()}"
    from_env = getattr(load(env={env_name: value}), section)
    path = tmp_path / name
    path.write_text(f"  {value}\n")
    config = load(overrides={f"{section}.{name}_file": str(path)})
    for got in (getattr(from_env, name), getattr(getattr(config, section), name)):
        assert got.get_secret_value() == value
    assert value not in repr(config) + str(config) + config.to_toml() + config.model_dump_json()
    assert f"# {name} is set (secret, not shown)" in config.to_toml().splitlines()
    assert getattr(getattr(load(write_toml(tmp_path, config.to_toml())), section), name) \
        .get_secret_value() == value  # the file, not the value, goes into the TOML
    with pytest.raises(ConfigError, match=f"{section}: set {name} or {name}_file, not both") as both:
        load(overrides={f"{section}.{name}_file": str(path), f"{section}.{name}": value})
    with pytest.raises(ConfigError, match=f"{name}_file .* cannot be read") as missing:
        load(overrides={f"{section}.{name}_file": str(tmp_path / "nope")})
    assert value not in str(both.value) + str(missing.value)


@pytest.mark.parametrize("settings, refused", [
    ({"role": "prefill"}, True),
    ({"role": "decode"}, True),
    ({"instances": [{"url": "http://a:1", "role": "prefill"}, {"url": "http://b:1", "role": "decode"}]}, True),
    ({"role": "decode", "allow_insecure_no_secret": True}, False),
    ({"role": "decode", "kv_transfer_secret": "0123456789abcdef"}, False),
    ({"instances": [{"url": "http://a:1", "role": "both"}]}, False),
    ({}, False),
])
def test_a_disaggregated_start_needs_the_cluster_secret(settings, refused):
    from tandem.config import require_cluster_secret

    config = load(overrides={f"disaggregation.{k}": v for k, v in settings.items()})
    if not refused:
        require_cluster_secret(config, "this")
        return
    with pytest.raises(ConfigError) as info:
        require_cluster_secret(config, "this")
    message = str(info.value)
    for part in ("disaggregation.kv_transfer_secret", "TANDEM_DISAGGREGATION__KV_TRANSFER_SECRET",
                 "tandem serve --disaggregated", "allow_insecure_no_secret"):
        assert part in message

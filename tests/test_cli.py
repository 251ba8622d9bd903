"""The ``tandem`` command line, run as a subprocess (``python -m tandem.cli`` and the console
script), plus the shared configuration flags parsed in-process.

Subprocesses see a sandbox of plugins: every installed entry point except tandem-spf is disabled
(the built-ins have their own tests) and a fake distribution registers stand-ins for the default
names "fcfs" and "paged".
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import textwrap
import tomllib
import types
from pathlib import Path

import pytest

from tandem.cli import build_parser, main
from tandem.config_flags import CONFIG_FLAGS, add_config_flags, flags_to_overrides
from tandem.config import ConfigError, ServerConfig, load_config

FAKE_BUILTINS = '''
import tandem
from tandem import interfaces


def _stand_in(base):
    methods = {name: lambda self, *args, **kwargs: None for name in base.__abstractmethods__}
    return type("StandIn" + base.__name__, (base,), methods)


@tandem.hookimpl
def tandem_register_schedulers(register):
    register("fcfs", _stand_in(interfaces.SchedulingPolicy))


@tandem.hookimpl
def tandem_register_kv_allocators(register):
    register("paged", _stand_in(interfaces.KVAllocator))


@tandem.hookimpl
def tandem_register_structured_output_backends(register):
    register("xgrammar", _stand_in(interfaces.StructuredOutputBackend))
'''


def write_dist(root: Path, project: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    dist_info = root / f"{project.replace('-', '_')}-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (dist_info / "entry_points.txt").write_text(f"[tandem]\n{lines}")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def cli_env(tmp_path):
    """Environment for a CLI subprocess: the fake built-ins on PYTHONPATH, every installed entry
    point but tandem-spf's disabled, no TANDEM_* configuration inherited."""
    site = tmp_path / "site"
    write_dist(site, "tandem-fake-builtins", {"fake_builtins": "tandem_fake_builtins"},
               {"tandem_fake_builtins": FAKE_BUILTINS})
    disabled = [ep.name for ep in importlib.metadata.entry_points(group="tandem") if ep.name != "spf"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env["TANDEM_DISABLE_PLUGINS"] = ",".join(disabled)
    return env


def tandem(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)


# --------------------------------------------------------------------------- help and version


def test_no_arguments_prints_help_that_explains_every_subcommand():
    result = tandem()
    assert result.returncode == 0
    assert "usage: tandem" in result.stdout
    assert "list the installed plugins: kind, name, package" in result.stdout
    assert "print the effective configuration as TOML" in result.stdout
    assert "write a small random-weight model folder" in result.stdout


def test_version_of_the_console_script_is_the_distributions():
    script = Path(sys.executable).with_name("tandem")
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == f"tandem {importlib.metadata.version('tandem-serve')}"


def test_the_parser_and_help_import_no_torch():
    """Every subcommand's arguments are added without importing torch or transformers, so
    ``tandem --help`` and ``--version`` answer at once (importing them takes seconds)."""
    code = ("import sys; from tandem.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_config_help_lists_the_shared_flags_with_their_config_keys():
    result = tandem("config", "--help", env={**os.environ, "COLUMNS": "300"})
    assert result.returncode == 0
    assert "--max-num-seqs N" in result.stdout
    assert "[engine.max_num_seqs, default: 64]" in result.stdout
    assert "--no-enable-prefix-caching" in result.stdout


# --------------------------------------------------------------------------- plugins


def test_plugins_lists_spf_with_its_package(cli_env):
    result = tandem("plugins", env=cli_env)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert rows[0] == ["KIND", "NAME", "PACKAGE", "CLASS"]
    assert ["scheduler", "spf", "tandem-spf", "tandem_spf.policy.ShortestPromptFirstPolicy"] in rows
    assert ["scheduler", "fcfs", "tandem-fake-builtins"] == rows[1][:3]


def test_a_broken_plugin_exits_1_naming_it(cli_env, tmp_path):
    write_dist(tmp_path / "site", "tandem-broken", {"broken": "tandem_no_such_module"}, {})
    result = tandem("plugins", env=cli_env)
    assert result.returncode == 1
    assert "entry point 'broken'" in result.stderr
    assert result.stdout == ""


def test_log_level_debug_shows_plugin_loading(cli_env):
    result = tandem("--log-level", "debug", "plugins", env=cli_env)
    assert result.returncode == 0
    assert "loaded plugin entry point 'spf'" in result.stderr


# --------------------------------------------------------------------------- config


def test_config_prints_the_effective_configuration_file_env_flags(cli_env, tmp_path):
    config_file = tmp_path / "tandem.toml"
    config_file.write_text("[engine]\nmax_num_seqs = 8\nblock_size = 8\n[server]\nport = 9000\n")
    env = {**cli_env, "TANDEM_ENGINE__MAX_NUM_SEQS": "16", "TANDEM_ENGINE__BLOCK_SIZE": "32"}
    result = tandem("config", "--config", str(config_file), "--max-num-seqs", "4",
                    "--kv-cache-memory", "512MiB", "--no-enable-prefix-caching", "/models/x", env=env)
    assert result.returncode == 0, result.stderr
    printed = tomllib.loads(result.stdout)
    assert printed["engine"]["max_num_seqs"] == 4
    assert printed["engine"]["block_size"] == 32
    assert printed["engine"]["kv_cache_memory"] == "512MiB"
    assert printed["engine"]["enable_prefix_caching"] is False
    assert printed["server"]["port"] == 9000
    assert printed["model"]["path"] == "/models/x"
    assert printed["engine"]["scheduler"] == "fcfs"


def test_config_output_reads_back_to_the_same_configuration(cli_env, tmp_path):
    first = tandem("config", "--scheduler", "spf", "--max-model-len", "512", "--port", "1234",
                   env=cli_env)
    assert first.returncode == 0, first.stderr
    saved = tmp_path / "saved.toml"
    saved.write_text(first.stdout)
    second = tandem("config", "--config", str(saved), env=cli_env)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout


def test_config_never_prints_the_kv_transfer_secret(cli_env):
    secret = "s3cret-kv-transfer-value-9f8e7d"
    result = tandem("config", env={**cli_env, "TANDEM_DISAGGREGATION__KV_TRANSFER_SECRET": secret})
    assert result.returncode == 0, result.stderr
    assert secret not in result.stdout + result.stderr
    assert "# kv_transfer_secret is set (secret, not shown)" in result.stdout.splitlines()
    assert "kv_transfer_secret" not in tomllib.loads(result.stdout)["disaggregation"]
    short = tandem("config", env={**cli_env, "TANDEM_DISAGGREGATION__KV_TRANSFER_SECRET": "hush hush"})
    assert short.returncode == 2
    assert "disaggregation.kv_transfer_secret: must be at least 16" in short.stderr
    assert "hush" not in short.stderr


def test_config_never_prints_a_key_or_secret_from_a_flag_the_environment_or_a_file(cli_env, tmp_path):
    api_key, admin_key, secret = "api-key-4c1d9e", "admin-key-77ab10", "cluster-secret-from-a-file-5e"
    (tmp_path / "secret").write_text(secret + "\n")
    (tmp_path / "admin").write_text(admin_key)
    result = tandem("config", "--api-key", api_key, "--kv-transfer-secret-file", str(tmp_path / "secret"),
                    env={**cli_env, "TANDEM_DISAGGREGATION__ROUTER_ADMIN_KEY_FILE": str(tmp_path / "admin")})
    assert result.returncode == 0, result.stderr
    for value in (api_key, admin_key, secret):
        assert value not in result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for name in ("api_key", "router_admin_key", "kv_transfer_secret"):
        assert f"# {name} is set (secret, not shown)" in lines
    assert f"kv_transfer_secret_file = \"{tmp_path / 'secret'}\"" in lines
    both = tandem("config", "--api-key", api_key, "--api-key-file", str(tmp_path / "admin"), env=cli_env)
    assert both.returncode == 2 and "set api_key or api_key_file, not both" in both.stderr
    assert api_key not in both.stderr and admin_key not in both.stderr


@pytest.mark.parametrize("args, message", [
    (["--max-num-seqs", "0"], "engine.max_num_seqs"),
    (["--scheduler", "nope"], "engine.scheduler: no scheduler named 'nope'; allowed: 'fcfs', 'spf'"),
    (["--kv-cache-memory", "lots"], "engine.kv_cache_memory: invalid byte size 'lots'"),
    (["--model", "/a", "/b"], "two different models given"),
])
def test_invalid_config_exits_2_with_the_message_on_stderr(cli_env, args, message):
    result = tandem("config", *args, env=cli_env)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""


def test_invalid_config_file_exits_2(cli_env, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nmax_num_seqs = \n")
    result = tandem("config", "--config", str(bad), env=cli_env)
    assert result.returncode == 2
    assert "not valid TOML" in result.stderr


def test_a_bad_flag_choice_is_a_usage_error():
    result = tandem("config", "--dtype", "float64")
    assert result.returncode == 2
    assert "invalid choice: 'float64'" in result.stderr


# --------------------------------------------------------------------------- shared flags, in-process


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return parser.parse_args(argv)


def test_every_serve_flag_maps_to_its_config_field():
    argv = [
        "--model", "/m", "--host", "0.0.0.0", "--port", "8080", "--dtype", "bfloat16",
        "--device", "cuda:1", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        "--num-kv-blocks", "100", "--scheduler", "spf", "--attention-backend", "torch",
        "--quantization", "gptq", "--api-key", "secret", "--served-model-name", "m1",
        "--role", "decode", "--block-size", "32", "--max-model-len", "1024",
        "--kv-cache-memory", "2GiB", "--enable-prefix-caching", "--no-enable-chunked-prefill",
        "--generation-config", "vllm",
    ]
    assert flags_to_overrides(parse(argv)) == {
        "model.path": "/m", "server.host": "0.0.0.0", "server.port": 8080,
        "model.dtype": "bfloat16", "engine.device": "cuda:1", "engine.max_num_seqs": 8,
        "engine.max_num_batched_tokens": 512, "engine.num_kv_blocks": 100,
        "engine.scheduler": "spf", "engine.attention_backend": "torch",
        "model.quantization": "gptq", "server.api_key": "secret", "model.served_model_name": "m1",
        "disaggregation.role": "decode", "engine.block_size": 32, "model.max_model_len": "1024",
        "engine.kv_cache_memory": "2GiB", "engine.enable_prefix_caching": True,
        "engine.enable_chunked_prefill": False, "model.generation_config": "vllm",
    }


def test_every_server_setting_has_a_flag():
    argv = [
        "--max-queued-requests", "7", "--max-queued-tokens", "900", "--shutdown-timeout-s", "2.5",
        "--stream-stall-timeout-s", "12.5", "--log-requests", "--max-logprobs", "5",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-request-body-bytes", "65536",
        "--max-prompt-chars", "900", "--max-messages", "9", "--max-prompts", "3", "--max-abs-priority", "10",
        "--header-timeout-s", "4.5", "--keep-alive-timeout-s", "2", "--max-connections", "50",
    ]
    assert flags_to_overrides(parse(argv)) == {
        "server.max_queued_requests": 7, "server.max_queued_tokens": 900,
        "server.shutdown_timeout_s": 2.5, "server.stream_stall_timeout_s": 12.5,
        "server.log_requests": True, "engine.max_logprobs": 5,
        "server.enable_auto_tool_choice": True, "server.tool_call_parser": "hermes",
        "server.max_request_body_bytes": 65536, "server.max_prompt_chars": 900, "server.max_messages": 9,
        "server.max_prompts": 3, "server.max_abs_priority": 10, "server.header_timeout_s": 4.5,
        "server.keep_alive_timeout_s": 2.0, "server.max_connections": 50,
    }
    server_fields = {"host", "port", "api_key", "api_key_file", "max_queued_requests", "max_queued_tokens",
                     "shutdown_timeout_s", "log_requests", "stream_stall_timeout_s",
                     "enable_auto_tool_choice", "tool_call_parser", "max_request_body_bytes",
                     "max_prompt_chars", "max_messages", "max_prompts", "max_abs_priority",
                     "header_timeout_s", "keep_alive_timeout_s", "max_connections"}
    assert server_fields == set(ServerConfig.model_fields), "a [server] field was added: give it a flag"
    assert {f"server.{name}" for name in server_fields} <= {flag.key for flag in CONFIG_FLAGS}


def test_serve_accepts_the_queue_flags_it_used_to_refuse():
    args = build_parser().parse_args(["serve", "--max-queued-requests", "5", "--stream-stall-timeout-s", "3"])
    overrides = flags_to_overrides(args)
    assert overrides == {"server.max_queued_requests": 5, "server.stream_stall_timeout_s": 3.0}
    config = load_config(overrides=overrides, env={}, check_plugins=False)
    assert (config.server.max_queued_requests, config.server.stream_stall_timeout_s) == (5, 3.0)


def test_unset_flags_are_left_out_and_the_config_file_is_kept_apart():
    args = parse(["--config", "x.toml"])
    assert flags_to_overrides(args) == {}
    assert args.config_file == "x.toml"


def test_the_positional_model_is_the_model_path():
    assert flags_to_overrides(parse(["/models/a"])) == {"model.path": "/models/a"}
    assert flags_to_overrides(parse(["--model", "/models/a", "/models/a"])) == {"model.path": "/models/a"}
    with pytest.raises(ConfigError, match="two different models"):
        flags_to_overrides(parse(["--model", "/models/a", "/models/b"]))


def test_make_demo_model_calls_the_preset_builder(monkeypatch, tmp_path, capsys):
    calls = []

    def make_demo_model(preset: str, path: str) -> Path:
        calls.append((preset, path))
        return Path(path)

    fake = types.ModuleType("tandem.models.presets")
    fake.make_demo_model = make_demo_model
    monkeypatch.setitem(sys.modules, "tandem.models.presets", fake)
    assert main(["make-demo-model", "--preset", "bench-100m", str(tmp_path / "m")]) == 0
    assert main(["make-demo-model", str(tmp_path / "d")]) == 0
    assert calls == [("bench-100m", str(tmp_path / "m")), ("demo", str(tmp_path / "d"))]
    assert capsys.readouterr().out.split() == [str(tmp_path / "m"), str(tmp_path / "d")]

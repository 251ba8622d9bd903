"""What the benchmarks that start a cluster of processes (and the tests that do the same) share:
a child's environment, its TOML config file, and its Prometheus metrics, read back."""
from __future__ import annotations

import os

import httpx

from tandem.config import toml_value


def child_env(**extra: str) -> dict[str, str]:
    """This environment without TANDEM_* (a child's config file says everything) plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}, **extra}


def toml(sections: dict[str, dict]) -> str:
    """TOML of ``{section: {key: value}}``: strings, numbers, booleans, lists and inline tables."""
    return "".join(f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items()) + "\n"
                   for name, keys in sections.items())


def scrape(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Every sample of ``url``/metrics, parsed by prometheus_client's own parser, keyed by name
    with its labels sorted: ``tandem:request_errors_total{reason=queue_full}``."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=timeout_s).text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples

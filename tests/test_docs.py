"""The docs against the code.

docs/plugins.md documents every hook of tandem.hookspecs, and its examples are valid: the Python
examples compile, and each plugin example registers through a real plugin manager (which checks
its classes against the interfaces); the TOML examples parse.

docs/configuration.md has every field of the config schema (``tandem.config``) with its default
(the documented default, read as TOML, validates through the schema to the schema's own default);
docs/api.md every route of the instance's app and of the router's app, and each of its request
tables the fields of its model in ``tandem.server.protocol``; neither names a field or a route
that does not exist."""
from __future__ import annotations

import inspect
import re
import tomllib
import types
from pathlib import Path

import pytest
from pydantic import BaseModel

from tandem import hookspecs
from tandem.config import TandemConfig, load_config
from tandem.plugin_manager import TandemPluginManager, build_registry
from tandem.router.app import create_router_app
from tandem.server.app import create_app

DOCS = Path(__file__).resolve().parents[1] / "docs"
GUIDE = DOCS / "plugins.md"
TEXT = GUIDE.read_text()


def hookspec_signatures() -> dict[str, list[str]]:
    """Every function of tandem.hookspecs marked as a hookspec, with its argument names."""
    return {
        name: list(inspect.signature(function).parameters)
        for name, function in vars(hookspecs).items()
        if callable(function) and hasattr(function, "tandem_spec")
    }


def documented_hooks() -> dict[str, list[str]]:
    """The ``## tandem_xxx(arg, ...)`` headings of the guide."""
    return {
        match.group(1): [a.strip() for a in match.group(2).split(",") if a.strip()]
        for match in re.finditer(r"^## (tandem_\w+)\((.*)\)\s*$", TEXT, re.MULTILINE)
    }


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", TEXT, re.MULTILINE | re.DOTALL)


def test_the_hookspecs_module_has_hooks():
    assert "tandem_register_schedulers" in hookspec_signatures()
    assert len(hookspec_signatures()) >= 9


@pytest.mark.parametrize("hook", sorted(hookspec_signatures()))
def test_every_hook_has_a_section_headed_by_its_signature(hook):
    documented = documented_hooks()
    assert hook in documented, f"docs/plugins.md has no '## {hook}(...)' section"
    assert documented[hook] == hookspec_signatures()[hook], f"the heading of {hook} has stale arguments"


def test_no_section_documents_a_hook_that_does_not_exist():
    assert set(documented_hooks()) <= set(hookspec_signatures())


def test_the_guide_covers_packaging_selection_disabling_and_duplicates():
    for topic in ["[project.entry-points.tandem]", "TANDEM_DISABLE_PLUGINS", "registered twice",
                  'scheduler = "spf"', "tandem plugins"]:
        assert topic in TEXT, topic


@pytest.mark.parametrize("index", range(len(code_blocks("python"))))
def test_python_examples_compile(index):
    compile(code_blocks("python")[index], f"docs/plugins.md python block {index}", "exec")


@pytest.mark.parametrize("index", [i for i, block in enumerate(code_blocks("python"))
                                   if "@tandem.hookimpl" in block])
def test_plugin_examples_register_valid_components(index):
    namespace: dict = {}
    exec(compile(code_blocks("python")[index], f"docs/plugins.md python block {index}", "exec"),
         namespace)
    module = types.ModuleType(f"docs_example_{index}")
    module.__dict__.update(namespace)
    pm = TandemPluginManager()
    pm.register(module, name=module.__name__)
    pm.check_pending()
    build_registry(pm)


@pytest.mark.parametrize("index", range(len(code_blocks("toml"))))
def test_toml_examples_parse(index):
    tomllib.loads(code_blocks("toml")[index])


# ------------------------------------------------------------------ configuration and API references

CONFIGURATION = (DOCS / "configuration.md").read_text()
API = (DOCS / "api.md").read_text()
SECTIONS: dict[str, type[BaseModel]] = {name: field.annotation for name, field in TandemConfig.model_fields.items()}


def documented_fields() -> dict[str, dict[str, str]]:
    """Section → {field: default text} of the ``## `[section]``` tables."""
    parts = re.split(r"^## `\[(\w+)\]`\s*$", CONFIGURATION, flags=re.MULTILINE)
    return {name: dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", body, re.MULTILINE))
            for name, body in zip(parts[1::2], parts[2::2])}


def test_the_reference_has_every_section_and_no_other():
    assert set(documented_fields()) == set(SECTIONS)


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_every_field_of_a_section_is_documented_and_no_other(section):
    documented = documented_fields().get(section, {})
    fields = SECTIONS[section].model_fields
    assert sorted(set(fields) - set(documented)) == [], f"[{section}] fields missing from the reference"
    assert sorted(set(documented) - set(fields)) == [], f"[{section}] names fields that do not exist"


@pytest.mark.parametrize("section, name", [(s, f) for s, cls in sorted(SECTIONS.items())
                                           for f in cls.model_fields])
def test_the_documented_default_is_the_schema_default(section, name):
    text = documented_fields()[section][name]
    schema_default = getattr(SECTIONS[section](), name)
    if text == "unset":
        assert schema_default is None, f"[{section}] {name} defaults to {schema_default!r}, documented unset"
        return
    value = tomllib.loads(f"value = {text}")["value"]
    assert getattr(SECTIONS[section].model_validate({name: value}), name) == schema_default, \
        f"[{section}] {name}: documented {text}, the schema's default is {schema_default!r}"


def app_routes() -> set[str]:
    """``METHOD /path`` of the instance's and the router's apps (path parameters as ``{}``)."""
    config = load_config(overrides={"model.path": "unused: the apps are built, never started"})
    routes = set()
    for app in (create_app(config), create_router_app(config)):
        for path, operations in app.openapi()["paths"].items():
            routes |= {f"{method.upper()} {re.sub(r'{[^}]*}', '{}', path)}" for method in operations}
    return routes


def documented_routes() -> set[str]:
    """Every ``METHOD /path`` the API reference names (in code spans; a query left out)."""
    found = re.findall(r"`(GET|POST|PUT|PATCH|DELETE) (/[^`\s?]*)", API)
    return {f"{method} {re.sub(r'{[^}]*}', '{}', path)}" for method, path in found}


def test_every_route_is_documented_and_no_other():
    routes, documented = app_routes(), documented_routes()
    assert "POST /v1/completions" in routes and "GET /admin/instances" in routes
    assert sorted(routes - documented) == [], "routes missing from docs/api.md"
    assert sorted(documented - routes) == [], "docs/api.md names routes that do not exist"


def documented_request_fields() -> dict[str, list[str]]:
    """The ``### heading`` of each request-field table of docs/api.md → its field names."""
    parts = re.split(r"^### (.+?)\s*$", API, flags=re.MULTILINE)
    tables = {}
    for heading, body in zip(parts[1::2], parts[2::2]):
        if "| field | type | default | bounds |" in body:
            tables[heading] = re.findall(r"^\| `(\w+)` \|", body, re.MULTILINE)
    return tables


def _names(model: type[BaseModel], less: type[BaseModel] | None = None) -> list[str]:
    skip = set(less.model_fields) if less is not None else set()
    return [f.alias or name for name, f in model.model_fields.items() if name not in skip]


def _request_models() -> dict[str, list[str]]:
    """Where each request model of ``tandem.server.protocol`` is documented (a heading's start)."""
    from tandem.server import protocol as p

    return {
        "Fields of both": _names(p.SamplingFields),
        "`/v1/completions` only": _names(p.CompletionRequest, p.SamplingFields),
        "`/v1/chat/completions` only": _names(p.ChatCompletionRequest, p.SamplingFields),
        "A chat message": _names(p.ChatMessage),
        "A tool (`tools[i]`)": _names(p.ChatCompletionTool),
        "`tools[i].function`": _names(p.FunctionDefinition),
        "A named `tool_choice`": _names(p.NamedToolChoice),
        "`response_format`": _names(p.ResponseFormat),
        "`response_format.json_schema`": _names(p.JsonSchemaFormat),
        "`stream_options`": _names(p.StreamOptions),
        "`POST /tokenize`": _names(p.TokenizeRequest),
        "`POST /detokenize`": _names(p.DetokenizeRequest),
        "`kv_transfer_params`": _names(p.KVTransferParams),
        "`POST /kv/release`": _names(p.KVReleaseRequest),
    }


def test_every_request_table_lists_its_model_fields_and_no_other():
    tables, models = documented_request_fields(), _request_models()
    matched = {start: [h for h in tables if h.startswith(start)] for start in models}
    assert all(len(headings) == 1 for headings in matched.values()), matched
    assert sorted(h for headings in matched.values() for h in headings) == sorted(tables), \
        "a request-field table of docs/api.md documents no model of tandem.server.protocol"
    for start, fields in models.items():
        assert sorted(tables[matched[start][0]]) == sorted(fields), f"docs/api.md '### {start}'"

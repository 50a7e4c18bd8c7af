"""The models and the route table against the OpenAPI document of a real supervisor, both ways:
a field, a schema or a route that the API gains or loses fails here."""

from __future__ import annotations

import inspect
import typing
from typing import Any

import pytest

import taskbox
from taskbox import models as m
from taskbox._routes import IDEMPOTENT, ROUTES

#: Schemas of the document that are no model class, and why.
NOT_MODELS = {
    "ExecOutcome": "an untagged union: Sandbox.exec reads its ExecResult side, Sandbox.start its ProcessInfo side",
    "ExecEvent": "a union: each variant is a model of its own (StartedEvent, ...), checked below",
    "SandboxId": "a string",
    "ApprovalId": "a string",
    "SecretValue": "a string (pydantic's SecretStr in the models, masked in reprs)",
    "ChangeKind": "a Literal of models.py",
    "FindingKind": "a Literal of models.py",
    "EntryKind": "a Literal of models.py",
    "ExportFormat": "a Literal of models.py",
    "ApprovalState": "a Literal of models.py",
}
#: Literals of models.py and the schema each is.
LITERALS = {
    "ChangeKind": m.ChangeKind,
    "FindingKind": m.FindingKind,
    "EntryKind": m.EntryKind,
    "ExportFormat": m.ExportFormat,
    "ApprovalState": m.ApprovalState,
}


@pytest.fixture(scope="module")
def doc(supervisor: Any) -> dict[str, Any]:
    with supervisor.client() as c:
        return c.openapi()


def model_classes() -> list[type[m.Answer] | type[m.Request]]:
    return [
        cls
        for _, cls in inspect.getmembers(m, inspect.isclass)
        if issubclass(cls, (m.Answer, m.Request)) and cls not in (m.Answer, m.Request) and cls.__module__ == m.__name__
    ]


def schema_for(doc: dict[str, Any], cls: type[Any]) -> dict[str, Any]:
    schemas = doc["components"]["schemas"]
    name = cls.schema_name or cls.__name__
    assert name in schemas, f"{cls.__name__}: the API has no schema {name} (removed or renamed?)"
    s = schemas[name]
    if name == "ExecEvent":
        tag = cls.model_fields["type"].default
        variants = [v for v in s["oneOf"] if v["properties"]["type"].get("const") == tag]
        assert len(variants) == 1, f"{cls.__name__}: ExecEvent has no variant {tag!r}"
        return variants[0]
    return s


def resolve(doc: dict[str, Any], s: dict[str, Any], defs: dict[str, Any]) -> frozenset[str]:
    """The JSON kinds a property schema allows, null aside: `object:NAME` for a model."""
    if "$ref" in s:
        name = s["$ref"].rsplit("/", 1)[-1]
        target = defs.get(name) or doc["components"]["schemas"][name]
        if "properties" in target or "oneOf" in target and all("properties" in v for v in target["oneOf"]):
            return frozenset({f"object:{name}"})
        return resolve(doc, target, defs)
    kinds: set[str] = set()
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in s.get(key, []):
            kinds |= resolve(doc, sub, defs)
    t = s.get("type")
    if isinstance(t, str):
        kinds.add(t)
    elif isinstance(t, list):
        kinds |= set(t)
    if "const" in s and not t:
        kinds.add(type(s["const"]).__name__.replace("str", "string"))
    kinds.discard("null")
    return frozenset(kinds)


def enum_values(doc: dict[str, Any], s: dict[str, Any]) -> set[Any] | None:
    if "$ref" in s:
        return enum_values(doc, doc["components"]["schemas"][s["$ref"].rsplit("/", 1)[-1]])
    if "enum" in s:
        return set(s["enum"]) - {None}
    if "oneOf" in s and all("const" in v for v in s["oneOf"]):
        return {v["const"] for v in s["oneOf"]}
    if "const" in s:
        return {s["const"]}
    for key in ("anyOf", "oneOf"):
        for sub in s.get(key, []):
            if (v := enum_values(doc, sub)) is not None:
                return v
    return None


def json_fields(cls: type[Any]) -> dict[str, Any]:
    return {(f.alias or name): f for name, f in cls.model_fields.items()}


def test_every_schema_of_the_api_has_a_model(doc: dict[str, Any]) -> None:
    names = {cls.schema_name or cls.__name__ for cls in model_classes()}
    missing = set(doc["components"]["schemas"]) - names - set(NOT_MODELS)
    assert not missing, f"schemas of the API without a model in taskbox.models: {sorted(missing)}"
    stale = set(NOT_MODELS) - set(doc["components"]["schemas"])
    assert not stale, f"NOT_MODELS names schemas the API no longer has: {sorted(stale)}"


@pytest.mark.parametrize("cls", model_classes(), ids=lambda c: c.__name__)
def test_a_model_has_exactly_the_fields_of_its_schema(doc: dict[str, Any], cls: type[Any]) -> None:
    s = schema_for(doc, cls)
    props: dict[str, Any] = s.get("properties", {})
    fields = json_fields(cls)
    assert set(fields) == set(props), (
        f"{cls.__name__}: fields only in the model {sorted(set(fields) - set(props))}, "
        f"only in the API {sorted(set(props) - set(fields))}"
    )
    required = {k for k, f in fields.items() if f.is_required()}
    assert required == set(s.get("required", [])) - ({"type"} if "type" in fields else set()), (
        f"{cls.__name__}: required in the model {sorted(required)}, in the API {sorted(s.get('required', []))}"
    )
    mine = cls.model_json_schema(by_alias=True, mode="validation")
    defs = mine.get("$defs", {})
    for name, prop in props.items():
        ours = resolve(doc, mine["properties"][name], defs)
        theirs = resolve(doc, prop, {})
        # A model's nested models are named as the API's schemas (ExecEvent variants aside).
        assert ours == theirs or ours == {"number"} and theirs == {"integer"}, (
            f"{cls.__name__}.{name}: the model takes {sorted(ours)}, the API {sorted(theirs)}"
        )
        want = enum_values(doc, prop)
        if want is not None:
            got = enum_values(doc, mine["properties"][name] if "$ref" not in mine["properties"][name] else defs[mine["properties"][name]["$ref"].rsplit("/", 1)[-1]])
            assert got == want, f"{cls.__name__}.{name}: values {got} in the model, {want} in the API"


def test_the_literals_are_the_api_enums(doc: dict[str, Any]) -> None:
    for name, lit in LITERALS.items():
        want = enum_values(doc, doc["components"]["schemas"][name])
        assert set(typing.get_args(lit)) == want, f"{name}: {typing.get_args(lit)} vs {want}"


def test_every_event_of_the_stream_has_a_model(doc: dict[str, Any]) -> None:
    tags = {v["properties"]["type"]["const"] for v in doc["components"]["schemas"]["ExecEvent"]["oneOf"]}
    assert tags == set(m.EVENT_TYPES)


def test_the_route_table_is_the_api(doc: dict[str, Any]) -> None:
    api = {
        op["operationId"]: (method.upper(), path)
        for path, item in doc["paths"].items()
        for method, op in item.items()
    }
    assert ROUTES == api, (
        f"routes only in the SDK {sorted(set(ROUTES.items()) - set(api.items()))}, "
        f"only in the API {sorted(set(api.items()) - set(ROUTES.items()))}"
    )


def test_the_operations_that_take_an_idempotency_key_are_the_apis(doc: dict[str, Any]) -> None:
    keyed = {
        op["operationId"]
        for item in doc["paths"].values()
        for op in item.values()
        if any(p["in"] == "header" and p["name"] == "Idempotency-Key" for p in op.get("parameters", []))
    }
    assert keyed == IDEMPOTENT


def test_a_field_the_api_gains_or_loses_would_fail(doc: dict[str, Any]) -> None:
    """The check above, on a doctored copy of the document: it does see drift."""
    import copy

    gained = copy.deepcopy(doc)
    gained["components"]["schemas"]["ExecResult"]["properties"]["merged"] = {"type": "string"}
    with pytest.raises(AssertionError, match="only in the API \\['merged'\\]"):
        test_a_model_has_exactly_the_fields_of_its_schema(gained, m.ExecResult)
    lost = copy.deepcopy(doc)
    del lost["components"]["schemas"]["ReadResult"]["properties"]["binary"]
    with pytest.raises(AssertionError, match="only in the model \\['binary'\\]"):
        test_a_model_has_exactly_the_fields_of_its_schema(lost, m.ReadResult)
    retyped = copy.deepcopy(doc)
    retyped["components"]["schemas"]["StatResult"]["properties"]["mode"] = {"type": "string"}
    with pytest.raises(AssertionError, match="StatResult.mode"):
        test_a_model_has_exactly_the_fields_of_its_schema(retyped, m.StatResult)


def test_the_package_exports_what_it_documents() -> None:
    for name in taskbox.__all__:
        assert hasattr(taskbox, name), name

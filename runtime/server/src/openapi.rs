//! The OpenAPI 3.1 document, generated from the route table and the types' JSON schemas.

use schemars::generate::SchemaSettings;
use serde_json::{Map, Value, json};

use taskbox_core::api::ApiError;

use crate::error::ErrorBody;
use crate::idempotency::MAX_KEY_LEN;
use crate::spec::{Body, RouteSpec};

/// The OpenAPI 3.1 document of the API whose routes are `routes` (the route table's
/// [`crate::routes::route_specs`]).
pub fn document(routes: &[RouteSpec]) -> Value {
    let mut settings = SchemaSettings::draft2020_12();
    settings.definitions_path = "/components/schemas".into();
    settings.meta_schema = None;
    let mut g = settings.into_generator();
    let error = g.subschema_for::<ErrorBody>();
    let codes = error_codes();
    let listed: Vec<String> = codes
        .iter()
        .map(|(code, status, meaning)| format!("`{code}` ({status}): {meaning}"))
        .collect();
    let error_response = json!({
        "description": format!(
            "an error: `{{\"error\":{{\"code\",\"message\"}}}}` with the status of its code; \
             the codes: {}",
            listed.join("; ")
        ),
        "content": {"application/json": {"schema": error}},
    });

    let mut paths = Map::new();
    for spec in routes {
        let op = operation(spec, &mut g, &error_response);
        let item = paths
            .entry(spec.path.to_string())
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(item) = item {
            item.insert(spec.verb.as_str().to_string(), op);
        }
    }

    let mut schemas = g.take_definitions(true);
    // The codes an error may carry, each with its status and meaning: a client branches on
    // them (and makes one exception per code of the list). A table beside the schema, not an
    // `enum` of it: a client made from this document keeps reading the errors of a newer
    // supervisor, whose codes it does not know yet.
    if let Some(code) = schemas
        .get_mut("ErrorDetail")
        .and_then(|d| d.pointer_mut("/properties/code"))
    {
        code["x-codes"] = json!(
            codes
                .iter()
                .map(|(c, s, meaning)| json!({"code": c, "status": s, "description": meaning}))
                .collect::<Vec<_>>()
        );
    }
    json!({
        "openapi": "3.1.0",
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "info": {
            "title": "taskbox",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Sandboxed execution for AI coding agents: the narrow exec/fs API over HTTP. \
                A tenant sees only its own sandboxes; any other id answers 404.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "a token of the server's tokens file (not needed when it runs without one)",
                },
            },
        },
    })
}

/// Every error code an answer may carry, with its status and meaning: the narrow API's
/// ([`ApiError::CODES`]) and the few of the HTTP layer alone.
pub fn error_codes() -> Vec<(&'static str, u16, &'static str)> {
    let mut codes = ApiError::CODES.to_vec();
    codes.extend([
        ("unauthorized", 401, "a token is missing or unknown"),
        (
            "method_not_allowed",
            405,
            "the route exists, not with this method",
        ),
        (
            "request_timeout",
            408,
            "the request's body did not arrive in time",
        ),
        (
            "idempotency_key_reused",
            422,
            "the Idempotency-Key was sent before with another request (operation, sandbox or body)",
        ),
    ]);
    codes
}

fn operation(spec: &RouteSpec, g: &mut schemars::SchemaGenerator, error: &Value) -> Value {
    let mut params = Vec::new();
    for name in spec.path_params() {
        let schema = if name == "exec_id" {
            json!({"type": "integer", "format": "uint64", "minimum": 0})
        } else {
            json!({"type": "string", "pattern": "^[a-z0-9-]{1,64}$"})
        };
        params.push(json!({"name": name, "in": "path", "required": true, "schema": schema}));
    }
    for p in spec.query {
        let schema = match p.kind {
            "integer" => json!({"type": "integer", "format": "uint64", "minimum": 0}),
            kind => json!({"type": kind}),
        };
        params.push(json!({
            "name": p.name, "in": "query", "required": p.required,
            "description": p.description, "schema": schema,
        }));
    }

    if let Some(what) = spec.idempotent {
        params.push(json!({
            "name": "Idempotency-Key", "in": "header", "required": false,
            "description": format!(
                "{what}. The key: 1 to {MAX_KEY_LEN} printable ASCII characters, bare or as a \
                 quoted string; scoped to the tenant; kept with its answer for a day by default. The same \
                 key with another request is 422 `idempotency_key_reused`; a request while the \
                 first runs waits for its answer; an error answer is not kept (a retry runs \
                 again)."
            ),
            "schema": {"type": "string", "minLength": 1, "maxLength": MAX_KEY_LEN},
        }));
    }

    let mut op = Map::new();
    op.insert("operationId".into(), json!(spec.operation_id));
    op.insert("summary".into(), json!(spec.summary));
    if !params.is_empty() {
        op.insert("parameters".into(), Value::Array(params));
    }
    let mut request = Map::new();
    if let Some(req) = spec.request {
        request.insert("application/json".into(), json!({"schema": req(g)}));
    }
    if let Some(what) = spec.raw_request {
        request.insert(
            "application/octet-stream".into(),
            json!({"schema": {"type": "string", "format": "binary"}, "x-description": what}),
        );
    }
    if !request.is_empty() {
        op.insert(
            "requestBody".into(),
            json!({"required": true, "content": Value::Object(request)}),
        );
    }
    let mut content = Map::new();
    match spec.response {
        Body::Empty => {}
        Body::Json(s) => {
            content.insert("application/json".into(), json!({"schema": s(g)}));
        }
        Body::Text => {
            content.insert("text/plain".into(), json!({"schema": {"type": "string"}}));
        }
        Body::Binary => {
            content.insert(
                "application/octet-stream".into(),
                json!({"schema": {"type": "string", "format": "binary"}}),
            );
        }
    }
    if let Some(ev) = spec.events {
        content.insert(
            "text/event-stream".into(),
            json!({
                "schema": {"type": "string"},
                "x-item-schema": ev(g),
                "description": "events `approval` (the command policy waits for a person), `started`, `stdout`, `stderr`, `ended` (or `error`); each `data:` is the event's JSON",
            }),
        );
    }
    let mut ok = Map::new();
    ok.insert("description".into(), json!(spec.summary));
    if spec.idempotent.is_some() {
        ok.insert(
            "headers".into(),
            json!({
                "Idempotent-Replayed": {
                    "description": "`true` when this is the answer of an earlier request with \
                        the same Idempotency-Key (or of the one running when this came), not \
                        of work done for this one",
                    "schema": {"type": "string", "enum": ["true"]},
                },
            }),
        );
    }
    if !content.is_empty() {
        ok.insert("content".into(), Value::Object(content));
    }
    let mut responses = Map::new();
    responses.insert(spec.status.to_string(), Value::Object(ok));
    responses.insert("default".into(), error.clone());
    op.insert("responses".into(), Value::Object(responses));
    let security = if spec.auth {
        json!([{"bearer": []}])
    } else {
        json!([])
    };
    op.insert("security".into(), security);
    Value::Object(op)
}

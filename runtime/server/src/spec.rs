//! What the route table says of each route, for the router and the OpenAPI document alike:
//! method, path, operation id, whether it needs a token, the request and answer schemas.

use axum::routing::MethodFilter;
use schemars::{JsonSchema, Schema, SchemaGenerator};

/// Produces a schema (a `$ref` into `components/schemas` for named types).
pub type SchemaFn = fn(&mut SchemaGenerator) -> Schema;

pub(crate) fn schema<T: JsonSchema>(g: &mut SchemaGenerator) -> Schema {
    g.subschema_for::<T>()
}

/// The HTTP methods the API uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Get,
    Post,
    Put,
    Delete,
}

impl Verb {
    /// Lowercase, as OpenAPI path items name operations.
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Get => "get",
            Verb::Post => "post",
            Verb::Put => "put",
            Verb::Delete => "delete",
        }
    }

    pub(crate) fn filter(self) -> MethodFilter {
        match self {
            Verb::Get => MethodFilter::GET,
            Verb::Post => MethodFilter::POST,
            Verb::Put => MethodFilter::PUT,
            Verb::Delete => MethodFilter::DELETE,
        }
    }
}

/// What a successful answer carries.
#[derive(Debug, Clone, Copy)]
pub enum Body {
    /// Nothing (204).
    Empty,
    /// JSON of this schema.
    Json(SchemaFn),
    /// Plain text (the metrics).
    Text,
    /// Raw bytes (`application/octet-stream`: a file's content).
    Binary,
}

/// A query parameter of a route.
#[derive(Debug, Clone, Copy)]
pub struct Param {
    pub name: &'static str,
    pub description: &'static str,
    /// Its JSON schema type: "integer" (unsigned), "string" or "boolean".
    pub kind: &'static str,
    pub required: bool,
}

impl Param {
    /// An optional unsigned integer.
    pub(crate) const fn int(name: &'static str, description: &'static str) -> Param {
        Param {
            name,
            description,
            kind: "integer",
            required: false,
        }
    }

    /// An optional boolean.
    pub(crate) const fn flag(name: &'static str, description: &'static str) -> Param {
        Param {
            name,
            description,
            kind: "boolean",
            required: false,
        }
    }

    /// A string the route needs.
    pub(crate) const fn text(name: &'static str, description: &'static str) -> Param {
        Param {
            name,
            description,
            kind: "string",
            required: true,
        }
    }
}

/// One route of the API.
#[derive(Debug, Clone)]
pub struct RouteSpec {
    pub verb: Verb,
    /// Path template, `{name}` for parameters (as axum and OpenAPI both write them).
    pub path: &'static str,
    pub operation_id: &'static str,
    pub summary: &'static str,
    /// Needs `Authorization: Bearer` when the server has a tokens file.
    pub auth: bool,
    /// The JSON request body's schema, if the route takes one.
    pub request: Option<SchemaFn>,
    /// The route also takes a raw body (`application/octet-stream`, streamed, no body limit):
    /// what it is.
    pub raw_request: Option<&'static str>,
    /// Success status and body.
    pub status: u16,
    pub response: Body,
    /// Also answers `text/event-stream` with events of this schema.
    pub events: Option<SchemaFn>,
    /// Query parameters.
    pub query: &'static [Param],
    /// Takes an `Idempotency-Key` header (see [`crate::idempotency`]): what a key does here.
    pub idempotent: Option<&'static str>,
}

impl RouteSpec {
    pub(crate) fn new(
        verb: Verb,
        path: &'static str,
        operation_id: &'static str,
        summary: &'static str,
    ) -> Self {
        RouteSpec {
            verb,
            path,
            operation_id,
            summary,
            auth: true,
            request: None,
            raw_request: None,
            status: 200,
            response: Body::Empty,
            events: None,
            query: &[],
            idempotent: None,
        }
    }

    pub(crate) fn public(mut self) -> Self {
        self.auth = false;
        self
    }

    pub(crate) fn takes(mut self, s: SchemaFn) -> Self {
        self.request = Some(s);
        self
    }

    /// Also takes a raw, streamed body (see [`RouteSpec::raw_request`]).
    pub(crate) fn takes_raw(mut self, what: &'static str) -> Self {
        self.raw_request = Some(what);
        self
    }

    pub(crate) fn with_query(mut self, query: &'static [Param]) -> Self {
        self.query = query;
        self
    }

    /// Takes an `Idempotency-Key`; `what` says what a key does on this route.
    pub(crate) fn idempotent(mut self, what: &'static str) -> Self {
        self.idempotent = Some(what);
        self
    }

    pub(crate) fn answers(mut self, status: u16, body: Body) -> Self {
        self.status = status;
        self.response = body;
        self
    }

    /// The `{...}` parameters of the path.
    pub fn path_params(&self) -> Vec<&'static str> {
        self.path
            .split('/')
            .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .collect()
    }
}

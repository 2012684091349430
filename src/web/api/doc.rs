//! The OpenAPI 3.1 document of `/api/v1`: the routes' own annotations
//! (`records`, `control`), with what every operation shares added here:
//! the bearer token it needs and the problem details it may answer.

use std::sync::Arc;

use serde_json::Value;
use utoipa::openapi::path::Operation;
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, OpenApi as Document, Ref, RefOr, Server};
use utoipa::{Modify, OpenApi, PartialSchema, ToSchema};

use crate::web::error::{PROBLEM_JSON, Problem};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Ballast API",
        description = "Records through pipelines of provider calls: enqueue, list, inspect and act on \
            them, and the providers, audit log and users around them. Every call takes an API token \
            (`Authorization: Bearer …`) whose role (viewer, operator, admin) and pipelines decide \
            what it sees and may do; a record of a pipeline it may not see is not found. Errors are \
            RFC 9457 problem details with a stable `code`.",
        license(name = "MIT OR Apache-2.0"),
    ),
    security(("bearer" = [])),
)]
struct Base;

/// What every operation shares: the token scheme, the server prefix and
/// the problems it may answer.
struct Shared;

/// The problems any operation may answer, and those of one that changes
/// something: what each status means here.
const READ_PROBLEMS: &[(&str, &str)] = &[
    (
        "400",
        "The request is not as this operation takes it (`code` says how).",
    ),
    ("401", "No API token, or one unknown, revoked or expired."),
    ("403", "The token's role does not allow this."),
    ("404", "Not found, or of a pipeline the token may not see."),
    (
        "429",
        "Too many requests from this token or address: see `Retry-After`.",
    ),
    (
        "500",
        "Ballast failed; the log has the detail under the request's id.",
    ),
];
const WRITE_PROBLEMS: &[(&str, &str)] = &[
    (
        "409",
        "The request is sound but the state of what it names does not allow it now.",
    ),
    ("413", "The body is larger than the server takes."),
    (
        "503",
        "Not now: the same request may be sent again shortly (`Retry-After`).",
    ),
];

impl Modify for Shared {
    fn modify(&self, doc: &mut Document) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("An API token, made on the dashboard's tokens page."))
                    .build(),
            ),
        );
        let mut schemas = Vec::new();
        <Problem as ToSchema>::schemas(&mut schemas);
        components.schemas.insert(
            <Problem as ToSchema>::name().into_owned(),
            <Problem as PartialSchema>::schema(),
        );
        components.schemas.extend(schemas);
        doc.servers = Some(vec![Server::new("/api/v1")]);
        for item in doc.paths.paths.values_mut() {
            for (op, changes) in [
                (&mut item.get, false),
                (&mut item.post, true),
                (&mut item.put, true),
                (&mut item.delete, true),
                (&mut item.patch, true),
            ] {
                if let Some(op) = op.as_mut() {
                    add_problems(op, changes);
                }
            }
        }
    }
}

/// Adds the problem responses to `op` that its annotation left out.
fn add_problems(op: &mut Operation, changes: bool) {
    let problems = READ_PROBLEMS
        .iter()
        .chain(changes.then_some(WRITE_PROBLEMS).into_iter().flatten());
    for (status, what) in problems {
        let problem = ContentBuilder::new()
            .schema(Some(Ref::from_schema_name("Problem")))
            .build();
        let response = ResponseBuilder::new()
            .description(*what)
            .content(PROBLEM_JSON, problem)
            .build();
        op.responses
            .responses
            .entry((*status).to_owned())
            .or_insert(RefOr::T(response));
    }
}

/// The whole document.
pub(super) fn document(routes: Document) -> Document {
    let mut doc = Base::openapi();
    doc.merge(routes);
    Shared.modify(&mut doc);
    doc.merge(triggers());
    doc
}

/// `POST /triggers/{name}`, beside the API: served from the root (its
/// path's own server), authenticated by the sender's signature alone.
#[derive(OpenApi)]
#[openapi(
    paths(crate::web::triggers::receive),
    components(schemas(crate::web::triggers::Taken)),
    tags((name = "triggers", description = "Events other systems send, each starting a record (`[triggers.NAME]`)."))
)]
struct Triggers;

fn triggers() -> Document {
    let mut doc = Triggers::openapi();
    for item in doc.paths.paths.values_mut() {
        item.servers = Some(vec![Server::new("/")]);
    }
    doc
}

/// The document as `/api/v1/openapi.json` serves it (and `ballast
/// openapi` prints it), made once per router.
pub fn served() -> Result<Arc<str>, serde_json::Error> {
    render(super::routes().into_openapi())
}

/// The document of `routes` (the paths the router was built from) as JSON.
pub(super) fn render(routes: Document) -> Result<Arc<str>, serde_json::Error> {
    let mut doc = serde_json::to_value(document(routes))?;
    name_moments(&mut doc);
    Ok(serde_json::to_string_pretty(&doc)?.into())
}

/// Every moment is a [`UnixMs`](crate::domain::UnixMs), an alias the
/// schema derive sees as the `i64` it stands for: named and described once
/// as what it is.
fn name_moments(doc: &mut Value) {
    const FROM: &str = "#/components/schemas/i64";
    const TO: &str = "#/components/schemas/UnixMs";
    fn walk(v: &mut Value) {
        match v {
            Value::Object(map) => {
                if map.get("$ref").and_then(Value::as_str) == Some(FROM) {
                    map.insert("$ref".into(), TO.into());
                }
                map.values_mut().for_each(walk);
            }
            Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(doc);
    if let Some(schemas) = doc
        .pointer_mut("/components/schemas")
        .and_then(Value::as_object_mut)
    {
        if let Some(Value::Object(mut moment)) = schemas.remove("i64") {
            moment.insert(
                "description".into(),
                "A moment: milliseconds since 1970-01-01T00:00:00Z.".into(),
            );
            schemas.insert("UnixMs".into(), Value::Object(moment));
        }
    }
}

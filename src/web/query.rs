//! The records list's filters as a query string: what the list page, its
//! bulk form and the JSON API all read.

use serde::Deserialize;

use crate::domain::RecordState;
use crate::domain::park::UntilKind;
use crate::store::{MAX_PAGE, RecordFilter, TimeRange};
use crate::web::error::{WebError, WebResult};

/// The list's filters, as the form and the API send them. Empty fields
/// mean "any".
#[derive(Debug, Default, Deserialize, Clone, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// A pipeline's name.
    pub pipeline: Option<String>,
    /// A record state.
    #[param(schema_with = record_states)]
    pub state: Option<String>,
    /// The provider of the step the record is at.
    pub provider: Option<String>,
    /// The step the record is at.
    pub step: Option<String>,
    /// The stable code of the record's last failure.
    pub error_code: Option<String>,
    /// The group records were enqueued in.
    pub group: Option<String>,
    /// A priority, 0 to 9.
    #[param(schema_with = priorities)]
    pub priority: Option<String>,
    /// External key prefix.
    pub q: Option<String>,
    /// Parked records by resume condition: `time`, `provider`, `never`.
    #[param(schema_with = park_conditions)]
    pub until: Option<String>,
    /// Created from / until, UTC (`2026-12-02`, `2026-12-02T09:30`, RFC
    /// 3339); a bare date as the end takes in that whole day.
    pub created_from: Option<String>,
    pub created_to: Option<String>,
    /// Last changed from / until, likewise.
    pub updated_from: Option<String>,
    pub updated_to: Option<String>,
    /// The page after this record id: the last page's `next`.
    pub before: Option<i64>,
    /// How many (50 when unset; more than 500 are taken as 500).
    #[param(value_type = Option<i64>, minimum = 0, maximum = 4294967295_i64)]
    pub limit: Option<u32>,
}

/// One of `names`, or empty for any.
fn any_of(names: impl IntoIterator<Item = &'static str>) -> utoipa::openapi::schema::Object {
    use utoipa::openapi::schema::{ObjectBuilder, Type};
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(names.into_iter().chain([""])))
        .build()
}

fn record_states() -> utoipa::openapi::schema::Object {
    any_of(crate::domain::RecordState::ALL.map(|s| s.as_str()))
}

fn priorities() -> utoipa::openapi::schema::Object {
    const LEVELS: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
    any_of(LEVELS)
}

fn park_conditions() -> utoipa::openapi::schema::Object {
    any_of(crate::domain::park::UntilKind::ALL.map(|k| k.as_str()))
}

/// An export's own options beside the list's filters.
#[derive(Debug, Default, Deserialize, Clone, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ExportQuery {
    /// `jsonl` (the default) or `csv`.
    #[param(schema_with = export_formats)]
    pub format: Option<String>,
    /// `1`/`true`: each record's attempts too.
    pub attempts: Option<String>,
    /// `1`/`true`: sensitive fields in clear (a caller with `unmask`, who
    /// gives a `reason`); masked otherwise, whoever asks.
    pub unmasked: Option<String>,
    /// `1`/`true`: of a database encrypted at rest, values in clear (an
    /// unmasked export is); sealed otherwise. Needs a `reason`.
    pub decrypted: Option<String>,
    /// Why an unmasked or decrypted export is made (kept in the audit log).
    pub reason: Option<String>,
}

fn export_formats() -> utoipa::openapi::schema::Object {
    any_of(["jsonl", "ndjson", "json", "csv"])
}

/// Whether a query flag is set (`1`, `true`, `yes`, `on`).
fn flag(v: &Option<String>) -> bool {
    matches!(non_empty(v).as_deref(), Some("1" | "true" | "yes" | "on"))
}

impl ExportQuery {
    /// The rules each pipeline's records are masked by in this export, or
    /// `None` for an unmasked one, which only a caller with `unmask` who
    /// gives a reason may make.
    fn masking(
        &self,
        state: &crate::web::AppState,
        caller: &crate::web::auth::Caller,
    ) -> WebResult<Option<std::sync::Arc<crate::engine::export::Masking>>> {
        if flag(&self.unmasked) {
            if !caller.unmask {
                return Err(WebError::Forbidden);
            }
            if non_empty(&self.reason).is_none() {
                return Err(WebError::bad(
                    "reason_required",
                    "an export with sensitive fields in clear needs a reason (it is audited)",
                ));
            }
            return Ok(None);
        }
        let masking = crate::engine::export::Masking::of(&state.config.get());
        Ok(Some(std::sync::Arc::new(masking)))
    }

    /// The export of the records `list` filters (as `filter`, within
    /// what the caller sees), as a streamed response (a download named
    /// after its moment), audited as the caller's: inputs and outputs in
    /// bulk leave the system.
    pub async fn respond(
        &self,
        state: &crate::web::AppState,
        caller: &crate::web::auth::Caller,
        (list, filter): (&ListQuery, RecordFilter),
    ) -> WebResult<axum::response::Response> {
        let (db, now, actor) = (&state.db, state.clock.now_ms(), caller.actor.as_str());
        let masking = self.masking(state, caller)?;
        use crate::engine::export::{Export, Format};
        use axum::http::header;
        use axum::response::IntoResponse;
        let format = Format::parse(non_empty(&self.format).as_deref().unwrap_or("jsonl"))
            .map_err(|e| WebError::bad("bad_format", e))?;
        let attempts = flag(&self.attempts);
        let decrypt = masking.is_none() || flag(&self.decrypted);
        let sealed = Export::sealing(db, decrypt);
        // Asked in clear of an encrypted database: the reason is audited.
        let encrypted = db.keyring().current().is_some();
        if decrypt && encrypted && non_empty(&self.reason).is_none() {
            return Err(WebError::bad(
                "reason_required",
                "an export of an encrypted database in clear needs a reason (it is audited)",
            ));
        }
        crate::store::History::append_event(
            &**db,
            &crate::store::NewEvent {
                record_id: None,
                at: now,
                kind: "export".into(),
                actor: actor.to_owned(),
                audit: true,
                step: None,
                reason: non_empty(&self.reason),
                detail: Some(serde_json::json!({
                    "filter": list.query_string(),
                    "format": format.extension(),
                    "attempts": attempts,
                    "unmasked": masking.is_none(),
                    "sealed": sealed.is_some(),
                })),
            },
        )
        .await?;
        let export = Export {
            filter,
            format,
            attempts,
            masking,
            sealed,
        };
        let stamp: String = crate::domain::time::format_ms(now)
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .take(15)
            .collect();
        let name = format!("ballast-records-{stamp}.{}", format.extension());
        let body = axum::body::Body::from_stream(crate::engine::export::stream(db.clone(), export));
        Ok((
            [
                (header::CONTENT_TYPE, format.content_type().to_owned()),
                (
                    header::CONTENT_DISPOSITION,
                    format!("attachment; filename=\"{name}\""),
                ),
                (header::CACHE_CONTROL, "no-store".to_owned()),
            ],
            body,
        )
            .into_response())
    }
}

/// The audit log as `caller` may read it: `filter`'s page, only actions
/// on records of its pipelines when it is limited to some, details
/// masked for it (the audit page and `GET /api/v1/audit`).
pub async fn audit_log(
    state: &crate::web::AppState,
    caller: &crate::web::auth::Caller,
    mut filter: crate::store::AuditFilter,
) -> WebResult<crate::store::Page<crate::domain::Event>> {
    filter.pipelines = crate::web::scope::visible(state, caller).await?;
    let mut page = state.db.audit_log(&filter).await?;
    crate::web::mask::event_details(state, caller, &mut page.items);
    Ok(page)
}

/// What the search box finds for `q` as `caller` may see it (the search
/// page and `GET /api/v1/search`): the records `q` names (an id, a key, a
/// job id), and the newest 50 holding every word of it; masked for it.
pub async fn search(
    state: &crate::web::AppState,
    caller: &crate::web::auth::Caller,
    q: &str,
) -> WebResult<(Vec<crate::domain::Record>, Vec<crate::domain::Record>)> {
    let providers: Vec<String> = state.config.get().providers.keys().cloned().collect();
    let mut named = state.db.find_records(q, &providers).await?;
    named.retain(|r| caller.sees(&r.pipeline));
    // A caller limited to pipelines gets the newest 50 of its own among
    // the newest matches (up to 500 read).
    let read = if caller.sees_all() { 50 } else { 500 };
    let mut worded = state.db.search_records(q, read).await?;
    worded.retain(|r| caller.sees(&r.pipeline));
    worded.truncate(50);
    crate::web::mask::list(state, caller, &mut named);
    crate::web::mask::list(state, caller, &mut worded);
    Ok((named, worded))
}

pub fn non_empty(v: &Option<String>) -> Option<String> {
    v.as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

impl ListQuery {
    pub fn to_filter(&self) -> WebResult<RecordFilter> {
        let state = match non_empty(&self.state) {
            Some(s) => Some(
                s.parse::<RecordState>()
                    .map_err(|_| WebError::bad("bad_filter", format!("unknown state `{s}`")))?,
            ),
            None => None,
        };
        let until = match non_empty(&self.until) {
            Some(u) => Some(UntilKind::parse(&u).ok_or_else(|| {
                WebError::bad(
                    "bad_filter",
                    format!("unknown resume condition `{u}` (time, provider or never)"),
                )
            })?),
            None => None,
        };
        let priority = match non_empty(&self.priority) {
            Some(p) => Some(
                p.parse::<u8>()
                    .ok()
                    .filter(|p| *p <= crate::domain::MAX_PRIORITY)
                    .ok_or_else(|| {
                        WebError::bad("bad_filter", format!("priority `{p}` is not 0 to 9"))
                    })?,
            ),
            None => None,
        };
        Ok(RecordFilter {
            pipeline: non_empty(&self.pipeline),
            pipelines: None,
            state,
            provider: non_empty(&self.provider),
            step: non_empty(&self.step),
            error_code: non_empty(&self.error_code),
            // Exact (not trimmed): a group never has spaces around it, and
            // a selection must not widen to every group by losing one.
            group: self.group.clone().filter(|g| !g.is_empty()),
            priority,
            key_prefix: non_empty(&self.q),
            until,
            created: span("created", &self.created_from, &self.created_to)?,
            updated: span("updated", &self.updated_from, &self.updated_to)?,
            before: self.before,
            limit: self.limit.unwrap_or(50).min(MAX_PAGE),
        })
    }

    /// The filters as a query string (without the cursor), for links.
    pub fn query_string(&self) -> String {
        let mut s = form_urlencoded::Serializer::new(String::new());
        for (k, v) in [
            ("pipeline", &self.pipeline),
            ("state", &self.state),
            ("provider", &self.provider),
            ("step", &self.step),
            ("error_code", &self.error_code),
            ("group", &self.group),
            ("priority", &self.priority),
            ("q", &self.q),
            ("until", &self.until),
            ("created_from", &self.created_from),
            ("created_to", &self.created_to),
            ("updated_from", &self.updated_from),
            ("updated_to", &self.updated_to),
        ] {
            if let Some(v) = non_empty(v) {
                s.append_pair(k, &v);
            }
        }
        s.finish()
    }
}

/// A span from a filter's `<what>_from` and `<what>_to`: each a UTC moment
/// as [`parse_utc`](crate::domain::time::parse_utc) reads it; a bare date
/// as the end means the end of that day.
fn span(what: &str, from: &Option<String>, to: &Option<String>) -> WebResult<TimeRange> {
    use crate::domain::time::parse_utc;
    let read = |end: &str, v: &Option<String>| -> WebResult<Option<i64>> {
        let Some(text) = non_empty(v) else {
            return Ok(None);
        };
        let at = parse_utc(&text)
            .map_err(|e| WebError::bad("bad_filter", format!("`{what}_{end}`: {e}")))?;
        let whole_day = end == "to" && text.len() == 10 && !text.contains(['T', ' ']);
        Ok(Some(if whole_day { at + 86_400_000 } else { at }))
    };
    let range = TimeRange {
        from: read("from", from)?,
        to: read("to", to)?,
    };
    if let (Some(a), Some(b)) = (range.from, range.to) {
        if a >= b {
            return Err(WebError::bad(
                "bad_filter",
                format!("`{what}_from` must come before `{what}_to`"),
            ));
        }
    }
    Ok(range)
}

/// A bulk action as the records page and the API run it: the selection
/// (at most `bulk_max` records), the caller's bulk actions per minute when
/// it is applied, then `Ops::bulk` (a dry run unless `apply`).
pub async fn bulk(
    state: &crate::web::AppState,
    caller: &crate::web::auth::Caller,
    selection: crate::engine::Selection,
    (action, reason, step): (crate::domain::OperatorAction, &str, Option<&str>),
    apply: bool,
) -> WebResult<crate::engine::BulkOutcome> {
    use crate::engine::Selection;
    let actor = caller.actor.as_str();
    // Only records the caller sees: a filter within its pipelines, ids of
    // other pipelines dropped as unknown ones are.
    let selection = match selection {
        Selection::Matching(mut filter) => {
            filter.pipelines = crate::web::scope::visible(state, caller).await?;
            Selection::Matching(filter)
        }
        Selection::Ids(ids) => Selection::Ids(crate::web::scope::ids(state, caller, ids).await?),
    };
    let ops = state.ops();
    let targets = ops
        .select(
            selection,
            state.config.get().server.limits.bulk_max as usize,
        )
        .await?;
    if apply && state.web.bulk_limiter.check_key(&actor.to_owned()).is_err() {
        return Err(WebError::TooManyRequests(
            "too many bulk actions; wait a minute".into(),
        ));
    }
    Ok(ops.bulk(&targets, action, actor, reason, step, apply).await)
}

/// The actions an operator may take on `rec` as it stands (its step runs
/// `runs`), and its one uncertain call an operator may settle, if any:
/// what the record page offers and the API's record detail lists, asked
/// of `domain::action::offered` and the uncertain call `took_effect` acts
/// on.
pub async fn offered(
    state: &crate::web::AppState,
    rec: &crate::domain::Record,
    runs: &[crate::domain::StepRun],
) -> (
    Vec<crate::domain::OperatorAction>,
    Option<crate::domain::StepRun>,
) {
    // With the items parked on a call whose outcome is not known (the
    // runs copied only when there are some).
    let uncertain = match (
        &state.engine,
        crate::engine::uncertain_items_of(&state.db, rec).await,
    ) {
        (Some(engine), Ok(items)) if items.is_empty() => {
            crate::engine::uncertain_run(engine, rec, runs).await.ok()
        }
        (Some(engine), Ok(items)) => {
            let all = [runs, items.as_slice()].concat();
            crate::engine::uncertain_run(engine, rec, &all).await.ok()
        }
        _ => None,
    };
    let undoable = match &state.engine {
        Some(engine) => !engine.versions().undo_steps(rec, runs).await.is_empty(),
        None => false,
    };
    let facts = crate::domain::action::Facts {
        runs,
        uncertain: uncertain.is_some(),
        undoable,
    };
    (crate::domain::action::offered(rec, &facts), uncertain)
}

/// A pipeline's newest `n` pinned definitions, each with whether new
/// records start on it here (the pipelines page and the API).
pub async fn pipeline_versions(
    state: &crate::web::AppState,
    name: &str,
    n: i64,
) -> WebResult<Vec<(crate::domain::PipelineVersion, bool)>> {
    let current = state
        .engine
        .as_ref()
        .and_then(|e| e.versions().current(name));
    let versions = state.db.pipeline_versions(Some(name), n).await?;
    Ok(versions
        .into_iter()
        .map(|v| {
            let now = Some(v.id) == current;
            (v, now)
        })
        .collect())
}

//! Records out, as JSON Lines or CSV: the records list's filter, newest
//! first, with each record's steps (outputs) and, if asked, its attempts.
//! Streamed a page at a time (the store's keyset pages), so an export of
//! a million records holds one page in memory. The dashboard, the API and
//! `ballast export` all read this.

use std::collections::BTreeMap;

use bytes::Bytes;
use futures_util::Stream;
use serde_json::{Value, json};

use crate::auth::seal::{Field, Keyring, SealError};
use crate::domain::mask::Scrubber;
use crate::domain::{Attempt, Record, StepRun, time::format_ms};
use crate::store::{Db, RecordFilter, StoreError};

/// Records per page read from the store; fewer with their attempts (a
/// record may have many). A chunk holds one page serialised, so memory
/// is bounded by a page of records, not by the export.
const PAGE: u32 = 500;
const PAGE_WITH_ATTEMPTS: u32 = 10;

/// The formats an export comes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One JSON object per line: `{"record", "steps", "attempts"?}`, the
    /// shapes the API's `GET /api/v1/records/{id}` gives.
    Jsonl,
    /// One row per record; the input, the steps' outputs (and attempts)
    /// as JSON text in their columns.
    Csv,
}

impl Format {
    pub fn parse(text: &str) -> Result<Format, String> {
        match text {
            "jsonl" | "ndjson" | "json" => Ok(Format::Jsonl),
            "csv" => Ok(Format::Csv),
            other => Err(format!("unknown export format `{other}` (jsonl or csv)")),
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::Jsonl => "application/x-ndjson",
            Format::Csv => "text/csv; charset=utf-8",
        }
    }

    pub fn extension(self) -> &'static str {
        match self {
            Format::Jsonl => "jsonl",
            Format::Csv => "csv",
        }
    }
}

/// What to export.
#[derive(Debug, Clone)]
pub struct Export {
    /// The filter (its cursor and page size are the export's own).
    pub filter: RecordFilter,
    pub format: Format,
    /// Each record's attempts too.
    pub attempts: bool,
    /// Sensitive fields masked, by the rules of each record's pipeline
    /// (`domain::mask`); `None`: in clear (an unmasked export).
    pub masking: Option<std::sync::Arc<Masking>>,
    /// The data keys of an encrypted database: inputs, outputs, excerpts
    /// and requests are written sealed with the current one
    /// ([`open_export`] opens them); `None`: in clear.
    pub sealed: Option<std::sync::Arc<Keyring>>,
}

impl Export {
    /// The keys to seal with when `db` seals values at rest and the export
    /// was not asked in clear (`decrypt`).
    pub fn sealing(db: &Db, decrypt: bool) -> Option<std::sync::Arc<Keyring>> {
        let ring = db.keyring();
        (!decrypt && ring.current().is_some()).then_some(ring)
    }
}

/// What an export masks: each configured pipeline's sensitive fields, and
/// for a pipeline the configuration does not know, everything.
#[derive(Debug)]
pub struct Masking {
    pub by_pipeline: BTreeMap<String, Vec<crate::domain::mask::Rule>>,
    pub unknown: Vec<crate::domain::mask::Rule>,
}

impl Masking {
    /// The masking by `config`'s pipelines.
    pub fn of(config: &crate::config::Config) -> Masking {
        Masking {
            by_pipeline: config
                .pipelines
                .keys()
                .map(|p| (p.clone(), config.sensitive_rules(p)))
                .collect(),
            // No pipeline has an empty name: the rules of one not known.
            unknown: config.sensitive_rules(""),
        }
    }

    fn rules(&self, pipeline: &str) -> &[crate::domain::mask::Rule] {
        self.by_pipeline.get(pipeline).unwrap_or(&self.unknown)
    }
}

const CSV_COLUMNS: [&str; 17] = [
    "id",
    "pipeline",
    "pipeline_version",
    "external_key",
    "group",
    "state",
    "step",
    "provider",
    "error_code",
    "reason",
    "created_at",
    "updated_at",
    "finished_at",
    "input",
    "outputs",
    "attempts",
    "priority",
];

/// The export as a stream of chunks, one per page of records (the CSV
/// header first).
pub fn stream(db: Db, export: Export) -> impl Stream<Item = Result<Bytes, StoreError>> + Send {
    struct At {
        db: Db,
        export: Export,
        cursor: Option<i64>,
        started: bool,
        done: bool,
    }
    let at = At {
        db,
        export,
        cursor: None,
        started: false,
        done: false,
    };
    futures_util::stream::unfold(at, |mut at| async move {
        if at.done {
            return None;
        }
        let mut out = Vec::new();
        if !at.started && at.export.format == Format::Csv {
            csv_row(&mut out, CSV_COLUMNS.iter().map(|c| (*c).to_owned()));
        }
        at.started = true;
        match page(&at.db, &at.export, at.cursor, &mut out).await {
            Ok(Some(next)) => at.cursor = Some(next),
            Ok(None) => at.done = true,
            Err(e) => {
                tracing::warn!(error = %e, "export stopped part way: the download ends incomplete");
                at.done = true;
                return Some((Err(e), at));
            }
        }
        Some((Ok(Bytes::from(out)), at))
    })
}

/// Writes one page after `cursor` to `out`; returns the next cursor.
async fn page(
    db: &Db,
    export: &Export,
    cursor: Option<i64>,
    out: &mut Vec<u8>,
) -> Result<Option<i64>, StoreError> {
    let filter = RecordFilter {
        before: cursor,
        limit: if export.attempts {
            PAGE_WITH_ATTEMPTS
        } else {
            PAGE
        },
        ..export.filter.clone()
    };
    let page = db.list_records(&filter).await?;
    let ids: Vec<i64> = page.items.iter().map(|r| r.id).collect();
    if ids.is_empty() {
        return Ok(page.next);
    }
    let mut steps: BTreeMap<i64, Vec<StepRun>> = BTreeMap::new();
    for s in db.step_runs_of(&ids).await? {
        steps.entry(s.record_id).or_default().push(s);
    }
    let mut attempts: BTreeMap<i64, Vec<Attempt>> = BTreeMap::new();
    if export.attempts {
        for a in db.attempts_of(&ids).await? {
            attempts.entry(a.record_id).or_default().push(a);
        }
    }
    for r in &page.items {
        let mut steps = steps.remove(&r.id).unwrap_or_default();
        let mut tried = export
            .attempts
            .then(|| attempts.remove(&r.id).unwrap_or_default());
        let rules = export.masking.as_ref().map(|m| m.rules(&r.pipeline));
        let mut r = std::borrow::Cow::Borrowed(r);
        if let Some(rules) = rules.filter(|rules| !rules.is_empty()) {
            let r = r.to_mut();
            let values = Scrubber::new(crate::domain::mask::record(rules, r, &mut steps));
            r.reason = r.reason.as_deref().map(|t| values.clean(t));
            for s in &mut steps {
                s.reason = s.reason.as_deref().map(|t| values.clean(t));
            }
            for a in tried.iter_mut().flatten() {
                scrub_attempt(a, &values);
            }
        }
        let r = r.as_ref();
        let seal = export.sealed.as_deref();
        match export.format {
            Format::Jsonl => jsonl_line(out, r, &steps, tried.as_deref(), seal)?,
            Format::Csv => csv_record(out, r, &steps, tried.as_deref(), seal)?,
        }
    }
    Ok(page.next)
}

/// An attempt's kept texts with `values` masked.
fn scrub_attempt(a: &mut Attempt, values: &Scrubber) {
    if let Some(e) = &a.excerpt {
        a.excerpt = Some(values.clean(e));
    }
    if let Some(req) = &mut a.request {
        req.url = values.clean(&req.url);
        req.body = req.body.as_deref().map(|b| values.body(b));
        for (_, v) in &mut req.headers {
            *v = values.clean(v);
        }
    }
}

fn jsonl_line(
    out: &mut Vec<u8>,
    r: &Record,
    steps: &[StepRun],
    attempts: Option<&[Attempt]>,
    seal: Option<&Keyring>,
) -> Result<(), SealError> {
    let mut line = json!({ "record": r, "steps": steps });
    if let Some(a) = attempts {
        line["attempts"] = json!(a);
    }
    if let Some(k) = seal {
        for p in sealed_places(&line) {
            if let Some(v) = line.pointer_mut(&p).filter(|v| !v.is_null()) {
                *v = k.seal_json(Field::Export, v)?.into_owned();
            }
        }
    }
    // A serialisable value into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, &line);
    out.push(b'\n');
    Ok(())
}

fn csv_record(
    out: &mut Vec<u8>,
    r: &Record,
    steps: &[StepRun],
    attempts: Option<&[Attempt]>,
    seal: Option<&Keyring>,
) -> Result<(), SealError> {
    // A JSON cell as its text, or sealed.
    let cell = |v: &Value| -> Result<String, SealError> {
        Ok(match seal {
            Some(k) => match k.seal_json(Field::Export, v)?.into_owned() {
                Value::String(s) => s,
                other => other.to_string(),
            },
            None => v.to_string(),
        })
    };
    let opt = |v: &Option<String>| v.clone().unwrap_or_default();
    let time = |t: Option<i64>| t.map(format_ms).unwrap_or_default();
    let outputs: serde_json::Map<String, Value> = steps
        .iter()
        .filter_map(|s| s.output.clone().map(|o| (s.step.clone(), o)))
        .collect();
    let fields = [
        r.id.to_string(),
        r.pipeline.clone(),
        r.pipeline_version
            .map(|v| v.to_string())
            .unwrap_or_default(),
        opt(&r.external_key),
        opt(&r.group),
        r.state.as_str().to_owned(),
        opt(&r.step),
        opt(&r.provider),
        opt(&r.error_code),
        opt(&r.reason),
        format_ms(r.created_at),
        format_ms(r.updated_at),
        time(r.finished_at),
        cell(&r.input)?,
        cell(&Value::Object(outputs))?,
        attempts
            .map(|a| cell(&json!(a)))
            .transpose()?
            .unwrap_or_default(),
        r.priority.to_string(),
    ];
    csv_row(out, fields);
    Ok(())
}

/// An export's text with the values [`Export::sealed`] sealed opened: as
/// the export would have been in clear. Only where an export seals (a
/// record's input, its steps' outputs, its attempts' excerpts and
/// requests; in CSV, those columns): a field a provider filled that only
/// looks sealed is left as it is.
pub fn open_export(text: &str, format: Format, keys: &Keyring) -> Result<String, SealError> {
    match format {
        Format::Jsonl => {
            let mut out = String::with_capacity(text.len());
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                let mut v: Value = serde_json::from_str(line).map_err(|_| SealError::Malformed)?;
                for p in sealed_places(&v) {
                    if let Some(at) = v.pointer_mut(&p).filter(|at| at.is_string()) {
                        *at = keys.open_json(Field::Export, std::mem::take(at))?;
                    }
                }
                out.push_str(&v.to_string());
                out.push('\n');
            }
            Ok(out)
        }
        Format::Csv => open_csv(text, keys),
    }
}

/// Where a JSON Lines export seals: the pointers within `line`.
fn sealed_places(line: &Value) -> Vec<String> {
    let count = |k: &str| line[k].as_array().map_or(0, Vec::len);
    let mut at = vec!["/record/input".to_owned()];
    at.extend((0..count("steps")).map(|i| format!("/steps/{i}/output")));
    for i in 0..count("attempts") {
        at.push(format!("/attempts/{i}/excerpt"));
        at.push(format!("/attempts/{i}/request"));
    }
    at
}

/// The CSV columns an export seals: input, outputs, attempts.
const CSV_SEALED: std::ops::RangeInclusive<usize> = 13..=15;

/// A CSV export with the sealed cells of [`CSV_SEALED`] opened (a sealed
/// cell is never quoted: nothing in it needs quoting), each quoted as the
/// export quotes a field; every other byte as it was.
fn open_csv(text: &str, keys: &Keyring) -> Result<String, SealError> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(text.len());
    let (mut i, mut column) = (0, 0);
    while i < bytes.len() {
        // At the start of a field.
        let end = field_end(bytes, i);
        let field = &text[i..end];
        if CSV_SEALED.contains(&column) && crate::auth::seal::sealed_with(field).is_some() {
            let opened = keys.open_json(Field::Export, Value::String(field.to_owned()))?;
            csv_field(&mut out, &opened.to_string());
        } else {
            out.extend_from_slice(field.as_bytes());
        }
        i = end;
        // The separator after it: a comma, or a line's end.
        match bytes.get(i) {
            Some(b',') => {
                out.push(b',');
                column += 1;
                i += 1;
            }
            Some(_) => {
                let eol = if bytes[i..].starts_with(b"\r\n") {
                    2
                } else {
                    1
                };
                out.extend_from_slice(&bytes[i..i + eol]);
                column = 0;
                i += eol;
            }
            None => {}
        }
    }
    String::from_utf8(out).map_err(|_| SealError::Malformed)
}

/// Where the CSV field starting at `i` ends: after its closing quote (a
/// doubled quote inside is text), or at the next comma or line break.
fn field_end(bytes: &[u8], mut i: usize) -> usize {
    if bytes.get(i) == Some(&b'"') {
        i += 1;
        while i < bytes.len() {
            if bytes[i] == b'"' {
                if bytes.get(i + 1) == Some(&b'"') {
                    i += 2;
                    continue;
                }
                return i + 1;
            }
            i += 1;
        }
        return i;
    }
    while i < bytes.len() && !matches!(bytes[i], b',' | b'\r' | b'\n') {
        i += 1;
    }
    i
}

/// One CSV row (RFC 4180): a field with a comma, quote or line break is
/// quoted, quotes doubled. A field a spreadsheet would run as a formula
/// (`=`, `+`, `-`, `@`, tab or CR first) gets a leading `'`: text a
/// provider sent must not become a formula on an operator's machine.
fn csv_row(out: &mut Vec<u8>, fields: impl IntoIterator<Item = String>) {
    for (i, field) in fields.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        csv_field(out, &field);
    }
    out.extend_from_slice(b"\r\n");
}

/// One CSV field, quoted (and defused) as [`csv_row`] says.
fn csv_field(out: &mut Vec<u8>, field: &str) {
    let formula = field.starts_with(['=', '+', '-', '@', '\t', '\r']);
    let quote = formula || field.contains([',', '"', '\n', '\r']);
    if quote {
        out.push(b'"');
    }
    if formula {
        out.push(b'\'');
    }
    for b in field.bytes() {
        if b == b'"' {
            out.push(b'"');
        }
        out.push(b);
    }
    if quote {
        out.push(b'"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(fields: &[&str]) -> String {
        let mut out = Vec::new();
        csv_row(&mut out, fields.iter().map(|f| (*f).to_owned()));
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn csv_fields_are_quoted_and_formulas_defused() {
        assert_eq!(row(&["a", "b c", ""]), "a,b c,\r\n");
        assert_eq!(
            row(&["x,y", "say \"hi\"", "two\nlines"]),
            "\"x,y\",\"say \"\"hi\"\"\",\"two\nlines\"\r\n"
        );
        assert_eq!(
            row(&["=HYPERLINK(\"x\")", "-1", "@a"]),
            "\"'=HYPERLINK(\"\"x\"\")\",\"'-1\",\"'@a\"\r\n"
        );
        assert_eq!(row(&["{\"a\":1}"]), "\"{\"\"a\"\":1}\"\r\n");
    }

    #[test]
    fn formats_are_named() {
        assert_eq!(Format::parse("csv"), Ok(Format::Csv));
        assert_eq!(Format::parse("jsonl"), Ok(Format::Jsonl));
        assert!(Format::parse("xml").is_err_and(|e| e.contains("jsonl or csv")));
    }
}

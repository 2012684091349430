//! The columns that hold values sealed at rest (`auth::seal`), and the
//! two chores on them: the keys ever used (`data_keys`, migration 27) and
//! re-sealing a batch of values with the current key
//! (`ballast rotate-data-key`), each value replaced only if it has not
//! changed since it was read.

use serde_json::Value;
use sqlx::Row;
use sqlx::types::Json;

use super::backend::{RowsAffected, SqlDb};
use super::sql::{SqlStore, Tx};
use super::{StoreError, StoreResult};
use crate::auth::seal::{self, Field, Keyring};
use crate::domain::UnixMs;

/// A column of values sealed at rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SealedColumn {
    RecordInput,
    StepOutput,
    StepVersionOutput,
    AttemptExcerpt,
    AttemptRequest,
    IntentRequest,
    EventDetail,
    CallbackBody,
}

/// How a column's rows are named: by their own id, or by their record and
/// step (and generation).
#[derive(Clone, Copy, PartialEq, Eq)]
enum RowKey {
    Id,
    Step,
    Version,
}

impl SealedColumn {
    pub const ALL: [SealedColumn; 8] = [
        SealedColumn::RecordInput,
        SealedColumn::StepOutput,
        SealedColumn::StepVersionOutput,
        SealedColumn::AttemptExcerpt,
        SealedColumn::AttemptRequest,
        SealedColumn::IntentRequest,
        SealedColumn::EventDetail,
        SealedColumn::CallbackBody,
    ];

    /// (table, column, field, JSON column, how rows are named).
    fn shape(self) -> (&'static str, &'static str, Field, bool, RowKey) {
        match self {
            SealedColumn::RecordInput => ("records", "input", Field::Input, true, RowKey::Id),
            SealedColumn::StepOutput => ("step_runs", "output", Field::Output, true, RowKey::Step),
            SealedColumn::StepVersionOutput => (
                "step_versions",
                "output",
                Field::Output,
                true,
                RowKey::Version,
            ),
            SealedColumn::AttemptExcerpt => {
                ("attempts", "excerpt", Field::Excerpt, false, RowKey::Id)
            }
            SealedColumn::AttemptRequest => {
                ("attempts", "request", Field::Request, false, RowKey::Id)
            }
            SealedColumn::IntentRequest => (
                "attempt_intents",
                "request",
                Field::Request,
                false,
                RowKey::Id,
            ),
            SealedColumn::EventDetail => ("events", "detail", Field::Detail, true, RowKey::Id),
            SealedColumn::CallbackBody => ("callbacks", "body", Field::Callback, true, RowKey::Id),
        }
    }

    /// `table.column`, for messages.
    pub fn name(self) -> String {
        let (table, column, ..) = self.shape();
        format!("{table}.{column}")
    }
}

/// What one batch of [`reseal`](super::Housekeeping::reseal) did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resealed {
    /// Where the next batch starts (an id of the column's table, or of
    /// `records` for step rows); `None`: the column is done.
    pub next: Option<i64>,
    /// Values read.
    pub scanned: u64,
    /// Values written sealed with the current key (or in clear, when
    /// there is none).
    pub resealed: u64,
    /// Values that changed between the read and the write (a node wrote
    /// them meanwhile): left for the next pass.
    pub raced: u64,
}

/// A data key values were sealed with (`data_keys`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataKeyRow {
    pub id: String,
    pub check_value: String,
    pub added_at: UnixMs,
    pub retired_at: Option<UnixMs>,
}

/// A stored value as read for re-sealing: its row and its text.
struct Stored {
    id: i64,
    step: String,
    generation: i64,
    text: String,
}

/// A value that does not open, named by its column and row.
fn at_row(column: SealedColumn, row: &Stored, e: seal::SealError) -> StoreError {
    let step = if row.step.is_empty() {
        String::new()
    } else {
        format!(" step {}", row.step)
    };
    let row_name = match column {
        SealedColumn::StepOutput | SealedColumn::StepVersionOutput => "record",
        _ => "row",
    };
    let generation = if column == SealedColumn::StepVersionOutput {
        format!(" generation {}", row.generation)
    } else {
        String::new()
    };
    StoreError::Keys(format!(
        "{} of {row_name} {}{step}{generation}: {e}",
        column.name(),
        row.id
    ))
}

impl<DB: SqlDb> SqlStore<DB>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Decode<'q, DB> + sqlx::Type<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Decode<'q, DB> + sqlx::Type<DB>,
    for<'q> Json<Value>: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    /// One batch of `column`'s values after `after`, each not sealed with
    /// the current key re-sealed with it, in one transaction.
    pub(crate) async fn reseal_batch(
        &self,
        column: SealedColumn,
        after: i64,
        limit: u32,
    ) -> StoreResult<Resealed> {
        let keys = self.keyring();
        let (_, _, field, json, row_key) = column.shape();
        let mut tx = self.begin_write().await?;
        let (rows, next) = Self::read_batch(&mut tx, column, after, i64::from(limit)).await?;
        let mut done = Resealed {
            next,
            scanned: rows.len() as u64,
            ..Resealed::default()
        };
        let current = keys.current().map(str::to_owned);
        // Records whose input or output words leave their search document:
        // values sealed now that were in clear.
        let mut unsearched = Vec::new();
        for row in rows {
            // A JSON column's value, parsed once; a text column's is its text.
            let stored: Option<Value> = json
                .then(|| serde_json::from_str(&row.text))
                .transpose()
                .map_err(|e| {
                StoreError::Corrupt(format!("{} of row {}: {e}", column.name(), row.id))
            })?;
            let was = match &stored {
                Some(v) => seal::json_sealed_with(v),
                None => seal::sealed_with(&row.text),
            }
            .map(str::to_owned);
            if was == current {
                continue;
            }
            let changed = if let Some(stored) = stored {
                let plain = keys
                    .open_json(field, stored)
                    .map_err(|e| at_row(column, &row, e))?;
                let new = keys.seal_json(field, &plain)?.into_owned();
                Self::replace(&mut tx, column, row_key, &row, Json(new)).await?
            } else {
                let plain = keys
                    .open_text(field, row.text.clone())
                    .map_err(|e| at_row(column, &row, e))?;
                let new = keys.seal_text(field, &plain)?.into_owned();
                Self::replace(&mut tx, column, row_key, &row, new).await?
            };
            if changed {
                done.resealed += 1;
                let searched =
                    matches!(column, SealedColumn::RecordInput | SealedColumn::StepOutput);
                if searched && was.is_none() && current.is_some() {
                    unsearched.push(row.id);
                }
            } else {
                done.raced += 1;
            }
        }
        if !unsearched.is_empty() {
            unsearched.sort_unstable();
            unsearched.dedup();
            // Written bare (without input and output values): what a
            // sealed record's document holds, whichever of its columns
            // this pass has reached (and a sensitive pipeline's record is
            // indexed bare anyway).
            DB::index_in(&mut tx, &unsearched, &unsearched).await?;
        }
        tx.commit().await?;
        Ok(done)
    }

    /// The batch's rows, and where the next batch starts.
    async fn read_batch(
        tx: &mut Tx<DB>,
        column: SealedColumn,
        after: i64,
        limit: i64,
    ) -> StoreResult<(Vec<Stored>, Option<i64>)> {
        let (table, col, _, _, row_key) = column.shape();
        let text = format!("CAST({col} AS TEXT)");
        // Every batch reads (row or record id, step, generation, text).
        let (rows, next) = if row_key == RowKey::Id {
            let sql = format!(
                "SELECT id, CAST('' AS TEXT), CAST(0 AS BIGINT), {text} FROM {table} \
                 WHERE id > $1 AND {col} IS NOT NULL ORDER BY id LIMIT $2"
            );
            let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(after)
                .bind(limit)
                .fetch_all(&mut **tx)
                .await?;
            let next = (rows.len() as i64 == limit)
                .then(|| rows.last().map(|r| r.try_get::<i64, _>(0)))
                .flatten()
                .transpose()?;
            (rows, next)
        } else {
            // Step rows: every row of the next `limit` records.
            let ids: Vec<i64> =
                sqlx::query_scalar("SELECT id FROM records WHERE id > $1 ORDER BY id LIMIT $2")
                    .bind(after)
                    .bind(limit)
                    .fetch_all(&mut **tx)
                    .await?;
            let Some(&last) = ids.last() else {
                return Ok((Vec::new(), None));
            };
            let generation = if row_key == RowKey::Version {
                "CAST(generation AS BIGINT)"
            } else {
                "CAST(0 AS BIGINT)"
            };
            let sql = format!(
                "SELECT record_id, step, {generation}, {text} FROM {table} \
                 WHERE record_id > $1 AND record_id <= $2 AND {col} IS NOT NULL \
                 ORDER BY record_id, step"
            );
            let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(after)
                .bind(last)
                .fetch_all(&mut **tx)
                .await?;
            (rows, (ids.len() as i64 == limit).then_some(last))
        };
        let out = rows
            .iter()
            .map(|r| {
                Ok(Stored {
                    id: r.try_get(0)?,
                    step: r.try_get(1)?,
                    generation: r.try_get(2)?,
                    text: r.try_get(3)?,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()?;
        Ok((out, next))
    }

    /// Writes `new` over the row's value if it still holds the text read.
    async fn replace<T>(
        tx: &mut Tx<DB>,
        column: SealedColumn,
        row_key: RowKey,
        row: &Stored,
        new: T,
    ) -> StoreResult<bool>
    where
        for<'q> T: sqlx::Encode<'q, DB> + sqlx::Type<DB> + Send + 'q,
    {
        let (table, col, ..) = column.shape();
        let which = match row_key {
            RowKey::Id => "id = $3",
            RowKey::Step => "record_id = $3 AND step = $4",
            RowKey::Version => "record_id = $3 AND step = $4 AND generation = $5",
        };
        let sql =
            format!("UPDATE {table} SET {col} = $1 WHERE CAST({col} AS TEXT) = $2 AND {which}");
        let mut q = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(new)
            .bind(row.text.clone())
            .bind(row.id);
        if row_key != RowKey::Id {
            q = q.bind(row.step.clone());
        }
        if row_key == RowKey::Version {
            q = q.bind(row.generation);
        }
        let done = q.execute(&mut **tx).await?;
        Ok(done.rows_affected() == 1)
    }
}

/// Whether `ring` can read what the database holds: every key the database
/// lists and has not retired is among `ring`'s, under the same check
/// value; the message says what to do otherwise.
pub fn check_keys(ring: &Keyring, listed: &[DataKeyRow]) -> Result<(), String> {
    for row in listed {
        match ring.check(&row.id) {
            // Refused even once retired: a value a late writer sealed with
            // the old key could never be opened again.
            Some(check) if check != row.check_value => {
                return Err(format!(
                    "data key `{}` is not the key this database's values were sealed with \
                     under that id (its check value differs; a new key takes a new id)",
                    row.id
                ));
            }
            None if row.retired_at.is_none() => {
                return Err(format!(
                    "values may be sealed with data key `{}`, which database.encryption.keys \
                     does not list: add it back (`ballast rotate-data-key` moves its values to \
                     the current key, after which it may go)",
                    row.id
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

/// Checks `ring` against the database ([`check_keys`]), then lists its
/// current key as one values are sealed with (no longer retired). Every
/// command that opens the database for work passes here (`migrate::up`,
/// with the store's keys), and a reload with the keys it read.
pub async fn admit_keys(db: &super::Db, ring: &Keyring, now: UnixMs) -> StoreResult<()> {
    let listed = db.data_keys().await?;
    check_keys(ring, &listed).map_err(StoreError::Keys)?;
    note_current(db, ring, now).await
}

/// Lists `ring`'s current key as in use (no longer retired), whatever a
/// rotation did since the keys were read.
pub async fn note_current(db: &super::Db, ring: &Keyring, now: UnixMs) -> StoreResult<()> {
    if let Some(id) = ring.current() {
        let check = ring.check(id).unwrap_or_default();
        db.note_data_key(id, check, now).await?;
    }
    Ok(())
}

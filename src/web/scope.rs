//! Permissions per pipeline, for every route: a caller limited to some
//! pipelines (`domain::scope`) gets records of those only. Lists, counts,
//! exports and bulk selections carry the pipelines it may see into the
//! query; a record of another pipeline is not found (404), the same answer
//! as a record that does not exist, so its existence is not told.

use crate::domain::Record;
use crate::store::RecordFilter;
use crate::web::AppState;
use crate::web::auth::Caller;
use crate::web::error::{WebError, WebResult};
use crate::web::query::ListQuery;

impl Caller {
    /// Whether records of `pipeline` are the caller's to see.
    pub fn sees(&self, pipeline: &str) -> bool {
        self.scope.allows(pipeline)
    }

    /// Whether the caller sees every pipeline.
    pub fn sees_all(&self) -> bool {
        self.scope.is_all()
    }
}

/// The pipelines the caller sees among those there are (configured, or
/// with records counted): `None` when it sees every one.
pub async fn visible(state: &AppState, caller: &Caller) -> WebResult<Option<Vec<String>>> {
    if caller.sees_all() {
        return Ok(None);
    }
    let counted = state.db.state_counts().await?;
    let config = state.config.get();
    let names = config
        .pipelines
        .keys()
        .map(String::as_str)
        .chain(counted.iter().map(|c| c.pipeline.as_str()));
    Ok(caller.scope.within(names))
}

/// `q` as a records filter within what the caller sees.
pub async fn filter(state: &AppState, caller: &Caller, q: &ListQuery) -> WebResult<RecordFilter> {
    let mut filter = q.to_filter()?;
    filter.pipelines = visible(state, caller).await?;
    Ok(filter)
}

/// Record `id`, when it exists and the caller sees its pipeline; else not
/// found, the same either way.
pub async fn record(state: &AppState, caller: &Caller, id: i64) -> WebResult<Record> {
    state
        .db
        .get_record(id)
        .await?
        .filter(|r| caller.sees(&r.pipeline))
        .ok_or_else(|| WebError::NotFound(format!("record {id} not found")))
}

/// Of `ids`, those of records the caller sees (all of them, unread, when
/// it sees every pipeline).
pub async fn ids(state: &AppState, caller: &Caller, ids: Vec<i64>) -> WebResult<Vec<i64>> {
    if caller.sees_all() {
        return Ok(ids);
    }
    let found = state.db.get_records(&ids).await?;
    Ok(found
        .into_iter()
        .filter(|r| caller.sees(&r.pipeline))
        .map(|r| r.id)
        .collect())
}

/// Refuses what only a caller seeing every pipeline may do: an action on
/// something all pipelines share (a provider).
pub fn every_pipeline(caller: &Caller) -> WebResult<()> {
    match caller.sees_all() {
        true => Ok(()),
        false => Err(WebError::Forbidden),
    }
}

/// The providers the steps of the caller's pipelines call (`None`: the
/// caller sees every pipeline, so every provider).
pub fn providers(
    config: &crate::config::Config,
    caller: &Caller,
) -> Option<std::collections::BTreeSet<String>> {
    if caller.sees_all() {
        return None;
    }
    let steps = config
        .pipelines
        .iter()
        .filter(|(name, _)| caller.sees(name))
        .flat_map(|(_, p)| p.steps.iter());
    Some(
        steps
            .filter(|s| !s.provider.is_empty())
            .map(|s| s.provider.clone())
            .collect(),
    )
}

/// Records per (provider, state) as the caller may count them: every
/// record's when it sees every pipeline (`all`), else those of its
/// pipelines, by the provider each one's current step calls.
pub fn provider_counts(
    config: &crate::config::Config,
    caller: &Caller,
    all: Vec<crate::domain::StateCount>,
    steps: &[crate::domain::StepCount],
) -> Vec<crate::domain::StateCount> {
    if caller.sees_all() {
        return all;
    }
    steps
        .iter()
        .filter(|c| caller.sees(&c.pipeline))
        .filter_map(|c| {
            let p = config.pipelines.get(&c.pipeline)?;
            let step = p.steps.iter().find(|s| s.name == c.step)?;
            Some(crate::domain::StateCount {
                pipeline: step.provider.clone(),
                state: c.state,
                count: c.count,
            })
        })
        .filter(|c| !c.pipeline.is_empty())
        .collect()
}

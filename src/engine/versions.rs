//! The pipeline versions this node runs: the current version of each
//! configured pipeline (new records are pinned to it), and every pinned
//! version compiled against this node's providers on first use (a record
//! runs the version it started on). A version this node's configuration
//! cannot run is waited on while another node (or a reload here) may run
//! it, for at most [`VERSION_GRACE_MS`] once every live node runs the same
//! file.

use std::sync::Arc;

use super::{Compiled, Inner, NotHere, lock};
use crate::domain::{Record, UnixMs};
use crate::pipeline::Pipeline;
use crate::store::StoreError;

/// How long a node that meets a pipeline version its configuration cannot
/// run, while every live node runs the same file, waits before it gives
/// up on it (a reload's heartbeat may not have been seen yet).
const VERSION_GRACE_MS: i64 = 60_000;

/// How many pinned versions a node reads to learn the older versions'
/// callback steps.
const VERSIONS_LEARNED: i64 = 1_000;

/// How often, at most, a node reads them (a provider sending deliveries
/// without a job id does not make a read each).
const LEARN_EVERY_MS: i64 = 60_000;

/// The pipeline versions of one engine (see [`Engine::versions`](super::Engine::versions)).
#[derive(Clone, Copy)]
pub struct Versions<'a> {
    pub(super) i: &'a Inner,
}

impl Versions<'_> {
    /// The version id new records of pipeline `name` are pinned to.
    pub fn current(&self, name: &str) -> Option<i64> {
        lock(&self.i.current).get(name).copied()
    }

    /// The current compiled pipeline called `name`.
    pub fn pipeline(&self, name: &str) -> Option<Arc<Pipeline>> {
        self.i.setup().pipelines.pipelines.get(name).cloned()
    }

    /// The version of the configuration this node runs (the file's, see
    /// [`Engine::reconfigure`](super::Engine::reconfigure)).
    pub fn config_version(&self) -> String {
        self.i.setup().version.clone()
    }

    /// The steps of the pipeline a record runs (its pinned version), each
    /// with the steps it needs, in the pipeline's order.
    pub async fn graph_of(&self, rec: &Record) -> Vec<crate::domain::pipeline::Shape> {
        self.compiled(rec)
            .await
            .map(|c| c.0.steps.iter().map(Into::into).collect())
            .unwrap_or_default()
    }

    /// The pipeline version `rec` runs on, if it runs here.
    pub(super) async fn compiled(&self, rec: &Record) -> Option<Compiled> {
        self.compiled_for(rec).await.ok()
    }

    /// The definition of step `name` in the pipeline `rec` runs on.
    pub async fn step_of(&self, rec: &Record, name: &str) -> Option<crate::pipeline::Step> {
        self.compiled(rec).await.and_then(|c| {
            let undo = || c.0.undo.iter().find(|u| u.name == name);
            let item = || {
                let (of, index) = crate::domain::each::item_of(name)?;
                let s = c.0.step(of)?;
                Some(super::each::item_step(s, s.each.as_ref()?, index))
            };
            c.0.step(name).or_else(undo).cloned().or_else(item)
        })
    }

    /// The undo steps an undo of `rec` would run (its steps that
    /// succeeded and have an undo call, last finished first).
    pub async fn undo_steps(&self, rec: &Record, runs: &[crate::domain::StepRun]) -> Vec<String> {
        let Some((pipeline, _)) = self.compiled(rec).await else {
            return Vec::new();
        };
        let states = runs
            .iter()
            .map(|r| (r.step.clone(), crate::domain::StepWrite::from(r)))
            .collect();
        crate::domain::undo::to_run(&pipeline, &states)
    }

    /// Pinned version `id`, compiled, with its steps (read together: a
    /// reload between two reads could pair them wrongly).
    pub(super) fn pinned(&self, id: i64) -> Option<Compiled> {
        super::lock(&self.i.pinned).get(&id).cloned()
    }

    /// Whether work on a record whose version cannot run here waits, to
    /// be asked again (here after a reload, or on another node), rather
    /// than being given up: a read that failed always; a version this
    /// node's configuration lacks while the live nodes run different
    /// files, or for [`VERSION_GRACE_MS`] after this node first met it.
    /// Past that, every node runs what this one does, and none can run it.
    pub(super) async fn waits_for(&self, not: &NotHere) -> bool {
        match not {
            NotHere::Unknown => false,
            NotHere::Unread(_) => true,
            NotHere::Mismatch(_, version) => self.version_waits(*version).await,
        }
    }

    /// [`waits_for`](Self::waits_for) a version this node cannot run.
    pub(super) async fn version_waits(&self, version: i64) -> bool {
        let i = self.i;
        let now = i.clock.now_ms();
        let first = *lock(&i.mismatched).entry(version).or_insert(now);
        if now - first < VERSION_GRACE_MS {
            return true;
        }
        match i.db.list_nodes().await {
            Ok(nodes) => !crate::domain::host::config_split(&nodes, now).is_empty(),
            Err(_) => true,
        }
    }

    /// The pipeline version `rec` runs on, compiled against this node's
    /// providers (cached by version id).
    pub(super) async fn compiled_for(&self, rec: &Record) -> Result<Compiled, NotHere> {
        let i = self.i;
        let version = match rec.pipeline_version {
            Some(v) => v,
            None => *lock(&i.current)
                .get(&rec.pipeline)
                .ok_or(NotHere::Unknown)?,
        };
        if let Some(c) = lock(&i.pinned).get(&version).cloned() {
            return Ok(c);
        }
        let pv = match i.db.pipeline_version(version).await {
            Ok(Some(pv)) => pv,
            Ok(None) => return Err(NotHere::Unknown),
            Err(e) => {
                return Err(NotHere::Unread(format!(
                    "cannot read pipeline version {version}: {e}"
                )));
            }
        };
        let compiled = crate::pipeline::compile_pinned(&pv.pipeline, &pv.definition, &i.config())
            .map_err(|e| {
            let why = format!(
                "pipeline `{}` version {version} does not run with this node's configuration ({e})",
                pv.pipeline
            );
            NotHere::Mismatch(why, version)
        })?;
        lock(&i.pinned).insert(version, compiled.clone());
        Ok(compiled)
    }

    /// Every pinned version's pipeline this node has compiled.
    pub(super) fn pinned_pipelines(&self) -> Vec<Arc<Pipeline>> {
        lock(&self.i.pinned).values().map(|c| c.0.clone()).collect()
    }

    /// Compiles every pinned version this node has not (the newest
    /// [`VERSIONS_LEARNED`]), at most once a [`LEARN_EVERY_MS`] (callers
    /// meanwhile wait for a learning under way, then use it). `Err` when
    /// the versions could not be read, or some do not compile here (their
    /// callback steps are unknown to this node): the provider should
    /// deliver again rather than be told there is no job id.
    pub(super) async fn learn(&self) -> Result<(), StoreError> {
        let i = self.i;
        let mut learned = i.versions_learned.lock().await;
        let now: UnixMs = i.clock.now_ms();
        if now - learned.0 >= LEARN_EVERY_MS {
            let versions =
                i.db.pipeline_versions(None, VERSIONS_LEARNED)
                    .await
                    .map_err(|e| {
                        StoreError::NotNow(format!("cannot read the pipeline versions: {e}"))
                    })?;
            let config = i.config();
            let mut skipped = false;
            for pv in versions {
                if lock(&i.pinned).contains_key(&pv.id) {
                    continue;
                }
                match crate::pipeline::compile_pinned(&pv.pipeline, &pv.definition, &config) {
                    Ok(c) => {
                        lock(&i.pinned).insert(pv.id, c);
                    }
                    Err(_) => skipped = true,
                }
            }
            *learned = (now, skipped);
        }
        if learned.1 {
            return Err(StoreError::NotNow(
                "a pipeline version this node cannot run may say where the job id is".into(),
            ));
        }
        Ok(())
    }
}

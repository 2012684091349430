//! Sensitive values kept out of what a call leaves behind for people (the
//! request kept, the reply's excerpt): masked at the source, before any
//! excerpt is cut. A JSON reply's sensitive fields (its provider's, and
//! those the step takes outputs from that its pipeline declares) are
//! masked by pointer; the record's sensitive values (its pipeline's
//! fields, as the pass sees them, found once per pass) wherever they
//! appear: as JSON leaves (short ones too), and in any text however it is
//! spelt (JSON escapes, percent-encoding).

use std::sync::Arc;

use serde_json::Value;

use crate::config::Config;
use crate::domain::mask::{self, Rule, Scrubber};
use crate::domain::request::SentRequest;
use crate::domain::rules::{Reply, ReplyError};
use crate::domain::{EXCERPT_MAX_BYTES, excerpt};
use crate::pipeline::PassContext;

/// What one call's history is masked by; `None` of [`Masking::of`] when
/// nothing (the common case, which costs a look at the configuration).
pub(super) struct Masking {
    /// The record's sensitive values.
    values: Arc<Scrubber>,
    /// The reply's sensitive fields.
    reply: Vec<Rule>,
}

impl Masking {
    /// The masking of a call of `provider` by `step` of a record of
    /// `pipeline` whose pass context is `ctx`.
    pub(super) fn of(
        config: &Config,
        (pipeline, step, provider): (&str, &str, &str),
        ctx: &PassContext,
    ) -> Option<Masking> {
        if config.masks_nothing(pipeline) {
            return None;
        }
        // An item's call (`STEP#N`) by its step's fields.
        let step = crate::domain::each::step_of(step);
        let reply = config.reply_rules(pipeline, step, provider);
        let values = ctx.scrubber(|| config.sensitive_rules(pipeline));
        (!reply.is_empty() || !values.is_empty()).then_some(Masking { values, reply })
    }

    /// The call's URL and body with the record's sensitive values masked
    /// (before the kept request cuts the body).
    pub(super) fn outgoing(&self, url: &str, body: Option<&str>) -> (String, Option<String>) {
        (self.values.clean(url), body.map(|b| self.values.body(b)))
    }

    /// The kept request's header values masked (the URL and body were,
    /// before it was made).
    pub(super) fn headers(&self, sent: &mut SentRequest) {
        for (_, v) in &mut sent.headers {
            *v = self.values.clean(v);
        }
    }

    /// The excerpt of `reply`: a JSON one masked whole (by pointer and
    /// by value) and then cut; any other's cut excerpt (`was`) scrubbed of
    /// the record's values, or, where the reply has sensitive fields that
    /// a body not read as JSON cannot be searched for, not kept.
    pub(super) fn excerpt(&self, reply: &Reply, was: &str) -> String {
        match reply {
            Reply::Http {
                json: Some(json), ..
            } => excerpt(&self.json(json), EXCERPT_MAX_BYTES).to_owned(),
            Reply::Http {
                json: None,
                body_error,
                ..
            } if !self.reply.is_empty() && *body_error != Some(ReplyError::BodyEmpty) => {
                "[not kept: the body is not JSON, and this provider's replies hold sensitive \
                 fields]"
                    .to_owned()
            }
            _ => self.values.clean(was),
        }
    }

    /// `json` masked and written out.
    fn json(&self, json: &Value) -> String {
        let mut masked = json.clone();
        mask::apply(&mut masked, &self.reply);
        self.values.json(&mut masked);
        masked.to_string()
    }

    /// A webhook delivery's body as kept: as a reply's.
    pub(super) fn delivery(&self, body: &Value) -> String {
        excerpt(&self.json(body), EXCERPT_MAX_BYTES).to_owned()
    }
}

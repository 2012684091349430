//! Logs, and OpenTelemetry traces when `[traces]` names a collector.
//!
//! The engine marks each pass over a record, each step run in it and each
//! provider call with a `tracing` span at `DEBUG` (the names and fields are
//! in `ARCHITECTURE.md`). With traces off, the default, the subscriber is
//! the log formatter alone at `info`: those spans' call sites are disabled
//! once and never built again, so the engine pays one cached check per
//! site and sends no `traceparent`. With traces on, a second layer
//! (`tracing-opentelemetry`) takes Ballast's spans, and its events at
//! `info` and above as span events, and a batch processor on its own
//! thread sends them over OTLP/HTTP; the log formatter keeps its own
//! filter and output.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::propagation::{Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

use crate::config::TracesConfig;

/// How long stopping waits for the last spans to reach the collector.
const FLUSH_WITHIN: Duration = Duration::from_secs(5);

/// Why logging or traces could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("traces: cannot export to {url}: {message}")]
    Exporter { url: String, message: String },
    #[error("cannot install logging: {0}")]
    Install(String),
}

/// The process's logging (and tracing, when on); [`shutdown`](Self::shutdown)
/// sends the spans not yet exported.
#[must_use = "dropping it without shutdown loses the last spans"]
pub struct Telemetry {
    traces: Option<SdkTracerProvider>,
}

/// Whether log lines are JSON objects (set by [`Telemetry::install`]).
static JSON_LINES: AtomicBool = AtomicBool::new(false);

/// Writes [`say`]'s lines as JSON from now on (set before the
/// configuration loads, so that its errors are JSON too).
pub fn say_json(json: bool) {
    JSON_LINES.store(json, Ordering::Relaxed);
}

/// Writes a line a person must see whatever `BALLAST_LOG` lets through
/// (the dashboard's address, a generated password, the error that ends a
/// command): as it is, or, when the logs are JSON, as one JSON object
/// (`timestamp`, `level`, `target`, `message`) so that every line of the
/// log still parses.
pub fn say(level: tracing::Level, text: &str) {
    if JSON_LINES.load(Ordering::Relaxed) {
        let now = crate::domain::Clock::now_ms(&crate::domain::SystemClock);
        let line = serde_json::json!({
            "timestamp": crate::domain::time::format_ms(now),
            "level": level.as_str(),
            "target": "ballast",
            "message": text.trim(),
        });
        eprintln!("{line}");
    } else {
        eprintln!("{text}");
    }
}

/// How log lines look.
pub struct LogFormat {
    /// Which events are written (`BALLAST_LOG`).
    pub filter: EnvFilter,
    /// Colours, for a person at a terminal.
    pub ansi: bool,
    /// One JSON object per line (`BALLAST_LOG_FORMAT=json`), for a log
    /// pipeline: `timestamp`, `level`, `target`, `message` and the event's
    /// fields by their dotted names (`record.id`, `request.id`), at the top
    /// level.
    pub json: bool,
}

impl LogFormat {
    /// `BALLAST_LOG_FORMAT`: `text` (or unset) or `json`.
    pub fn parse_kind(value: Option<&str>) -> Result<bool, String> {
        match value.map(str::trim) {
            None | Some("" | "text") => Ok(false),
            Some("json") => Ok(true),
            Some(other) => Err(format!(
                "BALLAST_LOG_FORMAT must be `text` or `json`, not `{other}`"
            )),
        }
    }
}

/// The log formatter as a layer: text, or JSON with the event's fields
/// flattened (and the span it happened in, when spans are on).
fn fmt_layer<S>(log: &LogFormat) -> Box<dyn tracing_subscriber::Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let layer = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    if log.json {
        layer
            .json()
            .flatten_event(true)
            .with_span_list(false)
            .boxed()
    } else {
        layer.with_ansi(log.ansi).boxed()
    }
}

impl Telemetry {
    /// Installs the process-wide subscriber: the log formatter, and the
    /// OTLP exporter when `traces` has an endpoint. Fails when the exporter
    /// cannot be built or a subscriber is already installed.
    pub fn install(
        log: LogFormat,
        traces: Option<&TracesConfig>,
    ) -> Result<Telemetry, TelemetryError> {
        say_json(log.json);
        let Some((url, traces)) = traces.and_then(|t| Some((t.export_url()?, t))) else {
            // The formatter and its filter alone: nothing added to the
            // cost of a log line or a span site.
            tracing_subscriber::registry()
                .with(fmt_layer(&log))
                .with(log.filter)
                .try_init()
                .map_err(|e| TelemetryError::Install(e.to_string()))?;
            return Ok(Telemetry { traces: None });
        };
        let fmt = fmt_layer(&log);
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(url.clone())
            .build()
            .map_err(|e| TelemetryError::Exporter {
                url: url.clone(),
                message: e.to_string(),
            })?;
        // The configured name, else `OTEL_SERVICE_NAME` (the builder reads
        // it), else Ballast's own.
        let name = traces.service_name.clone().or_else(|| {
            let from_env = std::env::var_os("OTEL_SERVICE_NAME").is_some_and(|v| !v.is_empty());
            (!from_env).then(|| "ballast".to_owned())
        });
        let mut resource = opentelemetry_sdk::Resource::builder();
        if let Some(name) = name {
            resource = resource.with_service_name(name);
        }
        let resource = resource.build();
        let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(traces.sample)));
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource)
            .with_sampler(sampler)
            .build();
        let otel = tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("ballast"))
            .with_location(false)
            .with_threads(false)
            .with_tracked_inactivity(false)
            .with_filter(
                tracing_subscriber::filter::filter_fn(|m| {
                    m.target().starts_with("ballast")
                        && (m.is_span() || *m.level() <= tracing::Level::INFO)
                })
                // Nothing below DEBUG is ever wanted: `log` records and
                // TRACE sites elsewhere stay disabled.
                .with_max_level_hint(tracing::level_filters::LevelFilter::DEBUG),
            );
        tracing_subscriber::registry()
            .with(fmt.with_filter(log.filter))
            .with(otel)
            .try_init()
            .map_err(|e| TelemetryError::Install(e.to_string()))?;
        tracing::info!(
            endpoint = %url,
            sample = traces.sample,
            "traces exported over OTLP/HTTP"
        );
        Ok(Telemetry {
            traces: Some(provider),
        })
    }

    /// Sends the spans still queued (waiting at most a few seconds for
    /// the collector) and stops the exporter. Blocks: call it outside the
    /// async runtime, or from a blocking task.
    pub fn shutdown(self) {
        let Some(provider) = self.traces else { return };
        if let Err(e) = provider.shutdown_with_timeout(FLUSH_WITHIN) {
            eprintln!("ballast: traces: the last spans may be lost: {e}");
        }
    }
}

/// The W3C `traceparent` of `span`, for a provider's request, when traces
/// are on; `None` otherwise (a disabled span builds nothing).
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    if span.is_disabled() {
        return None;
    }
    struct Carrier(Option<String>);
    impl Injector for Carrier {
        fn set(&mut self, key: &str, value: String) {
            if key == "traceparent" {
                self.0 = Some(value);
            }
        }
    }
    let mut carrier = Carrier(None);
    TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
    carrier.0
}

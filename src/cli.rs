//! The command line: `serve` (with `--demo`), `migrate`, `user`,
//! `check-config`, `rotate-secret`, `enqueue`, `provider`, `sim`, and the
//! shell completions and manual page made from these definitions.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::auth::password;
use crate::config::{Config, Loaded};
use crate::domain::scope::Scope;
use crate::domain::{Clock, Role, SystemClock, time::format_ms};
use crate::store::{Db, NewUser, StoreError, UserChange, migrate};

/// Environment variable that supplies a password to `user add` and `user passwd`.
pub const PASSWORD_ENV: &str = "BALLAST_PASSWORD";

/// Durable workflows over unreliable third-party APIs, with a control plane.
#[derive(Debug, Parser)]
#[command(name = "ballast", version, propagate_version = true)]
pub struct Cli {
    /// Configuration file (TOML). Without it, `./ballast.toml` is read if it
    /// exists; `BALLAST_*` environment variables override either.
    #[arg(long, global = true, env = "BALLAST_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the control plane and the workers: migrates the database, creates
    /// the first admin on an empty one, serves HTTP, stops gracefully on
    /// SIGINT/SIGTERM.
    Serve {
        /// Address to listen on, overriding `server.bind` (default 127.0.0.1:8080).
        #[arg(long, value_name = "ADDR")]
        bind: Option<SocketAddr>,
        /// Demo mode: chaos simulators in-process, demo pipelines and a
        /// generator feeding them, on `ballast-demo.db` unless a database is
        /// configured.
        #[arg(long)]
        demo: bool,
        /// Records per second the demo generator enqueues.
        #[arg(long, value_name = "N", default_value_t = 2.0, requires = "demo")]
        demo_rate: f64,
    },
    /// Apply, revert or list the schema migrations embedded in this binary.
    Migrate {
        #[command(subcommand)]
        action: MigrateCommand,
    },
    /// Manage control-plane users.
    User {
        #[command(subcommand)]
        action: UserCommand,
    },
    /// Validate the configuration, print where each part came from, and exit
    /// non-zero on the first problem.
    CheckConfig,
    /// Copy a SQLite database to FILE while it serves: one consistent
    /// moment of it (SQLite's VACUUM INTO), checked after. For PostgreSQL
    /// use pg_dump (docs/operations.md, "Backups").
    Backup {
        /// The new file to write (refused if it exists).
        file: std::path::PathBuf,
    },
    /// Delete finished records past their pipeline's `retain` (and blank
    /// the excerpts of attempts past `retain_excerpts`), as the nodes do
    /// once a minute; or, with --dry-run, say what would go. Parked
    /// records are never deleted.
    Purge {
        /// Only this pipeline (one no longer configured needs --older-than).
        #[arg(long)]
        pipeline: Option<String>,
        /// Records finished longer ago than this (`30d`, `12h`), instead
        /// of each pipeline's `retain`.
        #[arg(long)]
        older_than: Option<String>,
        /// Count what would go; delete nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Write records as JSON Lines or CSV, newest first, with their steps'
    /// outputs (and attempts): the records page's filters, streamed, so a
    /// million records do not sit in memory.
    Export(ExportArgs),
    /// Print an export of a database encrypted at rest with its sealed
    /// values opened (with the configured data keys): the export as it
    /// would have been made with --decrypt.
    OpenExport {
        /// The export file (.jsonl or .csv).
        file: PathBuf,
        /// jsonl or csv (by default, from the file's extension).
        #[arg(long)]
        format: Option<String>,
    },
    /// Replace the generated session signing key (kept in the database) and
    /// end every session. Restart every node afterwards. Not needed when
    /// BALLAST_SECRET_KEY is set: change that variable instead.
    RotateSecret,
    /// Re-seal every value kept encrypted at rest with the data key
    /// `database.encryption.key` names (or write them in clear when it
    /// names none), in batches while the nodes run; then retire the keys
    /// no value uses. Reload every node with the new key first.
    RotateDataKey {
        /// Values per transaction.
        #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=10_000))]
        batch: u32,
    },
    /// Enqueue one record; repeating it with the same --key returns the
    /// record already enqueued instead of creating another.
    Enqueue {
        /// The pipeline to run.
        pipeline: String,
        /// External key: idempotency of the enqueue, unique per pipeline.
        #[arg(long)]
        key: Option<String>,
        /// The record's group (a tenant, say): a pipeline's groups share
        /// the workers fairly, and its `group_concurrency` caps each.
        #[arg(long)]
        group: Option<String>,
        /// 0 to 9 (5 when left out): within its pipeline and group, a
        /// record of higher priority is claimed first.
        #[arg(long, value_parser = clap::value_parser!(u8).range(0..=9))]
        priority: Option<u8>,
        /// The record's input, a JSON value.
        #[arg(long, default_value = "{}")]
        input: String,
        /// Due at this UTC moment (`2026-12-02T09:00Z`) instead of now.
        #[arg(long, conflicts_with = "delay")]
        run_at: Option<String>,
        /// Due this long from now (`90s`, `2h`, `1d`) instead of now.
        #[arg(long)]
        delay: Option<String>,
    },
    /// Pause, resume or list providers. A paused provider gets no calls;
    /// its records wait, spending no attempts.
    Provider {
        #[command(subcommand)]
        action: ProviderCommand,
    },
    /// Run the chaos simulator: a provider that fails like real ones, for
    /// trying pipelines and for tests and benchmarks.
    Sim(SimArgs),
    /// Ask a running node to read its configuration again, as SIGHUP does:
    /// providers and pipelines change without a restart (records under way
    /// keep their pipeline's version); a file that does not pass
    /// `check-config` is refused and the node runs on as it was. Needs an
    /// admin API token in BALLAST_API_TOKEN.
    Reload {
        /// The node (default: BALLAST_SERVER_BIND, else `server.bind` of
        /// the configuration file, on loopback when it is every address).
        #[arg(long, value_name = "URL")]
        url: Option<String>,
    },
    /// Print a shell's completion script for every command and flag
    /// (`ballast completions bash > /etc/bash_completion.d/ballast`).
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Print the API's OpenAPI 3.1 document, as a node serves it at
    /// `/api/v1/openapi.json` (to generate a client without a node).
    Openapi,
    /// Print the manual page (roff) to standard output, or with `--dir`
    /// write one page per command there (`ballast.1`, `ballast-serve.1` …).
    Man {
        /// Write every command's page into this directory (it must exist).
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
}

/// `ballast export`'s flags.
#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    #[arg(long)]
    pipeline: Option<String>,
    /// pending, running, waiting, retrying, succeeded, failed, parked,
    /// cancelled.
    #[arg(long)]
    state: Option<String>,
    #[arg(long)]
    provider: Option<String>,
    #[arg(long)]
    step: Option<String>,
    #[arg(long)]
    error_code: Option<String>,
    /// Records of this group (given at enqueue).
    #[arg(long)]
    group: Option<String>,
    /// Records of this priority (0 to 9).
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=9))]
    priority: Option<u8>,
    /// Records whose external key starts with this.
    #[arg(long)]
    key_prefix: Option<String>,
    /// jsonl or csv.
    #[arg(long, default_value = "jsonl")]
    format: String,
    /// Each record's attempts too.
    #[arg(long)]
    attempts: bool,
    /// Write to this new file instead of standard output.
    #[arg(long, short)]
    out: Option<std::path::PathBuf>,
    /// Of a database encrypted at rest: values in clear (they are
    /// written sealed otherwise; `ballast open-export` opens them).
    #[arg(long)]
    decrypt: bool,
}

/// `ballast sim`'s flags.
#[derive(Debug, clap::Args)]
pub struct SimArgs {
    /// Port on 127.0.0.1.
    #[arg(long, default_value_t = 8090)]
    port: u16,
    /// `chaos` (the default mix: ~87% good answers) or `clean`.
    #[arg(long, default_value = "chaos", value_parser = ["chaos", "clean"])]
    profile: String,
    /// Seed of the failure mix, so a run repeats.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Multiplies every latency (0 for instant answers).
    #[arg(long, default_value_t = 1.0)]
    latency_scale: f64,
    /// Every answer takes exactly this long (`50ms`), instead of the
    /// profile's spread of latencies.
    #[arg(long, value_name = "DURATION", value_parser = crate::config::parse_duration)]
    latency: Option<std::time::Duration>,
    /// A scheduled outage, AFTER+LASTS[@FRACTION] from the start:
    /// `30s+10s` fails everything for 10 s, `1m+2m@0.5` half of it.
    #[arg(long, value_name = "AFTER+LASTS[@F]")]
    outage: Vec<crate::sim::Outage>,
    /// A scheduled maintenance window, AFTER+LASTS@RETRY_AFTER from the
    /// start: `1m+10s@30s` answers every call `503` with `Retry-After: 30`
    /// for 10 s.
    #[arg(long, value_name = "AFTER+LASTS@RA")]
    maintenance: Vec<crate::sim::Maintenance>,
    /// Sign callbacks with the secret in this environment variable.
    #[arg(long, value_name = "VAR")]
    callback_secret_env: Option<String>,
    /// Share of calls answered `302 Found` to `/v1/moved/{id}` (which says
    /// "succeeded"), doing nothing. Drawn after the profile's own faults,
    /// as are the next two.
    #[arg(long, value_name = "P", default_value_t = 0.0, value_parser = probability)]
    redirects: f64,
    /// Share of calls answered 200 with a gzip body that inflates to
    /// 64 MiB (the call's effect applied).
    #[arg(long, value_name = "P", default_value_t = 0.0, value_parser = probability)]
    gzip_bombs: f64,
    /// Share of calls answered 200 with a JSON body that is not UTF-8 (the
    /// call's effect applied).
    #[arg(long, value_name = "P", default_value_t = 0.0, value_parser = probability)]
    bad_utf8: f64,
    /// Share of charges and job submissions that do their work (a charge
    /// made, a job created) and then reset the connection, so the client
    /// never hears of it. Polls and lookups that draw it are answered.
    #[arg(long, value_name = "P", default_value_t = 0.0, value_parser = probability)]
    reset_after_charge: f64,
    /// Share of charges and job submissions that do their work and then
    /// stall past any client timeout. Polls and lookups that draw it are
    /// answered.
    #[arg(long, value_name = "P", default_value_t = 0.0, value_parser = probability)]
    stall_after_charge: f64,
    /// Ignore idempotency keys: a repeated key charges again and creates
    /// another job (find them with `GET /v1/charges?client_reference=R`
    /// and `GET /v1/jobs?client_reference=R`).
    #[arg(long)]
    ignore_keys: bool,
    /// Put OAuth2 client credentials in front of `/v1/*`: tokens from
    /// `POST /oauth/token` last this long (e.g. `5m`).
    #[arg(long, value_name = "DURATION", value_parser = crate::config::parse_duration)]
    oauth2_ttl: Option<std::time::Duration>,
    /// The `expires_in` the token endpoint states (default: the TTL); more
    /// than the TTL makes tokens die early.
    #[arg(long, value_name = "DURATION", value_parser = crate::config::parse_duration, requires = "oauth2_ttl")]
    oauth2_stated_ttl: Option<std::time::Duration>,
    /// The OAuth2 client id (default `sim-client`).
    #[arg(long, value_name = "ID", requires = "oauth2_ttl")]
    oauth2_client_id: Option<String>,
    /// Read the OAuth2 client secret from this environment variable
    /// (default secret: `sim-secret`).
    #[arg(long, value_name = "VAR", requires = "oauth2_ttl")]
    oauth2_client_secret_env: Option<String>,
}

/// A probability, 0 to 1.
fn probability(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!("`{text}` is not a probability from 0 to 1")),
    }
}

#[derive(Debug, Subcommand)]
pub enum ProviderCommand {
    /// Stop calling a provider until it is resumed.
    Pause {
        name: String,
        /// Why, for the audit log and the dashboard.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Call a paused provider again.
    Resume { name: String },
    /// Show every provider's breaker and pause state.
    List,
}

#[derive(Debug, Subcommand)]
pub enum MigrateCommand {
    /// Apply pending migrations (all, or up to `--to`).
    Up {
        /// Stop after this version.
        #[arg(long, value_name = "N")]
        to: Option<i64>,
    },
    /// Revert migrations: the latest one, or every one newer than `--to`
    /// (`--to 0` empties the database).
    Down {
        /// Keep this version and older.
        #[arg(long, value_name = "N")]
        to: Option<i64>,
    },
    /// List every migration and whether it is applied.
    Status,
}

#[derive(Debug, Subcommand)]
pub enum UserCommand {
    /// Create a user. The password is prompted for, or read from
    /// BALLAST_PASSWORD when set (for scripts).
    Add {
        /// Login name: 1-64 characters of a-z, 0-9, `.`, `_`, `-`, `@`.
        username: String,
        /// What the user may do.
        #[arg(long, default_value = "viewer", value_parser = ["viewer", "operator", "admin"])]
        role: String,
        /// Limit the user to these pipelines: names or patterns (`lead-*`)
        /// separated by commas (not for an admin). Default: every pipeline.
        #[arg(long, default_value = "")]
        pipelines: String,
        /// Show the user sensitive fields in clear (`sensitive` of
        /// pipelines and providers); masked otherwise.
        #[arg(long)]
        unmask: bool,
    },
    /// Show a user sensitive fields in clear (`on`) or masked (`off`); ends
    /// their sessions.
    Unmask {
        username: String,
        #[arg(value_parser = ["on", "off"])]
        setting: String,
    },
    /// Limit a user to pipelines (names or patterns separated by commas;
    /// `*` for every pipeline); ends their sessions and revokes the API
    /// tokens they made.
    Pipelines { username: String, pipelines: String },
    /// Set a user's password (prompted, or BALLAST_PASSWORD); ends their sessions.
    Passwd { username: String },
    /// List users.
    List,
    /// Disable a user; ends their sessions.
    Disable { username: String },
    /// Enable a disabled user.
    Enable { username: String },
}

impl Cli {
    /// Writes what `completions` and `man` make, which need no
    /// configuration (none is read for them: a broken one must not stop a
    /// package build); `None` for every other command.
    pub fn print_generated(&self) -> Option<std::io::Result<()>> {
        use clap::CommandFactory;
        let mut cmd = Cli::command();
        match &self.command {
            Command::Completions { shell } => {
                // Made whole first: `generate` panics on a failed write
                // (a closed pipe); this says it as an error instead.
                let mut script = Vec::new();
                clap_complete::generate(*shell, &mut cmd, "ballast", &mut script);
                let mut out = std::io::stdout().lock();
                Some(
                    std::io::Write::write_all(&mut out, &script)
                        .and_then(|()| std::io::Write::flush(&mut out)),
                )
            }
            Command::Openapi => {
                let mut out = std::io::stdout().lock();
                Some(
                    crate::web::openapi()
                        .map_err(std::io::Error::other)
                        .and_then(|doc| std::io::Write::write_all(&mut out, doc.as_bytes()))
                        .and_then(|()| std::io::Write::write_all(&mut out, b"\n"))
                        .and_then(|()| std::io::Write::flush(&mut out)),
                )
            }
            Command::Man { dir: Some(dir) } => Some(clap_mangen::generate_to(cmd, dir)),
            Command::Man { dir: None } => {
                let mut out = std::io::stdout().lock();
                Some(
                    clap_mangen::Man::new(cmd)
                        .render(&mut out)
                        .and_then(|()| std::io::Write::flush(&mut out)),
                )
            }
            _ => None,
        }
    }

    /// Whether the command needs this process's configuration checked:
    /// all but `reload` (the node reads and checks its own file, with the
    /// secrets of its own environment; `reload` reads only the address).
    pub fn needs_config(&self) -> bool {
        !matches!(&self.command, Command::Reload { .. })
    }

    /// The command runs the workers (`serve`): the one that exports
    /// traces when `[traces]` names a collector.
    pub fn serves(&self) -> bool {
        matches!(self.command, Command::Serve { .. })
    }
}

/// Runs one command to completion over its configuration (`Config::load`,
/// which the binary calls first to set up logging and traces).
pub async fn run(cli: Cli, loaded: Loaded) -> anyhow::Result<()> {
    let Loaded { config, file, env } = loaded;
    // Every command checks the pipelines, so a mistake in one is reported
    // before anything starts, whichever command was asked for (but
    // `reload`: the node checks the file it reads, and says what is wrong).
    if let Command::Reload { url } = cli.command {
        let url = match url {
            Some(url) => url,
            None => node_url(cli.config.as_deref())?,
        };
        return reload(&url).await;
    }
    crate::pipeline::compile(&config)?;
    match cli.command {
        Command::CheckConfig => {
            check_config(&config, file, &env);
            Ok(())
        }
        Command::Serve {
            bind,
            demo,
            demo_rate,
        } => serve(config, file, bind, demo, demo_rate).await,
        Command::Reload { .. } => Ok(()),
        Command::RotateSecret => rotate_secret(&config).await,
        Command::RotateDataKey { batch } => rotate_data_key(&config, batch).await,
        Command::Backup { file } => backup(&config, &file).await,
        Command::Export(args) => export(&config, args).await,
        Command::OpenExport { file, format } => open_export(&config, &file, format.as_deref()),
        Command::Purge {
            pipeline,
            older_than,
            dry_run,
        } => purge(&config, pipeline, older_than.as_deref(), dry_run).await,
        Command::Enqueue {
            pipeline,
            key,
            group,
            priority,
            input,
            run_at,
            delay,
        } => {
            let when = When {
                run_at: run_at.as_deref(),
                delay: delay.as_deref(),
            };
            enqueue(
                config,
                &pipeline,
                (key.as_deref(), group.as_deref(), priority),
                &input,
                when,
            )
            .await
        }
        Command::Provider { action } => manage_providers(&config, action).await,
        Command::Sim(args) => sim(args).await,
        Command::Completions { .. } | Command::Openapi | Command::Man { .. } => Ok(()),
        Command::Migrate { action } => manage_migrations(&config, action).await,
        Command::User { action } => manage_users(&config, action).await,
    }
}

/// `export`: the records the flags select, in the format they name, to
/// `--out` or standard output.
async fn export(config: &Config, args: ExportArgs) -> anyhow::Result<()> {
    let ExportArgs {
        pipeline,
        state,
        provider,
        step,
        error_code,
        group,
        priority,
        key_prefix,
        format,
        attempts,
        out,
        decrypt,
    } = args;
    let state = state
        .map(|s| s.parse::<crate::domain::RecordState>())
        .transpose()
        .map_err(|_| anyhow::anyhow!("--state: unknown state"))?;
    let filter = crate::store::RecordFilter {
        pipeline,
        state,
        provider,
        step,
        error_code,
        group,
        priority,
        key_prefix,
        ..Default::default()
    };
    let format = crate::engine::export::Format::parse(&format)
        .map_err(|e| anyhow::anyhow!("--format: {e}"))?;
    let export = crate::engine::export::Export {
        filter,
        format,
        attempts,
        // The command reads the database itself: in clear.
        masking: None,
        sealed: None,
    };
    export_records(config, export, out.as_deref(), decrypt).await
}

/// `open-export`: the file with its sealed values opened, to standard output.
fn open_export(
    config: &Config,
    file: &std::path::Path,
    format: Option<&str>,
) -> anyhow::Result<()> {
    use crate::engine::export::Format;
    let format = match format {
        Some(f) => Format::parse(f),
        None => Format::parse(
            file.extension()
                .and_then(|e| e.to_str())
                .unwrap_or_default(),
        ),
    }
    .map_err(|e| anyhow::anyhow!("--format: {e}"))?;
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read `{}`", file.display()))?;
    let keys = &config.database.encryption.keyring;
    let opened = crate::engine::export::open_export(&text, format, keys)
        .with_context(|| format!("cannot open `{}`", file.display()))?;
    std::io::Write::write_all(&mut std::io::stdout().lock(), opened.as_bytes())?;
    Ok(())
}

/// `provider`: the action on the configured database, migrated first.
async fn manage_providers(config: &Config, action: ProviderCommand) -> anyhow::Result<()> {
    let db = crate::app::connect(config).await?;
    migrate::up(&db, None)
        .await
        .context("cannot migrate the database")?;
    let result = provider_command(&db, config, action).await;
    db.close().await;
    result
}

/// `migrate`: the action on the configured database, as it is.
async fn manage_migrations(config: &Config, action: MigrateCommand) -> anyhow::Result<()> {
    let db = crate::app::connect(config).await?;
    let result = migrate_command(&db, action).await;
    db.close().await;
    result
}

/// `user`: the action on the configured database, migrated first (saying
/// which migrations that applied).
async fn manage_users(config: &Config, action: UserCommand) -> anyhow::Result<()> {
    let db = crate::app::connect(config).await?;
    let applied = migrate::up(&db, None)
        .await
        .context("cannot migrate the database")?;
    if !applied.is_empty() {
        eprintln!("applied migrations {applied:?}");
    }
    let result = user_command(&db, action).await;
    db.close().await;
    result
}

/// `sim`: the chaos simulator on 127.0.0.1 until Ctrl-C.
async fn sim(args: SimArgs) -> anyhow::Result<()> {
    let env_secret = |var: &str| -> anyhow::Result<String> {
        crate::config::secret_var(&|v| std::env::var(v).ok(), var, 1)
            .map_err(anyhow::Error::msg)?;
        std::env::var(var).with_context(|| format!("{var} is not set"))
    };
    let mut p = match args.profile.as_str() {
        "clean" => crate::sim::Profile::clean(args.seed),
        _ => crate::sim::Profile::chaos(args.seed),
    };
    p.latency_scale = args.latency_scale;
    if let Some(fixed) = args.latency {
        p.latency_median = fixed;
        p.latency_sigma = 0.0;
        p.latency_scale = 1.0;
    }
    p.outages = args.outage;
    p.maintenance = args.maintenance;
    p.callback_secret = args
        .callback_secret_env
        .as_deref()
        .map(env_secret)
        .transpose()?;
    p.p_redirect = args.redirects;
    p.p_gzip_bomb = args.gzip_bombs;
    p.p_bad_utf8 = args.bad_utf8;
    p.p_reset_after_effect = args.reset_after_charge;
    p.p_stall_after_effect = args.stall_after_charge;
    p.ignore_keys = args.ignore_keys;
    if let Some(ttl) = args.oauth2_ttl {
        let secret = match args.oauth2_client_secret_env.as_deref() {
            Some(var) => env_secret(var)?,
            None => "sim-secret".to_owned(),
        };
        let id = args.oauth2_client_id.as_deref().unwrap_or("sim-client");
        let mut oauth = crate::sim::SimOAuth2::new(id, &secret, ttl);
        oauth.stated_ttl = args.oauth2_stated_ttl.unwrap_or(ttl);
        p.oauth2 = Some(oauth);
    }
    let port = args.port;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .with_context(|| format!("cannot listen on 127.0.0.1:{port}"))?;
    // The default secret is said; one from the environment is not.
    let secret_said = match &args.oauth2_client_secret_env {
        Some(var) => format!("the secret in {var}"),
        None => "secret `sim-secret`".to_owned(),
    };
    let extras = sim_extras(&p, &secret_said);
    let sim = crate::sim::SimHandle::start(p, listener).await?;
    println!(
        "simulator ({}, seed {}) on {}",
        args.profile,
        args.seed,
        sim.base_url()
    );
    for line in extras {
        println!("  {line}");
    }
    tokio::signal::ctrl_c().await?;
    sim.stop();
    Ok(())
}

/// The simulator's optional faults that are on, a line each, for people.
fn sim_extras(p: &crate::sim::Profile, secret_said: &str) -> Vec<String> {
    use crate::config::HumanDuration;
    let mut lines: Vec<String> = [
        ("redirects", p.p_redirect),
        ("gzip bombs", p.p_gzip_bomb),
        ("bad UTF-8", p.p_bad_utf8),
        ("resets after charging", p.p_reset_after_effect),
        ("stalls after charging", p.p_stall_after_effect),
    ]
    .into_iter()
    .filter(|(_, share)| *share > 0.0)
    .map(|(name, share)| format!("{name}: {share} of calls"))
    .collect();
    if p.ignore_keys {
        lines.push("idempotency keys ignored: a repeated key charges again".to_owned());
    }
    if let Some(o) = &p.oauth2 {
        lines.push(format!(
            "OAuth2: POST /oauth/token, client id `{}`, {secret_said}, tokens last {} (stated {})",
            o.client_id,
            HumanDuration(o.ttl),
            HumanDuration(o.stated_ttl),
        ));
    }
    lines
}

/// `serve [--demo]`: the control plane and the workers until a signal.
async fn serve(
    mut config: Config,
    file: Option<PathBuf>,
    bind: Option<std::net::SocketAddr>,
    demo: bool,
    demo_rate: f64,
) -> anyhow::Result<()> {
    if let Some(bind) = bind {
        config.server.bind = bind;
    }
    let listener = tokio::net::TcpListener::bind(config.server.bind)
        .await
        .with_context(|| format!("cannot listen on {}", config.server.bind))?;
    let shutdown = CancellationToken::new();
    crate::app::cancel_on_signals(shutdown.clone());
    if !demo {
        let source = crate::reload::Source::File { file, bind };
        return crate::app::run_from(config, source, listener, shutdown, |_| {}).await;
    }
    let demo = crate::demo::prepare(&mut config, demo_rate).await?;
    crate::telemetry::say(
        tracing::Level::INFO,
        &format!(
            "ballast: demo mode: simulated providers, demo pipelines, {demo_rate} records/s, database {}",
            config.database.url
        ),
    );
    let hook = format!("http://{}/hooks/render-api", listener.local_addr()?);
    let stop = shutdown.clone();
    crate::app::run_with(config, listener, shutdown, move |state| {
        match state.engine.clone() {
            Some(engine) => {
                tokio::spawn(crate::demo::generate(engine, demo, hook, stop));
            }
            None => tracing::error!("demo mode without workers"),
        }
    })
    .await
}

/// The environment variable `reload` reads an admin API token from.
pub const API_TOKEN_ENV: &str = "BALLAST_API_TOKEN";

/// The address of the node whose configuration is `file` (or
/// `./ballast.toml`): its `server.bind` as written, or `BALLAST_SERVER_BIND`.
/// Nothing else in it is read or checked (the secrets it names are in the
/// node's environment, not this shell's).
fn node_url(file: Option<&std::path::Path>) -> anyhow::Result<String> {
    let bind: SocketAddr = match std::env::var("BALLAST_SERVER_BIND") {
        Ok(text) => text
            .parse()
            .with_context(|| format!("BALLAST_SERVER_BIND `{text}` is not an address"))?,
        Err(_) => bind_in(file)?.unwrap_or(Config::default().server.bind),
    };
    // A node listening on every address answers on loopback.
    let host = if bind.ip().is_unspecified() {
        std::net::IpAddr::from([127, 0, 0, 1])
    } else {
        bind.ip()
    };
    Ok(format!("http://{}", SocketAddr::new(host, bind.port())))
}

/// `server.bind` as `file` (or `./ballast.toml`) writes it, read as plain
/// TOML: a mistake elsewhere in the file is the node's to report.
fn bind_in(file: Option<&std::path::Path>) -> anyhow::Result<Option<SocketAddr>> {
    let file = file
        .map(PathBuf::from)
        .or_else(|| Some(PathBuf::from(crate::config::DEFAULT_FILE)).filter(|p| p.exists()));
    let Some(file) = file else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(&file)
        .with_context(|| format!("cannot read {} (or give --url)", file.display()))?;
    let table: toml::Table = text
        .parse()
        .with_context(|| format!("{} is not TOML (give --url)", file.display()))?;
    let Some(bind) = table.get("server").and_then(|s| s.get("bind")) else {
        return Ok(None);
    };
    let bind = bind
        .as_str()
        .and_then(|b| b.parse().ok())
        .with_context(|| format!("server.bind in {} is not an address", file.display()))?;
    Ok(Some(bind))
}

/// `reload`: `POST /api/v1/reload` on the node at `base`; prints what
/// changed.
async fn reload(base: &str) -> anyhow::Result<()> {
    let token = std::env::var(API_TOKEN_ENV)
        .ok()
        .filter(|t| !t.is_empty())
        .with_context(|| format!("{API_TOKEN_ENV} is not set (an admin's API token)"))?;
    let endpoint = format!("{}/api/v1/reload", base.trim_end_matches('/'));
    let reply = reqwest::Client::new()
        .post(&endpoint)
        .bearer_auth(token)
        .timeout(std::time::Duration::from_secs(60))
        .send()
        .await
        .with_context(|| format!("cannot reach {endpoint}"))?;
    let status = reply.status();
    let body: serde_json::Value = reply
        .json()
        .await
        .with_context(|| format!("{endpoint} answered {status} with no JSON"))?;
    let text = |k: &str| {
        body.get(k)
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_owned()
    };
    if !status.is_success() {
        bail!(
            "the node refused: {} ({}, {status})",
            text("message"),
            text("error")
        );
    }
    let lines = |k: &str| -> Vec<String> {
        body.get(k)
            .and_then(|v| v.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|l| l.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    println!("reloaded: configuration {}", text("version"));
    let changes = lines("changes");
    if changes.is_empty() {
        println!("  nothing changed");
    }
    for line in changes {
        println!("  {line}");
    }
    for section in lines("at_restart") {
        println!("  [{section}] changed in the file: takes effect at a restart");
    }
    Ok(())
}

/// `rotate-secret`: a new session signing key; every session ends.
async fn purge(
    config: &Config,
    pipeline: Option<String>,
    older_than: Option<&str>,
    dry_run: bool,
) -> anyhow::Result<()> {
    use crate::engine::retention::{PurgeOptions, purge};
    let older_than = older_than
        .map(crate::config::parse_duration)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--older-than: {e}"))?;
    let db = crate::app::connect(config).await?;
    // A dry run changes nothing, the schema included.
    if !dry_run {
        migrate::up(&db, None)
            .await
            .context("cannot migrate the database")?;
    }
    let opts = PurgeOptions {
        pipeline,
        older_than,
        dry_run,
        actor: cli_actor(),
        max_batches: None,
    };
    let report = purge(&db, config, SystemClock.now_ms(), &opts).await;
    db.close().await;
    let report = report?;
    if report.pipelines.is_empty() {
        println!("no pipeline has a retention period (`retain`, `retain_excerpts`); nothing to do");
        return Ok(());
    }
    let verb = if dry_run { "would delete" } else { "deleted" };
    for (name, p) in &report.pipelines {
        let states: Vec<String> = p.by_state.iter().map(|(s, n)| format!("{n} {s}")).collect();
        println!(
            "{name}: {verb} {} records ({}), {} attempts, {} events; {} attempts' excerpts {}",
            p.records,
            if states.is_empty() {
                "none".into()
            } else {
                states.join(", ")
            },
            p.attempts,
            p.events,
            p.stripped,
            if dry_run {
                "would be blanked"
            } else {
                "blanked"
            }
        );
    }
    Ok(())
}

async fn export_records(
    config: &Config,
    mut export: crate::engine::export::Export,
    out: Option<&std::path::Path>,
    decrypt: bool,
) -> anyhow::Result<()> {
    use futures_util::StreamExt;
    use std::io::Write;
    if let Some(path) = out.filter(|p| p.exists()) {
        anyhow::bail!("cannot create `{}`: it exists", path.display());
    }
    let db = crate::app::connect(config).await?;
    // Its audit entry is sealed: with a key the database lists.
    if db.keyring().current().is_some() {
        crate::store::admit_keys(&db, &db.keyring(), SystemClock.now_ms()).await?;
    }
    export.sealed = crate::engine::export::Export::sealing(&db, decrypt);
    db.append_event(&crate::store::NewEvent {
        record_id: None,
        at: SystemClock.now_ms(),
        kind: "export".into(),
        actor: cli_actor(),
        audit: true,
        step: None,
        reason: None,
        detail: Some(serde_json::json!({
            "filter": format!("{:?}", export.filter),
            "format": export.format.extension(),
            "attempts": export.attempts,
            "sealed": export.sealed.is_some(),
        })),
    })
    .await?;
    // Written beside the file and put in place once complete: a failed
    // export leaves no file that looks whole.
    let partial = match out {
        Some(p) => Some(
            crate::store::partial_beside(p)
                .ok_or_else(|| anyhow::anyhow!("`{}` is not a file name", p.display()))?,
        ),
        None => None,
    };
    let mut sink: Box<dyn Write> = match &partial {
        Some(path) => Box::new(std::io::BufWriter::new(
            crate::store::create_private(path)
                .with_context(|| format!("cannot create `{}`", path.display()))?,
        )),
        None => Box::new(std::io::BufWriter::new(std::io::stdout().lock())),
    };
    let mut chunks = std::pin::pin!(crate::engine::export::stream(db.clone(), export));
    let mut bytes = 0usize;
    let mut failed = None;
    while let Some(chunk) = chunks.next().await {
        match chunk {
            Ok(c) => {
                bytes += c.len();
                if let Err(e) = sink.write_all(&c) {
                    failed = Some(anyhow::Error::from(e).context("cannot write the export"));
                    break;
                }
            }
            Err(e) => {
                failed = Some(anyhow::Error::from(e).context("the export stopped part way"));
                break;
            }
        }
    }
    db.close().await;
    let flushed = sink.flush().context("cannot write the export");
    drop(sink);
    if let Some(e) = failed.or(flushed.err()) {
        if let Some(p) = &partial {
            let _ = std::fs::remove_file(p);
        }
        return Err(e);
    }
    if let (Some(from), Some(to)) = (&partial, out) {
        if let Err(e) = crate::store::place_new(from, to) {
            let _ = std::fs::remove_file(from);
            return Err(e).with_context(|| format!("cannot create `{}`", to.display()));
        }
    }
    // The process's peak resident memory (Linux): flat however many
    // records went out, since one page is held at a time.
    let peak = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map(|kib| format!("; peak memory {:.1} MiB", kib as f64 / 1024.0))
        .unwrap_or_default();
    eprintln!("exported {:.1} MiB{peak}", bytes as f64 / (1024.0 * 1024.0));
    Ok(())
}

async fn backup(config: &Config, file: &std::path::Path) -> anyhow::Result<()> {
    let db = crate::app::connect(config).await?;
    let crate::store::Db::Sqlite(sqlite) = &db else {
        db.close().await;
        anyhow::bail!(
            "`ballast backup` copies a SQLite database; back up PostgreSQL with pg_dump \
             (docs/operations.md, \"Backups\")"
        );
    };
    let started = SystemClock.instant();
    let copied = sqlite.backup_into(file).await;
    db.close().await;
    copied.with_context(|| format!("cannot back up into `{}`", file.display()))?;
    // Read back: the copy opens, holds a current schema and is whole.
    let url = format!("sqlite://{}", file.display());
    let copy = crate::store::Db::connect(&url, &crate::store::ConnectOptions::default())
        .await
        .with_context(|| format!("cannot open the backup `{}`", file.display()))?;
    let checked = check_backup(&copy).await;
    copy.close().await;
    let (version, records) =
        checked.with_context(|| format!("the backup `{}` is damaged", file.display()))?;
    let bytes = std::fs::metadata(file).map(|m| m.len()).unwrap_or(0);
    println!(
        "backed up into {} in {:.1} s: {:.1} MiB, schema version {version}, {records} records, integrity ok",
        file.display(),
        (SystemClock.instant() - started).as_secs_f64(),
        bytes as f64 / (1024.0 * 1024.0)
    );
    Ok(())
}

/// A backup's schema version and record count, once SQLite finds it whole.
async fn check_backup(copy: &crate::store::Db) -> anyhow::Result<(i64, i64)> {
    let status = migrate::status(copy).await?;
    let version = status
        .iter()
        .filter(|m| m.applied)
        .map(|m| m.version)
        .max()
        .unwrap_or(0);
    // One moment: the maintained counters agree with the rows.
    let nonzero = |mut v: Vec<crate::domain::StateCount>| {
        v.retain(|c| c.count != 0);
        v.sort();
        v
    };
    let counted = nonzero(copy.state_counts().await?);
    let recounted = nonzero(copy.recount_states().await?);
    if counted != recounted {
        anyhow::bail!("its counters ({counted:?}) disagree with its records ({recounted:?})");
    }
    let records: i64 = recounted.iter().map(|c| c.count).sum();
    let crate::store::Db::Sqlite(s) = copy else {
        anyhow::bail!("not a SQLite database");
    };
    let check = s.integrity_check().await?;
    if check != "ok" {
        anyhow::bail!("integrity check: {check}");
    }
    Ok((version, records))
}

/// `rotate-data-key`: every sealed value moved to the current data key,
/// the figures per column printed, the run audited.
async fn rotate_data_key(config: &Config, batch: u32) -> anyhow::Result<()> {
    let db = crate::app::connect(config).await?;
    migrate::up(&db, None)
        .await
        .context("cannot migrate the database")?;
    let ring = db.keyring();
    let target = ring
        .current()
        .unwrap_or("none: values are written in clear");
    eprintln!("re-sealing with data key {target}");
    let done = crate::engine::datakeys::rotate(&db, &SystemClock, batch, |pass, column, r| {
        eprintln!(
            "pass {pass}: {}: {} read, {} re-sealed, {} changed meanwhile",
            column.name(),
            r.scanned,
            r.resealed,
            r.raced
        );
    })
    .await;
    let detail = match &done {
        Ok(d) => serde_json::json!({
            "key": ring.current(),
            "passes": d.passes,
            "resealed": d.resealed,
            "retired": d.retired,
        }),
        Err(e) => serde_json::json!({ "key": ring.current(), "refused": e.to_string() }),
    };
    db.append_event(&crate::store::NewEvent {
        record_id: None,
        at: SystemClock.now_ms(),
        kind: "data_key_rotated".into(),
        actor: cli_actor(),
        audit: true,
        step: None,
        reason: None,
        detail: Some(detail),
    })
    .await?;
    db.close().await;
    let done = done?;
    println!(
        "{} values re-sealed in {} passes; retired keys: {}",
        done.resealed,
        done.passes,
        if done.retired.is_empty() {
            "none".to_owned()
        } else {
            done.retired.join(", ")
        }
    );
    Ok(())
}

async fn rotate_secret(config: &Config) -> anyhow::Result<()> {
    let db = crate::app::connect(config).await?;
    migrate::up(&db, None)
        .await
        .context("cannot migrate the database")?;
    let revoked = db
        .rotate_meta_secret(
            crate::web::SESSION_SECRET_KEY,
            &crate::web::new_session_secret()?,
            SystemClock.now_ms(),
        )
        .await;
    db.close().await;
    let revoked = revoked?;
    println!(
        "new session signing key stored; {revoked} session(s) ended. Restart every ballast node to use it."
    );
    if config.server.secret_key.is_some() {
        println!("note: BALLAST_SECRET_KEY is set and takes precedence over the stored key");
    }
    Ok(())
}

/// `enqueue`: one record, idempotent on its key.
/// When an enqueued record falls due, as given on the command line.
struct When<'a> {
    run_at: Option<&'a str>,
    delay: Option<&'a str>,
}

async fn enqueue(
    config: Config,
    pipeline: &str,
    (key, group, priority): (Option<&str>, Option<&str>, Option<u8>),
    input: &str,
    when: When<'_>,
) -> anyhow::Result<()> {
    let input: serde_json::Value =
        serde_json::from_str(input).map_err(|e| anyhow::anyhow!("--input is not JSON: {e}"))?;
    if let Some(k) = key {
        crate::domain::schedule::check_key(k).map_err(|e| anyhow::anyhow!("--key: {e}"))?;
    }
    // Checked before anything is opened: a bad time changes nothing.
    let delay = when
        .delay
        .map(crate::config::parse_duration)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--delay: {e}"))?;
    let now = crate::domain::Clock::now_ms(&crate::domain::SystemClock);
    let run_at = crate::domain::schedule::due_at(when.run_at, delay, now)
        .map_err(|e| anyhow::anyhow!("--run-at/--delay: {e}"))?;
    let db = crate::app::connect(&config).await?;
    migrate::up(&db, None)
        .await
        .context("cannot migrate the database")?;
    let engine = crate::engine::Engine::new(
        db.clone(),
        std::sync::Arc::new(config),
        crate::engine::EngineOptions::new("cli"),
    )
    .await?;
    let created = engine
        .enqueue(
            crate::engine::Enqueue::new(pipeline, key, input)
                .in_group(group)
                .with_priority(priority)
                .at(run_at),
        )
        .await;
    db.close().await;
    let created = created?;
    if created.created && run_at > now {
        println!(
            "enqueued record {} in {pipeline}, due at {}",
            created.record.id,
            crate::domain::time::format_ms(run_at)
        );
    } else if created.created {
        println!("enqueued record {} in {pipeline}", created.record.id);
    } else {
        println!(
            "already enqueued: record {} ({}) has key {:?}",
            created.record.id,
            created.record.state,
            created.record.external_key.unwrap_or_default()
        );
    }
    Ok(())
}

fn check_config(config: &Config, file: Option<PathBuf>, env: &[String]) {
    match file {
        Some(f) => println!("config file: {}", f.display()),
        None => println!("config file: none (defaults)"),
    }
    if !env.is_empty() {
        println!("overridden by: {}", env.join(", "));
    }
    println!("server.bind: {}", config.server.bind);
    println!("database.url: {}", config.database.url);
    match config.traces.export_url() {
        Some(url) => println!(
            "traces: to {} (sample {}, service {})",
            crate::domain::request::redact_url(&url),
            config.traces.sample,
            config.traces.service_name.as_deref().unwrap_or("ballast")
        ),
        None => println!("traces: off"),
    }
    for (name, p) in &config.providers {
        let limits: Vec<String> = p.rate_limits.iter().map(|r| format!("{r:?}")).collect();
        println!(
            "provider {name}: {} (concurrency {}, limits [{}], {} rules)",
            crate::domain::request::redact_url(&p.base_url),
            p.concurrency,
            limits.join(", "),
            p.rules.len()
        );
    }
    for (name, p) in &config.pipelines {
        let steps: Vec<String> = p.steps.iter().map(step_summary).collect();
        let undo = match p.on_failure {
            Some(crate::config::pipeline::OnFailure::Undo) => "; on failure: undo",
            _ => "",
        };
        println!("pipeline {name}: {}{undo}", steps.join(" → "));
    }
    println!("configuration is valid");
}

/// A step as `check-config` lists it: its name, then in brackets what is
/// more than a required call (its kind, its child pipeline, its join, its
/// condition, its undo).
fn step_summary(s: &crate::config::pipeline::StepConfig) -> String {
    let kind = crate::pipeline::kinds::registered(s.kind);
    let mut notes: Vec<String> = Vec::new();
    if kind.name != "request" {
        notes.push(match &s.pipeline {
            Some(child) => format!("{}: runs {child}", kind.label),
            None => kind.label.to_owned(),
        });
    }
    if !s.needs_any.is_empty() {
        notes.push(format!("any of {}", s.needs_any.join(", ")));
    }
    if let Some(list) = &s.for_each {
        notes.push(format!("for each of {list}, {} at once", s.items_at_once()));
    }
    if let Some(when) = &s.when {
        notes.push(format!("if {when}"));
    }
    if s.undo.is_some() {
        notes.push("undo".into());
    }
    if !s.required {
        notes.push("optional".into());
    }
    match notes.is_empty() {
        true => s.name.clone(),
        false => format!("{} [{}]", s.name, notes.join("; ")),
    }
}

async fn migrate_command(db: &Db, action: MigrateCommand) -> anyhow::Result<()> {
    let backend = db.backend().as_str();
    match action {
        MigrateCommand::Up { to } => {
            // One migration at a time, each announced before it runs, so a
            // long one shows where it is.
            let pending: Vec<(i64, String)> = migrate::status(db)
                .await?
                .into_iter()
                .filter(|m| !m.applied && to.is_none_or(|t| m.version <= t))
                .map(|m| (m.version, m.description.unwrap_or_default()))
                .collect();
            let total = pending.len();
            let mut applied = Vec::new();
            for (i, (v, name)) in pending.into_iter().enumerate() {
                println!("[{}/{total}] applying {v:04} {name}…", i + 1);
                let started = SystemClock.instant();
                applied.extend(migrate::up(db, Some(v)).await?);
                println!(
                    "[{}/{total}] applied {v:04} in {} ms",
                    i + 1,
                    (SystemClock.instant() - started).as_millis()
                );
            }
            println!(
                "{backend}: {} applied; schema at version {}",
                applied.len(),
                current_version(db).await?
            );
        }
        MigrateCommand::Down { to } => {
            let target = match to {
                Some(t) => t,
                None => {
                    // The latest applied version goes; the one before stays.
                    let status = migrate::status(db).await?;
                    let applied: Vec<i64> = status
                        .iter()
                        .filter(|m| m.applied)
                        .map(|m| m.version)
                        .collect();
                    applied.iter().rev().nth(1).copied().unwrap_or(0)
                }
            };
            let reverted = migrate::down(db, target).await?;
            for v in &reverted {
                println!("reverted {v:04}");
            }
            println!(
                "{backend}: {} reverted; schema at version {}",
                reverted.len(),
                current_version(db).await?
            );
        }
        MigrateCommand::Status => {
            println!("{:<8} {:<10} DESCRIPTION", "VERSION", "STATE");
            for m in migrate::status(db).await? {
                let state = if m.applied { "applied" } else { "pending" };
                let desc = m
                    .description
                    .unwrap_or_else(|| "(unknown: applied by a newer ballast)".into());
                println!("{:<8} {:<10} {desc}", format!("{:04}", m.version), state);
            }
            println!(
                "{backend}: binary knows up to version {}",
                migrate::latest_version(db.backend())
            );
        }
    }
    Ok(())
}

/// Who is at the terminal, for the audit log.
fn cli_actor() -> String {
    format!(
        "cli:{}",
        std::env::var("USER").unwrap_or_else(|_| "unknown".into())
    )
}

async fn provider_command(db: &Db, config: &Config, action: ProviderCommand) -> anyhow::Result<()> {
    // The CLI runs no workers: a resume wakes the nodes' loops through
    // their provider sync.
    let config = std::sync::Arc::new(config.clone());
    let ops = crate::engine::Ops::new(db, &config, None, &SystemClock);
    match action {
        ProviderCommand::Pause { name, reason } => {
            ops.pause_provider(&name, true, &cli_actor(), reason)
                .await?;
            println!(
                "paused {name}: its records wait, spending no attempts, until `ballast provider resume {name}`"
            );
        }
        ProviderCommand::Resume { name } => {
            ops.pause_provider(&name, false, &cli_actor(), None).await?;
            println!("resumed {name}");
        }
        ProviderCommand::List => {
            println!(
                "{:<20} {:<10} {:<8} REASON",
                "PROVIDER", "BREAKER", "PAUSED"
            );
            let states = db.provider_states().await?;
            for name in config.providers.keys() {
                let s = states.iter().find(|s| &s.provider == name);
                println!(
                    "{:<20} {:<10} {:<8} {}",
                    name,
                    s.map_or("closed", |s| s.breaker.as_str()),
                    s.is_some_and(|s| s.paused),
                    s.and_then(|s| s.paused_reason.clone()).unwrap_or_default()
                );
            }
        }
    }
    Ok(())
}

async fn current_version(db: &Db) -> anyhow::Result<i64> {
    Ok(migrate::status(db)
        .await?
        .iter()
        .filter(|m| m.applied)
        .map(|m| m.version)
        .max()
        .unwrap_or(0))
}

/// `user passwd`: a new password, asked for (twice); refused for a user
/// who signs on at the OpenID provider before anything is asked.
async fn set_password(db: &Db, username: &str, now: crate::domain::UnixMs) -> anyhow::Result<()> {
    let user = find_user(db, username).await?;
    if user.signs_on {
        let refusal = crate::domain::account::AccountRefusal::SignsOn(username.to_owned());
        return Err(crate::store::StoreError::from(refusal).into());
    }
    let pw = read_new_password(username)?;
    let hash = password::hash_blocking(pw).await?;
    db.update_user(user.id, &UserChange::Password(hash), now)
        .await?;
    println!("password changed for {username}; their sessions are ended");
    Ok(())
}

async fn user_command(db: &Db, action: UserCommand) -> anyhow::Result<()> {
    let now = SystemClock.now_ms();
    match action {
        UserCommand::Add {
            username,
            role,
            pipelines,
            unmask,
        } => {
            let role: Role = role.parse().map_err(anyhow::Error::msg)?;
            crate::store::validate_username(&username)?;
            let pipelines = Scope::parse(&pipelines).map_err(anyhow::Error::msg)?;
            pipelines.check_role(role).map_err(anyhow::Error::msg)?;
            if db.user_by_name(&username).await?.is_some() {
                bail!(
                    "user `{username}` already exists (use `ballast user passwd {username}` to change the password)"
                );
            }
            let pw = read_new_password(&username)?;
            let hash = password::hash_blocking(pw).await?;
            let user = db
                .create_user(
                    &NewUser {
                        username,
                        password_hash: hash,
                        role,
                        pipelines,
                        unmask,
                    },
                    now,
                )
                .await?;
            println!(
                "added user {} with role {} on {}",
                user.username, user.role, user.pipelines
            );
        }
        UserCommand::Unmask { username, setting } => {
            let user = find_user(db, &username).await?;
            let on = setting == "on";
            db.update_user(user.id, &UserChange::Unmask(on), now)
                .await?;
            let shown = if on { "in clear" } else { "masked" };
            println!("{username} now sees sensitive fields {shown}; their sessions are ended");
        }
        UserCommand::Pipelines {
            username,
            pipelines,
        } => {
            let user = find_user(db, &username).await?;
            let scope = Scope::parse(&pipelines).map_err(anyhow::Error::msg)?;
            let user = db
                .update_user(user.id, &UserChange::Pipelines(scope), now)
                .await?;
            println!(
                "{username} now sees {}; their sessions and tokens are ended",
                user.pipelines
            );
        }
        UserCommand::Passwd { username } => set_password(db, &username, now).await?,
        UserCommand::List => {
            println!(
                "{:<24} {:<9} {:<9} {:<20} PIPELINES",
                "USERNAME", "ROLE", "STATUS", "CREATED"
            );
            for u in db.list_users().await? {
                let status = if u.disabled { "disabled" } else { "active" };
                println!(
                    "{:<24} {:<9} {:<9} {:<20} {}",
                    u.username,
                    u.role,
                    status,
                    format_ms(u.created_at),
                    u.pipelines
                );
            }
        }
        UserCommand::Disable { username } => {
            let user = find_user(db, &username).await?;
            db.update_user(user.id, &UserChange::Disabled(true), now)
                .await?;
            println!("disabled {username}; their sessions are ended");
        }
        UserCommand::Enable { username } => {
            let user = find_user(db, &username).await?;
            db.update_user(user.id, &UserChange::Disabled(false), now)
                .await?;
            println!("enabled {username}");
        }
    }
    Ok(())
}

async fn find_user(db: &Db, username: &str) -> anyhow::Result<crate::domain::User> {
    db.user_by_name(username).await?.ok_or_else(|| {
        StoreError::NotFound {
            what: "user",
            key: username.to_owned(),
        }
        .into()
    })
}

/// The new password from `BALLAST_PASSWORD`, or typed twice at the terminal.
fn read_new_password(username: &str) -> anyhow::Result<String> {
    let pw = match std::env::var(PASSWORD_ENV) {
        Ok(pw) => pw,
        Err(_) => {
            if !std::io::stdin().is_terminal() {
                bail!("no terminal to prompt for a password: set {PASSWORD_ENV}");
            }
            let first = rpassword::prompt_password(format!("password for {username}: "))?;
            let again = rpassword::prompt_password("again: ")?;
            if first != again {
                bail!("the passwords do not match");
            }
            first
        }
    };
    password::check_policy(&pw)?;
    Ok(pw)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sim_args(args: &[&str]) -> Result<SimArgs, clap::Error> {
        let argv = ["ballast", "sim"].iter().chain(args);
        match Cli::try_parse_from(argv)?.command {
            Command::Sim(a) => Ok(a),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn sim_flags_parse_and_refuse_what_is_not_a_probability_or_a_duration() {
        let a = sim_args(&[
            "--redirects",
            "0.1",
            "--gzip-bombs",
            "1",
            "--bad-utf8",
            "0",
            "--reset-after-charge",
            "0.25",
            "--stall-after-charge",
            "0.5",
            "--ignore-keys",
            "--oauth2-ttl",
            "5m",
            "--oauth2-stated-ttl",
            "1h",
            "--oauth2-client-id",
            "me",
        ])
        .unwrap();
        assert_eq!((a.redirects, a.gzip_bombs, a.bad_utf8), (0.1, 1.0, 0.0));
        assert_eq!((a.reset_after_charge, a.stall_after_charge), (0.25, 0.5));
        assert!(a.ignore_keys);
        assert_eq!(a.oauth2_ttl, Some(std::time::Duration::from_secs(300)));
        assert_eq!(
            a.oauth2_stated_ttl,
            Some(std::time::Duration::from_secs(3600))
        );
        assert_eq!(a.oauth2_client_id.as_deref(), Some("me"));
        let none = sim_args(&[]).unwrap();
        assert_eq!((none.redirects, none.oauth2_ttl), (0.0, None));
        assert_eq!(
            (none.reset_after_charge, none.stall_after_charge),
            (0.0, 0.0)
        );
        assert!(!none.ignore_keys);
        for bad in [
            &["--redirects", "1.5"][..],
            &["--bad-utf8", "-0.1"],
            &["--gzip-bombs", "NaN"],
            &["--reset-after-charge", "2"],
            &["--stall-after-charge", "-1"],
            &["--ignore-keys", "yes"],
            &["--oauth2-ttl", "soon"],
            // OAuth2's other flags mean nothing without a TTL.
            &["--oauth2-client-id", "me"],
        ] {
            assert!(sim_args(bad).is_err(), "{bad:?}");
        }
    }
}

//! Start-up and supervision: connect, migrate, serve, heartbeat, and shut
//! down gracefully when the token is cancelled. `main` and the tests call
//! the same [`run`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, Secret};
use crate::domain::host::HEARTBEAT_EVERY;
use crate::domain::{Clock, Role, SystemClock};
use crate::reload::{Reloader, Source};
use crate::store::{ConnectOptions, Db, NewUser, NodeBeat, migrate};
use crate::web::AppState;

/// Connects to the configured database.
pub async fn connect(config: &Config) -> anyhow::Result<Db> {
    let opts = ConnectOptions {
        max_connections: config.database.max_connections,
        acquire_timeout: config.database.acquire_timeout.0,
        busy_timeout: config.database.busy_timeout.0,
        keyring: config.database.encryption.keyring.clone(),
    };
    let db = Db::connect(config.database.url.expose(), &opts)
        .await
        .with_context(|| format!("cannot open database {}", config.database.url))?;
    db.set_notify_filters(config.notify.iter().map(|n| n.filter()).collect());
    Ok(db)
}

/// Tells systemd how start-up and shutdown go, when it started this process
/// with `Type=notify` (`NOTIFY_SOCKET` set); nothing otherwise.
fn tell_systemd(state: &[sd_notify::NotifyState]) {
    if let Err(e) = sd_notify::notify(false, state) {
        tracing::warn!(error = %e, "could not notify systemd");
    }
}

/// Pings systemd's watchdog (`WatchdogSec=`, `WATCHDOG_USEC` set) at half
/// its interval while the engine's dispatch loop turns (without an
/// engine, while the server runs): a wedged loop stops the pings, and
/// systemd restarts the node.
async fn watchdog(engine: Option<crate::engine::Engine>, shutdown: CancellationToken) {
    let mut usec = 0;
    if !sd_notify::watchdog_enabled(false, &mut usec) {
        return;
    }
    let limit = Duration::from_micros(usec);
    let mut withheld = false;
    loop {
        tokio::select! {
            () = tokio::time::sleep(limit / 2) => {}
            () = shutdown.cancelled() => return,
        }
        if engine.as_ref().is_none_or(|e| e.turned_within(limit)) {
            tell_systemd(&[sd_notify::NotifyState::Watchdog]);
            withheld = false;
        } else if !withheld {
            tracing::error!(
                limit_ms = limit.as_millis() as u64,
                "the engine's loop has not turned within the watchdog's limit: no ping (systemd restarts the node)"
            );
            withheld = true;
        }
    }
}

/// What start-up did about the first user.
#[derive(Debug, PartialEq, Eq)]
pub enum Bootstrap {
    /// There were users already.
    NotNeeded,
    /// `admin` was created with the configured password.
    Configured,
    /// `admin` was created with this random password, to show once.
    Generated(String),
}

/// On a database without users, creates `admin` (role admin) with the
/// configured password or a random one. There is never a default password.
/// Several nodes (or a `user add`) at once agree: the first user is made
/// only while there is none.
pub async fn bootstrap_admin(db: &Db, configured: Option<&Secret>) -> anyhow::Result<Bootstrap> {
    if !db.list_users().await?.is_empty() {
        return Ok(Bootstrap::NotNeeded);
    }
    let (password, generated) = match configured {
        Some(p) => (p.expose().to_owned(), false),
        None => {
            // 26 letters of 62 from the OS's CSPRNG: about 154 bits.
            (crate::auth::secret::password(26)?, true)
        }
    };
    let hash = crate::auth::password::hash_blocking(password.clone())
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let user = NewUser {
        username: "admin".into(),
        password_hash: hash,
        role: Role::Admin,
        pipelines: crate::domain::scope::Scope::all(),
        // The installer's account: every permission (drop it on the Users
        // page once others manage the data).
        unmask: true,
    };
    // Checked again with the creation, atomically: a `user add` or another
    // node's start-up since the first look leaves this one nothing to do.
    match db.create_first_user(&user, SystemClock.now_ms()).await {
        Ok(None) => {
            tracing::info!(
                "a user was created by another process meanwhile; `admin` is not created"
            );
            Ok(Bootstrap::NotNeeded)
        }
        Ok(Some(_)) => Ok(if generated {
            Bootstrap::Generated(password)
        } else {
            Bootstrap::Configured
        }),
        Err(e) => Err(e.into()),
    }
}

/// Runs the control plane on `listener` until `shutdown` is cancelled:
/// migrates the database, serves HTTP, keeps the node's heartbeat, then
/// drains within the configured grace period.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    run_with(config, listener, shutdown, |_| {}).await
}

/// [`run`], calling `on_start` with the state once everything is up (the
/// demo starts its generator there).
pub async fn run_with(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
    on_start: impl FnOnce(&AppState),
) -> anyhow::Result<()> {
    let source = Source::Built("made by the program");
    run_from(config, source, listener, shutdown, on_start).await
}

/// [`run_with`] for a configuration read from `source`, which SIGHUP and
/// `POST /api/v1/reload` read again (`crate::reload`).
pub async fn run_from(
    config: Config,
    source: Source,
    listener: TcpListener,
    shutdown: CancellationToken,
    on_start: impl FnOnce(&AppState),
) -> anyhow::Result<()> {
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    run_on_clock(config, source, listener, shutdown, clock, on_start).await
}

/// [`run_from`] reading time from `clock`: tests drive a node's time with
/// a manual clock (login delays, idle sessions).
pub async fn run_on_clock(
    config: Config,
    source: Source,
    listener: TcpListener,
    shutdown: CancellationToken,
    clock: Arc<dyn Clock>,
    on_start: impl FnOnce(&AppState),
) -> anyhow::Result<()> {
    // SIGHUP's default action ends the process: taken from here on (a
    // long migration may come first), and read as a reload once serving.
    #[cfg(unix)]
    let hangups = hangups();
    // Metrics are recorded from the start, not from the first scrape; and
    // before `assemble`: provider runtimes keep the handles they register
    // (`engine::call_metrics`), which count into the recorder of the time.
    let _ = crate::web::metrics::handle();
    let db = ready_database(&config).await?;
    let grace = config.server.shutdown_grace.0;
    let (state, engine) = assemble(config, source, &db, &shutdown, clock).await?;

    let tasks = TaskTracker::new();
    tasks.spawn(crate::web::housekeeping(state.clone()));
    #[cfg(unix)]
    if let Some(hangups) = hangups {
        let reloader = state.reloader.clone();
        tasks.spawn(reload_on_hangup(hangups, reloader, shutdown.clone()));
    }
    if let Some(engine) = engine {
        let stop = shutdown.clone();
        // The engine keeps the node's heartbeat while it runs.
        tasks.spawn(async move { engine.run(stop, grace).await });
    } else {
        tasks.spawn(heartbeat(state.clone()));
    }

    let addr = listener.local_addr()?;
    say_listening(addr, &state);
    on_start(&state);
    // Migrated, the first admin made, the listener bound: ready.
    tell_systemd(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(&format!("serving on {addr}")),
    ]);
    tasks.spawn(watchdog(state.engine.clone(), shutdown.clone()));
    let app = crate::web::router(state.clone());
    let server = axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown.clone().cancelled_owned());
    let server = tokio::spawn(async move { server.await });

    shutdown.cancelled().await;
    drain(server, &tasks, grace).await;
    db.close().await;
    Ok(())
}

/// The configured database, connected and migrated, with its first user
/// made if it had none.
async fn ready_database(config: &Config) -> anyhow::Result<Db> {
    let db = connect(config).await?;
    let applied = migrate::up(&db, None)
        .await
        .context("cannot migrate the database")?;
    if !applied.is_empty() {
        tracing::info!(versions = ?applied, "applied migrations");
    }
    let bootstrap = bootstrap_admin(&db, config.server.admin_password.as_ref()).await?;
    announce_bootstrap(bootstrap);
    Ok(db)
}

/// Says what start-up did about the first user: a generated password is
/// shown once, whatever the log filter.
fn announce_bootstrap(bootstrap: Bootstrap) {
    match bootstrap {
        Bootstrap::NotNeeded => {}
        Bootstrap::Configured => {
            tracing::info!(
                "created user `admin` with the password from BALLAST_ADMIN_PASSWORD (or its _FILE)"
            );
        }
        Bootstrap::Generated(password) => {
            // Whatever the log filter: shown once.
            crate::telemetry::say(
                tracing::Level::WARN,
                &format!(
                    "\nballast: first start: created user `admin` with password\n\n    {password}\n\n  \
                     It is shown only this once. Change it with `ballast user passwd admin`.\n"
                ),
            );
        }
    }
}

/// The node's state: its id, its workers (when the configuration has
/// pipelines; returned beside the state to be run) and the control plane,
/// all on one clock.
async fn assemble(
    config: Config,
    source: Source,
    db: &Db,
    shutdown: &CancellationToken,
    clock: Arc<dyn Clock>,
) -> anyhow::Result<(AppState, Option<crate::engine::Engine>)> {
    let config = Arc::new(config);
    let node_id: Arc<str> = crate::domain::host::new_node_id().into();
    // One clock for the workers and the control plane.
    let engine = if config.pipelines.is_empty() {
        None
    } else {
        let mut opts = crate::engine::EngineOptions::new(node_id.to_string());
        opts.lease = config.engine.lease.0;
        opts.idle_max = config.engine.idle_max.0;
        opts.batch = config.engine.batch;
        opts.max_in_flight = config.engine.max_in_flight as usize;
        Some(
            crate::engine::Engine::with_clock(db.clone(), config.clone(), opts, clock.clone())
                .await
                .context("cannot start the workers")?,
        )
    };
    let web = crate::web::context(&config, db, clock.clone())
        .await
        .context("cannot set up the control plane")?;
    let live = crate::config::Live::new(config);
    let reloader = Arc::new(Reloader::new(
        source,
        live.clone(),
        engine.clone(),
        db.clone(),
        node_id.clone(),
        clock.clone(),
    ));
    let state = AppState {
        db: db.clone(),
        config: live,
        reloader,
        node_id,
        shutdown: shutdown.clone(),
        engine: engine.clone(),
        web,
        clock,
    };
    Ok((state, engine))
}

/// Logs where the node listens and says where its dashboard is.
fn say_listening(addr: SocketAddr, state: &AppState) {
    tracing::info!(%addr, node.id = %state.node_id, backend = state.db.backend().as_str(), "ballast listening");
    let url = state
        .config
        .get()
        .server
        .public_url
        .clone()
        .unwrap_or_else(|| format!("http://{addr}/"));
    crate::telemetry::say(
        tracing::Level::INFO,
        &format!("ballast: dashboard at {url}"),
    );
}

/// Once shutdown is asked: waits for the server and the background tasks
/// up to `grace` (and five seconds more), and says how the stop went.
async fn drain(
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    tasks: &TaskTracker,
    grace: Duration,
) {
    tell_systemd(&[sd_notify::NotifyState::Stopping]);
    tracing::info!(grace_ms = grace.as_millis() as u64, "shutting down");
    tasks.close();
    // The workers use `grace` for in-flight calls, then release leases.
    let drained = tokio::time::timeout(grace + Duration::from_secs(5), async {
        let served = server.await;
        tasks.wait().await;
        served
    })
    .await;
    match drained {
        Ok(Ok(Ok(()))) => tracing::info!("stopped cleanly"),
        Ok(Ok(Err(e))) => tracing::error!(error = %e, "server failed"),
        Ok(Err(e)) => tracing::error!(error = %e, "server task panicked"),
        Err(_) => tracing::warn!(
            tasks = tasks.len(),
            "grace period over; stopping with work still running"
        ),
    }
}

/// SIGHUP, taken from the process's default (which ends it).
#[cfg(unix)]
fn hangups() -> Option<tokio::signal::unix::Signal> {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::hangup()) {
        Ok(hup) => Some(hup),
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP; reload through the API");
            None
        }
    }
}

/// Reloads the configuration on each SIGHUP until shutdown (a refusal is
/// logged by the reloader; the node goes on as it was). A SIGHUP that came
/// while the node started is one reload now.
#[cfg(unix)]
async fn reload_on_hangup(
    mut hup: tokio::signal::unix::Signal,
    reloader: Arc<Reloader>,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            got = hup.recv() => if got.is_none() { return },
            () = shutdown.cancelled() => return,
        }
        tracing::info!("SIGHUP: reloading the configuration");
        let _ = reloader.reload("signal:SIGHUP").await;
    }
}

/// Registers this node and beats until shutdown, then deregisters.
async fn heartbeat(state: AppState) {
    let clock = state.clock.clone();
    let started = clock.now_ms();
    loop {
        let beat = NodeBeat::this_process(&state.node_id, started).running(state.config.version());
        if let Err(e) = state.db.heartbeat(&beat, clock.now_ms()).await {
            tracing::warn!(error = %e, "heartbeat failed");
        }
        tokio::select! {
            () = tokio::time::sleep(HEARTBEAT_EVERY) => {}
            () = state.shutdown.cancelled() => break,
        }
    }
    if let Err(e) = state.db.remove_node(&state.node_id).await {
        tracing::warn!(error = %e, "could not deregister node");
    }
}

/// Cancels `token` on SIGINT or SIGTERM.
pub fn cancel_on_signals(token: CancellationToken) {
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            match signal(SignalKind::terminate()) {
                Ok(mut term) => {
                    tokio::select! {
                        _ = ctrl_c => {}
                        _ = term.recv() => {}
                    }
                }
                Err(_) => {
                    let _ = ctrl_c.await;
                }
            }
        }
        #[cfg(not(unix))]
        {
            let _ = ctrl_c.await;
        }
        token.cancel();
    });
}

//! The `ballast` binary: parse the command line, read the configuration,
//! set up logging (and traces, for `serve` with `[traces]`), run.

use std::process::ExitCode;

use ballast::config::Config;
use ballast::telemetry::{LogFormat, Telemetry};
use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = ballast::cli::Cli::parse();
    if let Some(written) = cli.print_generated() {
        return match written {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let json = match LogFormat::parse_kind(std::env::var("BALLAST_LOG_FORMAT").ok().as_deref()) {
        Ok(json) => json,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    ballast::telemetry::say_json(json);
    let fail = |line: String| {
        ballast::telemetry::say(tracing::Level::ERROR, &line);
        ExitCode::FAILURE
    };
    // `reload` asks a node to read and check its own file (this one may
    // be the bad one being reloaded, and its secrets are in the node's
    // environment): it reads only the node's address, itself.
    let loaded = if cli.needs_config() {
        match Config::load(cli.config.as_deref()) {
            Ok(loaded) => loaded,
            Err(e) => return fail(format!("error: {e}")),
        }
    } else {
        ballast::config::Loaded {
            config: Config::default(),
            file: None,
            env: Vec::new(),
        }
    };
    let filter = std::env::var("BALLAST_LOG")
        .ok()
        .and_then(|f| EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| EnvFilter::new("info,sqlx=warn"));
    // Colours only for a person at a terminal, not in files and journals.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let traces = cli.serves().then_some(&loaded.config.traces);
    let log = LogFormat { filter, ansi, json };
    let telemetry = match Telemetry::install(log, traces) {
        Ok(t) => t,
        Err(e) => return fail(format!("error: {e}")),
    };

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(format!("error: cannot start the async runtime: {e}")),
    };
    let result = runtime.block_on(ballast::cli::run(cli, loaded));
    // One line: the error and its causes, said before the wait below.
    if let Err(e) = &result {
        fail(format!("error: {}", ballast::advice::report(e)));
    }
    // The last passes' spans leave before the process does.
    telemetry.shutdown();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::FAILURE,
    }
}

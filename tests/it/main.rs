//! The one integration-test binary. Store tests run against SQLite and
//! PostgreSQL; PostgreSQL comes from `BALLAST_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`). Without it, PostgreSQL
//! tests print a SKIP line, except under `CI=true`, where they fail.
#![allow(clippy::unwrap_used, clippy::expect_used)]
// The tests run real processes, databases and sockets, so they bound their
// waits by real time (a broken build fails instead of hanging) and print
// what a run took; `src/` reads time only through its clock. No test
// asserts how long something took.
#![allow(clippy::disallowed_methods)]

mod api;
mod approvals;
mod architecture;
mod browser;
mod children;
mod cli;
mod cluster;
mod conditions;
mod encryption;
mod engine;
mod faults;
mod for_each;
mod fuzz;
mod helpers;
mod http;
mod migrations;
mod notify;
mod openapi;
mod per_step;
mod pipelines;
mod reload;
mod scale;
mod scopes;
mod secrets;
#[path = "../../benches/support/seed.rs"]
mod seed;
mod sensitive;
mod sign_on;
mod sigv4;
mod store;
mod tls;
mod traces;
mod triggers;
mod undo;
mod wait;
mod web;
mod workflows;

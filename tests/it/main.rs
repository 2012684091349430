//! The one integration-test binary. Store tests run against SQLite and
//! PostgreSQL; PostgreSQL comes from `BALLAST_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`). Without it, PostgreSQL
//! tests print a SKIP line, except under `CI=true`, where they fail.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod api;
mod browser;
mod cli;
mod engine;
mod faults;
mod fuzz;
mod helpers;
mod http;
mod migrations;
mod scale;
#[path = "../../benches/support/seed.rs"]
mod seed;
mod store;
mod wait;
mod web;

//! Ballast: durable workflows over unreliable third-party APIs, with a
//! control plane to see and steer every record. See `ARCHITECTURE.md`.

pub mod advice;
pub mod app;
pub mod auth;
pub mod cli;
pub mod config;
pub mod demo;
pub mod domain;
pub mod engine;
pub mod pipeline;
pub mod reload;
pub mod sim;
pub mod store;
pub mod telemetry;
pub mod web;

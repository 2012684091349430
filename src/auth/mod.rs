//! Authentication building blocks: password hashing now; sessions, tokens
//! and the request extractors join as the control plane grows.

pub mod password;
pub mod presets;
pub mod seal;
pub mod secret;
pub mod signing;
pub mod webhook;

//! pxed: a single-binary PXE/iPXE boot and reinstall appliance.
//!
//! One process answers DHCP (full or proxy), serves TFTP and HTTP, keeps inventory and
//! every node's lifecycle in SQLite, and drives BMCs. See `shared/DESIGN.md` for the
//! architecture; each server takes an already-bound socket and a cancellation token.

pub(crate) mod agent;
pub(crate) mod app;
pub mod bmc;
pub(crate) mod boot;
pub mod cli;
pub(crate) mod client;
pub mod config;
pub mod credential;
pub mod dhcp;
pub(crate) mod discovery;
pub mod hardware;
pub(crate) mod hostname;
pub mod http;
pub mod images;
pub mod install;
pub mod inventory;
pub mod leftovers;
pub mod lifecycle;
pub mod metrics;
pub use pxed_model as model;
pub mod net;
pub mod pacing;
pub mod provision;
pub mod script;
pub mod stages;
pub mod state;
pub mod store;
pub mod telemetry;
pub mod tftp;
pub mod webhook;
pub mod wire;

/// An error and its sources, `: `-joined, each cause once (an HTTP client's error says
/// "error sending request", its source says why: connection refused, a TLS failure).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}

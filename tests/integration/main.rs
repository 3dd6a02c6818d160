//! Integration tests: one binary, one module per area.

mod bmc;
mod bmc_lifecycle;
mod common;
mod crash;
mod daemon;
mod install;
mod lifecycle;
mod tftp;

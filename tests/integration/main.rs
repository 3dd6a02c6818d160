//! Integration tests: one binary, one module per area.

mod bmc;
mod bmc_lifecycle;
mod board;
mod cli;
mod common;
mod crash;
mod daemon;
mod dhcp;
mod image_check;
mod install;
mod lifecycle;
mod netns;
mod qemu;
mod status;
mod telemetry;
mod tftp;

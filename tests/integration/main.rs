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
mod instances;
mod inventory;
mod lifecycle;
mod lldp;
mod netboot;
mod netns;
mod pacing;
mod postgres;
mod qemu;
mod slurm;
mod stages;
mod status;
mod telemetry;
mod tftp;
mod webhooks;

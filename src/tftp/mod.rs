//! Read-only TFTP server on tokio.

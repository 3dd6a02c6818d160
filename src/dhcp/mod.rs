//! DHCP server (full and proxy).

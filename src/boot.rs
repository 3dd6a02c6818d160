//! Boot decision: what a PXE client is told to fetch (filled in by the DHCP work).

//! BMC drivers (Redfish, IPMI).

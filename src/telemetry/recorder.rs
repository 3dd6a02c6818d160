//! The recorder (stub).

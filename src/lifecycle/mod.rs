//! Node lifecycle: the pure transition function, its application in one transaction,
//! and the worker that runs effects and deadlines.

pub mod apply;
pub mod worker;

//! Node lifecycle: the pure transition function, its application in one transaction,
//! the worker that runs effects and deadlines, and the pacer that spreads power-ons in
//! waves.

pub mod apply;
pub mod pacing;
pub mod transition;
pub mod worker;

pub use transition::{
    BmcStep, BootToken, Effect, Event, Failure, FirstBoot, Ignored, Node, Outcome, Policy, State,
    Step, Transition, TransitionError, transition,
};

//! Node lifecycle: the pure transition function, its application in one transaction,
//! and the worker that runs effects and deadlines.

pub mod apply;
pub mod transition;
pub mod worker;

pub use transition::{
    BmcStep, BootToken, Effect, Event, Failure, FirstBoot, Ignored, Node, Outcome, Policy, State,
    Step, Transition, TransitionError, transition,
};

//! Node lifecycle: the pure transition function and its application.

pub mod transition;

pub use transition::{
    BmcStep, BootToken, Effect, Event, Failure, FirstBoot, Ignored, Node, Outcome, Policy, State,
    Step, Transition, TransitionError, transition,
};

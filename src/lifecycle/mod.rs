//! Node lifecycle: the pure transition function and its application.

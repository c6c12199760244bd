//! Program plumbing shared by the executors (being split out of the CPU executor).

pub(crate) mod layout;
pub(crate) mod values;

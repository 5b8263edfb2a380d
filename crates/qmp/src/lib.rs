//! QMP.

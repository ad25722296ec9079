//! End-to-end tests: the real `gpu-broker` binary, driven by the client crate and by
//! separate worker processes.

mod smoke;

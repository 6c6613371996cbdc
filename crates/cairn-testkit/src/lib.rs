//! What the hostile-input tests (`tests/hostile_*.rs` in each crate) share:
//! a global allocator that meters what a decoder allocates, and mutations
//! of valid encodings. A dev-dependency only.

pub mod alloc_meter;
pub mod mutation;

//! What the tests share: a global allocator that meters what a decoder
//! allocates and mutations of valid encodings (the hostile-input tests,
//! `tests/hostile_*.rs` in each crate), and a scripted model server that
//! speaks Anthropic's and OpenAI's wire formats (the agent loop's tests).
//! A dev-dependency only.

pub mod alloc_meter;
pub mod model_server;
pub mod mutation;

//! cairn-layers
pub mod archive;

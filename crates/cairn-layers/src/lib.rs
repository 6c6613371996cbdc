//! cairn-layers

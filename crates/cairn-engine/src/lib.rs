//! cairn-engine

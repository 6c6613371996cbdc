//! cairn-store

//! cairn-protocol

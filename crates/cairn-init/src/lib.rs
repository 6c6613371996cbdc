//! cairn-init

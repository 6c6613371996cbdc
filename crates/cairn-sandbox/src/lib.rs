//! cairn-sandbox

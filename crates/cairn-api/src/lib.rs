//! cairn-api

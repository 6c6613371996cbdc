//! Pipeline files: a user's TOML, parsed and checked before anything runs.
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(e) = cairn_pipeline::parse("fuzz.toml", text, &BTreeMap::new()) {
        // Every error names a line of the file and says what is wrong.
        assert!(e.line >= 1 && e.line <= text.lines().count() + 1, "{e}");
        assert!(!e.message.trim().is_empty(), "{e}");
    }
    let _ = cairn_pipeline::spec::parse_duration(text);
});

//! Init protocol frames, both directions: the host decodes `FromInit` from
//! a sandbox, init decodes `ToInit` and `NativeSetup` from the host. The
//! input is a stream of frames; every one is decoded as all three types.
#![no_main]

use cairn_protocol::{decode_payload, read_frame, FromInit, NativeSetup, ToInit};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // As a stream: what a reader on a socket sees.
    let mut stream = data;
    while read_frame::<ToInit, _>(&mut stream).is_ok() {}
    let mut stream = data;
    while read_frame::<FromInit, _>(&mut stream).is_ok() {}
    let mut stream = data;
    let _ = read_frame::<NativeSetup, _>(&mut stream);
    // As one payload, so mutations need not keep a length prefix right.
    let _ = decode_payload::<ToInit>(data);
    let _ = decode_payload::<FromInit>(data);
    let _ = decode_payload::<NativeSetup>(data);
});

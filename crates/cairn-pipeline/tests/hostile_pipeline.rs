//! Pipeline files are a user's text. Arbitrary text, TOML-shaped text and
//! mutations of a valid pipeline give an error naming a line of the file,
//! never a panic; a file over the size cap is refused before it is parsed.

use cairn_testkit::{alloc_meter, mutation};

use std::collections::BTreeMap;

use cairn_pipeline::spec::{parse_duration, read_file, MAX_FILE_LEN};
use cairn_pipeline::{parse, PipelineError};
use proptest::prelude::*;

#[global_allocator]
static METER: alloc_meter::Meter = alloc_meter::Meter;

const GOOD: &str = r#"[pipeline]
name = "demo"
image = "busybox"
driver = "gvisor"

[params]
sample = "s1"

[[stage]]
name = "prepare"
key = "prepare-{params.sample}"
run = ["seq 1 10 > /work/ref"]
edits = [{ path = "/work/cfg", content = "x", mode = 420 }]
artifacts = ["/work/ref"]
timeout = "6h"
checkpoint_every = "10m"
retries = 2

[[stage]]
name = "fit"
after = "prepare"
key = "fit-{hypothesis}"
run = ["echo {hypothesis.ff} > /work/energy"]
[stage.branches]
select = "min"
metric = "file:/work/energy"
hypotheses = [{ name = "a", ff = "1" }, { name = "b", ff = "2" }]
"#;

/// A decide stage choosing everything, a stage waiting for approval, and
/// a branch group whose hypotheses the decision gives.
const DECIDED: &str = include_str!("../../../fuzz/seeds/pipeline_file/decide.toml");

/// Parses `text` and checks the outcome is a pipeline or an error naming a
/// line that exists (or the one past the end, for something missing).
fn parse_checked(text: &str) -> Result<(), PipelineError> {
    let (result, usage) = alloc_meter::measure(|| parse("p.toml", text, &BTreeMap::new()));
    // Parsing costs memory in proportion to the text, whatever it says.
    assert!(
        usage.peak <= 64 * text.len() + (64 << 10),
        "{} bytes: {usage:?}",
        text.len()
    );
    assert!(
        usage.largest <= 16 * text.len() + (16 << 10),
        "{} bytes: {usage:?}",
        text.len()
    );
    match result {
        Ok(p) => {
            assert!(!p.stages.is_empty());
            Ok(())
        }
        Err(e) => {
            assert_eq!(e.file, "p.toml");
            assert!(
                e.line >= 1 && e.line <= text.lines().count() + 1,
                "line {} of {text:?}: {e}",
                e.line
            );
            assert!(!e.message.is_empty(), "{text:?}");
            Err(e)
        }
    }
}

#[test]
fn the_sample_pipeline_parses() {
    parse_checked(GOOD).unwrap();
    parse_checked(DECIDED).unwrap();
}

#[test]
fn a_file_over_the_cap_is_refused_before_parsing() {
    let mut text = GOOD.to_string();
    text.push_str(&"#".repeat(MAX_FILE_LEN));
    let (err, usage) = alloc_meter::measure(|| parse("p.toml", &text, &BTreeMap::new()).unwrap_err());
    assert_eq!(err.line, 1);
    assert!(err.message.contains("limit"), "{err}");
    assert!(usage.peak < 4096, "{usage:?}");
}

#[test]
fn a_file_of_any_size_is_read_no_further_than_the_cap() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge.toml");
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(64 * MAX_FILE_LEN as u64).unwrap();
    let (text, usage) = alloc_meter::measure(|| read_file(&path).unwrap());
    assert_eq!(text.len(), MAX_FILE_LEN + 1);
    assert!(usage.peak <= 4 * MAX_FILE_LEN, "{usage:?}");
    let err = parse("huge.toml", &text, &BTreeMap::new()).unwrap_err();
    assert!(err.message.contains("limit"), "{err}");
}

#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    for open in ["[", "{a=", "[{a="] {
        let text = format!("x = {}", open.repeat(50_000));
        let err = parse("p.toml", &text, &BTreeMap::new()).unwrap_err();
        assert_eq!(err.line, 1, "{err}");
    }
}

#[test]
fn durations_past_what_a_duration_holds_are_refused() {
    for text in [
        "18446744073709551615h",
        "5124095576030432h",
        "213503982334602d",
        "18446744073709551615s1s",
    ] {
        assert_eq!(parse_duration(text), None, "{text}");
        let e = parse_checked(&GOOD.replace("\"6h\"", &format!("{text:?}"))).unwrap_err();
        assert!(e.message.contains("not a duration"), "{e}");
    }
}

/// Lines that look like a pipeline file's, in any order.
fn toml_line() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("[pipeline]".to_string()),
        Just("[[stage]]".to_string()),
        Just("[params]".to_string()),
        Just("[stage.branches]".to_string()),
        "(name|key|after|image|driver|select|metric|timeout|checkpoint_every) = \"[a-z{}.:/0-9-]{0,12}\"",
        "(run|artifacts) = \\[(\"[a-z {}.]{0,8}\", ?){0,3}\\]",
        "retries = -?[0-9]{1,12}",
        "hypotheses = \\[(\\{ ?name = \"[a-c]\",? ?(ff = \"[0-9]\")? ?\\}, ?){0,3}\\]",
        "edits = \\[\\{ ?path = \"/?[a-z]{0,4}\", content = \"\", mode = [0-9]{1,11} ?\\}\\]",
        "[a-z_.]{1,8} ?= ?[\\[\\]{}\"'0-9a-z=,.]{0,16}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn arbitrary_text_is_refused_with_a_line(text in "\\PC{0,400}") {
        let _ = parse_checked(&text);
        let _ = parse_duration(&text);
    }

    #[test]
    fn pipeline_shaped_text_is_parsed_or_refused_with_a_line(
        lines in proptest::collection::vec(toml_line(), 0..24),
    ) {
        let _ = parse_checked(&lines.join("\n"));
    }

    #[test]
    fn mutated_pipelines_are_parsed_or_refused_with_a_line(muts in mutation::mutations()) {
        let mut bytes = GOOD.as_bytes().to_vec();
        mutation::apply(&mut bytes, &muts);
        let _ = parse_checked(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn mutated_decide_pipelines_are_parsed_or_refused_with_a_line(muts in mutation::mutations()) {
        let mut bytes = DECIDED.as_bytes().to_vec();
        mutation::apply(&mut bytes, &muts);
        let _ = parse_checked(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn durations_parse_or_are_refused(text in "[0-9]{0,22}(ms|s|m|h|d|x)?([0-9]{0,22}(ms|s|m|h|d))?") {
        if let Some(d) = parse_duration(&text) {
            prop_assert!(!text.is_empty());
            let _ = d.as_secs();
        }
    }
}

//! One rule for the names that become parts of paths on the host: stage
//! and hypothesis (branch) names name a run's log files, session names
//! name a session's directory. Checked where a name is parsed (a pipeline
//! file, a decision, a request), with the rule in the error; checked again
//! where a path is made of one, so that no other way in can reach a path.
//! Image names have a stricter rule of their own (`images.rs`).

/// The rule, as errors give it.
pub const RULE: &str = "1 to 63 letters, digits, '-' and '_', not starting with '-'";

/// Whether `name` may become part of a path.
pub fn valid(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// `Ok` for a valid name; else the error, naming `what` it is.
pub fn check(what: &str, name: &str) -> Result<(), String> {
    if valid(name) {
        Ok(())
    } else {
        let shown: String = name.chars().take(80).collect();
        let more = if name.chars().count() > 80 { "…" } else { "" };
        Err(format!("{what} {shown:?}{more}: use {RULE}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_could_leave_their_directory_are_refused() {
        for bad in [
            "",
            "..",
            "../../etc",
            "a/b",
            "a.b",
            "-x",
            ".hidden",
            "a\0b",
            "é",
            &"x".repeat(64),
        ] {
            assert!(!valid(bad), "{bad:?}");
            assert!(check("stage name", bad).unwrap_err().contains(RULE));
        }
        for good in ["a", "build-1", "amber_99", &"x".repeat(63)] {
            assert!(valid(good), "{good:?}");
        }
    }
}

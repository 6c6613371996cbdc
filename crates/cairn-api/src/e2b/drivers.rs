//! Which driver runs an E2B template's sandboxes: `cairn serve
//! --e2b-driver [TEMPLATE=]DRIVER`. A server-wide default (native unless
//! set) and per-template choices; a snapshot used as a template keeps the
//! driver it was taken on. Cairn's images carry no driver, so the choice
//! is the server's, not the image's.

use std::collections::BTreeMap;

/// One `--e2b-driver` value: a template (or every template) and a driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverChoice {
    /// `None`: the default for every template not named.
    pub template: Option<String>,
    pub driver: &'static str,
}

/// Parses `native`, `gvisor`, `TEMPLATE=native` or `TEMPLATE=gvisor`.
pub fn parse_driver_choice(s: &str) -> Result<DriverChoice, String> {
    let (template, driver) = match s.split_once('=') {
        Some((t, d)) => (Some(t.trim()), d.trim()),
        None => (None, s.trim()),
    };
    let driver = match driver {
        "native" => "native",
        "gvisor" => "gvisor",
        other => {
            return Err(format!(
                "unknown driver {other:?}: use native or gvisor, or TEMPLATE=native|gvisor"
            ))
        }
    };
    if let Some(t) = template {
        if t.is_empty() || t.len() > 256 || t.contains('\0') {
            return Err("a template name is 1 to 256 bytes, e.g. --e2b-driver base=gvisor".into());
        }
    }
    Ok(DriverChoice {
        template: template.map(str::to_string),
        driver,
    })
}

/// The driver of each template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Drivers {
    default: &'static str,
    templates: BTreeMap<String, &'static str>,
}

impl Default for Drivers {
    fn default() -> Drivers {
        Drivers {
            default: "native",
            templates: BTreeMap::new(),
        }
    }
}

impl Drivers {
    /// The choices in order; a later one for the same template wins.
    pub fn new(choices: impl IntoIterator<Item = DriverChoice>) -> Drivers {
        let mut d = Drivers::default();
        for c in choices {
            match c.template {
                Some(t) => {
                    d.templates.insert(t, c.driver);
                }
                None => d.default = c.driver,
            }
        }
        d
    }

    /// The driver for a new sandbox of `template` (an image template:
    /// `base` or a Cairn image name).
    pub fn of(&self, template: &str) -> &'static str {
        self.templates.get(template).copied().unwrap_or(self.default)
    }

    /// Whether any template runs on gVisor.
    pub fn uses_gvisor(&self) -> bool {
        self.default == "gvisor" || self.templates.values().any(|d| *d == "gvisor")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_default_and_per_template_choices_pick_the_driver() {
        let d = Drivers::new(
            ["gvisor", "debian=native", "base = gvisor"]
                .iter()
                .map(|s| parse_driver_choice(s).unwrap()),
        );
        assert_eq!(d.of("debian"), "native");
        assert_eq!(d.of("base"), "gvisor");
        assert_eq!(d.of("anything"), "gvisor");
        assert!(d.uses_gvisor());
        assert_eq!(Drivers::default().of("base"), "native");
        assert!(!Drivers::default().uses_gvisor());
    }

    #[test]
    fn unknown_drivers_and_empty_templates_are_refused() {
        assert!(parse_driver_choice("firecracker")
            .unwrap_err()
            .contains("native or gvisor"));
        assert!(parse_driver_choice("=gvisor").is_err());
        assert!(parse_driver_choice("base=").is_err());
    }
}

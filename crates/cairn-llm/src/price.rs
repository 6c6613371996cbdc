//! What a call costs: prices per million tokens, from a table of the
//! providers' published list prices (as of 2026-11) or given by the user
//! for any other model (a local one costs nothing).

use serde::{Deserialize, Serialize};

use crate::Usage;

/// US dollars per million input and output tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Price {
    pub input_per_mtok: f64,
    pub output_per_mtok: f64,
}

impl Price {
    pub fn cost(&self, usage: &Usage) -> f64 {
        (usage.input_tokens as f64 * self.input_per_mtok + usage.output_tokens as f64 * self.output_per_mtok) / 1e6
    }
}

/// Model-name prefixes and their list prices; the longest matching prefix wins.
const LIST_PRICES: &[(&str, f64, f64)] = &[
    ("claude-opus-4-5", 5.0, 25.0),
    ("claude-opus-4-1", 15.0, 75.0),
    ("claude-opus-4", 15.0, 75.0),
    ("claude-sonnet-4", 3.0, 15.0),
    ("claude-3-7-sonnet", 3.0, 15.0),
    ("claude-haiku-4", 1.0, 5.0),
    ("claude-3-5-haiku", 0.8, 4.0),
    ("gpt-5-mini", 0.25, 2.0),
    ("gpt-5-nano", 0.05, 0.4),
    ("gpt-5", 1.25, 10.0),
    ("gpt-4.1-mini", 0.4, 1.6),
    ("gpt-4.1-nano", 0.1, 0.4),
    ("gpt-4.1", 2.0, 8.0),
    ("gpt-4o-mini", 0.15, 0.6),
    ("gpt-4o", 2.5, 10.0),
];

/// The list price of `model`, if the table knows it.
pub fn price_for(model: &str) -> Option<Price> {
    LIST_PRICES
        .iter()
        .filter(|(prefix, ..)| model.starts_with(prefix))
        .max_by_key(|(prefix, ..)| prefix.len())
        .map(|&(_, i, o)| Price {
            input_per_mtok: i,
            output_per_mtok: o,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_prefix_wins() {
        assert_eq!(price_for("gpt-4o-mini-2024-07-18").unwrap().input_per_mtok, 0.15);
        assert_eq!(price_for("gpt-4o-2024-08-06").unwrap().input_per_mtok, 2.5);
        assert!(price_for("llama-3.1-8b").is_none());
        let p = price_for("claude-sonnet-4-5").unwrap();
        let usage = Usage {
            input_tokens: 1_000_000,
            output_tokens: 100_000,
        };
        assert!((p.cost(&usage) - 4.5).abs() < 1e-9);
    }
}

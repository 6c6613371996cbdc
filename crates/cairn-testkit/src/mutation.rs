//! Mutations of a valid encoding: what a corrupted file, a buggy peer or an
//! attacker makes of one.

use proptest::prelude::*;

#[derive(Debug, Clone)]
pub enum Mutation {
    /// XOR one byte.
    Flip { at: usize, mask: u8 },
    /// Cut the input short.
    Truncate { at: usize },
    /// Append bytes.
    Extend(Vec<u8>),
    /// Overwrite 8 bytes with a length-like value (small, huge, or all ones).
    Length { at: usize, value: u64 },
    /// Insert bytes in the middle.
    Insert { at: usize, bytes: Vec<u8> },
}

pub fn mutation() -> impl Strategy<Value = Mutation> {
    let length = prop_oneof![0u64..300, Just(u64::from(u32::MAX)), Just(u64::MAX), any::<u64>()];
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(at, mask)| Mutation::Flip { at, mask }),
        any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        proptest::collection::vec(any::<u8>(), 1..64).prop_map(Mutation::Extend),
        (any::<usize>(), length).prop_map(|(at, value)| Mutation::Length { at, value }),
        (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
    ]
}

pub fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    proptest::collection::vec(mutation(), 1..4)
}

pub fn apply(bytes: &mut Vec<u8>, mutations: &[Mutation]) {
    for m in mutations {
        let len = bytes.len();
        match m {
            Mutation::Flip { at, mask } if len > 0 => bytes[at % len] ^= mask,
            Mutation::Truncate { at } => bytes.truncate(at % (len + 1)),
            Mutation::Extend(more) => bytes.extend_from_slice(more),
            Mutation::Length { at, value } if len >= 8 => {
                let at = at % (len - 7);
                bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
            }
            Mutation::Insert { at, bytes: more } => {
                let at = at % (len + 1);
                bytes.splice(at..at, more.iter().copied());
            }
            _ => {}
        }
    }
}

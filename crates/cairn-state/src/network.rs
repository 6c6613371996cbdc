//! The `network` column of a sandbox's row: the policy it was made with
//! and the address it holds while it runs.

use std::net::Ipv4Addr;

use cairn_sandbox::net::NetPolicy;
use serde::{Deserialize, Serialize};

/// The `network` column of a sandbox's row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxNetwork {
    #[serde(flatten)]
    pub policy: NetPolicy,
    /// The address it holds while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<Held>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Held {
    pub slot: u32,
    pub interface: String,
    pub address: Ipv4Addr,
    pub gateway: Ipv4Addr,
    pub mac: String,
    /// Each allowed name and the addresses it was pinned to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resolved: Vec<(String, Vec<Ipv4Addr>)>,
}

impl SandboxNetwork {
    /// `None` for loopback only.
    pub fn of(policy: &NetPolicy) -> Option<SandboxNetwork> {
        policy.egress.then(|| SandboxNetwork {
            policy: policy.clone(),
            held: None,
        })
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a network record serialises")
    }

    pub fn from_json(text: &str) -> Result<SandboxNetwork, String> {
        let n: SandboxNetwork =
            serde_json::from_str(text).map_err(|e| format!("a sandbox's network record is unreadable: {e}"))?;
        n.policy
            .check()
            .map_err(|e| format!("a sandbox's network record is invalid: {e}"))?;
        Ok(n)
    }
}

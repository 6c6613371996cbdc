//! A sandbox's network, as the engine keeps it: the policy asked for
//! (`--network`, `--allow`, `--publish`) is recorded on the sandbox's row;
//! each start leases an address from the host ([`cairn_sandbox::net`]),
//! records it beside the policy, and hands the slot to the sandbox's init;
//! removal, a failed start and `cairn gc` give it back. A fork or a restore
//! is a new sandbox with a lease of its own: a new address and MAC, fresh
//! resolver files.

pub use cairn_state::network::{Held, SandboxNetwork};

use cairn_sandbox::net::{HostNet, Lease, NetError, NetPolicy};
use cairn_sandbox::SandboxProcess;

use crate::state::SandboxRecord;
use crate::{Engine, EngineError};

impl Engine {
    pub(crate) fn host_net(&self) -> Result<&HostNet, EngineError> {
        self.host_net
            .get_or_init(|| HostNet::new().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| EngineError::Network(NetError::Invalid(e.clone())))
    }

    /// Leases an address for a sandbox about to start with `egress` and
    /// notes it on the record (the caller writes the row); `None` for
    /// loopback only.
    pub(crate) fn lease_network(&self, rec: &mut SandboxRecord) -> Result<Option<Lease>, EngineError> {
        let Some(net) = rec.network.as_mut() else {
            return Ok(None);
        };
        if rec.driver != "native" {
            return Err(EngineError::Network(NetError::Invalid(format!(
                "--network egress is for native sandboxes; this one's driver is {} (see docs/network.md)",
                rec.driver
            ))));
        }
        let lease = self
            .host_net()?
            .lease(&net.policy, &self.home.sandbox(&rec.id), &rec.name)?;
        net.held = Some(Held {
            slot: lease.slot,
            interface: lease.plan.ifname.clone(),
            address: lease.plan.address,
            gateway: lease.plan.gateway,
            mac: cairn_sandbox::net::mac_text(&lease.plan.mac),
            resolved: lease.resolved.clone(),
        });
        Ok(Some(lease))
    }

    /// The sandbox started: its rules are confirmed in place, and its init
    /// holds the slot from here on.
    pub(crate) fn network_started(
        &self,
        rec: &SandboxRecord,
        lease: Option<&mut Lease>,
        process: SandboxProcess,
    ) -> Result<(), EngineError> {
        if let (Some(lease), Some(net)) = (lease, rec.network.as_ref()) {
            let host = self.host_net()?;
            host.confirm(lease, &net.policy.publish)?;
            host.bind(
                lease,
                &self.home.sandbox(&rec.id),
                &self.init_binary,
                process.pid,
                process.start_time,
            )?;
        }
        Ok(())
    }

    /// Gives the sandbox's address back (its process is gone or going).
    pub(crate) fn release_network(&self, rec: &SandboxRecord) -> Result<(), EngineError> {
        if let Some(net) = rec.network.as_ref() {
            if let Some(held) = &net.held {
                self.host_net()?.release(held.slot, &self.home.sandbox(&rec.id))?;
                let released = SandboxNetwork {
                    policy: net.policy.clone(),
                    held: None,
                };
                self.db.set_network(&rec.id, Some(&released))?;
            }
        }
        Ok(())
    }

    /// Replaces a running sandbox's allows and denies with `policy`'s, live
    /// (one nftables transaction; its published ports stay), and records
    /// them on its row, so forks and snapshots taken later carry them.
    pub fn update_network(&mut self, rec: &SandboxRecord, policy: &NetPolicy) -> Result<SandboxRecord, EngineError> {
        let invalid = |m: String| EngineError::Network(NetError::Invalid(m));
        if rec.state != crate::state::SandboxState::Running {
            return Err(EngineError::NotRunning {
                id: rec.id.clone(),
                state: rec.state,
                reason: rec.ended_reason.clone(),
            });
        }
        let Some(net) = rec.network.as_ref() else {
            return Err(invalid(format!(
                "sandbox {} was created without a network (loopback only), and one cannot be added while it runs;                  create it with --network egress",
                rec.id
            )));
        };
        let Some(held) = net.held.clone() else {
            return Err(invalid(format!("sandbox {} holds no address", rec.id)));
        };
        let policy = NetPolicy {
            egress: true,
            publish: net.policy.publish.clone(),
            ..policy.clone()
        };
        let resolved =
            self.host_net()?
                .update(held.slot, &self.home.sandbox(&rec.id), &policy, &rec.name, held.address)?;
        let changed = SandboxNetwork {
            policy,
            held: Some(Held { resolved, ..held }),
        };
        self.db.set_network(&rec.id, Some(&changed))?;
        Ok(SandboxRecord {
            network: Some(changed),
            ..rec.clone()
        })
    }

    /// `cairn gc`: every slot on this host whose owner died.
    pub(crate) fn release_dead_networks(&self) -> Result<Vec<String>, EngineError> {
        if !std::path::Path::new("/run/cairn/net").exists() {
            return Ok(Vec::new());
        }
        Ok(self.host_net()?.release_dead()?)
    }
}

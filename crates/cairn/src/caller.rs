//! Commands run with an API token (`--token`, `CAIRN_TOKEN`): whose the
//! token is, which commands a tenant's token may run, and the request
//! log's row for each command.
//!
//! A tenant's command runs on an engine acting for the tenant
//! (`cairn_engine::tenants`): its lookups find the tenant's objects only
//! (another's answers as an absent one), what it makes is the tenant's and
//! counts against its limits, names are the tenant's own, and the lists a
//! command prints are filtered to the tenant's. The CLI opens the state
//! directory itself, so this scopes what a command does; it is no
//! boundary against whoever runs `cairn` (without a token they are the
//! administrator). A tenant that must not be the administrator reaches
//! `cairn serve` with its token.

use anyhow::{anyhow, bail, Result};
use cairn_engine::access::TokenRecord;
use cairn_engine::tenants::AuditEntry;
use cairn_engine::{Engine, Home};
use clap::CommandFactory;

use crate::cli::{Cli, Command};

/// The holder of the token a command was given, checked in the store.
pub struct Caller {
    home: Home,
    /// The engine the token was checked with, lent to the command (one
    /// state store opened, not two) and given back for the log's row.
    engine: std::sync::Mutex<Option<Engine>>,
    token: TokenRecord,
}

impl Caller {
    /// The holder of the token `secret`, if `cmd` is theirs to run:
    /// refused when the token is unknown (revoked, or its tenant removed),
    /// and when a tenant's token asks for an administrator's command (that
    /// refusal recorded in the request log).
    pub fn check(home: &Home, secret: &str, cmd: &Command) -> Result<Caller> {
        let engine = Engine::open(home.clone())?;
        let Some(token) = engine.check_token(secret)? else {
            bail!(
                "the token given (--token or CAIRN_TOKEN) is not one of this state directory's: revoked, its \
                 tenant removed, or mistyped (the administrator's `cairn token ls` lists tokens; without a \
                 token, a command runs as the state directory's owner, the administrator)"
            );
        };
        let caller = Caller {
            home: home.clone(),
            engine: std::sync::Mutex::new(Some(engine)),
            token,
        };
        if let (Some(tenant), Some(what)) = (&caller.token.tenant, administrators(cmd)) {
            let refusal = anyhow!(
                "`cairn {what}` is the administrator's; this token is tenant {tenant:?}'s (run it without \
                 --token or CAIRN_TOKEN, as the administrator)"
            );
            caller.record(i32::from(crate::CAIRN_FAILED));
            return Err(refusal);
        }
        Ok(caller)
    }

    /// The tenant the command acts for; `None`: the administrator.
    pub fn tenant(&self) -> Option<String> {
        self.token.tenant.clone()
    }

    /// The engine the token was checked with, for the command to use.
    pub fn take_engine(&self) -> Option<Engine> {
        self.engine.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Gives the command's engine back, to record the command with.
    pub fn give_back(&self, engine: Engine) {
        *self.engine.lock().unwrap_or_else(|e| e.into_inner()) = Some(engine);
    }

    /// The token's id (never its secret).
    pub fn token_id(&self) -> &str {
        &self.token.id
    }

    /// Records the command in the request log with its exit status.
    pub fn record(&self, status: i32) {
        let row = AuditEntry::now(
            Some(&self.token.id),
            self.token.tenant.as_deref(),
            "cli",
            "CMD",
            &command_path(),
            i64::from(status),
        );
        let lent = self.engine.lock().unwrap_or_else(|e| e.into_inner());
        let recorded = match lent.as_ref() {
            Some(engine) => engine.record_audit(&[row]),
            // The command kept its engine (it ended early): open another.
            None => Engine::open(self.home.clone()).and_then(|e| e.record_audit(&[row])),
        };
        if let Err(e) = recorded {
            eprintln!("cairn: warning: the request log could not record this command: {e}");
        }
    }
}

/// The command that the administrator alone may run, as its name; `None`
/// for those a tenant's token may run. Every command is named here, so a
/// new one must be placed.
fn administrators(cmd: &Command) -> Option<&'static str> {
    match cmd {
        Command::Tenant(_) => Some("tenant"),
        Command::Token(_) => Some("token"),
        Command::Gc { .. } => Some("gc"),
        Command::Verify { .. } => Some("verify"),
        Command::Serve { .. } => Some("serve"),
        Command::Worker { .. } => Some("worker"),
        Command::Agent(_) => Some("agent"),
        Command::Bench { .. } => Some("bench"),
        Command::BenchFlood { .. } => Some("bench-flood"),
        Command::Run { .. }
        | Command::Pipeline(_)
        | Command::Audit { .. }
        | Command::Runs { .. }
        | Command::Dlq(_)
        | Command::Session(_)
        | Command::Artifact(_)
        | Command::Create { .. }
        | Command::Exec { .. }
        | Command::Cp { .. }
        | Command::Ps { .. }
        | Command::Logs { .. }
        | Command::Rm { .. }
        | Command::Snapshot { .. }
        | Command::Snapshots { .. }
        | Command::Diff { .. }
        | Command::Fork { .. }
        | Command::Restore { .. }
        | Command::Reset { .. }
        | Command::Image(_)
        | Command::Mcp { .. }
        | Command::Doctor { .. } => None,
    }
}

/// The command as the request log keeps it: its subcommands' names
/// (`cairn session exec`), not its arguments, which may hold secrets.
fn command_path() -> String {
    let mut path = String::from("cairn");
    // Parsed again, whole: the parse that ran the command succeeded.
    let Ok(matches) = Cli::command().try_get_matches_from(std::env::args_os()) else {
        return path;
    };
    let mut at = matches.subcommand();
    while let Some((name, sub)) = at {
        path.push(' ');
        path.push_str(name);
        at = sub.subcommand();
    }
    path
}

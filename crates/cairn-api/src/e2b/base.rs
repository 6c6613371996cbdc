//! E2B's `base` template: by default Debian with bash, python3, pip, git
//! and curl and the user `user` (`cairn image build e2b-base`), built from
//! Debian's packages in the background when the gateway starts without
//! it, and awaited by the creates that need it; with `--e2b-base busybox`,
//! Cairn's tiny default image.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use cairn_engine::images::E2B_BASE;
use cairn_engine::Silent;

use super::{Gateway, RestError};

/// What `base` is (`--e2b-base`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BaseKind {
    /// E2B's: Debian with bash, python3, pip, git, curl and `user`.
    #[default]
    Debian,
    /// Cairn's default image, busybox: starts in milliseconds, root only.
    Busybox,
}

impl std::str::FromStr for BaseKind {
    type Err = String;
    fn from_str(s: &str) -> Result<BaseKind, String> {
        match s {
            "debian" => Ok(BaseKind::Debian),
            "busybox" => Ok(BaseKind::Busybox),
            other => Err(format!("{other:?} is not a base: use debian or busybox")),
        }
    }
}

/// How long a create waits for the base image being built before it is
/// told to come back (the SDK's own request timeout is a minute).
const WAIT_FOR_BUILD: Duration = Duration::from_secs(45);

enum State {
    /// Not being built (built, or not needed).
    Idle,
    Building {
        since: Instant,
    },
    Failed(String),
}

pub(crate) struct Base {
    kind: BaseKind,
    state: Mutex<State>,
}

impl Base {
    pub(crate) fn new(kind: BaseKind) -> Base {
        Base {
            kind,
            state: Mutex::new(State::Idle),
        }
    }

    fn finished(&self, outcome: Result<(), String>) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        *state = match outcome {
            Ok(()) => State::Idle,
            Err(why) => State::Failed(why),
        };
    }
}

/// Starts building the Debian base in the background if it is the base
/// and missing (or its last build failed).
pub(crate) fn build_if_missing(gw: &Arc<Gateway>) {
    if gw.base.kind != BaseKind::Debian {
        return;
    }
    let app = &gw.app;
    {
        let mut state = gw.base.state.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*state, State::Building { .. }) {
            return;
        }
        let present = app.take_engine().map(|e| {
            let found = e.image(E2B_BASE).is_ok();
            app.give_back(e);
            found
        });
        if present.unwrap_or(true) {
            return;
        }
        *state = State::Building { since: Instant::now() };
    }
    tracing::info!("e2b: building the base template ({E2B_BASE}: Debian with bash, python3, pip, git, curl)");
    let g = Arc::clone(gw);
    let started = std::thread::Builder::new().name("e2b-base".into()).spawn(move || {
        let outcome = g.app.take_engine().map_err(|e| e.message).and_then(|mut e| {
            let out = e
                .build_e2b_base(E2B_BASE, None, &[], &Silent)
                .map(|_| ())
                .map_err(|err| err.to_string());
            g.app.give_back(e);
            out
        });
        match &outcome {
            Ok(()) => tracing::info!("e2b: the base template is built"),
            Err(why) => tracing::error!("e2b: cannot build the base template: {why}"),
        }
        g.base.finished(outcome);
    });
    if let Err(e) = started {
        gw.base.finished(Err(e.to_string()));
    }
}

/// The image `base` starts: `None` for Cairn's default (busybox), else
/// the Debian base, waited for while it is built; a 503 saying to retry
/// when it takes longer, a 500 saying why when its build failed.
pub(crate) async fn image(gw: &Arc<Gateway>) -> Result<Option<String>, RestError> {
    if gw.base.kind == BaseKind::Busybox {
        return Ok(None);
    }
    let deadline = Instant::now() + WAIT_FOR_BUILD;
    loop {
        let present = gw.app.engine(|e| Ok(e.image(E2B_BASE).is_ok())).await?;
        if present {
            gw.base.finished(Ok(()));
            return Ok(Some(E2B_BASE.to_string()));
        }
        let since = {
            let state = gw.base.state.lock().unwrap_or_else(|e| e.into_inner());
            match &*state {
                State::Building { since } => Some(*since),
                State::Failed(why) => {
                    return Err(RestError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!(
                            "the base template ({E2B_BASE}) could not be built: {why}; build it with `cairn image \
                             build e2b-base`, or serve --e2b-base busybox"
                        ),
                    ))
                }
                State::Idle => None,
            }
        };
        let since = match since {
            Some(since) => since,
            None => {
                // Removed since it was built (or never built): build it.
                build_if_missing(gw);
                Instant::now()
            }
        };
        if Instant::now() >= deadline {
            return Err(RestError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "the base template ({E2B_BASE}: Debian with bash, python3, pip, git and curl) is being built \
                     from Debian's packages, {} s so far; retry in a minute (`cairn image build e2b-base` builds \
                     it ahead)",
                    since.elapsed().as_secs()
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

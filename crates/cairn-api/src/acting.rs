//! Which tenant the current request acts for: a task-local value that
//! the request's middleware sets ([`crate::tenancy::own`]) and everything
//! the request runs reads, engines included ([`crate::App::engine`]).

use std::future::Future;

tokio::task_local! {
    static ACTING: Option<String>;
}

/// The tenant the current request acts for; `None` for an administrator
/// (the Unix socket, a token without a tenant) and outside requests.
pub fn current() -> Option<String> {
    ACTING.try_with(|t| t.clone()).ok().flatten()
}

/// Runs `f` as a request of `tenant`.
pub async fn acting<F: Future>(tenant: Option<String>, f: F) -> F::Output {
    ACTING.scope(tenant, f).await
}

/// A name the current request gives (an image's) as its tenant stores it
/// (`cairn_engine::tenants::qualify`); an administrator's as given.
pub fn qualify(name: String) -> String {
    match current() {
        Some(t) => cairn_engine::tenants::qualify(&t, &name),
        None => name,
    }
}
